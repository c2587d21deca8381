"""`python -m launch.plan_server --serve | --stop | --status` (`make plan-server-stop`): the plan server's command line.
How the server works, and when a command becomes it: src/overlapkit/serve/__init__.py and docs/plan.md."""

from __future__ import annotations

import argparse
import os
import sys

from overlapkit.serve import client, server
from overlapkit.serve.paths import Paths, holder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.plan_server", description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--serve", action="store_true", help="run the server (the first make plan starts it)")
    g.add_argument("--stop", action="store_true", help="stop this checkout's server (make plan-server-stop)")
    g.add_argument("--status", action="store_true", help="say whether this checkout's server runs")
    args = ap.parse_args(argv)
    try:
        paths = Paths.of().private()
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.serve:
        code = server.serve()
        os._exit(code)  # no interpreter teardown: nothing to flush, and extensions report "leaks" of frozen objects
    if args.stop:
        print(client.stop(paths))
        return 0
    held = holder(paths)
    print(f"plan server pid {held[0]}: {held[1]} ({paths.sock})" if held else "no plan server running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
