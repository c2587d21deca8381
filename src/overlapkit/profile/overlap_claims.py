"""The plan's overlap claims checked against what the profile measured (overlap_report's figures): an overlap the
plan says on whose class is exposed above its threshold, or has no kernel in the profile at all, a class the plan
says cannot exist, an overlap the plan says off that the profile shows hidden, a profile with no communication, a
communication-like kernel no rule knows, and a profile whose layout or GPU is not the plan's. Each finding is
{"code", "level", "message", "fix"}; level "error" makes `make overlap-report` exit 1."""

from __future__ import annotations

from overlapkit.profile.overlap_classes import CLASSES, Layout
from overlapkit.spec import runopts
from overlapkit.spec.overlap import Overlap
from overlapkit.spec.topology import DEFAULT_GPU, PINNED

# The plan's audit rows that claim each class's overlap. CP has none: TE's context-parallel attention always
# overlaps its K/V ring (attention/dot_product_attention/context_parallel.py, v2.4), so CP > 1 is a claim by itself.
CLAIMS = {c: tuple(str(o) for o in Overlap if o.klass == c) for c in CLASSES if c != "cp"}

# Exposed share above which a claimed overlap is a failure, with what is exposed by design below it (sources: TE
# comm_gemm_overlap.cpp CommOverlapP2PBase for TP's ring; core 0.19 pipeline_parallel/combined_1f1b.py for EP's).
THRESHOLDS = {
    "tp": (0.5, "the first of TP chunks of each overlapped GEMM has nothing to hide under (1/TP of it at most 1/2)"),
    "cp": (0.5, "the first of CP K/V exchanges of each attention precedes any compute (1/CP <= 1/2)"),
    "pp": (0.5, "half of the p2p, plus the pipeline bubble (PP-1)/(M*VPP) of warm-up and cool-down, is expected"),
    # with the several buckets per chunk Megatron's DDP makes, the first and last are under half
    "dp": (0.5, "the DP tail after the last bucket and the first param all-gather are exposed by design"),
    "ep": (0.5, "the first dispatch and the last combine of each step have no other micro-batch to hide under"),
}
# An overlap the plan says off that the profile shows at least this hidden: the plan (or the audit) misreads the run.
OFF_HIDDEN = 0.5

LEDGER = f"that the job's {PINNED} is the one make plan's launch environment sets"
FIXES = {
    "tp": f"check the job log for Transformer Engine's userbuffers bootstrap warnings, and {LEDGER}",
    "cp": f"check {LEDGER}",
    "pp": "keep model.virtual_pipeline_model_parallel_size>1 (overlap_p2p_comm needs the interleaved schedule); "
    f"check {LEDGER}",
    "dp": "lower ddp.bucket_size so that buckets start during the backward pass (SET=ddp.bucket_size=...)",
    "ep": "check the ep_overlap_* rows of make plan: a prerequisite the job does not meet turns the overlap off",
}
SIZE_FIX = {
    "tp": "SET=model.tensor_model_parallel_size=...",
    "pp": "SET=model.pipeline_model_parallel_size=...",
    "cp": "SET=model.context_parallel_size=...",
    "ep": "SET=model.expert_model_parallel_size=...",
    # DP is no setting: it is what is left of the GPUs (Megatron's parallel_state, GPUs / (TP * PP * CP))
    "dp": "NODES=<the nodes it ran on>: DP is the GPUs over TP x PP x CP",
}


def _finding(code: str, level: str, message: str, fix: str | None = None) -> dict:
    return {"code": code, "level": level, "message": message, "fix": fix}


def threshold(cls: str, plan: dict) -> float:
    """The exposed share above which a claimed overlap of `cls` fails (pp: plus this layout's bubble)."""
    limit = THRESHOLDS[cls][0]
    if cls == "pp":
        lay = plan["layout"]
        micro = max(1, lay["gbs"] // max(1, lay["mbs"] * lay["dp"]))
        limit += (lay["pp"] - 1) / (micro * (lay.get("vpp") or 1))
    return min(limit, 0.9)


def claim(cls: str, lay: Layout) -> str:
    """ "on", "off" or "n/a": what the plan says about `cls`'s overlap."""
    if getattr(lay, cls) < 2:
        return "n/a"
    if cls == "cp":
        return "on"
    states = [lay.states.get(row, "n/a") for row in CLAIMS[cls]]
    return "on" if "on" in states else ("off" if "off" in states else "n/a")


def findings(report: dict, plan: dict) -> list[dict]:
    """The profile against the plan's layout (ranks it cannot have, GPUs it was not planned for), then each class's
    claim (_class_findings), then the communication no rule knows or could tell apart."""
    lay = Layout.of_plan(plan)
    out = []
    nums = [int(r.split("/")[0]) for r in report["ranks"] if r.split("/")[0].isdigit()]
    if bad := sorted(n for n in nums if n >= lay.gpus):
        msg = f"profiled rank(s) {', '.join(map(str, bad))} but the plan has {lay.gpus} GPUs: not this plan's run"
        fix = "give the RECIPE= / NODES= the profiled run was planned with"
        out.append(_finding("profile_mismatch", "error", msg, fix))
    devices = {r["device"] for r in report["ranks"].values()}
    if len(devices) > min(8, lay.gpus):
        msg = f"the profiles hold {len(devices)} GPUs per node; the plan has {min(8, lay.gpus)}"
        out.append(_finding("profile_mismatch", "error", msg, "give the RECIPE= / NODES= the run was planned with"))
    planned = (runopts.planned_window(plan.get("run")) or (None, {}))[1]  # whichever profiler the run used
    if planned.get("ranks") and nums and sorted(set(nums)) != sorted(planned["ranks"]):
        msg = f"the plan profiles ranks {planned['ranks']}; the profiles are of ranks {sorted(set(nums))}"
        out.append(_finding("profile_ranks", "warning", msg))
    gpus = {r["gpu"] for r in report["ranks"].values() if r["gpu"]}
    planned = str(plan.get("gpu") or DEFAULT_GPU)  # plan.json's GPU= (sizing/hardware.py), h100 before GPU= existed
    if other := sorted(g for g in gpus if planned.upper() not in g.upper()):
        msg = f"profiled on {', '.join(other)}, but the plan is for GPU={planned}: its memory, throughput and the "
        msg += "claims' thresholds are sized for that GPU"
        out.append(_finding("profile_gpu", "warning", msg, "plan with the GPU= the run ran on (h100, h200)"))
    if not any(c["kernels"] for c in (*report["classes"].values(), report.get("unclassified") or {"kernels": 0})):
        msg = f"the profile holds no communication kernel at all, but the plan runs on {lay.gpus} GPUs: nothing to "
        msg += "check the overlaps against"
        fix = "profile the run's GPU activity with NCCL (nsys --trace=cuda,nvtx; the PyTorch profiler's CUDA "
        out.append(_finding("no_communication", "error", msg, fix + "activities), over training steps"))
    foreign = any(f["level"] == "error" for f in out)  # no communication, or another layout: said once, above
    for cls in CLASSES:
        out += _class_findings(cls, report["classes"][cls], lay, plan, foreign)
    if unknown := report.get("unknown_comm"):
        top = ", ".join(f"{u['name'][:100]} ({u['kernels']} kernels, {u['ms']} ms)" for u in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        msg = f"{len(unknown)} kernel name(s) look like communication but no rule knows them, so they were counted "
        fix = "report the name (docs/overlap_report.md lists the families known and their sources)"
        out.append(_finding("unknown_comm_kernel", "warning", f"{msg}as compute: {top}{more}", fix))
    if u := report.get("unclassified"):
        msg = f"{u['kernels']} communication kernels ({u['comm_ms']} ms, {u['exposed_ms']} ms exposed) could not be "
        msg += f"told apart: {', '.join(f'{k}: {n}' for k, n in u['candidates'].items())}"
        fix = "profile with Megatron's NVTX ranges on (SET=profiling.nvtx_ranges=true): they name who sent"
        out.append(_finding("unclassified_comm", "warning", msg, fix))
    return out


def _class_findings(cls: str, c: dict, lay: Layout, plan: dict, foreign: bool) -> list[dict]:
    """Class `cls`'s figures `c` against the plan's claim: an overlap said on with no kernel of its class (unless the
    profile is `foreign`, which is said once), a class the plan says cannot exist, an overlap said on whose class is
    exposed above its threshold, an overlap said off that the profile shows hidden."""
    state, name, size = claim(cls, lay), cls.upper(), getattr(lay, cls)
    what = "context-parallel attention overlaps it" if cls == "cp" else f"the plan says {CLAIMS[cls][0]} is on"
    if c["kernels"] == 0:
        if state != "on" or foreign:
            return []
        msg = f"{name}: {what} ({name}={size}), but the profile holds no {name} kernel: the profile missed it, or the "
        msg += "overlap does not run as claimed"
        fix = "profile whole training steps of a rank that runs it (NSYS=<start>:<end> or TORCH_PROFILE=<start>:<end>)"
        return [_finding(f"{cls}_overlap_unmeasured", "error", msg, f"{fix}; if it was profiled, {FIXES[cls]}")]
    if size < 2:
        msg = f"{name} communication in the profile ({c['kernels']} kernels, {c['comm_ms']} ms) but the plan has "
        msg += f"{name}={size}: the profile is not of this plan's layout"
        fix = f"profile a run of this plan, or plan the layout that ran ({SIZE_FIX[cls]})"
        return [_finding("class_not_in_plan", "error", msg, fix)]
    share = c["exposed_share"]
    if state == "on" and share > (limit := threshold(cls, plan)):
        msg = f"{name}: {what}, but {share:.1%} of its communication is exposed ({c['exposed_ms']} of {c['comm_ms']} "
        msg += f"ms; at most {limit:.0%} expected: {THRESHOLDS[cls][1]})"
        return [_finding(f"{cls}_overlap_exposed", "error", msg, FIXES[cls])]
    if state == "off" and c["comm_ms"] > 0 and share <= 1 - OFF_HIDDEN:
        msg = f"{name}: the plan says its overlap is off, yet {1 - share:.1%} of its communication is hidden under "
        return [_finding(f"{cls}_hidden_while_off", "warning", msg + "compute: the plan's claim understates this run")]
    return []
