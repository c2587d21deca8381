"""The one place that prepares the process for Megatron Bridge and imports it: once per process, since the import
costs about 30 s and 1.3 GB (docs/architecture.md, measured facts)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import sys
import warnings
from functools import cache

from overlapkit import paths
from overlapkit.bridge import te_stub
from overlapkit.cluster import preflight

# Exact pins; a drifted install fails tests/unit_tests/test_stack.py and is a warning line under `make plan`'s header
# (bridge/report.py render_plan: the plan stands, its numbers may not).
PINNED = {"megatron-bridge": "0.6.2", "megatron-core": "0.19.2", "nemo-run": "0.11.1"}


def offline_env() -> None:
    """Hub offline + repo-local cache, unless the caller already chose a cache."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_CACHE", str(paths.HF_CACHE))
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def quiet_logs() -> None:
    """Bridge/Core/transformers print import-time warnings about missing TE/Apex on CPU: expected, not news."""
    noisy = ("megatron.bridge.utils.import_utils", "megatron.bridge.utils.fusions")  # TE/Apex-absent notices
    for name in ("megatron", "megatron.core", "megatron.bridge", "transformers", "nemo_run", "torch", *noisy):
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (UserWarning, FutureWarning, DeprecationWarning, SyntaxWarning):
        warnings.filterwarnings("ignore", category=category)


@contextlib.contextmanager
def silenced():
    """Mute Bridge's import/build-time notices on CPU; never around `overlap.resolve` (its warnings are evidence)."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@cache
def import_bridge():
    """Import `megatron.bridge` once, offline, with the Transformer Engine shim (a no-op where TE exists). Everything it
    imports is imported: deferring wandb, the one package no command uses, saved 1.8 s of a 30 s cold start (measured
    2026-12-03) for a 153-line import hook; the plan server keeps the import warm instead (docs/plan.md)."""
    offline_env()
    quiet_logs()
    # Stays installed: Bridge imports gpt_full_te_layer_autocast_spec lazily too. It only ever serves the two named
    # importers, so it is invisible to megatron-core and everything else.
    te_stub.install()
    with silenced():
        import megatron.bridge as bridge

    quiet_logs()  # some imports reset levels
    return bridge


# What a run's record names: the pins plus the packages that decide its numbers (absent ones are left out).
RECORDED = ("megatron-bridge", "megatron-core", "torch", "transformer-engine", "transformers", "nemo-run")


def versions(names=RECORDED) -> dict[str, str]:
    """Installed version of each package in `names`; one that is not installed is left out, never guessed."""
    out = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def version_drift() -> list[str]:
    """One line per package whose installed version differs from its pin."""
    have = versions(PINNED)
    return [
        f"{name} {have.get(name, 'none')} is installed but this repo pins {want}: run `make setup`"
        for name, want in PINNED.items()
        if have.get(name) != want
    ]


# What a rank imports to train once its preflight passed (launch/entry.py), in the order it imports them: Bridge's
# forward step and pretrain, whose module imports nvidia-resiliency-ext unguarded (Bridge 0.6.2,
# megatron/bridge/training/pretrain.py), a package the project's CPU environment leaves out (pyproject.toml).
TRAINING_MODULES = ("megatron.bridge.training.gpt_step", "megatron.bridge.training.pretrain")


def training_entry():
    """(forward_step, pretrain): what a rank trains with, imported the one way the job imports them."""
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    return forward_step, pretrain


def training_import_problem() -> str | None:
    """Why this Python cannot import what a rank trains with (the module it stops on, and why), else None. Bridge must
    be imported first, as in the job (import_bridge)."""
    try:
        training_entry()
    except Exception as exc:  # a module missing, or one whose import fails (a mismatched version): either stops it
        failed = next((m for m in TRAINING_MODULES if m not in sys.modules), TRAINING_MODULES[-1])
        return f"cannot import {failed}: {preflight.missing(exc)}"
    return None
