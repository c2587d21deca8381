"""The clone stands alone: what the tests and the product read is in the repository, and nothing names a path beside
the checkout (the folder beside it where the team hands data over is not a dependency). `.ci/run` proves it on the
whole suite by running it with that folder out of reach; this guard says where, one line per offence, without that
sandbox (a developer's `make test`)."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest
from reference_traces import TRACE_DIR

from overlapkit import paths

# A path beside or above the checkout, as code or docs would name one. This file's own samples of them are skipped.
THIS = Path(__file__).resolve().relative_to(paths.REPO_ROOT).as_posix()
SHARED = "sha" + "red"
BESIDE = [
    re.compile(r"\.\./" + SHARED + r"\b"),  # the team folder beside the checkout, as a doc or a relative path names it
    re.compile(r"/work/" + SHARED + r"\b"),  # the team's machine path
    re.compile(r"OVERLAPKIT_" + SHARED.upper()),  # the variable that once pointed at it
    re.compile(r"\b(?:REPO_ROOT|REPO|ROOT|_ROOT)\.parents?\b"),  # the checkout's own parent
    re.compile(r"[\"']" + SHARED + r"[\"']\s*/|/\s*[\"']" + SHARED + r"[\"']"),  # a "shared" path component
]
# Path(__file__).parents[k]: beyond the checkout when k reaches the file's depth in it.
FILE_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")


def offences(rel: str, text: str) -> list[str]:
    """`rel:line: text` for each line of `text` (the file `rel` of the repository) that names a path beside it."""
    depth = len(Path(rel).parts)
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        deep = any(int(k) >= depth for k in FILE_PARENTS.findall(line))
        if deep or any(p.search(line) for p in BESIDE):
            found.append(f"{rel}:{n}: {line.strip()}")
    return found


def repo_files() -> list[str]:
    """Every file a clone has (tracked, or new and not ignored): what CI's fresh clone holds."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=paths.REPO_ROOT,
        capture_output=True,
        check=True,
    )
    return sorted({f for f in out.stdout.decode().split("\0") if f and (paths.REPO_ROOT / f).is_file()})


def test_nothing_names_a_path_beside_the_checkout():
    found = []
    for rel in repo_files():
        if rel == THIS:
            continue
        try:
            text = (paths.REPO_ROOT / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # the traces (gzip) and other binaries name no path
            continue
        found += offences(rel, text)
    assert not found, "paths beside the checkout (copy what is needed into the repo):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("rel", "line"),
    [
        ("tests/x.py", "p = Path('..') / '../" + SHARED + "/reference'"),
        ("docs/x.md", "the traces of `../" + SHARED + "/reference/traces`"),
        ("tests/x.py", "os.environ['OVERLAPKIT_" + SHARED.upper() + "']"),
        ("src/a/b.py", "REFERENCE = paths.REPO_ROOT.parent / 'reference'"),
        ("src/a/b.py", "x = paths.REPO_ROOT.parents[1] / 'y'"),
        ("tools/x.py", "d = ROOT / '..' / \"" + SHARED + "\" / 'x'"),
        ("tools/x.py", "REPO = Path(__file__).resolve().parents[2]"),
        ("src/overlapkit/x.py", "R = Path(__file__).parents[3]"),
        (".ci/run", "cp -r /work/" + SHARED + "/reference ."),
    ],
)
def test_the_guard_catches(rel, line):
    assert offences(rel, f"ok = 1\n{line}\n") == [f"{rel}:2: {line}"]


@pytest.mark.parametrize(
    ("rel", "line"),
    [
        ("tools/x.py", "REPO = Path(__file__).resolve().parents[1]"),  # tools/ -> the checkout
        ("src/overlapkit/sizing/x.py", "R = Path(__file__).resolve().parents[3]"),
        ("src/a.py", "m.moe_" + SHARED + "_expert_overlap = False"),
        ("docs/a.md", "the cluster's " + SHARED + " filesystem"),
    ],
)
def test_the_guard_passes(rel, line):
    assert offences(rel, line) == []


def test_the_traces_are_the_ones_the_readme_names():
    """Every file beside the README is listed there with its SHA-256, and is that file (unmodified HTA test data)."""
    readme = (TRACE_DIR / "README.md").read_text()
    listed = dict(re.findall(r"^\| `([^`]+)` \| `[0-9a-f]{40}` \| `([0-9a-f]{64})` \|$", readme, re.M))
    present = {p.name for p in TRACE_DIR.iterdir()} - {"README.md"}
    assert present == set(listed), "every file of tests/data/reference_traces has its row in the README"
    assert (TRACE_DIR / "LICENSE-HolisticTraceAnalysis").read_text().startswith("MIT License")
    for name, digest in listed.items():
        assert hashlib.sha256((TRACE_DIR / name).read_bytes()).hexdigest() == digest, f"{name} differs from the README"
