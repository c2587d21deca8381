"""Defer, in planning processes, the imports of packages that no command of ours uses (a faster cold start).

Why: `import megatron.bridge` costs about 30 s (docs/architecture.md, measured facts); some of it goes to packages
that Bridge/Core/ModelOpt import at module top for training, logging or other libraries' models, never for building
and auditing a recipe. Each deferral names the file (in the installed packages) whose import statement it defers,
and why planning doesn't need it. Found with `python -X importtime -c "from overlapkit import stack;
stack.import_bridge()"`. Kept because it still pays for its reading: deferring wandb saves every cold `make plan`
seconds (how many: the measured facts), against these 150 lines read once.

How: a meta-path finder serves the real module, whose body runs on first use (any attribute other than the import
system's own metadata), to the one named importer only. `importlib.util.find_spec`, `inspect.getmodule` and a
second `import` read only that metadata, so availability probes conclude what they would eagerly (the package is
there: megatron-core's `wandb is not None`, accelerate's `is_wandb_available()`). A deferred module whose body
fails raises an ImportError naming this file at its first use. Training imports in full
(`stack.import_bridge(full=True)`, launch/entry.py); OVERLAPKIT_LAZY_IMPORTS=0 turns deferral off.

Not deferred, and why: their importers use them at import time (`from X import name`, an attribute read), so a
lazy module would load at once, and hiding them would flip an availability flag; or planning itself uses them:
- nvidia-modelopt (~5.7 s: its HF/diffusers plugins pull in comet_ml, peft, diffusers, torchvision):
  `from modelopt.torch.opt.plugins import ...` in megatron/training/checkpointing.py and
  megatron/bridge/training/checkpointing.py; its plugins star-import (`from .transformers import *`), and the
  transformers plugin registers PreTrainedModel patches that `mto.enable_huggingface_checkpointing()` applies.
  diffusers is also imported by modelopt/torch/export/diffusers_utils.py (`from diffusers import ModelMixin`).
- comet_ml (~1.4 s): transformers/integrations/integration_utils.py reads `comet_ml.config` at import.
- sklearn, scipy, pandas (~3.9 s): `from sklearn.metrics import roc_curve` in
  transformers/generation/candidate_generator.py (behind `is_sklearn_available()`).
- datasets (~0.4 s): `import datasets` in transformers/trainer.py could wait, but planning itself imports it
  (`from datasets import load_dataset` in megatron/bridge/data/datasets/gpt_sft.py, reached by building recipes).
- flashinfer, cutlass (~1.9 s): `from flashinfer import mxfp8_quantize` in
  megatron/core/inference/quantization/mxfp8_tensor.py sets HAVE_FLASHINFER.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import threading
import types

from overlapkit.errors import BadInput

SWITCH = "OVERLAPKIT_LAZY_IMPORTS"
# module: (the module whose plain `import` of it is deferred, why planning doesn't need it)
LAZY = {
    "wandb": ("megatron.core.timers", "megatron/core/timers.py: only Timers.write(..., wandb_writer) logs to it"),
}
# Set by the import system before a module's body runs: reading them is not a use.
_METADATA = frozenset({"__name__", "__spec__", "__loader__", "__file__", "__cached__", "__package__", "__class__"})
_LOCK = threading.RLock()
_PENDING: dict[str, importlib.abc.Loader] = {}  # LAZY modules in sys.modules whose body has not run


def _importer_name() -> str | None:
    """Name of the module whose code runs the import statement (skipping importlib and this file)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_globals is globals()):
        frame = frame.f_back
    return None if frame is None else frame.f_globals.get("__name__")


class _DeferredModule(types.ModuleType):
    def __getattribute__(self, attr):
        if attr not in _METADATA:
            _run_body(self)
        return types.ModuleType.__getattribute__(self, attr)

    def __setattr__(self, attr, value):
        _run_body(self)
        types.ModuleType.__setattr__(self, attr, value)

    def __delattr__(self, attr):
        _run_body(self)
        types.ModuleType.__delattr__(self, attr)


def _run_body(module) -> None:
    name = types.ModuleType.__getattribute__(module, "__name__")
    with _LOCK:  # another thread waits here; the body's own use of its module (re-entrant) finds nothing pending
        loader = _PENDING.pop(name, None)
        if loader is None:
            return
        try:
            loader.exec_module(module)
        except BaseException as exc:
            if sys.modules.get(name) is module:
                del sys.modules[name]  # as a failed eager import leaves it
            raise ImportError(
                f"{name} failed to import at its first use (deferred by overlapkit.bridge.lazy_imports; "
                f"{SWITCH}=0 imports it eagerly): {exc!r}",
                name=name,
            ) from exc
        finally:
            object.__setattr__(module, "__class__", types.ModuleType)


class _DeferredLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.inner  # the metadata an eager import leaves
        _PENDING[module.__name__] = self.inner
        module.__class__ = _DeferredModule


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in LAZY or fullname in sys.modules or _importer_name() != LAZY[fullname][0]:
            return None
        for other in sys.meta_path:  # the real module's spec, as the rest of the meta path finds it
            if other is not self and (spec := getattr(other, "find_spec", lambda *a: None)(fullname, path, target)):
                if hasattr(spec.loader, "exec_module"):
                    spec.loader = _DeferredLoader(spec.loader)
                return spec
        return None  # absent, as an eager import would find


_FINDER = _Finder()


def enabled(environ=os.environ) -> bool:
    value = environ.get(SWITCH, "1")
    if value not in ("0", "1"):
        raise BadInput(f"{SWITCH}={value!r}: use 1 (defer, the default) or 0 (import everything eagerly)")
    return value == "1"


def install() -> bool:
    """Defer from now on (unless OVERLAPKIT_LAZY_IMPORTS=0). Returns True when deferral is active."""
    if not enabled():
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def deferred() -> list[str]:
    """The LAZY modules whose body has not run yet."""
    return sorted(_PENDING)


def finish() -> None:
    """The full stack: no more deferral, and everything deferred so far imported now."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in list(_PENDING):
        if name in sys.modules:
            _run_body(sys.modules[name])
