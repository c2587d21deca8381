"""The path `make plan` takes through this repository's modules: every call from one of our modules into another
(launch/, src/overlapkit/, recipes/), in order, so a reader can see where a plan goes back and forth. The Bridge import
runs first, untraced (it is the same for every plan); the plan itself runs as `python -m launch plan` does for
`make plan FORMAT=json RECIPE=...`.

    .venv/bin/python tools/plan_path.py [RECIPE] [--depth=N] [--flags launch/plan.py takes, e.g. --run-name=x]

Prints the entries (module entered, from which module, the function) up to call depth N below main (default 3),
and, per module, how often control entered it from another module at any depth. Module bodies run by an import
(`<module>`) are not entries: they are the same for every plan.
"""

from __future__ import annotations

import collections
import contextlib
import io
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = (REPO / "src" / "overlapkit", REPO / "launch", REPO / "recipes")


def module_of(filename: str) -> str | None:
    path = Path(filename)
    for root in OURS:
        if path.is_relative_to(root):
            rel = path.relative_to(root.parent if root.name != "overlapkit" else root.parent)
            return str(rel.with_suffix("")).replace("/", ".")
    return None


def main(argv: list[str]) -> int:
    sys.path[:0] = [str(REPO), str(REPO / "src")]
    from overlapkit import stack

    stack.import_bridge()
    from launch import commands

    recipe = next((a for a in argv if not a.startswith("-")), "llama3_70b_pretrain_64gpu_h100_bf16")
    depth = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--depth=")), "3"))
    flags = [a for a in argv if a.startswith("-") and not a.startswith("--depth=")]
    entries, stack_of = [], []

    def profile(frame, event, _arg):
        if event == "call":
            mod = module_of(frame.f_code.co_filename)
            caller = stack_of[-1] if stack_of else None
            if mod and mod != caller and caller is not None and frame.f_code.co_name != "<module>":
                entries.append((mod, caller, frame.f_code.co_name, len(stack_of)))
            stack_of.append(mod or caller)
        elif event == "return" and stack_of:
            stack_of.pop()

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        stack_of.append("launch.commands")
        sys.setprofile(profile)
        try:
            rc = commands.call("plan", ["--format=json", f"--runs={tmp}", *flags, "--", recipe])
        finally:
            sys.setprofile(None)
    visits = collections.Counter(mod for mod, _, _, _ in entries)
    for mod, caller, fn, level in entries:
        if level <= depth:
            print(f"{'  ' * (level - 1)}{caller} → {mod}.{fn}")
    print(f"\nexit status {rc}; {len(visits)} modules entered {len(entries)} times from another module:")
    for mod, n in visits.most_common():
        print(f"  {n:3}  {mod}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
