"""A checkpoint directory laid out as Megatron Core 0.19.2 and Bridge 0.6.2 write it in torch_dist (the file names of
cluster/resume.py's COMPLETE, with placeholder contents: the guard reads names and sizes, never the bytes), built on
CPU without a training run. Not a real Core save: dist_checkpointing.save cannot run on a CPU-only machine (its
filesystem writer's preload_tensors calls torch.cuda.synchronize, Core 0.19.2 strategies/filesystem_async.py), so
tests/gpu/test_resume_gpu.py checks the guard on a real Bridge save."""

from __future__ import annotations

from pathlib import Path

from overlapkit.cluster import resume


def save_iteration(ck: Path, step: int, lacking: tuple[str, ...] = (), tracker: bool = True) -> Path:
    """iter_<step> with every file of a complete torch_dist save except `lacking`, and (`tracker`) both trackers
    naming it, as Bridge's train_state_finalize_fn leaves them."""
    it = ck / f"iter_{step:07d}"
    it.mkdir(parents=True, exist_ok=True)
    (it / "__0_0.distcp").write_bytes(b"shard")
    for name in resume.COMPLETE["torch_dist"]:
        if name not in lacking:
            (it / name).write_bytes(b"written")
    if tracker:
        (ck / resume.TRACKERS[0]).write_bytes(b"train state")
        (ck / resume.TRACKERS[1]).write_text(str(step))
    return it
