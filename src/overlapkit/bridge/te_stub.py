"""Let `import megatron.bridge` succeed on a machine without Transformer Engine, without lying to megatron-core.

Why: Bridge 0.6.2 imports `transformer_engine.pytorch` unguarded in exactly two modules (ALLOWED_IMPORTERS), both
reached from `megatron.bridge.__init__`. A global fake package would make megatron-core's `HAVE_TE` probes (plain
`import transformer_engine`) take TE-only code paths.

How: a meta-path finder serves a placeholder package *only* to those two importers. It leaves `sys.modules` before
any other module is imported and at the latest when the importer's body ends, so megatron-core keeps `HAVE_TE=False`.
A no-op where real TE is importable; instantiating a placeholder raises an ImportError naming the fix.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

ALLOWED_IMPORTERS = {"megatron.bridge.peft.lora_layers", "megatron.bridge.models.gpt_full_te_layer_autocast_spec"}
_SERVED: set[str] = set()  # names of placeholder modules currently in sys.modules
_MSG = "Transformer Engine is not installed here; run on a node with the NeMo container (or `uv sync --extra gpu`)."


def _placeholder(_owner, name: str):
    """Any attribute of a placeholder module or class is another placeholder class (dunders stay absent)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name, (), {})


class _Missing(type):
    """Metaclass of placeholders: any call raises."""

    __getattr__ = _placeholder

    def __call__(cls, *args, **kwargs):
        raise ImportError(_MSG)


class _StubModule(types.ModuleType):
    __getattr__ = _placeholder


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        _SERVED.add(spec.name)
        return _StubModule(spec.name)

    def exec_module(self, module):  # importlib gives it its __path__ (a package) and binds it to its parent
        pass


def _importer_name() -> str | None:
    """Name of the module whose code runs the import statement (skipping importlib and this file)."""
    frame = sys._getframe(2)
    while frame is not None:
        fname = frame.f_code.co_filename
        if not fname.startswith("<frozen importlib") and fname != __file__:
            return frame.f_globals.get("__name__")
        frame = frame.f_back
    return None


def purge() -> None:
    while _SERVED:
        name = _SERVED.pop()
        if isinstance(sys.modules.get(name), _StubModule):
            del sys.modules[name]


class _PurgeAfterLoader(importlib.abc.Loader):
    """Wraps an allowed importer's own loader: the placeholder leaves sys.modules when its module body ends."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        try:
            self.inner.exec_module(module)
        finally:
            purge()


class _TEStubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            if _importer_name() in ALLOWED_IMPORTERS:
                return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
            return None
        purge()  # any other module imported meanwhile must not see the placeholder (none served: a no-op)
        if fullname in ALLOWED_IMPORTERS:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PurgeAfterLoader(spec.loader)
            return spec
        return None


_FINDER = _TEStubFinder()


def real_te_available() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Install the finder unless real TE exists. Returns True when the stub is active."""
    if real_te_available():
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True
