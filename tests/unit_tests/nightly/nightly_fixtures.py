"""Training-log fixtures made by DRIVING Bridge's own `training_log()` (megatron/bridge/training/utils/train_utils.py)
on CPU, so the parser is tested against the exact bytes Bridge prints, not a hand-typed imitation.

What cannot run on CPU is replaced at its seam, and only there: `torch.cuda.memory_stats` (no GPU: we feed byte
counts, and Bridge's real `report_memory()` formats them), the `device="cuda"` accumulator tensors (mapped to CPU),
`get_num_microbatches`/model-parallel max-reduce (no process groups), `report_theoretical_memory` (needs a full
model config) and `torch.distributed.get_rank` (no process group: rank 0). The timers and global state are minimal
stand-ins carrying the values Bridge reads. Everything else — the f-strings, field order, NaN handling — is Bridge's.
"""

from __future__ import annotations

import contextlib
import io
import math
from types import SimpleNamespace

import torch


class _Timer:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def elapsed(self, barrier=False):
        return self.seconds


class _Timers:
    def __init__(self):
        self.seconds = 1.0

    def __call__(self, name, log_level=None):
        return _Timer(self.seconds)

    def log(self, *a, **k):
        pass


def bridge_log(
    losses, step_ms, *, tflops=None, world=64, gbs=256, train_iters=None, memory_gb=None, grad_norm=2.5
) -> str:
    """The log text Bridge's training_log prints for iterations 1..len(losses) (log_interval=1).
    `tflops[i]` is the per-GPU TFLOP/s wanted (Bridge derives it from the FLOP counter we advance)."""
    from megatron.bridge.training.utils import train_utils as tu

    train_iters = train_iters or len(losses)
    tflops = tflops or [400.0] * len(losses)
    timers = _Timers()
    state = SimpleNamespace(step=0, consumed_train_samples=0, skipped_train_samples=0,
                            floating_point_operations_so_far=0.0)  # fmt: skip
    gs = SimpleNamespace(timers=timers, train_state=state, tensorboard_logger=None, wandb_logger=None,
                         mlflow_logger=None, comet_logger=None, energy_monitor=None,
                         _flops_at_last_log=0.0)  # fmt: skip
    logger = SimpleNamespace(log_interval=1, timing_log_level=0, log_timers_to_tensorboard=False,
                             tensorboard_log_interval=1, log_memory_to_tensorboard=False, log_throughput=True,
                             log_throughput_to_tensorboard=False, memory_keys=None)  # fmt: skip
    cfg = SimpleNamespace(logger=logger, train=SimpleNamespace(micro_batch_size=1, train_iters=train_iters),
                          data_parallel_size=2, model=SimpleNamespace(kv_channels=128, num_attention_heads=64),
                          profiling=None, optimizer=SimpleNamespace(decoupled_lr=None))  # fmt: skip
    pg = SimpleNamespace(mp=None, pp=None, dp=None)
    real_tensor = torch.tensor
    mem = memory_gb or {}
    stats = {"allocated_bytes.all.current": mem.get("current", 40.0) * 1e9,
             "allocated_bytes.all.peak": mem.get("peak", 60.0) * 1e9,
             "reserved_bytes.all.peak": mem.get("reserved", 70.0) * 1e9, "num_alloc_retries": 0}  # fmt: skip
    patches = [
        (torch, "tensor", lambda *a, device=None, **k: real_tensor(*a, **k)),
        (torch.cuda, "memory_stats", lambda *a, **k: stats),
        (torch.distributed, "get_rank", lambda group=None: 0),
        (tu, "get_num_microbatches", lambda: gbs // 2),
        (tu, "reduce_max_stat_across_model_parallel_group", lambda v, mp_group=None: v),
        (tu, "report_theoretical_memory", lambda *a, **k: None),
        (tu, "get_world_size_safe", lambda: world),
    ]
    saved = [(o, n, getattr(o, n)) for o, n, _ in patches]
    out, total, flag = io.StringIO(), {}, True
    try:
        for o, n, v in patches:
            setattr(o, n, v)
        with contextlib.redirect_stdout(out):
            for i, (loss, ms, tf) in enumerate(zip(losses, step_ms, tflops, strict=True), start=1):
                state.step, state.consumed_train_samples = i, i * gbs
                timers.seconds = ms / 1000.0
                state.floating_point_operations_so_far += tf * 1e12 * timers.seconds * world
                flag = tu.training_log(
                    {"lm loss": real_tensor([loss])}, total, 1e-4, None, 1.0, flag, 0,
                    grad_norm if math.isfinite(loss) else float("nan"), None, None, cfg, gs, [], [],
                    pg_collection=pg,
                )  # fmt: skip
    finally:
        for o, n, v in saved:
            setattr(o, n, v)
    return out.getvalue()


def curve(n: int, start: float = 11.0, end: float = 7.0) -> list[float]:
    """A plausible pretraining loss curve shape (exponential approach), for synthetic runs."""
    return [end + (start - end) * math.exp(-i / (n / 4)) for i in range(n)]


def renumbered_log(text: str, path, target_bytes: int) -> int:
    """A large log of Bridge's own lines: `text` (a bridge_log) written to `path` again and again until it holds
    `target_bytes`, its iteration lines renumbered so that every iteration is new, its memory report kept once (as
    Bridge prints it: the first iterations only). Returns the number of iterations written."""
    import re

    header = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|")
    lines = text.splitlines(keepends=True)
    per_pass = sum(1 for ln in lines if header.search(ln))
    passes = max(1, -(-target_bytes // len(text.encode())))
    total, done = per_pass * passes, 0
    with open(path, "w") as f:
        for p in range(passes):
            for ln in lines:
                if header.search(ln):
                    done += 1
                    ln = header.sub(f"iteration {done:8d}/{total:8d} |", ln)
                elif p and ln.startswith("[Rank "):
                    continue
                f.write(ln)
    return total
