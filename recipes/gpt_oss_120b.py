"""GPT-OSS 120B (128 experts, top-4, 36 layers alternating sliding/full attention) on 64 H100s.

Layout and MoE knobs: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.gpt_oss.h100.gpt_oss`, on Bridge's
`megatron.bridge.recipes.gpt_oss.h100.gpt_oss.gpt_oss_120b_pretrain_64gpu_h100_bf16_config` (expert-DP 2),
alltoall dispatcher, selective recompute of LayerNorm and the expert activation. PP4 without a virtual pipeline: p2p
overlap is off, as in NVIDIA's recipe, and Bridge allows EP all-to-all overlap only with one (it asserts VPP when
PP>1). CUDA_DEVICE_MAX_CONNECTIONS is 32 (TP=CP=1). Published H100 throughput: none listed (docs/throughput.md).
"""

from megatron.bridge.recipes.gpt_oss.h100.gpt_oss import gpt_oss_120b_pretrain_64gpu_h100_bf16_config as base

from overlapkit.spec.overlap import Overlap
from recipes._base import Layout, MoE, OverlapIntent, moe_pretrain, register

SRC = "megatron.bridge.perf_recipes.gpt_oss.h100.gpt_oss"
LAYOUT = Layout(tp=1, pp=4, cp=1, vpp=None, mbs=1, gbs=1280, seq=4096, ep=8, etp=1)
KNOBS = MoE(dispatcher="alltoall", recompute_modules=("layernorm", "moe_act"))
NO_VPP = f"NVIDIA's measured layout is PP4 without a virtual pipeline ({SRC})"
INTENT = OverlapIntent(
    off=(
        (Overlap.P2P, NO_VPP),
        (Overlap.EP, f"{NO_VPP}, and Bridge allows EP all-to-all overlap with PP>1 only on a virtual pipeline"),
    )
)


@register(model="GPT-OSS 120B", intent=INTENT, perf=SRC)
def gpt_oss_120b_pretrain_64gpu_h100_bf16():
    return moe_pretrain(base, "bf16", LAYOUT, KNOBS)


@register(model="GPT-OSS 120B", intent=INTENT, perf=SRC)
def gpt_oss_120b_pretrain_64gpu_h100_fp8cs():
    return moe_pretrain(base, "fp8cs", LAYOUT, KNOBS)
