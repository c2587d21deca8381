"""`make prep-data IN= TOKENIZER= OUT= [KEY=text] [WORKERS=1] [FORCE=1]`: JSONL → Megatron .bin/.idx + OUT/data.toml.

Argument parsing and printing only; the work is overlapkit.plan.dataprep (nvidia-modelopt's preprocessor). Exit
status: 0 written, 2 bad input (nothing written), 130 interrupted (nothing that looks complete is left).
"""

from __future__ import annotations

import sys

from launch.args import Parser
from overlapkit.plan import dataprep


def _args(argv):
    ap = Parser(prog="make prep-data", description=__doc__)
    ap.add_argument("--in", dest="in_path", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--key", default="text")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--force", default="", help="1: overwrite existing outputs")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    force = args.force.strip().lower() not in ("", "0", "false", "no")
    try:
        dataprep.check(args.in_path, args.tokenizer, args.out, args.key, args.workers, force)  # before any import
        spec = dataprep.prep(
            args.in_path, args.tokenizer, args.out, args.key, args.workers, force, log=lambda m: print(m, flush=True)
        )
    except KeyboardInterrupt:
        print("error: interrupted: no data.toml written; the partial output was removed", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"next: make plan RECIPE=<recipe> DATA={spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
