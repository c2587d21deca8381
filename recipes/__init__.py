"""H100 pretraining recipes: pure builders `<model>_pretrain_<N>gpu_h100_<dtype>() -> ConfigContainer`.

Importing this package imports Megatron Bridge (once, offline, with the TE shim) and registers every recipe.
"""

from __future__ import annotations

import difflib

from overlapkit import stack

stack.import_bridge()

with stack.silenced():
    from recipes import gpt3_175b, llama3_8b, llama3_70b, llama31_405b  # noqa: E402, F401
from recipes._base import REGISTRY, Recipe  # noqa: E402


class UnknownRecipe(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def get(name: str) -> Recipe:
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, REGISTRY, n=3, cutoff=0.4) or sorted(REGISTRY)[:3]
    raise UnknownRecipe(f"unknown recipe {name!r}; closest: {', '.join(close)} (`make recipes` lists all)")


def names() -> list[str]:
    return sorted(REGISTRY)
