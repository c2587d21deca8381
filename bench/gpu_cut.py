"""Real 1-GPU training: each dense recipe's cut next to the same cut of Bridge's own H100 recipe, in one run.

    python bench/gpu_cut.py                    # every cut, both sides; logs + results.json under --out
    python bench/gpu_cut.py --only llama3_8b   # one model
    python bench/gpu_cut.py --list             # no GPU needed: the cuts, their memory estimates, what differs

Each side trains in its own fresh process (torchrun, 1 rank) through Bridge's `pretrain()` with Bridge's GPT
`forward_step`, on mock data; its log is parsed by overlapkit.nightly.logparse, exactly as the nightly parses a
cluster run.
Sides alternate per model so that they share the machine's state. Prints TFLOP/s/GPU and step time per side and the
ratio ours ÷ Bridge (1.00 = our recipe knobs cost nothing on this cut). What a cut is: src/overlapkit/gpucut.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.args import Parser

REPO = Path(__file__).resolve().parents[1]
GOLDENS = REPO / "nightly" / "goldens" / "gpu_cut"  # <gpu>/<cut>.<side>.json, written only by --bless
SKIP_RC = 3  # the child's exit status for "does not fit this GPU": a verdict, not a failure


def _gpu_kind(name: str) -> str:
    return "h200" if "H200" in name.upper() else "h100"


def child(key: str, side: str, iters: int) -> int:
    """One side of one cut, inside torchrun: build, check the memory estimate against this card, train."""
    import torch

    from overlapkit.bridge import gpucut, stack

    stack.import_bridge()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    cfg = gpucut.build(key, side, iters)
    total = torch.cuda.mem_get_info()[1]
    est = gpucut.estimate(cfg, _gpu_kind(torch.cuda.get_device_name()), hbm_gb=total / 2**30)
    m = cfg.model
    print(
        f"CUT {key} {side}: {m.num_layers} layers, hidden {m.hidden_size}, seq {m.seq_length}, "
        f"GBS {cfg.train.global_batch_size}, {iters} iterations — {gpucut.LABEL}",
        flush=True,
    )
    print(f"CUT estimate: {est.summary()}", flush=True)
    if not est.fits:
        print(f"CUT-SKIP: needs {est.total_gb:.1f} GB, this card gives {est.budget_gb:.1f} GB", flush=True)
        return SKIP_RC
    pretrain(cfg, forward_step)
    return 0


def run_side(key: str, side: str, iters: int, out: Path, timeout: float, gpu: str) -> dict:
    """Run one side in a fresh torchrun process; its log goes to out/<key>.<side>.log. Returns its result."""
    log = out / f"{key}.{side}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        str(Path(__file__).resolve()),
        "--child",
        key,
        side,
        "--iters",
        str(iters),
    ]
    t0 = time.monotonic()
    rc = run_logged(cmd, log, timeout)
    from overlapkit.nightly import rules as regress

    golden = regress.load_golden(f"{key}.{side}", GOLDENS / gpu)
    return classify(log, side, rc, iters, round(time.monotonic() - t0, 1), golden)


def run_logged(cmd: list[str], log: Path, timeout: float):
    """Run cmd with stdout+stderr into log; its exit status, or "timeout". torchrun's worker is a grandchild, so the
    command gets its own process group and a timeout kills the whole group: a worker left behind would hold the GPU
    through every later side."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def warmup_of(iters: int) -> int:
    """Iterations the steady-state numbers skip: a quarter of a short run (logparse's 10 suit the nightly's 60)."""
    return max(1, iters // 4)


def classify(log: Path, side: str, rc, iters: int, wall_s: float, golden: dict | None = None) -> dict:
    """A side's result from its log and exit status: ok only with every iteration logged and a clean exit; an ok
    side is then judged against its golden by the nightly's rules (regress.py: ±5 % perf, tiered loss, and an
    unexpected improvement fails too)."""
    from overlapkit.nightly import logparse
    from overlapkit.nightly import rules as regress

    text = log.read_text(errors="replace")
    parsed = logparse.parse_text(text, warmup=warmup_of(iters))
    n = parsed["summary"]["iterations"]
    skip = [ln.split(": ", 1)[1] for ln in text.splitlines() if ln.startswith("CUT-SKIP")]
    if rc == SKIP_RC and skip:
        status = f"skipped: {skip[0]}"
    elif rc == 0 and n == iters and not parsed["summary"]["nan_iterations"]:
        status = "ok"
    else:
        why = next(iter(parsed["events"]), None) or ("NaN loss" if parsed["summary"]["nan_iterations"] else None)
        status = f"failed ({why or f'rc {rc}'}, {n}/{iters} iterations)"
    res = {
        "side": side,
        "status": status,
        "rc": rc,
        "wall_s": wall_s,
        "log": log.name,
        "summary": parsed["summary"],
        "events": parsed["events"],
    }
    if status == "ok":
        v = regress.classify(parsed, "COMPLETED", golden)
        res["vs_golden"], res["golden_reasons"] = v.status, v.reasons
    return res


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def table(results: dict[str, dict[str, dict]], header: str) -> str:
    """One row per cut: each side's TFLOP/s/GPU and steady step time, and ours ÷ Bridge."""
    from overlapkit.bridge import gpucut

    lines = [
        header,
        f"{'cut':<13} {'layers':>6} {'seq':>5} │ {'ours TFLOP/s':>12} {'Bridge TFLOP/s':>14} "
        f"{'ratio':>6} │ {'ours ms':>8} {'Bridge ms':>9} │ {'ours loss':>9} │ status",
    ]
    for key, sides in results.items():
        cut = gpucut.CUTS[key]
        o, b = (sides.get(s, {}).get("summary", {}) for s in gpucut.SIDES)
        to, tb = o.get("tflops_per_gpu"), b.get("tflops_per_gpu")
        ratio = to / tb if to and tb else None
        status = "; ".join(f"{s}: {r['status']}" for s, r in sides.items() if r["status"] != "ok") or "ok"
        if status == "ok":
            status = "ok · vs golden: " + ", ".join(f"{s} {r['vs_golden']}" for s, r in sides.items())
        lines.append(
            f"{key:<13} {cut.layers:>6} {cut.layout.seq:>5} │ {_fmt(o.get('tflops_per_gpu'), '12.1f')} "
            f"{_fmt(b.get('tflops_per_gpu'), '14.1f')} {_fmt(ratio, '6.2f')} │ "
            f"{_fmt(o.get('step_time_ms'), '8.1f')} {_fmt(b.get('step_time_ms'), '9.1f')} │ "
            f"{_fmt(o.get('last_loss'), '9.3f')} │ {status}"
        )
    return "\n".join(lines)


def list_cuts() -> int:
    """CPU: every cut's shape, estimate on H100/H200 and the non-layout knobs where ours and Bridge's differ."""
    from overlapkit.bridge import gpucut, stack

    stack.import_bridge()
    for key, cut in gpucut.CUTS.items():
        ours, bridge = (gpucut.build(key, s) for s in gpucut.SIDES)
        fits = ", ".join(
            f"{g.upper()} {e.total_gb:.1f} GB {e.verdict}" for g in ("h100", "h200") if (e := gpucut.estimate(ours, g))
        )
        print(f"{key}: {cut.layers} layer{'s' * (cut.layers > 1)}, seq {cut.layout.seq}, GBS {cut.layout.gbs} — {fits}")
        print(f"  ours   = {cut.recipe}\n  Bridge = {cut.reference}" + (f"\n  note: {cut.note}" if cut.note else ""))
        for field, a, b in gpucut.differences(ours, bridge):
            print(f"  differs: {field}: ours {a!r}, Bridge {b!r}")
    return 0


def _args(argv):
    from overlapkit import paths
    from overlapkit.bridge import gpucut

    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, rest=True)
    ap.add_argument("--only", action="append", choices=list(gpucut.CUTS), help="a cut (repeatable; default: all)")
    ap.add_argument("--cuts", default="", help="make's CUTS=: cuts separated by spaces (each one as --only)")
    ap.add_argument("--iters", type=int, default=gpucut.ITERS)
    ap.add_argument("--out", type=Path, default=paths.runs_root() / "gpu_cut" / time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting sides past this wall time")
    ap.add_argument("--list", action="store_true", help="print the cuts and their estimates (no GPU needed)")
    ap.add_argument("--bless", type=Path, metavar="RUN_DIR", help="a reviewed run's ok sides -> goldens")
    ap.add_argument("--child", nargs=2, metavar=("CUT", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for cut in args.cuts.replace(",", " ").split():
        if cut not in gpucut.CUTS:
            ap.error(f"CUTS={cut!r} is not a cut: one of {', '.join(gpucut.CUTS)}")
        args.only = [*(args.only or []), cut]
    return args


def main(argv=None) -> int:
    from overlapkit.bridge import gpucut
    from overlapkit.nightly import logparse

    args = _args(argv)
    if args.child:
        return child(*args.child, args.iters)
    if args.list:
        return list_cuts()
    if args.bless:
        return bless(args.bless)
    import torch

    if problem := _cannot_train(torch):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    header = f"{gpucut.LABEL} · {device} · torch {torch.__version__} · {args.iters} iterations"
    print(header, flush=True)
    results = _run_cuts(args, _gpu_kind(device))
    text = table(results, header)
    print(text)
    (args.out / "results.txt").write_text(text + "\n")
    doc = {
        "device": device,
        "gpu": _gpu_kind(device),
        "iters": args.iters,
        "label": gpucut.LABEL,
        "versions": _versions(),
        "results": results,
    }
    (args.out / "results.json").write_text(logparse.to_json(doc))  # NaN/inf as strings: JSON has none
    sides = [r for s in results.values() for r in s.values()]
    ran = all(r["status"] == "ok" or r["status"].startswith("skipped") for r in sides)
    return 0 if ran and all(r.get("vs_golden", "pass") in ("pass", "no_golden") for r in sides) else 1


def _cannot_train(torch) -> str | None:
    """Why this machine cannot run a side (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU here: run this on a GPU node (see docs/gpu_check.md); --list works on CPU"
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        return (
            "Bridge's pretrain imports nvidia_resiliency_ext, which this venv leaves out (its wheels need "
            "glibc >= 2.39): run in the NeMo container, or `uv pip install nvidia-resiliency-ext==0.6.0` where "
            "glibc allows (docs/gpu_check.md)"
        )
    return None


def _run_cuts(args, gpu: str) -> dict[str, dict[str, dict]]:
    """{cut: {side: result}}, the sides of each cut in turn, while the time budget leaves room for the longest side
    so far; a side that does not fit this GPU stands for both (the same cut: the same estimate)."""
    from overlapkit.bridge import gpucut

    t0, longest, results = time.monotonic(), 90.0, {}
    for key in args.only or list(gpucut.CUTS):
        results[key] = {}
        for side in gpucut.SIDES:
            left = args.budget_s - (time.monotonic() - t0)
            if left < longest:
                results[key][side] = {"side": side, "status": f"not run: {left:.0f} s of the time budget left"}
                continue
            res = results[key][side] = run_side(key, side, args.iters, args.out, left, gpu)
            longest = max(longest, res["wall_s"]) if res["status"] == "ok" else longest
            print(f"{key} {side}: {res['status']} in {res['wall_s']} s", flush=True)
            if res["status"].startswith("skipped"):
                results[key]["bridge"] = {**res, "side": "bridge"}  # the same cut: the same estimate
                break
    return results


def _versions() -> dict[str, str]:
    """The packages that decide a cut's numbers (stack.versions leaves out any that is not installed)."""
    from overlapkit.bridge import stack

    return stack.versions(("torch", "megatron-core", "megatron-bridge", "transformers"))


def bless(run_dir: Path, goldens: Path = GOLDENS) -> int:
    """A reviewed run's ok sides -> nightly/goldens/gpu_cut/<gpu>/<cut>.<side>.json (the nightly's golden format)."""
    from overlapkit import jsonio
    from overlapkit.bridge import gpucut
    from overlapkit.nightly import logparse
    from overlapkit.nightly import rules as regress

    doc_path = run_dir / "results.json"
    if not doc_path.is_file():
        print(f"error: {run_dir}: no results.json — give --bless <a gpu_cut run directory>", file=sys.stderr)
        return 2
    doc, written = json.loads(doc_path.read_text()), []
    for key, sides in doc["results"].items():
        for side, res in sides.items():
            if res["status"] != "ok":
                print(f"not blessed: {key} {side}: {res['status']}")
                continue
            parsed = logparse.parse_files([run_dir / res["log"]], warmup=warmup_of(doc["iters"]))
            c = gpucut.CUTS[key]
            cut = {
                "layers": c.layers,
                "seq": c.layout.seq,
                "gbs": c.layout.gbs,
                "iters": doc["iters"],
                "device": doc["device"],
            }
            plan = {"recipe": f"{key}.{side}", "layout": cut}
            meta = {"run_dir": str(run_dir), "versions": doc["versions"], "container_image": None}
            out = goldens / doc["gpu"] / f"{key}.{side}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            jsonio.write_json(out, regress.make_golden(parsed, plan, meta))
            written.append(out)
    for out in written:
        print(f"blessed {out}")
    return 0 if written else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
