"""DeepSeek-V3 (671B: MLA, 256 routed + 1 shared expert, 3 dense layers, 1 MTP layer) on 1024 H100s.

Layout and MoE knobs: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.deepseek.h100.deepseek_v3`, on
Bridge's `megatron.bridge.recipes.deepseek.h100.deepseek_v3.deepseek_v3_pretrain_1024gpu_h100_bf16_config`
(expert-DP 2), HybridEP flex dispatcher, selective recompute of the MLA up-projections and the dense MLPs, and the
explicit pipeline layout (embedding + 1 layer, then 2 layers per stage, MTP + loss last: 32 stages). NVIDIA keeps TP
overlap, EP all-to-all overlap and DP grad-reduce overlap off; CUDA_DEVICE_MAX_CONNECTIONS is 1. Published H100
throughput: NVIDIA lists an FP8 run and its blockwise variant (docs/throughput.md: a row of the validation table).
"""

from megatron.bridge.recipes.deepseek.h100.deepseek_v3 import deepseek_v3_pretrain_1024gpu_h100_bf16_config as base
from megatron.bridge.recipes.deepseek.h100.deepseek_v3 import set_deepseek_v3_pipeline_model_parallel_layout

from overlapkit.spec.overlap import Overlap
from recipes._base import HYBRIDEP_ENV, EnvVar, Layout, MoE, OverlapIntent, moe_pretrain, register

SRC = "megatron.bridge.perf_recipes.deepseek.h100.deepseek_v3"
LAYOUT = Layout(tp=2, pp=8, cp=1, vpp=4, mbs=1, gbs=16384, seq=4096, ep=64, etp=1)
PIPELINE = "Et|(tt|)*30mL"  # NVIDIA's: 61 layers + MTP over PP8·VP4 = 32 stages
KNOBS = MoE(dispatcher="flex", backend="hybridep", recompute_modules=("mla_up_proj", "mlp"))
INTENT = OverlapIntent(
    off=(
        (Overlap.TP, f"NVIDIA's recipe runs TP2 without userbuffers ({SRC}); Bridge has no preset for hidden 7168"),
        (Overlap.EP, f"NVIDIA's measured baseline runs HybridEP without the 1F1B all-to-all overlap ({SRC})"),
        (
            Overlap.RS,
            f"NVIDIA's recipe sets it off ({SRC}): with 256 microbatches per step the one "
            "reduce-scatter after the last is a small share of the step",
        ),
    )
)
ENV = {
    **HYBRIDEP_ENV,
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": EnvVar(0, f"deterministic TE kernels, as NVIDIA's measured baseline ({SRC})"),
}


def _build(dtype: str):
    cfg = moe_pretrain(base, dtype, LAYOUT, KNOBS)
    set_deepseek_v3_pipeline_model_parallel_layout(cfg.model, PIPELINE)
    cfg.dist.enable_megatron_core_experimental = True  # MLA RoPE fusion is experimental in Megatron Core
    return cfg


@register(model="DeepSeek-V3", time_limit="06:00:00", env=ENV, intent=INTENT, perf=SRC)
def deepseek_v3_pretrain_1024gpu_h100_bf16():
    return _build("bf16")


@register(model="DeepSeek-V3", time_limit="06:00:00", env=ENV, intent=INTENT, perf=SRC)
def deepseek_v3_pretrain_1024gpu_h100_fp8cs():
    return _build("fp8cs")
