"""The nightly suite: each recipe's nightly shape, its submission through the normal launch path, the summary job,
the report (night_report) with one retry of infrastructure failures, and blessing a reviewed run into a golden.
The summary job depends on every run of the night (afterany), so it runs last whatever their fate.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio, paths
from overlapkit.cluster import chain, joblog, slurm, submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.errors import BadInput
from overlapkit.nightly import junit, logparse, night_report
from overlapkit.nightly import rules as regress
from overlapkit.nightly.exposed import profile_window, profiled_ranks
from overlapkit.nightly.rules import NIGHTLY_ITERS, NIGHTLY_SEED
from overlapkit.sizing import hardware
from overlapkit.spec import planfile, runopts
from overlapkit.spec.profile import PROFILER_CHOICES
from overlapkit.spec.topology import GPUS_PER_NODE

# DP >= 2 keeps the data-parallel overlap paths (grad reduce-scatter, param all-gather) that DP=1 turns into "n/a":
# an overlap that silently stops working there is exactly what the nightly is for. MIN_DP=1 gives the smallest run.
MIN_DP = 2


def check_gpu(text: str) -> None:
    """GPU= on the nightly: refused as make plan refuses it (sizing/hardware.py), and anything but the default too:
    each night is compared with goldens measured on the recipes' own GPU, so another would be judged against them."""
    gpu = hardware.parse_gpu(text)
    if gpu != hardware.DEFAULT_GPU:
        raise hardware.GpuError(
            f"GPU={text}: the nightly runs each recipe on the GPU its goldens were measured on "
            f"({hardware.DEFAULT_GPU}); leave GPU= empty (plan an {gpu} run with make plan/submit GPU={gpu})"
        )


@dataclass(frozen=True)
class NightlyRun:
    """One recipe in tonight's suite: where it runs and the overrides that make it a nightly run."""

    recipe: str
    nodes: int
    dp: int
    gbs: int
    sets: str  # dotted overrides, as SET= takes them
    window: str = ""  # <start>:<end> of the profiler (profile_window), "" when the night is too short to profile
    ranks: str = ""  # its ranks: rank 0 of each node
    profiler: str = "nsys"  # its key in runopts.PROFILERS: "nsys", or "torch_profile" (the cluster profile's choice)

    def to_dict(self) -> dict:
        """The night entry, the window under the run options' own names (what run_options reads back)."""
        base = {"recipe": self.recipe, "nodes": self.nodes, "dp": self.dp, "gbs": self.gbs, "sets": self.sets}
        return base | {self.profiler: self.window, f"{self.profiler}_ranks": self.ranks}

    @property
    def typed(self) -> str:
        """The window as make variables (NSYS=33:35 NSYS_RANKS=0), as a user would type it."""
        knob = runopts.PROFILERS[self.profiler][0]
        return f"{knob}={self.window} {knob}_RANKS={self.ranks}"


def run_options(entry: dict) -> runopts.RunOptions:
    """The night entry's profiler window as run options (a night.json from before the window has none)."""
    return runopts.parse(**{k: entry.get(k, "") for key in runopts.PROFILERS for k in (key, f"{key}_ranks")})


def shape_for(
    recipe: str,
    layout: dict,
    *,
    iters: int = NIGHTLY_ITERS,
    min_dp: int = MIN_DP,
    profiler: str = "nsys",
) -> NightlyRun:
    """TP/PP/CP/VPP/EP/ETP stay (same overlap paths, an MoE run keeps its expert all-to-all). DP shrinks to
    min(recipe DP, min_dp), rounded up to whole nodes on which ETP·EP·PP divides too. GBS keeps the recipe's
    micro-batches per DP rank: the pipeline schedule and each rank's work per step stay the full-size run's, so step
    time is comparable. `profiler` (runopts.PROFILERS) profiles the same steady iterations whichever it is."""
    mp = layout["tp"] * layout["pp"] * layout["cp"]
    full_dp = layout["nodes"] * GPUS_PER_NODE // mp
    want = max(1, min(full_dp, min_dp))
    unit = math.lcm(mp, layout.get("ep", 1) * layout.get("etp", 1) * layout["pp"], GPUS_PER_NODE)
    nodes = math.ceil(mp * want / unit) * unit // GPUS_PER_NODE
    dp = nodes * GPUS_PER_NODE // mp
    microbatches = layout["gbs"] // (full_dp * layout["mbs"])
    gbs = microbatches * dp * layout["mbs"]
    sets = [
        f"train.train_iters={iters}",
        f"train.global_batch_size={gbs}",
        f"scheduler.lr_warmup_iters={max(1, iters // 10)}",  # Megatron asserts warm-up < decay iters (= train_iters)
        "dataset.blend=null",  # Bridge's mock data (GPTDatasetConfig with no blend)
        f"rng.seed={NIGHTLY_SEED}",
        "logger.log_interval=1",
        "logger.log_throughput=true",  # the TFLOP/s/GPU field is printed only with it
        "checkpoint.save=null",
        "checkpoint.load=null",  # never resume from an earlier run's checkpoint
        "validation.eval_iters=0",
    ]
    window = profile_window(iters)
    window = runopts.same_capture(window, profiler) if window else None
    text = f"{window[0]}:{window[1]}" if window else ""
    ranks = ",".join(map(str, profiled_ranks(nodes))) if window else ""
    return NightlyRun(recipe, nodes, dp, gbs, " ".join(sets), text, ranks, profiler)


# --- submitting a night ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NightRequest:
    profile: object  # cluster.profiles.ClusterProfile
    recipes: list[str]  # empty: every registered recipe
    report_command: tuple[str, ...]  # the summary job's command after the profile's python, without its options
    iters: int = NIGHTLY_ITERS
    min_dp: int = MIN_DP
    preflight_only: bool = False  # cluster.submit.preflight_mode(PREFLIGHT=)
    checks: str = "full"
    max_nodes: int | None = None  # default: the nodes in the profile's partition (sinfo)
    goldens: str = str(regress.GOLDENS_DIR)
    dryrun: bool = False
    bridge: object = None  # bridge/submission.py (lays out, plans, submits), from launch/nightly.py
    versions: dict = dataclasses.field(default_factory=dict)  # the stack's, recorded in each run's nightly.json


def _submit_one(req: NightRequest, name: str, stamp: str, limit: int | None, say) -> dict:
    """One recipe of the night: skipped (why), would-submit (dry run) or submitted (job id, run directory)."""
    layout = req.bridge.layout_of(name)
    profiler = PROFILER_CHOICES[req.profile.profiler]
    run = shape_for(name, layout, iters=req.iters, min_dp=req.min_dp, profiler=profiler)
    row = {**run.to_dict(), "attempt": 0}
    if limit and run.nodes > limit:
        mp = layout["tp"] * layout["pp"] * layout["cp"]
        row["skipped"] = (
            f"needs {run.nodes} nodes at DP={run.dp} (TP·PP·CP = {mp} GPUs); {req.profile.name} has {limit}"
        )
        say(f"skip {name}: {row['skipped']}")
    elif req.dryrun:
        window = f" {run.typed}" if run.window else " (ITERS too short to profile)"
        say(f'would submit {name}: nodes={run.nodes} dp={run.dp} SET="{run.sets}"{window}')
    else:
        try:
            sub = _prepare(req.bridge, row, req.profile, req.preflight_only, req.checks, check_partition=True)
        except (submit.SubmitError, ValueError) as exc:
            row["skipped"] = f"not submitted: {exc}"
            say(f"skip {name}: {row['skipped']}", err=True)
            return row
        meta = {**row, "preflight_only": req.preflight_only, "container_image": req.profile.container_image}
        jsonio.write_json(sub.run_dir / "nightly.json", meta | {"versions": req.versions, "night": stamp})
        info = submit.submit(sub)
        row.update(job_id=info["job_id"], run_dir=str(sub.run_dir))
        say(f"submitted {name}: job {info['job_id']} nodes={run.nodes} dp={run.dp}")
    return row


def _prepare(bridge, entry: dict, profile, preflight_only: bool, checks: str, **more):
    """A night entry's run prepared through the Bridge side (bridge/submission.py prepare), as make submit would."""
    return bridge.prepare(
        entry["recipe"],
        profile,
        nodes=entry["nodes"],
        sets=entry["sets"],
        preflight_only=preflight_only,
        checks=checks,
        run=run_options(entry),
        **more,
    )


def submit_night(req: NightRequest, say) -> Path | None:
    """Submit the suite and its summary job; the night directory (None for a dry run). `say(text, err=)`: progress."""
    names = req.recipes or req.bridge.recipe_names()
    req.bridge.check_recipes(names)
    limit = req.max_nodes or (slurm.partition_info(req.profile.partition) or {}).get("nodes") or None
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    entries = [_submit_one(req, name, stamp, limit, say) for name in names]
    if req.dryrun:
        say("dry run: nothing submitted")
        return None
    night_dir = req.profile.job_path / "nightly" / stamp
    night = {
        "stamp": stamp,
        "cluster": req.profile.name,
        "profile_path": str(req.profile.path),
        "job_dir": req.profile.job_dir,
        "preflight_only": req.preflight_only,
        "checks": req.checks,
        "iters": req.iters,
        "entries": entries,
        "goldens": req.goldens,
    }
    night_dir.mkdir(parents=True, exist_ok=True)
    ids = [e["job_id"] for e in entries if e.get("job_id")]
    night["report_job_id"] = submit_report(req.profile, night_dir, ids, req.report_command)
    jsonio.write_json(night_dir / "night.json", night)
    say(f"summary job {night['report_job_id']} runs after {len(ids)} job(s) (afterany); night: {night_dir}")
    return night_dir


def submit_report(profile, night_dir: Path, ids: list[str], command: tuple[str, ...]) -> str:
    """A plain `sbatch --wrap` (one CPU task) of `command` (NightRequest.report_command) under the profile's python:
    it only reads files and sacct, so it needs no nemo_run packaging."""
    argv = [submit.python_for(profile), *command, "--night", str(night_dir)]
    cmd = f"cd {shlex.quote(str(paths.REPO_ROOT))} && PYTHONPATH=src:. {shlex.join(argv)}"
    return slurm.sbatch_wrap(
        cmd,
        account=profile.account,
        partition=profile.partition,
        name="nightly-report",
        output=f"{night_dir}/report-%j.out",
        after=ids,
        secrets=profile.secrets,  # it resubmits an infrastructure failure, whose job needs them
    )


# --- reporting a night ----------------------------------------------------------------------------------------


def latest_night(root: Path) -> Path | None:
    """The newest night directory under `root` (their names are their start times); None before the first night."""
    return max((night.parent for night in root.glob("*/night.json")), default=None)


NIGHT_KEYS = ("job_dir", "preflight_only", "entries")  # what the report reads from night.json


def read_night(night_dir: Path) -> dict:
    """night.json, or one line saying what is wrong with it (missing, not JSON, lacking its keys)."""
    fix = "give NIGHT=<a night directory that make nightly wrote> (leave NIGHT= empty for the latest)"
    role = "the night's record that make nightly writes"
    night = jsonio.read_json(night_dir / "night.json", role=role, fix=fix, keys=NIGHT_KEYS)
    entries = night["entries"]
    if not isinstance(entries, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("recipe"), str)
        and (not e.get("job_id") or isinstance(e.get("run_dir"), str))
        for e in entries
    ):
        what = "its entries are not runs (each a recipe, and a run_dir where it has a job_id)"
        raise jsonio.file_problem(night_dir / "night.json", what, role, fix)
    return night


def to_retry(night: dict, results: list[dict]) -> list[dict]:
    """The entries whose verdict asks for a retry (rules.classify: infrastructure failures, once)."""
    judged = {r["recipe"]: r for r in results if not r.get("skipped")}
    return [e for e in night["entries"] if e["recipe"] in judged and judged[e["recipe"]]["verdict"]["retry"]]


def report_night(
    night_dir: Path,
    report_command: tuple[str, ...],
    *,
    goldens: Path = regress.GOLDENS_DIR,
    retry: bool = True,
    bridge=None,
) -> bool:
    """Judge each entry of the night, write the report, junit.xml and history, and resubmit infrastructure failures
    once with a new summary job after them (`bridge()`: the Bridge side, imported for a retry only). True when
    nothing failed: `make nightly-report` exits 1 otherwise, so the summary job's Slurm state is FAILED."""
    night = read_night(night_dir)
    goldens, results = Path(night.get("goldens") or goldens), []
    for e in night["entries"]:
        if e.get("skipped") or not e.get("job_id"):
            results.append({"recipe": e["recipe"], "skipped": e.get("skipped", "not submitted")})
            continue
        try:  # a record or experiment directory that cannot be read: that row says so, the others are judged
            logs, problem = chain.log_files(submit.load_submission(Path(e["run_dir"]))), None
        except BadInput as exc:
            logs, problem = [], str(exc)
        res = night_report.evaluate(e, slurm.job_state(e["job_id"]), logs, goldens, night["preflight_only"])
        res["unreadable_logs"] = [problem] * bool(problem) + res["unreadable_logs"]
        results.append(res)
    history = paths.in_checkout(night["job_dir"]) / "nightly" / "history.jsonl"  # beside the nights of that job_dir
    report = night_report.write_report(night_dir, night, results, history)
    print(jsonio.read_bytes(report).decode("utf-8", "replace"))  # what write_report just wrote
    print(f"junit: {junit.write(night_dir, night, results)}")  # for CI dashboards (Jenkins, GitLab)
    if retry and (again := to_retry(night, results)):
        side = bridge()
        profile = dataclasses.replace(load_profile(night["profile_path"]), job_dir=night["job_dir"])
        ids = []
        for e in again:
            sub = _prepare(side, e, profile, night["preflight_only"], night["checks"])
            info = submit.submit(sub)
            e.update(attempt=e.get("attempt", 0) + 1, job_id=info["job_id"], run_dir=str(sub.run_dir))
            ids.append(info["job_id"])
            print(f"retry {e['recipe']} (infrastructure failure): job {info['job_id']}")
        night["report_job_id"] = submit_report(profile, night_dir, ids, report_command)
        jsonio.write_json(night_dir / "night.json", night)
    return all(r.get("skipped") or r["verdict"]["ok"] for r in results)


def bless_run(run_dir: Path, goldens: Path = regress.GOLDENS_DIR, *, force: bool = False) -> Path:
    """A reviewed run → its golden, when plan, log and Slurm agree (rules.bless_checks); over an existing golden only
    with `force` (FORCE=1). The log: the job's own logs plus any *.log beside plan.json, every one readable (a golden
    is never blessed from part of a log)."""
    if not run_dir.is_dir():
        raise regress.BlessError(f"RUN={str(run_dir)!r}: give RUN=<run directory of a reviewed nightly run>")
    try:  # no submission.json: bless_checks refuses (no job); one without a job (a dry run...): said here
        info = submit.load_submission(run_dir) if os.path.lexists(run_dir / "submission.json") else None
    except (submit.SubmitError, jsonio.FileProblem) as exc:  # planted, not JSON, edited: the file names itself
        where = "" if isinstance(exc, jsonio.FileProblem) else f"{run_dir / 'submission.json'}: "
        raise regress.BlessError(f"{where}{exc}; bless a run submitted by make submit or make nightly") from None
    logs, unread = joblog.readable((chain.log_files(info) if info else []) + sorted(run_dir.glob("*.log")))
    if unread:
        raise regress.BlessError(f"{run_dir}: not blessed: {'; '.join(unread)}: bless a run whose logs are its own")
    skip = logparse.profiled_iterations(planfile.read_plan(run_dir))
    parsed = logparse.parse_files(logs, exclude=skip) if logs else logparse.parse_text("")
    state = slurm.job_state(str(info["job_id"])) if info and info.get("job_id") else None
    return regress.bless(run_dir, parsed, goldens, state=state, submission=info, force=force)
