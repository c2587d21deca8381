"""overlapkit: apply, resolve and audit Megatron Bridge's communication-overlap stack for H100 Slurm clusters."""

__version__ = "0.1.0"
