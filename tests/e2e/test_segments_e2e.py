"""SEGMENTS on the real local Slurm: `make submit ... RUN_NAME= SEGMENTS=3 PREFLIGHT=1 DATA=` queues three real jobs
chained with afterany (as Slurm itself shows), each script carries Bridge's PreemptionPlugin `--signal`, every rank
of a segment plans the same checkpoint directory, a later segment without a checkpoint fails with its message, two
submissions of one RUN_NAME typed at once leave one live run (and the name is free again once it ends), a segment
that finds training finished exits 0 and cancels the rest, and `make cancel` ends the whole chain. Preflight-only:
no GPUs here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from overlapkit import paths
from overlapkit.cluster import chain, runlock, slurm
from overlapkit.cluster.profiles import load_profile

sys.path[:0] = [str(Path(__file__).parents[1] / "unit_tests" / d) for d in ("bridge", "cluster")]
from ckpt_fixtures import save_iteration  # noqa: E402
from data_fixtures import build_dataset, corpus_docs, make_tokenizer, write_spec  # noqa: E402

pytestmark = pytest.mark.slurm
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"
JOBS = load_profile("local").job_path


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")  # /tmp: every fake node sees it, like a cluster's shared filesystem
    tok = make_tokenizer(d / "tok", corpus_docs(100))
    build_dataset(d / "corpus", [[5, 6, 7, 8, 1]] * 50)
    return write_spec(d / "data.toml", tok, [("corpus", 1.0)])


def submit_argv(spec, name: str, segments: int) -> list[str]:
    variables = [f"RECIPE={R8}", "CLUSTER=local", f"DATA={spec}", f"RUN_NAME={name}", f"SEGMENTS={segments}"]
    return ["make", "-s", "submit", *variables, "PREFLIGHT=1"]


def submitted(stdout: str) -> tuple[Path, list[str]]:
    m = re.search(r"submitted jobs ([\d, ]+) \(each afterany the one before\) to local; run directory: (\S+)", stdout)
    assert m, stdout[-2000:]
    return Path(m.group(2)), m.group(1).split(", ")


def submit(spec, name: str, segments: int = 3) -> tuple[Path, list[str]]:
    argv = submit_argv(spec, name, segments)
    out = subprocess.run(argv, cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return submitted(out.stdout)


@pytest.fixture(scope="module")
def pair(spec):
    """`make submit ... RUN_NAME=<new> SEGMENTS=3 PREFLIGHT=1` typed twice at once, in two new processes:
    (name, [((stdout, stderr), status)] × 2)."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(submit_argv(spec, name, 3), cwd=paths.REPO_ROOT, **pipes) for _ in range(2)]
    return name, [(p.communicate(timeout=600), p.returncode) for p in procs]


@pytest.fixture(scope="module")
def submitted_chain(pair):
    """The one of the pair that was submitted: (name, run directory, its three job ids), and segment 3's dependency
    as Slurm shows it right then (once segment 2 has ended, Slurm shows none)."""
    name, outs = pair
    won = [out for out, code in outs if code == 0]
    assert len(won) == 1, outs
    name, run_dir, ids = (name, *submitted(won[0][0]))
    return name, run_dir, ids, dependency(ids[2])


@pytest.fixture(scope="module")
def chain3(submitted_chain):
    return submitted_chain[:3]


@pytest.fixture(scope="module")
def ended(submitted_chain):
    """Once the chain has ended: each job's final state and `make status` on it, read before any test continues the
    run (a continuation under the same RUN_NAME adds a checkpoint that make status would then show)."""
    _, run_dir, ids, _ = submitted_chain
    states = [slurm.wait_for(j, timeout=600, poll=0.5).split()[0] for j in ids]
    return states, make("status", f"RUN={run_dir}").stdout


def dependency(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return re.search(r"Dependency=(\S+)", out).group(1)


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_three_segments_chain_with_afterany_and_a_later_segment_without_a_checkpoint_fails(submitted_chain, ended):
    name, run_dir, ids, queued_behind = submitted_chain
    states, status = ended
    assert len(ids) == 3
    assert queued_behind.startswith(f"afterany:{ids[1]}")  # queued behind segment 2: Slurm showed it
    assert states == ["COMPLETED", "FAILED", "FAILED"]
    info = json.loads((run_dir / "submission.json").read_text())
    exp = Path(info["experiment_dir"])
    for seg in (1, 2, 3):
        assert "#SBATCH --signal=TERM@300" in (exp / f"train-seg{seg}_sbatch.sh").read_text()
    ckdir = str(JOBS / "checkpoints" / name)
    ranks = [json.loads(f.read_text()) for f in sorted((run_dir / "segment-1" / "preflight").glob("rank-*.json"))]
    assert len(ranks) == 8 and {r["checkpoint_dir"] for r in ranks} == {ckdir}
    rebuilt = json.loads((run_dir / "segment-1" / "preflight.json").read_text())["checkpoint"]
    assert rebuilt == {"save": ckdir, "load": ckdir}
    log = "".join(f.read_text() for f in (exp / "train-seg2").glob("log-*.out"))
    assert f"error: segment 2/3: no checkpoint to resume from in {ckdir}" in log
    assert f"segment 1/3: job {ids[0]} COMPLETED; preflight OK" in status
    assert f"segment 2/3: job {ids[1]} FAILED" in status and "last checkpointed none yet" in status
    # the failed segment's line names why, from its own log (issue 40: status tells the story)
    assert (
        f"segment 2/3: job {ids[1]} FAILED; first error: segment 2/3: no checkpoint to resume from in {ckdir}" in status
    )


def test_one_live_run_per_run_name_and_a_finished_run_cancels_its_later_segments(spec, pair, chain3, ended):
    name, run_dir, ids = chain3
    ck = JOBS / "checkpoints" / name
    [((_, err), code)] = [out for out in pair[1] if out[1] != 0]  # typed at once: the other one is refused
    assert code == 2
    [refusal] = [line for line in err.splitlines() if line.startswith("error:")]  # one line (then make's own)
    assert refusal.startswith(f"error: RUN_NAME={name} is live in {ck} (job {ids[0]} "), refusal
    assert refusal.endswith(f"`make cancel RUN={run_dir}` first, or use another RUN_NAME; nothing submitted")
    mine = [p for p in (JOBS / "runs").glob("*/plan.json") if json.loads(p.read_text())["run"]["run_name"] == name]
    assert [p.parent for p in mine] == [run_dir]  # the refused one left no run directory
    assert [s["job_ids"] for s in runlock.submissions(ck)] == [ids]
    assert all(state.startswith(slurm.TERMINAL) for state in ended[0])  # the chain has ended
    # The run has ended: its RUN_NAME is accepted again (a continuation). Its checkpoint is at train_iters (the
    # recipe's 1168251, laid out as Megatron writes it): segment 1 exits 0 and cancels segment 2.
    save_iteration(ck, 1168251)
    run_dir, ids = submit(spec, name, segments=2)
    assert [slurm.wait_for(j, timeout=600, poll=0.5).split()[0] for j in ids] == ["COMPLETED", "CANCELLED"]
    exp = Path(json.loads((run_dir / "submission.json").read_text())["experiment_dir"])
    log = "".join(f.read_text() for f in (exp / "train-seg1").glob("log-*.out"))
    assert "segment 1/2: training finished at iteration 1168251" in log
    assert f"segment 2 (job {ids[1]}): cancelled: training is over" in log
    assert "last checkpointed iteration 1168251 of 1168251" in make("status", f"RUN={run_dir}").stdout


def test_make_cancel_ends_the_whole_chain(spec):
    run_dir, ids = submit(spec, f"e2e-{uuid.uuid4().hex[:8]}")
    out = make("cancel", f"RUN={run_dir}")
    assert out.returncode == 0, out.stderr
    assert [slurm.wait_for(j, timeout=120, poll=0.5).split()[0] for j in ids] == ["CANCELLED"] * 3
    info = json.loads((run_dir / "submission.json").read_text())
    assert all(line.endswith("CANCELLED") for line in chain.status_lines(run_dir, info)[:3])
