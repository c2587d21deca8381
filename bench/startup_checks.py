"""What the stack's own start-up checks (bridge/startup.py, issue 42) add to a plan, measured side by side in one run.

In one process, after the Bridge import (as the plan server plans): every shipped recipe planned with the check and
without it (startup.check replaced by one that says nothing), alternately, so machine noise is shared. Prints the
median plan time of each side, wall and CPU, and the difference; the goal is at most 1 s more per served plan.
"""

from __future__ import annotations

import statistics
import time

from overlapkit.bridge import build, registry, stack, startup

GOAL_S = 1.0
ROUNDS = 3


def main() -> None:
    stack.import_bridge()
    names = [n for n in registry.names() if registry.shipped(n)]
    real, silent = startup.check, lambda cfg, target, res: startup.Said(None, ())
    wall: dict[str, list[float]] = {"with": [], "without": []}
    cpu: dict[str, list[float]] = {"with": [], "without": []}
    build.make_plan(names[0])  # the first plan warms Bridge's caches for both sides
    for _ in range(ROUNDS):
        for side, check in (("with", real), ("without", silent)):
            startup.check = check
            try:
                for name in names:
                    w0, c0 = time.perf_counter(), time.process_time()
                    build.make_plan(name)
                    wall[side].append(time.perf_counter() - w0)
                    cpu[side].append(time.process_time() - c0)
            finally:
                startup.check = real
    med = {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in wall}
    more = med["with"][0] - med["without"][0]
    print(f"start-up checks: {len(names)} recipes x {ROUNDS} rounds, median plan (wall / CPU s)")
    print(f"  with the stack's checks   {med['with'][0]:.3f} / {med['with'][1]:.3f}")
    print(f"  without                   {med['without'][0]:.3f} / {med['without'][1]:.3f}")
    print(f"  added per plan            {more:+.3f} s (goal <= {GOAL_S:.1f} s): {'ok' if more <= GOAL_S else 'OVER'}")


if __name__ == "__main__":
    main()
