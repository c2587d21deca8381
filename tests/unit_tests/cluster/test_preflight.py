"""The in-job preflight's checks (cluster/preflight.py) on a real plan: what each rank compares against the ledger
and the plan, and rank 0's verdict over every rank's record. The job-level path (entry.py under srun on the local
Slurm) is tested in tests/e2e/test_slurm_e2e.py."""

from __future__ import annotations

import json

from overlapkit.cluster import preflight
from overlapkit.spec import runopts

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


def _job(rank=0, world=8, nodes=1, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank % 8)}
    return env | {"SLURM_NNODES": str(nodes)} | extra


def test_a_rank_whose_environment_matches_the_ledger_and_the_plan_passes(planned):
    plan = json.loads(json.dumps(planned(R8).to_dict()))
    ledger = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    rec = preflight.rank_checks(plan, ledger, environ=_job(CUDA_DEVICE_MAX_CONNECTIONS="1"))
    # this test process has imported torch (the suite plans with Bridge): the one failure it must report
    assert rec["failures"] == [
        "torch was imported before the preflight: the ledger's launch-time variables may be too late"
    ]
    assert rec["rank"] == 0 and rec["world_size"] == 8 and rec["nodes"] == 1


def test_each_mismatch_is_named(planned):
    plan = json.loads(json.dumps(planned(R8).to_dict()))
    ledger = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    rec = preflight.rank_checks(plan, ledger, secrets=("WANDB_API_KEY",), environ=_job(rank=9, world=16, nodes=2))
    text = "; ".join(rec["failures"])
    assert not rec["ok"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=None but the ledger says '1'" in text
    assert "secret WANDB_API_KEY is not in the job environment" in text
    assert "world size 16 != planned 8 GPUs" in text and "2 nodes != planned 1" in text


def test_rank_zeros_verdict_needs_every_rank_and_every_rank_ok(planned):
    plan = json.loads(json.dumps(planned(R8).to_dict()))
    rec = dict(preflight.rank_checks(plan, {}, environ=_job()), ok=True)  # as a rank run before torch reports
    ranks = [dict(rec, rank=r) for r in range(8)]
    assert preflight.summary(plan, rec, ranks, None, "env")["ok"]
    short = preflight.summary(plan, rec, ranks[:7], None, "env")
    assert not short["ok"] and short["ranks_reported"] == 7
    failed = preflight.summary(plan, rec, [*ranks[:7], dict(rec, rank=7, ok=False)], None, "env")
    assert not failed["ok"] and failed["failed_ranks"] == [7]


def test_a_rank_waits_for_rank_zeros_verdict_and_says_when_none_came(tmp_path, capsys):
    verdict = tmp_path / "preflight.json"
    assert not preflight.wait_for_summary(verdict, timeout=0.2)
    assert "no verdict from rank 0" in capsys.readouterr().err
    verdict.write_text(json.dumps({"ok": True}))
    assert preflight.wait_for_summary(verdict, timeout=0.2)


def test_the_preflight_names_a_profiled_rank_without_nsys_on_its_path():
    """A rank NSYS profiles needs nsys on its PATH (profile/profiled.py wraps it in `nsys profile`); the other ranks
    do not. A failure on a GPU node (/dev/nvidiactl), a note on this CPU one."""
    plan = {
        "run": {"nsys": {"steps": [33, 35], "ranks": [0, 8]}},
        "layout": {"gpus": 16, "nodes": 2},
        "audit": {"rows": {"tp_comm_overlap": {"state": "off"}}},
    }
    rec = preflight.rank_checks(plan, {}, environ=_job(rank=8, world=16, nodes=2, PATH="/nonexistent"))
    assert rec["notes"] == [
        f"NSYS profiles rank 8 but nsys is not on the PATH: {runopts.NSYS_FIX} (CPU node: dry run, not fatal)"
    ]
    assert preflight.rank_checks(plan, {}, environ=_job(rank=1, world=16, nodes=2, PATH="/nonexistent"))["notes"] == []
