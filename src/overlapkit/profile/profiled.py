"""A profiled rank in the job. NSYS=<start>:<end>: Nsight Systems around this rank's training, its SQLite export in
`<run dir>/nsys/rank<R>.{nsys-rep,sqlite}`, and the run's overlap report once every profiled rank has exported,
under the names `make overlap-report RUN=` writes (spec/runopts.py), so the nightly reads the directory as the job
left it. Standard library only at import: launch/entry.py calls it before its preflight.

Why the entry wraps its own rank instead of nemo_run's launcher prefix (Bridge's NsysPlugin):

- nsys writes its report when the profiled program exits (Nsight Systems User Guide, "Profiling from the CLI"), so
  only its parent can export it: on a profiled rank, launch/entry.py runs `nsys profile ... python launch/entry.py`
  as a child, then `nsys export --type sqlite`, on whichever node the rank is. One command line for every launch
  path (nemo_run, the plain sbatch script, run-local).
- SQLite export fails on filesystems without file locking (the exporter's "Known issues"), as parallel ones often
  are: it is written to the node's $TMPDIR, copied in under a temporary name, then renamed.
- srun ends a step 60 s after its first task exits (nemo_run's `--wait=60`): every rank waits, after training, for
  the report's marker (`nsys/report.done`).

TORCH_PROFILE=<start>:<end>: Bridge's PyTorch profiler writes `<tensorboard_dir>/../torch_profile/rank-<R>.json.gz`
(Bridge 0.6.2 training/profiling.py), a directory shared by every run that logs there. Each profiled rank copies its
trace into `<run dir>/torch_profile/` (a temporary name, then renamed), the first writes the report once every trace
is there, and every rank waits for `torch_profile/report.done`, as with nsys.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.profile.nsys_sqlite import export  # standard library only, as this module
from overlapkit.spec.runopts import NSYS_DIR, NSYS_FIX, OVERLAP_PNG, TORCH_DIR
from overlapkit.spec.topology import env_int

UNDER_NSYS = "OVERLAPKIT_UNDER_NSYS"  # set in the child nsys profiles: it trains, the parent exports
# `nsys profile` switches (Nsight Systems User Guide, "CLI Profile Command Switch Options"): CUDA and NVTX traces
# (kernels, memcpys, NCCL's NVTX ranges: what the overlap report classifies), no CPU sampling; collect only between
# Bridge's cudaProfilerStart and cudaProfilerStop (training/profiling.py) and keep the program running after;
# CUDA graphs traced per node, no CUDA event trace. Bridge's NsysPlugin asks nemo_run for the same ones.
PROFILE_ARGS = tuple(
    "profile --sample=none --trace=nvtx,cuda --capture-range=cudaProfilerApi --capture-range-end=stop "
    "--cuda-graph-trace=node --cuda-event-trace=false --force-overwrite=true".split()
)
WAIT_S = 1800  # for the other ranks' exports: a 2-step trace of a large model exports in minutes, not half an hour
DONE = "report.done"


def report_base(run_dir: Path, rank: int) -> Path:
    """`-o` of nsys profile: it adds .nsys-rep; the export is the same name with .sqlite."""
    return Path(run_dir) / NSYS_DIR / f"rank{rank}"


def exports(run_dir: Path, ranks, where: str = NSYS_DIR) -> list[Path]:
    """Each profiled rank's file the report reads: nsys/rank<R>.sqlite, or torch_profile/rank-<R>.json.gz (Bridge's
    name for its trace)."""
    return [Path(run_dir) / where / (f"rank{r}.sqlite" if where == NSYS_DIR else f"rank-{r}.json.gz") for r in ranks]


def profiles_rank(run_dir: Path, plan: dict, rank: int | None) -> bool:
    """Whether this rank runs under nsys in this job: a profiled rank, unless every profiled rank's export is already
    there (a later segment of SEGMENTS=N, after the one that held the window). Never inside nsys itself."""
    nsys = (plan.get("run") or {}).get("nsys")
    return (
        bool(nsys)
        and not os.environ.get(UNDER_NSYS)
        and rank in nsys["ranks"]
        and not all(p.is_file() for p in exports(run_dir, nsys["ranks"]))
    )


def wrap(run_dir: Path, plan: dict, program: list[str]) -> int | None:
    """launch/entry.py's first step: on a rank this job profiles (profiles_rank), its whole run under nsys
    (`program`: the entry again, as nsys's child) and the training's exit status; None on every other rank, and in
    nsys's child: go on with the preflight."""
    rank = env_int("SLURM_PROCID", "RANK")
    torch = (plan.get("run") or {}).get("torch_profile")
    if torch and rank == min(torch["ranks"]) and not _torch_done(run_dir, torch["ranks"]):
        (Path(run_dir) / TORCH_DIR / DONE).unlink(missing_ok=True)  # this job's report: the others wait for a fresh one
    return run_profiled(run_dir, rank, plan, program) if profiles_rank(run_dir, plan, rank) else None


def _torch_done(run_dir: Path, ranks) -> bool:
    """Every profiled rank's trace in the run directory and the report's marker there: an earlier segment did it."""
    return (Path(run_dir) / TORCH_DIR / DONE).is_file() and all(p.is_file() for p in exports(run_dir, ranks, TORCH_DIR))


def after_training(run_dir: Path, plan: dict, tensorboard_dir: str | None = None, since: float = 0.0) -> None:
    """A rank that trained outside nsys in a profiled run: wait for the report (see the module doc: srun --wait).
    With TORCH_PROFILE, a profiled rank first copies its trace from where Bridge wrote it (under `tensorboard_dir`, the
    job's cfg.logger.tensorboard_dir) into <run dir>/torch_profile/ (a temporary name, then renamed), and the first
    profiled rank writes the report. A trace older than `since` (when this job's training began) is an earlier run's
    (Bridge's directory is shared by every run logging beside it): never reported as this one's."""
    run = plan.get("run") or {}
    if run.get("nsys") and not os.environ.get(UNDER_NSYS):
        hold(run_dir)
        return
    if not (torch := run.get("torch_profile")) or _torch_done(run_dir, torch["ranks"]):
        return
    rank = env_int("SLURM_PROCID", "RANK")
    problem = None
    if rank in torch["ranks"]:
        src = Path(f"{tensorboard_dir}/../torch_profile/rank-{rank}.json.gz")  # Bridge's own f-string (profiling.py)
        if not src.is_file():
            problem = f"the PyTorch profiler wrote no {src} (did the run reach the profiled steps?)"
        elif src.stat().st_mtime < since:
            problem = (
                f"{src} predates this job's training: an earlier run's trace, not kept (did the run reach the "
                "profiled steps?)"
            )
        else:
            dst = exports(run_dir, [rank], TORCH_DIR)[0]
            dst.parent.mkdir(parents=True, exist_ok=True)
            part = dst.with_name(dst.name + ".part")
            shutil.copyfile(src, part)
            os.replace(part, dst)
    if problem:
        _say(f"error: rank {rank}: {problem}")
    if rank == min(torch["ranks"]):
        write_report(run_dir, torch["ranks"], failed=(rank,) if problem else (), where=TORCH_DIR)
    else:
        hold(run_dir, where=TORCH_DIR)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_profiled(run_dir: Path, rank: int, plan: dict, program: list[str]) -> int:
    """This rank's training under nsys (`program`: the entry again), then its export; the first profiled rank then
    writes the overlap report and every other rank waits for it. Returns the training's exit status."""
    if (nsys := shutil.which("nsys")) is None:
        _say(f"error: NSYS profiles rank {rank}, but nsys is not on the PATH on {socket.gethostname()}: {NSYS_FIX}")
        return 1
    (Path(run_dir) / NSYS_DIR).mkdir(parents=True, exist_ok=True)
    ranks = plan["run"]["nsys"]["ranks"]
    if rank == min(ranks):  # this job's report: the others wait for a fresh marker
        (Path(run_dir) / NSYS_DIR / DONE).unlink(missing_ok=True)
    cmd = [nsys, *PROFILE_ARGS, "-o", str(report_base(run_dir, rank)), *program]
    child = subprocess.Popen(cmd, env={**os.environ, UNDER_NSYS: "1"})
    forward = {s: signal.signal(s, lambda sig, _f: child.send_signal(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
    if code == 0 and (problem := export(nsys, report_base(run_dir, rank))):
        _say(f"error: rank {rank}: {problem}")
    if code == 0 and rank == min(ranks):
        write_report(run_dir, ranks, failed=(rank,) if problem else ())
    elif code == 0:
        hold(run_dir)
    return code


def write_report(run_dir: Path, ranks, wait_s: float = WAIT_S, failed=(), where: str = NSYS_DIR) -> None:
    """Once the exports of `ranks` are there (or `wait_s` has passed): the run's overlap report and its timeline
    (write_overlap), then the marker the other ranks wait for, whatever happened (its `error` says what). `failed`:
    ranks whose export is known to have failed, not waited for (the whole job would hold for WAIT_S). `where`: the
    profiles' directory (nsys/, or torch_profile/ for TORCH_PROFILE)."""
    deadline = time.monotonic() + wait_s
    want = [p for r, p in zip(ranks, exports(run_dir, ranks, where), strict=True) if r not in failed]
    while not all(p.is_file() for p in want) and time.monotonic() < deadline:
        time.sleep(2)
    missing = [p.name for p in exports(run_dir, ranks, where) if not p.is_file()]
    done = {"missing_exports": missing, "error": None}
    try:
        done["error"] = write_overlap(run_dir)  # the picture's problem, if any: the report stands without it
    except (BadInput, OSError) as exc:  # the report's ProfileError, a corrupt export: one line
        done["error"] = str(exc)
    finally:  # whatever happened: the other ranks stop waiting
        (Path(run_dir) / where).mkdir(parents=True, exist_ok=True)
        jsonio.write_text(Path(run_dir) / where / DONE, json.dumps(done) + "\n")  # never through a planted link
    if done["error"]:
        _say(f"error: the overlap report of {run_dir}: {done['error']}")


def write_overlap(run_dir: Path) -> str | None:
    """What `make overlap-report RUN=<run dir>` writes; None, or the timeline's problem."""
    from overlapkit.profile import overlap_report

    return overlap_report.write(*overlap_report.run_inputs(run_dir), Path(run_dir) / OVERLAP_PNG, Path(run_dir))[1]


def hold(run_dir: Path, wait_s: float = WAIT_S, where: str = NSYS_DIR) -> bool:
    """Wait for the report's marker: True when it came, False after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (Path(run_dir) / where / DONE).is_file():
            return True
        time.sleep(2)
    _say(f"profile: no {DONE} in {Path(run_dir) / where} after {wait_s:.0f} s; this rank stops waiting")
    return False
