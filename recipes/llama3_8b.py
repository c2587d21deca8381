"""Llama3 8B on one 8-GPU H100 node.

Layouts and env vars: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.llama.h100.llama3`; published:
Megatron-Bridge 25.11 performance summary (8 GPUs, FP8-CS, GBS 128, 14451 tokens/s/GPU). TP=1 on both, so TP comm
overlap is n/a by design: an 8B model fits without tensor parallelism, and the overlap that matters is DP
grad-reduce / param-gather. The FP8 recipe recomputes 5 layers per block in full, as NVIDIA's does.
"""

from megatron.bridge.recipes.llama import llama3_8b_pretrain_config as base

from recipes._base import EnvVar, Layout, h100_pretrain, register

SRC = "megatron.bridge.perf_recipes.llama.h100.llama3"
_CUDNN_LN = f"cuDNN LayerNorm kernels, as in NVIDIA's measured 8B FP8 baseline ({SRC})"
FP8_ENV = {
    "NVTE_NORM_FWD_USE_CUDNN": EnvVar(1, _CUDNN_LN),
    "NVTE_NORM_BWD_USE_CUDNN": EnvVar(1, _CUDNN_LN),
    "NCCL_CTA_POLICY": EnvVar(1, f"NCCL CTA scheduling policy of NVIDIA's measured 8B FP8 baseline ({SRC})"),
}


@register(model="Llama3 8B", perf=SRC)
def llama3_8b_pretrain_8gpu_h100_bf16():
    return h100_pretrain(base, "bf16", Layout(tp=1, pp=1, cp=2, vpp=None, mbs=1, gbs=128, seq=8192))


@register(model="Llama3 8B", perf=SRC, env=FP8_ENV)
def llama3_8b_pretrain_8gpu_h100_fp8cs():
    cfg = h100_pretrain(base, "fp8cs", Layout(tp=1, pp=1, cp=1, vpp=None, mbs=1, gbs=128, seq=8192))
    cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = "full", "block", 5
    return cfg
