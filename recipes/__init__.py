"""H100 pretraining recipes: pure builders `<model>_pretrain_<N>gpu_h100_<dtype>() -> ConfigContainer`.

Every module here registers its builders with `overlapkit.bridge.registry` (through `recipes._base.register`); the
registry finds the modules by name, so a new file (a fork from `make new-recipe`, or your own) needs no listing.
`RECIPES` is what the registry knows before the Bridge import: each shipped module's recipe names (a file named for
its one recipe, as a fork is, declares itself); tests/unit_tests/bridge/test_registry.py checks it against register.
"""

RECIPES = {
    "deepseek_v3": ("deepseek_v3_pretrain_1024gpu_h100_bf16", "deepseek_v3_pretrain_1024gpu_h100_fp8cs"),
    "gpt3_175b": ("gpt3_175b_pretrain_128gpu_h100_bf16", "gpt3_175b_pretrain_128gpu_h100_fp8cs"),
    "gpt_oss_120b": ("gpt_oss_120b_pretrain_64gpu_h100_bf16", "gpt_oss_120b_pretrain_64gpu_h100_fp8cs"),
    "llama31_405b": (
        "llama31_405b_pretrain_1024gpu_h100_bf16",
        "llama31_405b_pretrain_1024gpu_h100_fp8cs",
        "llama31_405b_pretrain_512gpu_h100_bf16",
        "llama31_405b_pretrain_512gpu_h100_fp8cs",
    ),
    "llama3_70b": ("llama3_70b_pretrain_64gpu_h100_bf16", "llama3_70b_pretrain_64gpu_h100_fp8cs"),
    "llama3_8b": ("llama3_8b_pretrain_8gpu_h100_bf16", "llama3_8b_pretrain_8gpu_h100_fp8cs"),
    "qwen3_235b_a22b": ("qwen3_235b_a22b_pretrain_256gpu_h100_bf16", "qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs"),
    "qwen3_30b_a3b": ("qwen3_30b_a3b_pretrain_16gpu_h100_bf16", "qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs"),
}
