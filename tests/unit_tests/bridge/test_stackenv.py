"""The candidate stack's pins and environment (overlapkit/bridge/stackenv.py): STACK's text refused in one line when
malformed or naming no package of this stack, the pins swapped into a copy of pyproject.toml (the CPU overrides
kept), and uv's failure as one line. No network: the builds here run uv with --offline on its cache."""

from __future__ import annotations

import time
import tomllib

import pytest

from overlapkit import paths
from overlapkit.bridge import stackenv
from overlapkit.errors import BadInput

PYPROJECT = (paths.REPO_ROOT / "pyproject.toml").read_text()


def test_a_stack_is_exact_pins_of_this_projects_packages():
    s = stackenv.parse("megatron-bridge==0.6.0 Megatron_Core==0.19.0,transformer-engine==2.9.0")
    assert s.pins == {"megatron-bridge": "0.6.0", "megatron-core": "0.19.0", "transformer-engine": "2.9.0"}
    assert s.spec == "megatron-bridge==0.6.0 megatron-core==0.19.0 transformer-engine==2.9.0"


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "STACK is empty"),
        ("megatron-bridge=0.6.0", "is not name==version"),
        ("megatron-bridge>=0.6", "is not name==version"),
        ("megatron-brigde==0.6.0", "did you mean megatron-bridge?"),
        ("nosuchthing==1.0", "is not a package of this project's stack"),
        ("megatron-core==0.19.0 megatron_core==0.19.1", "pinned twice"),
    ],
)
def test_bad_stack_text_is_one_line(text, says):
    with pytest.raises(BadInput, match=says) as exc:
        stackenv.parse(text)
    assert "\n" not in str(exc.value)


def test_the_pins_are_swapped_into_pyproject_and_nothing_else_moves():
    cand = stackenv.swapped_pyproject(PYPROJECT, stackenv.parse("megatron-bridge==0.6.0 transformer-engine==2.9.0"))
    new, old = tomllib.loads(cand), tomllib.loads(PYPROJECT)
    assert "megatron-bridge==0.6.0" in new["project"]["dependencies"]
    assert "transformer-engine==2.9.0" in new["project"]["dependencies"]  # not a dependency: added
    assert new["tool"]["uv"] == old["tool"]["uv"]  # the CPU overrides apply to the candidate too
    rest = [d for d in new["project"]["dependencies"] if not d.startswith(("megatron-bridge", "transformer-engine"))]
    assert rest == [d for d in old["project"]["dependencies"] if not d.startswith("megatron-bridge")]


def test_the_pinned_stack_swaps_into_the_same_pyproject_so_its_lock_needs_no_resolution():
    assert stackenv.swapped_pyproject(PYPROJECT, stackenv.pinned_stack()) == PYPROJECT
    assert stackenv.pinned_stack().pins == {"megatron-bridge": "0.6.2", "megatron-core": "0.19.2"}


def test_uvs_failure_is_its_one_line_of_why():
    err = (
        "  × No solution found when resolving dependencies:\n"
        "  ╰─▶ Because there is no version of megatron-bridge==99.0.0 and your project depends on it, we can\n"
    )
    assert stackenv.uv_line(err).startswith("Because there is no version of megatron-bridge==99.0.0")
    assert stackenv.uv_line("error: Failed to fetch: `https://pypi.org/simple/x/`\n  Caused by: dns\n") == (
        "Failed to fetch: `https://pypi.org/simple/x/`"
    )


def test_a_stack_that_does_not_install_is_one_line_from_uv_and_leaves_nothing(tmp_path):
    """Real uv, offline: no version 99 of Bridge is anywhere."""
    with pytest.raises(BadInput) as exc:
        stackenv.build(stackenv.parse("megatron-bridge==99.0.0"), offline=True, root=tmp_path)
    msg = str(exc.value)
    assert msg.startswith("stack megatron-bridge==99.0.0 does not install: uv: ") and "\n" not in msg
    assert "megatron-bridge==99.0.0" in msg.partition("uv: ")[2]
    assert list(tmp_path.iterdir()) == []  # no half-built environment to be taken for one


def test_the_pinned_stack_builds_offline_from_make_setups_cache_once_and_is_reused(tmp_path):
    """uv lock sees its lock up to date (nothing to resolve: an empty cache would do) and uv sync --frozen installs
    the lock's own URLs, the wheels `make setup` put in uv's cache: no index is asked, so a fresh machine's cache
    serves it offline."""
    t0 = time.perf_counter()
    first = stackenv.build(stackenv.pinned_stack(), offline=True, root=tmp_path)
    took = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = stackenv.build(stackenv.pinned_stack(), offline=True, root=tmp_path)
    assert first.built and not again.built and again.root == first.root
    assert time.perf_counter() - t0 <= took / 10
    assert stackenv.changed_packages(paths.REPO_ROOT / "uv.lock", first.lock) == []
    assert (first.python.parent / "torchrun").exists()  # the whole stack, torch included
