"""`make plan-server-stop`, and `python -m launch plan-server`: the server a client starts (launch/serve.py). The
client (`forward`) and what it shares with the server: overlapkit/cluster/plan_server.py. What it guarantees, and when
one is used: docs/plan.md, "Fast commands"."""

import contextlib
import os
import signal
import time

from launch.args import Parser
from overlapkit.cluster.plan_server import holder, paths


def parse(argv):
    p = Parser(prog="make plan-server-stop", description="run this checkout's plan server (a client does), or stop it")
    p.add_argument("action", choices=("serve", "stop"))
    return p.parse_args(argv)


def check(args) -> bool:
    return False


def run(args) -> int:
    sock, lock, log = paths()
    if args.action == "serve":
        from launch import serve

        os._exit(serve.serve(sock, lock))  # no interpreter teardown of torch
    if not (pid := holder(lock)):
        print("no plan server runs for this checkout")
        return 0
    with contextlib.suppress(ProcessLookupError):  # gone since
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a stopped server (kill -STOP, Ctrl-Z) hears its SIGTERM only once it runs
    deadline = time.monotonic() + 30
    while holder(lock) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"stopped the plan server (pid {pid}; log {log})" if holder(lock) is None else f"pid {pid} still stopping")
    return 0
