"""What a run resumes from: the checkpoint directory's tracker, which iterations in it are complete, and the layout
each was saved with. No torch: launch/entry.py asks before anything imports it.

- The tracker names the iteration Bridge loads. An incomplete one (a write cut short, files lost) is never resumed
  silently: the run falls back to the last complete iteration before it, said in one line and realised with
  `checkpoint.ckpt_step` (Bridge's checkpointing.py, _resolve_checkpoint_iteration), or stops when there is none.
- The layout each run trained with is recorded beside the checkpoints when it starts (LAYOUTS), with the iteration
  it started from; a resume under another layout is refused unless it loads only the weights (`layout_problem`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from overlapkit import jsonio
from overlapkit.cluster import runlock
from overlapkit.errors import BadInput
from overlapkit.spec import model, submission
from overlapkit.spec.runopts import directory_problem

# Bridge's checkpoint tracker (megatron/bridge/training/checkpointing.py: TRACKER_PREFIX + train_state.pt), and the
# Megatron-LM one Bridge writes beside it (save_checkpoint's train_state_finalize_fn: "Write Megatron-LM tracker file
# for compatibility"), the iteration as text.
TRACKERS = ("latest_train_state.pt", "latest_checkpointed_iteration.txt")
# A complete iteration directory as Megatron Core 0.19.2 and Bridge 0.6.2 write it in torch_dist: DCP's `.metadata`
# (torch.distributed.checkpoint FileSystemWriter.finish, once every rank's shards are written), Core's
# `metadata.json` (dist_checkpointing/serialization.py, save's metadata_finalize_fn: "written only if the checkpoint
# is complete"), then Bridge's train_state.pt, the trackers and run_config.yaml last (checkpointing.py,
# train_state_finalize_fn). `common.pt` is Core's legacy layout only: 0.19.2 keeps the common state inside the
# torch_dist checkpoint (serialization.py, load_common_state_dict), so it is not required.
COMPLETE = {"torch_dist": (".metadata", "metadata.json", "train_state.pt", "run_config.yaml")}
COMPLETE_OTHER = ("train_state.pt", "run_config.yaml")  # other formats: what Bridge itself writes last
LAYOUTS = "overlapkit-layouts.json"
TRACKER_LIMIT = 4096  # bytes: the text tracker holds one iteration number
# What a resume must keep: the world and its split (nodes, GPUs, TP/PP/VPP/CP/EP/ETP, DP) and what decides the data
# order (global batch, sequence length). Micro-batch size is not among them: the global batch's samples do not change.
LAYOUT_KEYS = ("nodes", "gpus", "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "gbs", "seq")


DIGITS = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes "²", which int() refuses


@dataclass(frozen=True)
class State:
    """A checkpoint directory: is there a tracker, which iteration it names, and what each iteration lacks."""

    tracker: bool = False
    named: int | None = None  # the tracker's iteration
    missing: dict[int, tuple[str, ...]] = field(default_factory=dict)  # iteration → files it lacks (none: complete)
    problem: str | None = None  # why nothing here can be resumed (the directory, or its tracker, is not usable)

    def lacks(self, iteration: int) -> tuple[str, ...]:
        return self.missing.get(iteration, (f"iter_{iteration:07d}",))

    def fallback(self, iteration: int) -> int | None:
        """`iteration` if complete, else the last complete one before it."""
        if not self.lacks(iteration):
            return iteration
        return max((i for i, lack in self.missing.items() if not lack and i < iteration), default=None)


def state(directory: str | None, ckpt_format: str = "torch_dist") -> State:
    if directory and (problem := directory_problem(directory)):
        return State(problem=problem)
    if not directory or not Path(directory).is_dir():
        return State()
    d, need = Path(directory), COMPLETE.get(ckpt_format, COMPLETE_OTHER)
    missing = {}
    for p in d.glob("iter_*"):
        if DIGITS.fullmatch(p.name[5:]) and p.is_dir():  # iter_<digits>
            missing[int(p.name[5:])] = tuple(f for f in need if not (p / f).is_file() or not (p / f).stat().st_size)
    legacy, text, problem = d / TRACKERS[1], "", None
    try:  # guarded: a FIFO or a huge file planted as the tracker is said, never read into a hang
        text = jsonio.read_bytes(legacy, TRACKER_LIMIT).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        pass
    except jsonio.Unreadable as exc:
        problem = f"{exc}: Bridge writes it as a small text file"
    # Without the text tracker (an older Bridge): the last iteration whose train_state.pt is written, which Bridge
    # writes just before the trackers.
    written = [i for i in missing if "train_state.pt" not in missing[i]]
    named = int(text) if DIGITS.fullmatch(text) else max(written, default=None)
    tracked = any((d / t).is_file() for t in TRACKERS)
    if text and not DIGITS.fullmatch(text):  # -5, "²", junk: never ignored for another iteration
        problem = f"{legacy} holds {text[:40]!r}, not an iteration number (Bridge writes one, e.g. 50)"
    return State(tracked, named, missing, problem)


@dataclass
class Verdict:
    """What a run about to start does with its checkpoint directory."""

    code: int | None = None  # exit now with this status (0: the run is finished); None: go on
    lines: list[tuple[str, bool]] = field(default_factory=list)  # (line, is an error)
    ckpt_step: int | None = None  # load this iteration, not the tracker's (checkpoint.ckpt_step)
    resume: int | None = None  # the iteration it resumes from; None: a fresh start


def guard(run: dict, layout: dict, where: str, later_segment: bool = False) -> Verdict:
    """`run`: the plan's run summary, `layout` its layout. A later segment must resume (never a silent start from
    iteration 0); an incomplete iteration falls back or stops; a finished run exits 0; a changed layout stops."""
    d, asked = run.get("checkpoint_dir"), run.get("ckpt_step")
    st = state(d, run.get("ckpt_format") or "torch_dist")
    want = asked if asked is not None else st.named
    at = st.fallback(want) if want is not None else None
    stop = None  # why this run may not start: exit 1 with it
    if st.problem:
        stop = f"{st.problem}: fix it, or use another RUN_NAME to start over"
    elif not st.tracker and later_segment:
        stop = (
            f"no checkpoint to resume from in {d} (no {' or '.join(TRACKERS)}): the previous segment saved none; "
            "refusing to start from iteration 0 (make status shows what each segment did)"
        )
    elif not st.tracker:
        return Verdict()  # a fresh start
    elif want is None:
        stop = (
            f"{d} has a tracker but no {TRACKERS[1]} and no iteration with its train_state.pt: nothing to resume; "
            "restore it, or use another RUN_NAME to start over"
        )
    elif at is None or (asked is not None and at != asked):
        stop = (
            f"{'checkpoint.ckpt_step' if asked is not None else 'the tracker'} names iteration {want} in {d}, which "
            f"is incomplete (missing {', '.join(st.lacks(want))}), and no complete iteration precedes it: refusing "
            "to resume a partial checkpoint; restore it, or use another RUN_NAME to start over"
        )
    if stop:
        return Verdict(1, [(f"error: {where}: {stop}", True)])
    v = Verdict(ckpt_step=at if at != want else None, resume=at)
    if at != want:
        why = f"iteration {want} in {d} is incomplete (missing {', '.join(st.lacks(want))})"
        then = f"resuming from iteration {at}, the last complete one (checkpoint.ckpt_step={at})"
        v.lines.append((f"warning: {where}: {why}: {then}", False))
    for it in sorted(i for i in st.missing if i > at and st.missing[i]):
        lack = ", ".join(st.missing[it])
        v.lines.append((f"note: {where}: iter_{it:07d} is a save cut short (missing {lack}): not resumed", False))
    iters = run.get("train_iters")
    if iters and at >= iters and not run.get("finetune"):
        v.code = 0
        v.lines.append((f"{where}: training finished at iteration {at} (train_iters {iters}): nothing to run", False))
        return v
    try:
        problem = layout_problem(d, at, layout, run)
    except BadInput as exc:  # the layout record is not ours to read: stop, saying which file and field
        problem = str(exc)
    if problem:
        v.code = 1
        v.lines.append((f"error: {where}: {problem}", True))
    else:
        v.lines.append((f"{where}: resuming from iteration {at} in {d}", False))
    return v


LAYOUTS_ROLE = "the layouts each run trained with, which the job records beside its checkpoints"


def layouts(directory: str) -> list[dict]:
    """The layout record beside the checkpoints (none yet: []), each entry checked, or a FileProblem naming it."""
    path = Path(directory) / LAYOUTS
    fix = "restore it (or remove it to resume without the layout check)"
    entries = jsonio.read_json(path, list, role=LAYOUTS_ROLE, fix=fix, missing_ok=True) or []
    for i, entry in enumerate(entries):
        try:
            submission.LayoutEntry.model_validate(entry)
        except ValidationError as exc:
            what = model.problem(exc, entry, submission.LAYOUT_MESSAGES, i=i, entry=entry)
            raise jsonio.file_problem(path, what, LAYOUTS_ROLE, fix) from None
    return entries


def layout_problem(directory: str, iteration: int, layout: dict, run: dict) -> str | None:
    """Why resuming `iteration` under `layout` is refused (one line naming the fix), or None."""
    before = [e for e in layouts(directory) if e.get("from_iteration", 0) < iteration]  # the runs started before it
    saved = before[-1].get("layout") if before else None  # the last one's, which saved it
    # Opted in: the run loads only the checkpoint's weights, which Core's torch_dist reshards to any layout: no
    # optimizer or LR-scheduler state (checkpoint.load_optim=false: Bridge's checkpointing.py loads neither then), or
    # it starts over at iteration 0 from them (checkpoint.finetune=true: no optimizer, no RNG, iteration 0).
    if saved is None or run.get("load_optim") is False or run.get("finetune"):
        return None
    changed = [f"{k} {saved.get(k)}→{layout.get(k)}" for k in LAYOUT_KEYS if saved.get(k) != layout.get(k)]
    if not changed:
        return None
    # Bridge compares only (TP, PP) on load (checkpointing.py: tp_pp_match) and refuses a changed data-parallel size
    # only for its Energon loader (Megatron-Bridge PR #5637); anything else resumes with another data order, or fails
    # inside the load (a non-reshardable optimizer).
    return (
        f"iteration {iteration} in {directory} was saved with another layout ({', '.join(changed)}): resuming it "
        "would read the data in another order or fail inside the load; keep the layout, use another RUN_NAME, or "
        f"SET='checkpoint.load_optim=false' to load only its weights and go on from iteration {iteration}"
    )


def record_layout(directory: str, layout: dict, from_iteration: int | None, job_id: str | None) -> None:
    """Append the layout a run trains with from `from_iteration` (None: a fresh start), before it trains."""
    entry = {
        "from_iteration": from_iteration or 0,
        "layout": {k: layout.get(k) for k in LAYOUT_KEYS},
        "slurm_job_id": job_id,
        "at": runlock.now(),
    }
    earlier = layouts(directory)
    if earlier and earlier[-1].get("layout") == entry["layout"]:
        return  # the next segment of the same run: the layout of its iterations is already on record
    Path(directory).mkdir(parents=True, exist_ok=True)
    jsonio.write_json(Path(directory) / LAYOUTS, [*earlier, entry])
