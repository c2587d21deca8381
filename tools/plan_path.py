"""The path `make plan` takes through this repository's modules: every call from one of our modules into another
(launch/, src/overlapkit/, recipes/), in order, so a reader can see where a plan goes back and forth. The Bridge import
runs first, untraced (it is the same for every plan); the plan itself runs as `python -m launch plan` does for
`make plan FORMAT=json RECIPE=...`.

    .venv/bin/python tools/plan_path.py [RECIPE] [--depth=N] [--flags launch/plan.py takes, e.g. --run-name=x]

Prints the entries (module entered, from which module, the function) up to call depth N below main (default 6:
the command's parse, check and run, and what each stage of bridge.build.plan_for calls); the visits per module on
that path (calls one after another into one module from one caller are one visit); every call from a stage of the
library into a later one (a climb, at any depth); and how often control entered each module at any depth. Module
bodies run by an import (`<module>`) are not entries: they are the same for every plan.
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
    from overlapkit.bridge import stack

    stack.import_bridge()
    from launch import commands

    recipe = next((a for a in argv if not a.startswith("-")), "llama3_70b_pretrain_64gpu_h100_bf16")
    depth = int(next((a.split("=", 1)[1] for a in argv if a.startswith("--depth=")), "6"))
    flags = [a for a in argv if a.startswith("-") and not a.startswith("--depth=")]
    entries, stack_of = [], []

    def profile(frame, event, _arg):
        if event == "call":
            mod = module_of(frame.f_code.co_filename)
            caller = stack_of[-1] if stack_of else None
            if mod and mod != caller and caller is not None and frame.f_code.co_name != "<module>":
                entries.append((mod, caller, frame.f_code.co_qualname, len(stack_of)))
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
    shown = [(mod, caller, fn, level) for mod, caller, fn, level in entries if level <= depth]
    for mod, caller, fn, level in shown:
        print(f"{'  ' * (level - 1)}{caller} → {mod}.{fn}")
    # A visit: control goes into a module's function and comes back. Calls one after another into one module from one
    # caller are one visit (launch.commands running launch.plan's parse, check and run; a step reading a module's two
    # functions in a row), whatever those calls do below; a method of a value the plan carries (AuditReport.extend,
    # MemoryEstimate.fits, a to_dict) reads that value, it is no stop on the way.
    visits: collections.Counter = collections.Counter()
    last_at: dict[int, tuple[str, str]] = {}  # per call depth, the (module, caller) of the last visit started there
    for mod, caller, fn, level in shown:
        if "." in fn:
            continue
        if last_at.get(level) != (mod, caller):
            visits[mod] += 1
        last_at = {d: v for d, v in last_at.items() if d < level} | {level: (mod, caller)}
    climbs = [f"{caller} → {mod}.{fn}" for mod, caller, fn, _ in entries if stage(mod) > stage(caller) >= 0]
    print(
        f"\nexit status {rc}; visits per module on the path above (depth ≤ {depth}; methods not counted), most first:"
    )
    for mod, n in visits.most_common():
        print(f"  {n:3}  {mod}")
    print(f"calls from a stage into a later one (a climb), at any depth: {len(climbs)}")
    for line in climbs:
        print(f"  {line}")
    entered = collections.Counter(mod for mod, _, _, _ in entries)
    print(f"{len(entered)} modules entered {len(entries)} times from another module at any depth (a helper in a loop")
    print("counts each call): " + ", ".join(f"{mod} {n}" for mod, n in entered.most_common()))
    return 0


# The library's rooms in an order the import rule keeps (docs/architecture.md, "Where things live"): a room imports
# only earlier ones, so a call into a later room is a climb. The entry layer (launch/) and the recipes sit outside.
STAGES = ("spec", "sizing", "profile", "cluster", "nightly", "bridge", "fork")


def stage(module: str) -> int:
    parts = module.split(".")
    if parts[0] != "overlapkit":
        return -1
    return STAGES.index(parts[1]) + 1 if len(parts) > 2 and parts[1] in STAGES else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
