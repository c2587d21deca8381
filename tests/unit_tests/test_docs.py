"""The docs, checked: the README stays a short front page with the two set-up commands, every relative link in
README.md and docs/*.md resolves to a file in the repository, no excerpt carries a path of the machine it was made
on, and every `make <target>` they show is a Makefile target that a test runs or that UNTESTED names with the
reason no test runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from overlapkit import stack

REPO = stack.REPO_ROOT
README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").glob("*.md")])
README_MAX_BYTES = 12_000
SETUP_COMMANDS = ("make plan RECIPE=llama3_70b_pretrain_64gpu_h100_bf16", "make test")

# Targets the docs show that no test runs through make, each with the reason. One home: a target a test does run
# must not be here (test_untested_targets_are_really_untested), nor a target the docs no longer show.
UNTESTED = {
    "help": "prints the Makefile's own ## comments; nothing to check beyond the Makefile",
    "setup": "uv sync --frozen: the suite already runs inside the venv it installs",
    "test": "the suite itself: it cannot run itself",
    "lint": "ruff check and format check over the tree: a style gate run before a commit, not a behaviour",
    "bench": "minutes of timed Bridge imports (docs/architecture.md, measured facts): a measurement, not a check",
    "slurm-up": "installs Debian packages as root and starts the local Slurm that the e2e tests need",
    "slurm-down": "stops the local Slurm the e2e tests need",
    "logs": "prints a run's Slurm job logs (python -m launch logs); no test reads them through make yet",
    "bless": "needs a completed GPU training run of a nightly shape; bless_checks are unit-tested in test_rules.py",
}

# Absolute paths an excerpt may show because the product itself uses them, with the file that uses each.
ALLOWED_PATHS = {
    "/tmp/overlapkit-slurm": "slurm/local/start.sh",  # the local dev Slurm's default LOCAL_SLURM_DIR
    # the plan server's socket directory without XDG_RUNTIME_DIR
    "/tmp/overlapkit-<uid>": "launch/plan_server.py",
    "/tmp/site": "tools/gpu_check_on_device.sh",  # where the lent GPU machine's carried wheels are installed
}
# Directories that only exist on the machine a doc was written on: a home, a workspace, pytest's or any temp dir.
MACHINE_PATH = re.compile(r"(?<![\w.~<>$}/-])/(?:work|root|home|Users|tmp|private/var|var/folders)/[^\s`\"')\]|,;]*")

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MAKE_CALL = re.compile(r"(?<![\w./-])make\s+(?:-[-\w]+\s+)*([a-z][a-z0-9-]*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _code(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown text: where a command is shown."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + CODE_SPAN.findall(FENCE.sub("", text))


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", text, re.M))


def shown_targets() -> dict[str, set[str]]:
    """target -> the docs that show `make <target>`."""
    shown: dict[str, set[str]] = {}
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for target in MAKE_CALL.findall(code):
                shown.setdefault(target, set()).add(_rel(doc))
    return shown


def tested_targets() -> set[str]:
    """Targets some test runs through make: ["make", <flags>, "T", ...], a make("T", ...) helper call, or a
    ("T", ...) parameter row in a file whose make call takes its target from a variable (["make", *args] or
    ["make", target, ...])."""
    found: set[str] = set()
    literal = re.compile(r"\[\s*\"make\"\s*,\s*(?:\"-[^\"]*\"\s*,\s*)*\"([a-z][a-z0-9-]*)\"")
    variable = re.compile(r"\[\s*\"make\"\s*,\s*(?:\"-[^\"]*\"\s*,\s*)*\*?[a-z_]+\b")
    for path in (REPO / "tests").rglob("*.py"):
        text = path.read_text()
        found |= set(literal.findall(text)) | set(re.findall(r"\bmake\(\s*\"([a-z][a-z0-9-]*)\"", text))
        if variable.search(text):
            found |= set(re.findall(r"^\s*\(\s*\"([a-z][a-z0-9-]*)\"\s*,", text, re.M))
    return found & makefile_targets()


def test_readme_is_short_and_has_the_two_setup_commands():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes > {README_MAX_BYTES}: move detail to docs/"
    code = "\n".join(_code(README.read_text()))
    missing = [c for c in SETUP_COMMANDS if c not in code]
    assert not missing, f"README.md does not show {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve_inside_the_repository(doc):
    bad = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the same page
        path = target.split("#", 1)[0]
        resolved = (doc.parent / path).resolve()
        if path.startswith("/") or not resolved.is_relative_to(REPO) or not resolved.is_file():
            bad.append(target)
    assert not bad, f"{_rel(doc)}: links that do not resolve to a file in the repository: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_no_machine_paths_in_excerpts(doc):
    text = doc.read_text()
    for allowed in ALLOWED_PATHS:
        text = text.replace(allowed, "<allowed>")
    found = sorted(set(MACHINE_PATH.findall(text)))
    assert not found, f"{_rel(doc)} shows paths of the machine it was written on: {found}; use <placeholder>s"


def test_allowed_paths_are_the_products_own():
    for path, user in ALLOWED_PATHS.items():
        assert path in (REPO / user).read_text(), f"{path} is not in {user}: drop it from ALLOWED_PATHS"
        assert any(path in d.read_text() for d in DOCS), f"no doc shows {path}: drop it from ALLOWED_PATHS"


def test_every_make_target_shown_exists_and_is_tested_or_listed():
    shown, targets, tested = shown_targets(), makefile_targets(), tested_targets()
    unknown = {t: sorted(d) for t, d in shown.items() if t not in targets}
    assert not unknown, f"`make <target>` shown but not in the Makefile: {unknown}"
    bare = {t: sorted(d) for t, d in shown.items() if t not in tested and t not in UNTESTED}
    assert not bare, f"shown, run by no test and not in UNTESTED (add a test, or the reason): {bare}"


def test_untested_targets_are_really_untested():
    tested, shown, targets = tested_targets(), shown_targets(), makefile_targets()
    assert not set(UNTESTED) & tested, f"a test runs {sorted(set(UNTESTED) & tested)}: drop it from UNTESTED"
    assert set(UNTESTED) <= targets, f"not Makefile targets: {sorted(set(UNTESTED) - targets)}"
    assert set(UNTESTED) <= set(shown), f"no doc shows {sorted(set(UNTESTED) - set(shown))}: drop from UNTESTED"


def test_the_checks_see_what_they_claim():
    """The detectors themselves, on known cases: a helper call, a parameter row, a machine path, a prose `make`."""
    assert {"prep-data", "plan", "submit", "sbatch", "run-local", "nightly-schedule", "plan-server-stop"} <= (
        tested_targets()
    )
    assert MAKE_CALL.findall("make -s prep-data IN=x; make: *** [Makefile:70: plan] Error 1") == ["prep-data"]
    assert MACHINE_PATH.findall("run directory /work/main/runs/x and <checkout>/runs/y, cd /root/a") == [
        "/work/main/runs/x",
        "/root/a",
    ]
    assert MACHINE_PATH.findall("tmp_path /tmp/pytest-of-root/p0/x and 2>&1 >/dev/null") == ["/tmp/pytest-of-root/p0/x"]
