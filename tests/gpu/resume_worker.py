"""One rank of tests/gpu/test_resume_gpu.py, under torchrun: the Llama3 8B 1-GPU cut (overlapkit.bridge.gpucut) on
the prepared data (DATA's spec applied by bridge/data.py), checkpoints in CKPT, Bridge's exit signal handler on."""

from __future__ import annotations

import sys


def main(spec: str, ckpt: str, iters: int, save_interval: int) -> int:
    from overlapkit.bridge import data, gpucut, stack

    stack.import_bridge()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = gpucut.build("llama3_8b", "ours", iters)
    data.apply(cfg, data.load(spec))
    cfg.dataset.seq_length = cfg.model.seq_length
    cfg.checkpoint.save = cfg.checkpoint.load = ckpt
    cfg.checkpoint.save_interval = save_interval
    cfg.checkpoint.async_save = False
    cfg.train.exit_signal_handler = True  # what PreemptionPlugin switches on: SIGTERM → save → exit
    cfg.scheduler.lr_warmup_iters = 2
    pretrain(cfg, forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
