"""Llama3 70B on 64 H100s.

Layouts: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.llama.h100.llama3`, with Bridge's userbuffers
presets `userbuffers_{bf16,fp8}_h100_h8192_tp4_mbs1_seqlen8192`; published: Megatron-Bridge 25.11 (FP8-CS, 64 GPUs,
TP4 PP8 VP5, GBS 128: 1602 tokens/s/GPU) and 26.04.01 (GBS 256: 1664 tokens/s/GPU).
"""

from megatron.bridge.recipes.llama import llama3_70b_pretrain_config as base

from recipes._base import Layout, h100_pretrain, register

SRC = "megatron.bridge.perf_recipes.llama.h100.llama3"


@register(model="Llama3 70B", perf=SRC)
def llama3_70b_pretrain_64gpu_h100_bf16():
    return h100_pretrain(base, "bf16", Layout(tp=4, pp=4, cp=2, vpp=5, mbs=1, gbs=256, seq=8192))


@register(model="Llama3 70B", perf=SRC)
def llama3_70b_pretrain_64gpu_h100_fp8cs():
    return h100_pretrain(base, "fp8cs", Layout(tp=4, pp=8, cp=1, vpp=5, mbs=1, gbs=256, seq=8192))
