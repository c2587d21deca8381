"""`make stack-diff`'s candidate environment: built once, then reused, timed side by side in one run.

The first build is from nothing (a fresh cache directory of this run: uv lock from the checkout's uv.lock, uv sync
--frozen hard-linking uv's cached wheels, torch included); the second finds it built and takes it. Goal: the second
at most a tenth of the first (issue 44). Default stack: the pinned one, offline (nothing downloaded, so the
timing is the build's, not the network's); `--stack "megatron-bridge==0.6.0 megatron-core==0.19.0"` times a real
candidate (online). The cache directory is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from overlapkit.bridge import stackenv

GOAL = 0.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stack", default="", help="candidate pins (default: the pinned stack, offline)")
    opts = ap.parse_args()
    stack = stackenv.parse(opts.stack) if opts.stack else stackenv.pinned_stack()
    root = Path(tempfile.mkdtemp(prefix="okstacks-bench-"))
    try:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            env = stackenv.build(stack, offline=not opts.stack, root=root)
            times.append((time.perf_counter() - t0, env.built))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (first, built), (second, again) = times
    assert built and not again, "the first call must build and the second reuse"
    print(f"candidate environment {stack.spec}")
    print(f"first (built by uv)   {first:7.2f} s")
    print(f"second (reused)       {second:7.3f} s")
    print(f"ratio second / first: {second / first:.4f}  (goal <= {GOAL})")


if __name__ == "__main__":
    main()
