"""Which Makefile targets the suite really runs, recorded as it runs them, and the rule the docs are held to: every
`make <target>` a doc shows is a Makefile target that some test runs through make, or one UNTESTED names with the
reason no test runs it.

A test "runs" a target when a pytest process of the session starts `make` on this repository's Makefile with that
target, seen by an audit hook on every subprocess the process starts (`sys.addaudithook`, event "subprocess.Popen");
a test file that only mentions a target runs nothing. The rule is a test, JUDGE (tests/unit_tests/test_docs.py),
which tests/conftest.py hands out last (after any shuffle) and which judges a session that runs the whole suite: part
of the suite (one file, -k, a machine whose Slurm is down) runs only part of the targets. The session's xdist workers
each write, as each test ends, that it ended and the targets they have run (LEDGER); the judge waits until every
other test of the session has ended, in any worker, and judges what they all ran.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

# Targets the docs show that no test runs through make, each with the reason. One home: a target a test does run
# must not be here, nor one the docs no longer show (both are part of the rule).
UNTESTED = {
    "setup": "uv sync --frozen: the suite already runs inside the venv it installs",
    "lint": "ruff check and format check over the tree: a style gate run before a commit, not a behaviour",
    "bench": "minutes of timed Bridge imports (docs/architecture.md, measured facts): a measurement, not a check",
    "docs": "rewrites the committed docs; test_docs.py runs its code (tools/docs.py) in-process and fails until the "
    "docs are what it would write",
    "slurm-up": "installs Debian packages as root and starts the local Slurm that the e2e tests need",
    "slurm-down": "stops the local Slurm the e2e tests need",
}

FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
MAKE_CALL = re.compile(r"(?<![\w./-])make\s+(?:-[-\w]+\s+)*([a-z][a-z0-9-]*)")

# GNU make's options whose value is the next argument (make --help, GNU make 4.3).
VALUED = {"-C", "--directory", "-f", "--file", "--makefile", "-I", "--include-dir", "-o", "--old-file", "-W"}
# Options under which make runs no recipe: the targets are printed or questioned, not run.
NOT_RUN = {"-n", "--dry-run", "--just-print", "--recon", "-q", "--question", "-p", "--print-data-base"}

made: set[str] = set()  # the targets this process has run, filled by `record`
JUDGE = "test_every_make_target_the_docs_show_is_run_by_a_test"
# Whether this session runs the whole suite, the condition for judging which make targets it ran: the tests/ root
# collected, nothing deselected (-k, -m, --lf, --deselect), nothing skipped but what needs a GPU (tests/conftest.py).
WHOLE = {"args": [], "partial": []}


# The session's folder where each pytest process appends, as each test ends, one JSON line: the test, the targets that
# process has run so far, why the run is partial (tests/conftest.py sets it; one file a process)
LEDGER: Path | None = None


def ended(nodeid: str) -> None:
    LEDGER.mkdir(exist_ok=True)
    with open(LEDGER / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"test": nodeid, "made": sorted(made), "partial": WHOLE["partial"]}) + "\n")


def session_ran(others: set[str], timeout: float = 1800) -> tuple[set[str], list[str]]:
    """Once every test in `others` has ended, in any process of the session: the targets they all ran, and why the
    run is partial (empty for a whole run)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(ln) for f in sorted(LEDGER.glob("*.jsonl")) for ln in f.read_text().splitlines()]
        left = others - {ln["test"] for ln in lines}
        if not left:
            break
        assert time.monotonic() < deadline, f"{len(left)} tests have not ended, e.g. {sorted(left)[:3]}"
        time.sleep(1)
    partial = sorted({p for ln in lines for p in ln["partial"]} | set(WHOLE["partial"]))
    return made.union(*(ln["made"] for ln in lines)), partial


SUITE = [str(REPO / "tests")]  # what pytest collects for the whole suite: the tests/ root, resolved


def whole_run(partial: list[str]) -> str | None:
    """None when this session runs the whole suite; else why not, one line."""
    if WHOLE["args"] != SUITE:
        return f"only {' '.join(WHOLE['args'])} collected"
    return "; ".join(partial[:3]) or None


def code_of(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown text: where a command is shown."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + CODE_SPAN.findall(FENCE.sub("", text))


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", MAKEFILE.read_text(), re.M))


def shown_targets() -> dict[str, set[str]]:
    """target -> the docs that show `make <target>`."""
    shown: dict[str, set[str]] = {}
    for doc in DOCS:
        for code in code_of(doc.read_text()):
            for target in MAKE_CALL.findall(code):
                shown.setdefault(target, set()).add(str(doc.relative_to(REPO)))
    return shown


def targets_run(argv: list[str], cwd: str | os.PathLike | None) -> list[str]:
    """The targets of this repository's Makefile that `argv`, started in `cwd`, runs: none when it is not make, when
    make is given another makefile or directory, or when it runs no recipe (-n, -q, -p); the default goal (help)
    when it names none."""
    if not argv or os.path.basename(argv[0]) != "make":
        return []
    where, targets, args = Path(cwd or os.getcwd()), [], iter(argv[1:])
    for arg in args:
        if arg in ("-C", "--directory"):
            where = where / next(args, "")
        elif arg.startswith("--directory="):
            where = where / arg.removeprefix("--directory=")
        elif arg in NOT_RUN or arg in VALUED or arg.startswith(("-f", "--file=", "--makefile=", "-C")):
            return []  # runs nothing, or another makefile, or an attached -Cdir we do not use: not ours to count
        elif not arg.startswith("-") and "=" not in arg:
            targets.append(arg)  # neither a flag nor a VAR=value
    return (targets or ["help"]) if where.resolve() == REPO else []


def record(event: str, args: tuple) -> None:
    """The audit hook: every `make` this process starts, its targets added to `made`."""
    if event == "subprocess.Popen" and isinstance(args[1], list | tuple):
        made.update(targets_run([os.fsdecode(a) for a in args[1]], args[2]))


def judge(shown: dict[str, set[str]], run: set[str]) -> list[str]:
    """Each break of the rule, one line: a target shown but not in the Makefile; shown but neither run nor in
    UNTESTED; in UNTESTED but run by a test; in UNTESTED but not a target, or shown by no doc."""
    targets, untested = makefile_targets(), set(UNTESTED)
    problems = [
        f"`make {t}` shown in {sorted(d)} is not a Makefile target" for t, d in shown.items() if t not in targets
    ]
    for t, docs in sorted(shown.items()):
        if t in targets and t not in run and t not in untested:
            problems.append(
                f"`make {t}` shown in {sorted(docs)}: no test ran it (add a test, or its reason to UNTESTED)"
            )
    problems += [f"a test ran `make {t}`: drop it from UNTESTED" for t in sorted(untested & run)]
    problems += [f"UNTESTED names {t}, not a Makefile target" for t in sorted(untested - targets)]
    problems += [f"UNTESTED names {t}, which no doc shows" for t in sorted((untested & targets) - set(shown))]
    return problems
