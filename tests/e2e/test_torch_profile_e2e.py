"""End to end on the real local Slurm: a PyTorch-profiler run (TORCH_PROFILE=) as a user submits it, and what it
leaves where `make overlap-report RUN=` and the nightly look.

Real: `make submit ... TORCH_PROFILE=3:5 TORCH_PROFILE_RANKS=0,3` plans the run, writes the run directory and
submits it through nemo_run; the job runs launch/entry.py's preflight on all 8 ranks (PREFLIGHT=env: this machine
has no GPU, so nothing trains). The profiler config checked is Bridge's own ProfilingConfig in the run's config.yaml
and the run options in overrides.json, which the job rebuilds its config from.

Mocked, the GPU only: no GPU here can write a trace, so two real traces written by others on real GPUs
(tests/data/reference_traces: nccl_data is rank 0 of its run, trace_diff_control rank 3) are put where Bridge 0.6.2
writes them in this job (`<tensorboard_dir>/../torch_profile/rank-<R>.json.gz`, training/profiling.py, with the
recipe's default TensorBoard directory under the job's working directory), and the job's own after-training step
(profile/profiled.py after_training, what launch/entry.py runs after `pretrain`) runs as a Slurm step on 8 ranks in
the job's packaged code: the profiled ranks keep their traces in the run directory, the first writes the
report, every rank waits for its marker. Then `make overlap-report RUN=<run dir>` must find and report them, with
figures equal to the independent computation (tests/reference_traces.py), and the nightly's readers must find the
report.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from reference_traces import brute, ms, traces_dir

from overlapkit import paths
from overlapkit.cluster import slurm, submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.nightly import exposed, logparse, night_report

pytestmark = pytest.mark.slurm
R8 = "llama3_8b_pretrain_8gpu_h100_bf16"  # TP1 PP1 CP2 DP4: SendRecv is CP's, AllReduce and Broadcast DP's
TRACES = {0: "nccl_data", 3: "trace_diff_control"}  # the rank each trace says it is (distributedInfo.rank)
# launch/entry.py's last step, as each rank of the job runs it (SLURM_PROCID from srun).
AFTER_TRAINING = """
import sys
sys.path[:0] = ["src", "."]
from overlapkit.spec.planfile import read_plan
from overlapkit.profile import profiled
run_dir, tensorboard_dir = sys.argv[1:3]
profiled.after_training(run_dir, read_plan(run_dir), tensorboard_dir)
"""


def test_a_torch_profile_run_leaves_traces_and_report_where_overlap_report_and_the_nightly_find_them(tmp_path):
    site = tmp_path / "site.toml"  # the local cluster, its runs under tmp_path
    local = load_profile("local")
    site.write_text(local.path.read_text().replace('job_dir = "runs/slurm"', f'job_dir = "{tmp_path / "jobs"}"'))
    cmd = ["make", "-s", "submit", f"RECIPE={R8}", f"CLUSTER={site}", "PREFLIGHT=env"]
    cmd += ["TORCH_PROFILE=3:5", "TORCH_PROFILE_RANKS=0,3"]
    out = subprocess.run(cmd, cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = [p.parent for p in (tmp_path / "jobs" / "runs").glob(f"{R8}-*/submission.json")]
    info = json.loads((run_dir / "submission.json").read_text())
    assert slurm.wait_for(info["job_id"], timeout=300, poll=0.5).split()[0] == "COMPLETED"
    assert json.loads((run_dir / "preflight.json").read_text())["ok"]

    # The profiler config the job runs with: Bridge's PyTorch profiler on steps 3-5 of ranks 0 and 3, nothing else
    # collected (shapes, call stacks, Chakra traces would grow every trace and the report reads none of them).
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["run"]["torch_profile"] == {"steps": [3, 5], "ranks": [0, 3]} and plan["run"]["nsys"] is None
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["profiling"] | {"_target_": None, "memory_snapshot_path": None} == {
        "_target_": None,
        "memory_snapshot_path": None,
        "use_pytorch_profiler": True,
        "use_nsys_profiler": False,
        "profile_step_start": 3,
        "profile_step_end": 5,
        "profile_ranks": [0, 3],
        "pytorch_profiler_collect_shapes": False,
        "pytorch_profiler_collect_callstack": False,
        "pytorch_profiler_collect_chakra": False,
        "record_shapes": False,
        "record_memory_history": False,
        "nvtx_ranges": False,
    }
    # No RUN_NAME: the recipe's own TensorBoard directory, $CWD/nemo_experiments/default/tb_logs (Bridge's
    # recipes/common.py), which in the job is under the job's working directory, nemo_run's packaged code.
    assert cfg["logger"]["tensorboard_dir"].endswith("/nemo_experiments/default/tb_logs")
    (script,) = Path(info["experiment_dir"]).glob("*_sbatch.sh")
    job_cwd = re.search(r"--chdir (\S+)", script.read_text()).group(1)
    tensorboard_dir = f"{job_cwd}/nemo_experiments/default/tb_logs"  # the job's cfg.logger.tensorboard_dir
    rec = json.loads((run_dir / "overrides.json").read_text())["run"]
    assert (rec["torch_profile"], rec["torch_profile_ranks"]) == ([3, 5], [0, 3])  # what the job rebuilds from
    assert list(logparse.profiled_iterations(plan)) == [2, 3, 4, 5]  # warm-up, ProfilerStep#3 and #4, the export

    # The GPU's part, mocked: each profiled rank's trace where Bridge's trace_handler writes it.
    bridge_dir = Path(f"{tensorboard_dir}/../torch_profile")
    bridge_dir.mkdir(parents=True, exist_ok=True)
    for rank, name in TRACES.items():
        shutil.copyfile(traces_dir() / f"{name}.json.gz", bridge_dir / f"rank-{rank}.json.gz")
    step = ["srun", f"--partition={local.partition}", "--nodes=1", "--ntasks=8", "--time=5"]
    step += [f"--chdir={job_cwd}", submit.python_for(local), "-c", AFTER_TRAINING]  # the job's code, where it ran
    step += [str(run_dir), tensorboard_dir]
    after = subprocess.run(step, capture_output=True, text=True, timeout=300)
    assert after.returncode == 0 and "error" not in after.stderr, after.stderr[-2000:]

    for rank, name in TRACES.items():  # kept in the run directory under Bridge's names, byte for byte
        kept = run_dir / "torch_profile" / f"rank-{rank}.json.gz"
        assert kept.read_bytes() == (traces_dir() / f"{name}.json.gz").read_bytes()
    done = json.loads((run_dir / "torch_profile" / "report.done").read_text())
    assert done == {"missing_exports": [], "error": None}
    written = json.loads((run_dir / "overlap_report.json").read_text())
    assert written["timeline"] == str(run_dir / "overlap_timeline.png") and (run_dir / "overlap_timeline.png").is_file()

    # make overlap-report RUN=, as a user types it: the job's report again, figures equal the independent sweep
    rep = subprocess.run(["make", "-s", "overlap-report", f"RUN={run_dir}", "FORMAT=json"], cwd=paths.REPO_ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    report = json.loads(rep.stdout)
    errors = [f for f in report["findings"] if f["level"] == "error"]
    assert rep.returncode == (2 if errors else 0), rep.stderr[-2000:]  # make exits 2 for the report's 1
    assert report == written
    assert report["window"]["ranks"] == [0, 3] and report["window"]["planned_steps"] == [3, 5]
    assert report["window"]["step_sources"] == ["profiler_step"]
    totals = {}
    for rank, name in TRACES.items():
        want = brute(traces_dir() / f"{name}.json.gz")
        got = report["ranks"][str(rank)]
        assert want["rank"] == rank and got["steps"]["count"] == len(want["steps"])
        for row, exp in zip(got["per_step"], want["steps"], strict=True):
            assert {c: (row[c]["comm_ms"], row[c]["exposed_ms"]) for c in exp} == {
                c: (ms(a), ms(b)) for c, (a, b) in exp.items()
            }
        for s in want["steps"]:
            for c, (a, b) in s.items():
                totals[c] = (totals.get(c, (0, 0))[0] + a, totals.get(c, (0, 0))[1] + b)
    assert {c: (report["classes"][c]["comm_ms"], report["classes"][c]["exposed_ms"]) for c in totals} == {
        c: (ms(a), ms(b)) for c, (a, b) in totals.items()
    }
    assert set(totals) == {"cp", "dp"}  # trace_diff_control's SendRecv (all-to-all) and both runs' AllReduce

    # The nightly reads the same file: its shares per class and the timeline link
    read, why = exposed.read(run_dir)
    assert why is None and exposed.shares(read) == {c: report["classes"][c]["exposed_share"] for c in ("cp", "dp")}
    column = night_report.exposed_of(run_dir, plan, preflight_only=False)
    assert column["missing"] is None and column["steps"] == [3, 5]
    assert column["png"] == str(run_dir / "overlap_timeline.png")
