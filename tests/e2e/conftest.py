"""Every process an e2e test starts (a `make` as a user types it) uses the session's plan server: one Bridge import
serves all of them, as it serves a user's working session (tests/conftest.py starts it; src/overlapkit/serve/)."""

from __future__ import annotations

import pytest

from overlapkit.serve import paths as serve_paths


@pytest.fixture(autouse=True)
def _served_processes(served, monkeypatch):
    monkeypatch.setenv(serve_paths.DIR_VAR, served[serve_paths.DIR_VAR])
    monkeypatch.delenv(serve_paths.SWITCH, raising=False)
