"""Llama3.1 405B on 512 or 1024 H100s.

Layout: NVIDIA's H100 perf recipes, `megatron.bridge.perf_recipes.llama.h100.llama31`, with Bridge's
`userbuffers_{bf16,fp8}_h100_h16384_tp8_cp2_mbs1_seqlen8192` presets; the 512-GPU variants halve GBS, as NVIDIA's do.
126 layers + embedding + loss (Bridge's base accounts for both in the pipeline split) = 128 = 2 per PP·VP stage.
Published: Megatron-Bridge 26.06 (FP8, 1024 GPUs, GBS 1536: 326 tokens/s/GPU).
"""

import dataclasses

from megatron.bridge.recipes.llama import llama31_405b_pretrain_config as base

from recipes._base import Layout, h100_pretrain, register

SRC = "megatron.bridge.perf_recipes.llama.h100.llama31"
LAYOUT = Layout(tp=8, pp=8, cp=2, vpp=8, mbs=1, gbs=1536, seq=8192)  # the base recipe defaults to 128K
HALF_LAYOUT = dataclasses.replace(LAYOUT, gbs=768)  # the 512-GPU variants keep DP's per-rank batch: 1536 × 512/1024


REGISTER = register(model="Llama3.1 405B", time_limit="06:00:00", perf=SRC)  # the four variants' one registration


@REGISTER
def llama31_405b_pretrain_1024gpu_h100_bf16():
    return h100_pretrain(base, "bf16", LAYOUT)


@REGISTER
def llama31_405b_pretrain_1024gpu_h100_fp8cs():
    return h100_pretrain(base, "fp8cs", LAYOUT)


@REGISTER
def llama31_405b_pretrain_512gpu_h100_bf16():
    return h100_pretrain(base, "bf16", HALF_LAYOUT)


@REGISTER
def llama31_405b_pretrain_512gpu_h100_fp8cs():
    return h100_pretrain(base, "fp8cs", HALF_LAYOUT)
