"""Every process an e2e test starts (a `make` as a user types it) uses the session's plan server: one Bridge import
serves all of them, as it serves a user's working session (tests/conftest.py starts it; launch/plan_server.py)."""

from __future__ import annotations

import pytest

from launch import plan_server


@pytest.fixture(autouse=True)
def _served_processes(served, monkeypatch):
    monkeypatch.setenv(plan_server.DIR_VAR, served[plan_server.DIR_VAR])
    monkeypatch.delenv(plan_server.SWITCH, raising=False)
