"""Plan-all cost vs the bare Bridge import, measured side by side in one run.

`make plan` must stay fast: Bridge is imported once, and planning every recipe (build, overrides, resolve, audit)
should cost little beyond that import. Each measurement is a fresh interpreter, alternated A/B to share machine noise.
Prints the ratio plan-all ÷ import (1.00 = planning is free).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

IMPORT = "from overlapkit import stack; stack.import_bridge()"
PLAN_ALL = (
    "from overlapkit import stack; stack.import_bridge()\n"
    "from overlapkit.plan import registry\n"
    "from overlapkit.plan.build import make_plan\n"
    "plans = [make_plan(n) for n in registry.names()]\n"
    "assert all(p.report.ok for p in plans), [p.recipe.name for p in plans if not p.report.ok]\n"
)


def timed(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2)
    reps = ap.parse_args().reps
    a, b = [], []
    for _ in range(reps):
        a.append(timed(IMPORT))
        b.append(timed(PLAN_ALL))
    ma, mb = statistics.median(a), statistics.median(b)
    runs = lambda xs: [round(x, 1) for x in xs]  # noqa: E731
    print(f"bare `import megatron.bridge` (with TE shim): median {ma:.1f} s over {reps} runs {runs(a)}")
    print(f"import + plan every recipe:                   median {mb:.1f} s over {reps} runs {runs(b)}")
    print(f"ratio plan-all / import: {mb / ma:.2f}")


if __name__ == "__main__":
    main()
