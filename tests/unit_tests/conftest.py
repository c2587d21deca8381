"""Fixtures more than one unit-test file builds on."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import pytest

# A plan.json that make submit wrote (llama3_8b fp8, 1 node), for tests that need a run directory's plan.
PLAN_FIXTURE = Path(__file__).parent / "nightly" / "fixtures" / "preflight_submit_run" / "plan.json"


@pytest.fixture
def write_plan():
    """`write_plan(run_dir, **run)`: the fixture plan.json in `run_dir`, its `run` key updated with `run`; returns
    the plan."""

    def write(run_dir: Path, **run) -> dict:
        plan = json.loads(PLAN_FIXTURE.read_text())
        plan["run"] = {**(plan.get("run") or {}), **run}
        (run_dir / "plan.json").write_text(json.dumps(plan))
        return plan

    return write


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo process group and Megatron's model-parallel state, as Bridge's setup makes them on a GPU.

    The group meets in a file, not on a TCP port: test runs in other checkouts on this machine would collide on any
    fixed port. A group that already exists (made earlier in this process and kept) is used and left in place:
    init_process_group would refuse a second, and destroying another's group would break it."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    fresh = not torch.distributed.is_initialized()
    if fresh:
        store = torch.distributed.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield ProcessGroupCollection.use_mpu_process_groups()
    ps.destroy_model_parallel()
    if fresh:
        torch.distributed.destroy_process_group()


@pytest.fixture
def within():
    """`with within(seconds):` fails the test (never hangs the suite) when the block takes longer: what a reader that
    blocks on a planted FIFO would do. SIGALRM interrupts a blocking open or read."""

    @contextlib.contextmanager
    def guard(seconds: float):
        def late(*_):
            raise TimeoutError(f"still running after {seconds} s: a planted file hung the reader")

        old = signal.signal(signal.SIGALRM, late)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    return guard
