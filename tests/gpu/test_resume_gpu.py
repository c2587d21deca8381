"""SIGTERM, checkpoint, resume on one GPU (marker `gpu`: skipped without CUDA, and without nvidia-resiliency-ext,
which Bridge's pretrain imports). The Llama3 8B cut trains on data made by `make prep-data`; run A goes straight to
ITERS; run B is sent SIGTERM mid-run (what Slurm's --signal=TERM@<s> delivers), saves through Bridge's exit signal
handler, and a fresh process resumes it from the checkpoint tracker to ITERS. After the resume, B's losses must
match A's within LOSS_RTOL (same seed, same data order: the data sampler state is in the checkpoint).
Logs go to tests/gpu/logs/resume/ so a GPU run can commit them."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "unit_tests" / "bridge"))
from data_fixtures import corpus_docs, make_tokenizer, write_corpus  # noqa: E402

from overlapkit.cluster import resume  # noqa: E402
from overlapkit.nightly import logparse  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / "tests" / "gpu" / "logs" / "resume"
ITERS, SAVE_INTERVAL, STOP_AFTER = 24, 100, 9  # no periodic save before the signal: the exit save is the one
LOSS_RTOL = 0.02  # bf16 on one GPU, same seed and data: kernels are not bitwise deterministic (no TE, local spec)


def _torchrun(args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "tests/gpu/resume_worker.py", *args]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _losses(log: Path) -> dict[int, float]:
    parsed = logparse.parse_files([log])
    return {r["iteration"]: r["lm_loss"] for r in parsed["iterations"] if "lm_loss" in r}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        pytest.skip("Bridge's pretrain imports nvidia_resiliency_ext: run in the NeMo container (docs/gpu_check.md)")
    d = tmp_path_factory.mktemp("resume")
    docs = corpus_docs(3000)
    tok = make_tokenizer(d / "tok", docs)
    corpus = write_corpus(d / "corpus.jsonl", docs)
    out = subprocess.run(["make", "-s", "prep-data", f"IN={corpus}", f"TOKENIZER={tok}", f"OUT={d / 'data'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return d / "data" / "data.toml"


def test_sigterm_checkpoint_resume_matches_an_uninterrupted_run(spec, tmp_path):
    LOGS.mkdir(parents=True, exist_ok=True)
    a = _torchrun([str(spec), str(tmp_path / "a"), str(ITERS), str(SAVE_INTERVAL)], LOGS / "a_uninterrupted.log")
    assert a.wait(timeout=1800) == 0
    b_log = LOGS / "b_until_sigterm.log"
    b = _torchrun([str(spec), str(tmp_path / "b"), str(ITERS), str(SAVE_INTERVAL)], b_log)
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and max(_losses(b_log), default=0) < STOP_AFTER:
        assert b.poll() is None, b_log.read_text()[-3000:]
        time.sleep(1)
    os.killpg(b.pid, signal.SIGTERM)  # the whole torchrun group, as Slurm signals every task of the step
    b.wait(timeout=900)
    st = resume.state(str(tmp_path / "b"))  # a real Bridge save: the tracker names a complete iteration
    step = st.named
    assert st.tracker and step is not None and not st.lacks(step), (st, b_log.read_text()[-3000:])
    assert STOP_AFTER <= step < ITERS, (step, b_log.read_text()[-3000:])
    c_log = LOGS / "c_resumed.log"
    c = _torchrun([str(spec), str(tmp_path / "b"), str(ITERS), str(SAVE_INTERVAL)], c_log)
    assert c.wait(timeout=1800) == 0
    ref, resumed = _losses(LOGS / "a_uninterrupted.log"), _losses(c_log)
    assert min(resumed) == step + 1 and max(resumed) == ITERS  # it resumed, not restarted from iteration 0
    for it in range(step + 1, ITERS + 1):
        assert resumed[it] == pytest.approx(ref[it], rel=LOSS_RTOL), (it, resumed[it], ref[it])
