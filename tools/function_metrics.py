"""The readability figures of issue 35, measured: of the functions defined in src/ and launch/, the share that is
named in exactly one other place in the repository (a one-caller helper the reader must hop to), and the median
function length in lines as `ruff format` lays them out (the `def` line to the last line of the body; the lint gate
keeps every file ruff-formatted, and this tool says when one is not).

    .venv/bin/python tools/function_metrics.py            # the figures
    .venv/bin/python tools/function_metrics.py --list     # and every function named once elsewhere, with its length

"Named": a NAME token (tokenize: code, not strings or comments) in any .py file of the repository (git's files,
tracked or new, never ignored ones), its own `def` not counted. A name defined more than once (`main`, `to_dict`)
pools its mentions: each of its definitions counts as named once elsewhere only when the mentions beyond the
definitions number one.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import statistics
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURED = ("src", "launch")


def python_files(*tops: str) -> list[Path]:
    """The repository's own .py files under `tops` (all when none): tracked or new, never what git ignores (.venv,
    runs/, where nemo_run copies the whole tree into each experiment and would double every mention)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *tops],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted(REPO / f for f in listed if f.endswith(".py") and (REPO / f).exists())


def functions(path: Path) -> list[tuple[str, int, str]]:
    """(name, length in lines, where) of every def in `path`, methods and nested ones included."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(REPO)
    return [
        (n.name, n.end_lineno - n.lineno + 1, f"{rel}:{n.lineno}")
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def mentions() -> collections.Counter:
    """How often each name is written as code in the repository (definitions included)."""
    count: collections.Counter = collections.Counter()
    for path in python_files():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        count.update(t.string for t in tokens if t.type == tokenize.NAME)
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list each function named in exactly one other place")
    args = ap.parse_args()
    unformatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--quiet", *MEASURED], cwd=REPO, capture_output=True
    )
    if unformatted.returncode not in (0, 1) or unformatted.stdout:
        print(f"note: not every file is ruff-formatted, lengths are as written: {unformatted.stdout.decode()[:300]}")
    defs = [f for path in python_files(*MEASURED) for f in functions(path)]
    defined = collections.Counter(name for name, _, _ in defs)
    said = mentions()
    once = [(name, n, where) for name, n, where in defs if said[name] - defined[name] == 1]
    lengths = [n for _, n, _ in defs]
    print(f"functions in {'/ and '.join(MEASURED)}/: {len(defs)}")
    print(f"named in exactly one other place: {len(once)} ({len(once) / len(defs):.1%})")
    mean = statistics.mean(lengths)
    print(f"median length: {statistics.median(lengths):g} lines (mean {mean:.1f}, longest {max(lengths)})")
    # What a median of 12 lines would take: every function under 12 lines that goes either leaves a caller under 12
    # (the median needs as many at 12 or more as under) or, at best, lifts its caller past 12 as well.
    small = [said[name] - defined[name] for name, n, _ in defs if n < 12]
    gap = len(small) - (len(defs) - len(small))
    places = collections.Counter(min(m, 6) for m in small)
    print(
        f"under 12 lines: {len(small)}; a median of 12 needs {max(gap, 0) // 2}-{max(gap, 0)} of them gone; "
        "named elsewhere in 0/1/2/3/4/5/6+ places: " + "/".join(str(places[k]) for k in range(7))
    )
    if args.list:
        for name, n, where in sorted(once, key=lambda f: f[2]):
            print(f"  {where}  {name}  ({n} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
