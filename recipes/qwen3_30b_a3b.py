"""Qwen3 30B-A3B (128 experts, top-8, no shared expert) on 16 H100s.

Layout and MoE knobs: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.qwen.h100.qwen3_moe` (expert-DP 1),
HybridEP flex dispatcher, no recompute. Each dtype starts from the Bridge recipe NVIDIA's does: BF16 from Bridge's
own 16-GPU recipe (TE-scoped CUDA graphs for the router, precision-aware optimizer) with EP all-to-all overlap on;
FP8 from Bridge's 8-GPU recipe, where NVIDIA's measured FP8 baseline keeps EP overlap off. TP=1, so TP comm overlap
is n/a and CUDA_DEVICE_MAX_CONNECTIONS is 32, as in NVIDIA's recipes. Published H100 throughput: NVIDIA lists an FP8
run (docs/throughput.md: a row of the validation table).
"""

from megatron.bridge.recipes.qwen.h100 import qwen3_moe as bridge

from overlapkit.spec.overlap import Overlap
from recipes._base import HYBRIDEP_ENV, Layout, MoE, OverlapIntent, moe_pretrain, register

SRC = "megatron.bridge.perf_recipes.qwen.h100.qwen3_moe"
LAYOUT = Layout(tp=1, pp=1, cp=1, vpp=None, mbs=1, gbs=1024, seq=4096, ep=16, etp=1)
KNOBS = MoE(dispatcher="flex", backend="hybridep")
base = bridge.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config  # what `make new-recipe FROM=` one of these forks
FP8_NO_EP_OVERLAP = f"NVIDIA's measured FP8 baseline runs HybridEP without the 1F1B all-to-all overlap ({SRC})"
FP8_INTENT = OverlapIntent(off=((Overlap.EP, FP8_NO_EP_OVERLAP),))


@register(model="Qwen3 30B-A3B", perf=SRC, env=HYBRIDEP_ENV)
def qwen3_30b_a3b_pretrain_16gpu_h100_bf16():
    return moe_pretrain(base, "bf16", LAYOUT, KNOBS)


@register(model="Qwen3 30B-A3B", perf=SRC, env=HYBRIDEP_ENV, intent=FP8_INTENT)
def qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs():
    return moe_pretrain(bridge.qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config, "fp8cs", LAYOUT, KNOBS)
