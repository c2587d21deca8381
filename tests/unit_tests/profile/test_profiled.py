"""A profiled rank in the job (profile/profiled.py) through launch/entry.py in new processes, as srun starts it.

Nsight Systems cannot run on this CPU machine, so a small `nsys` script on PATH stands in for it (the one mock of
something that cannot exist here): its `profile` runs the program it is given and writes the report `-o` names, its
`export` writes a real SQLite file (or fails, as an export onto a filesystem without locks does), or copies
$NSYS_FIXTURE, an export built to Nsight's schema (nsys_fixtures.py). The tests of the wrapper's mechanics give a
stub plan with no layout, so they record profiled.write_overlap instead of running it; the last test runs it for
real on a planned recipe and checks the job leaves what `make overlap-report RUN=` writes (overlap_report.json,
overlap_timeline.png: test_overlap_report checks those two against the make target)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from nsys_fixtures import dense_step

from overlapkit import paths
from overlapkit.nightly import exposed
from overlapkit.profile import overlap_report, profiled

FAKE_NSYS = textwrap.dedent(
    """\
    #!/bin/bash
    echo "$*" >> "$NSYS_LOG"
    if [ "$1" = profile ]; then
        shift; while [ "$1" != -o ]; do shift; done; base=$2; shift 2
        echo "UNDER=$OVERLAPKIT_UNDER_NSYS" >> "$NSYS_LOG"
        "$@"; rc=$?; [ $rc = 0 ] && echo report > "$base.nsys-rep"; exit $rc
    fi
    for a; do case $a in --output=*) out=${a#--output=};; esac; done
    if [ -n "$FAIL_EXPORT" ]; then echo "SQLite export failed: database is locked" >&2; exit 1; fi
    if [ -n "$NSYS_FIXTURE" ]; then exec cp "$NSYS_FIXTURE" "$out"; fi
    exec python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('CREATE TABLE StringIds (id)')" "$out"
    """
)
PLAN = {"run": {"nsys": {"steps": [33, 35], "ranks": [0, 8]}}}
REAL_WRITE_OVERLAP = profiled.write_overlap  # before the `job` fixture records it


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A run directory, the fake nsys first on PATH and its log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nsys").write_text(FAKE_NSYS)
    (bin_dir / "nsys").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("NSYS_LOG", str(tmp_path / "nsys.log"))
    monkeypatch.delenv(profiled.UNDER_NSYS, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = []
    monkeypatch.setattr(profiled, "write_overlap", lambda d: written.append(Path(d)))
    return run_dir, tmp_path / "nsys.log", written


def _trainer(marker: Path, code: int = 0) -> list[str]:
    """The program nsys profiles: it records that it ran under nsys, as launch/entry.py's child would."""
    under = f"os.environ.get({profiled.UNDER_NSYS!r}, '')"
    src = f"import os, sys; open({str(marker)!r}, 'w').write({under}); sys.exit({code})"
    return [sys.executable, "-c", src]


def test_the_first_profiled_rank_trains_under_nsys_exports_and_writes_the_report(job, capsys):
    run_dir, log, written = job
    (run_dir / "nsys").mkdir()
    (run_dir / "nsys" / "rank8.sqlite").write_bytes(b"")  # the other profiled rank, on another node, exported
    (run_dir / "nsys" / profiled.DONE).write_text("{}")  # an earlier segment's marker: this job writes its own
    assert profiled.run_profiled(run_dir, 0, PLAN, _trainer(run_dir / "ran")) == 0
    assert (run_dir / "ran").read_text() == "1"  # the child trained with UNDER_NSYS set: it does not wrap again
    calls = log.read_text().splitlines()
    assert calls[0].startswith("profile --sample=none --trace=nvtx,cuda --capture-range=cudaProfilerApi ")
    assert f"-o {run_dir}/nsys/rank0 " in calls[0] and calls[1] == "UNDER=1"
    assert calls[2].startswith("export --type=sqlite --force-overwrite=true --output=")
    assert calls[2].endswith(f"{run_dir}/nsys/rank0.nsys-rep") and f"--output={run_dir}" not in calls[2]  # via $TMPDIR
    db = sqlite3.connect(run_dir / "nsys" / "rank0.sqlite")
    assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("StringIds",)]
    assert not list((run_dir / "nsys").glob("*.part"))
    done = json.loads((run_dir / "nsys" / profiled.DONE).read_text())
    assert done == {"missing_exports": [], "error": None} and written == [run_dir]


def test_a_failed_export_is_one_line_naming_the_command_and_the_ranks_still_finish(job, monkeypatch, capsys):
    run_dir, _, _ = job
    monkeypatch.setenv("FAIL_EXPORT", "1")
    (run_dir / "nsys").mkdir()
    (run_dir / "nsys" / profiled.DONE).write_text("{}")  # the first rank's marker: rank 8 does not wait
    assert profiled.run_profiled(run_dir, 8, PLAN, _trainer(run_dir / "ran")) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: rank 8: nsys export of {run_dir}/nsys/rank8.nsys-rep failed")
    assert err[0].endswith(f"(SQLite export failed: database is locked); rerun: nsys export --type=sqlite "
                           f"{run_dir}/nsys/rank8.nsys-rep")  # fmt: skip
    assert not (run_dir / "nsys" / "rank8.sqlite").exists()


def test_the_first_rank_whose_own_export_failed_reports_at_once(job, monkeypatch, capsys):
    """It does not wait WAIT_S for its own export: the marker comes now, naming what is missing."""
    run_dir, _, written = job
    monkeypatch.setenv("FAIL_EXPORT", "1")
    (run_dir / "nsys").mkdir()
    (run_dir / "nsys" / "rank8.sqlite").write_bytes(b"")
    assert profiled.run_profiled(run_dir, 0, PLAN, _trainer(run_dir / "ran")) == 0
    done = json.loads((run_dir / "nsys" / profiled.DONE).read_text())
    assert done == {"missing_exports": ["rank0.sqlite"], "error": None} and written == [run_dir]


def test_the_marker_replaces_a_link_planted_at_its_name_and_leaves_its_target_alone(tmp_path):
    run_dir, target = tmp_path / "run", tmp_path / "precious"
    (run_dir / "nsys").mkdir(parents=True)
    target.write_text("keep")
    (run_dir / "nsys" / profiled.DONE).symlink_to(target)
    profiled.write_report(run_dir, [0], wait_s=0)  # no export, no plan: the marker says so, whatever happened
    assert target.read_text() == "keep" and not (run_dir / "nsys" / profiled.DONE).is_symlink()
    assert json.loads((run_dir / "nsys" / profiled.DONE).read_text())["missing_exports"] == ["rank0.sqlite"]


def test_training_that_fails_is_passed_on_and_nsys_missing_is_one_line(job, monkeypatch, capsys):
    run_dir, log, _ = job
    assert profiled.run_profiled(run_dir, 0, PLAN, _trainer(run_dir / "ran", code=3)) == 3
    assert "export" not in log.read_text() and not (run_dir / "nsys" / profiled.DONE).exists()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert profiled.run_profiled(run_dir, 0, PLAN, _trainer(run_dir / "ran")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: NSYS profiles rank 0, but nsys is not on the PATH on ") and "\n" not in err


def test_which_ranks_run_under_nsys_and_the_others_hold_for_the_marker(job, monkeypatch, capsys):
    run_dir, _, _ = job
    assert profiled.profiles_rank(run_dir, PLAN, 8) and not profiled.profiles_rank(run_dir, PLAN, 1)
    assert not profiled.profiles_rank(run_dir, {"run": {}}, 0)
    (run_dir / "nsys").mkdir()
    for r in (0, 8):  # a later segment: the window was profiled already
        (run_dir / "nsys" / f"rank{r}.sqlite").write_bytes(b"")
    assert not profiled.profiles_rank(run_dir, PLAN, 0)
    monkeypatch.setenv(profiled.UNDER_NSYS, "1")
    (run_dir / "nsys" / "rank8.sqlite").unlink()
    assert not profiled.profiles_rank(run_dir, PLAN, 0)  # nsys's own child never wraps itself again
    assert profiled.hold(run_dir, wait_s=0.1) is False
    assert "no report.done in" in capsys.readouterr().err
    (run_dir / "nsys" / profiled.DONE).write_text("{}")
    assert profiled.hold(run_dir, wait_s=5) is True


def test_entry_hands_a_profiled_rank_to_the_wrapper_before_its_preflight(tmp_path, job):
    """launch/entry.py as srun starts it: rank 0 of a NSYS run re-runs itself under nsys (the fake one), and the
    child, with UNDER_NSYS set, goes on to the preflight; a preflight-only job never wraps."""
    run_dir, log, _ = job
    layout = {"nodes": 2, "gpus": 16, "tp": 1, "pp": 1, "cp": 1, "dp": 16, "mbs": 1, "gbs": 16, "seq": 4096}
    whole = {**PLAN, "recipe": "r", "layout": layout, "audit": {"rows": {}}}  # what planfile.read_plan accepts
    (run_dir / "plan.json").write_text(json.dumps(whole))
    env = {**os.environ, "SLURM_PROCID": "0", "PYTHONPATH": "src:."}
    argv = [sys.executable, "launch/entry.py", "--recipe", "r", "--run-dir", str(run_dir)]
    out = subprocess.run(argv, cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines()
    assert calls[0].startswith("profile ") and calls[0].endswith(
        f"{paths.REPO_ROOT}/launch/entry.py --recipe r --run-dir {run_dir}"
    ), calls
    assert calls[1] == "UNDER=1" and out.returncode != 0  # the child's preflight: no ledger.json in this directory
    assert "ledger.json" in out.stderr and not any(c.startswith("export") for c in calls)
    log.unlink()
    out = subprocess.run([*argv, "--preflight-only"], cwd=paths.REPO_ROOT, env=env, capture_output=True, text=True)
    assert not log.exists() and "ledger.json" in out.stderr


def test_the_job_leaves_the_report_make_overlap_report_writes(job, planned, monkeypatch):
    """The first profiled rank of a 70B run (one rank profiled), its export a real-schema fixture (nsys_fixtures:
    dense_step, every class hidden, partly hidden or exposed). The run directory then holds the report and the
    timeline under the names the make target and the nightly use, with the figures the report computes from the
    directory as it is."""
    run_dir, _, _ = job
    monkeypatch.setattr(profiled, "write_overlap", REAL_WRITE_OVERLAP)
    plan = planned("llama3_70b_pretrain_64gpu_h100_bf16").to_dict()
    plan["run"] = {**(plan.get("run") or {}), "nsys": {"steps": [33, 35], "ranks": [0]}}
    (run_dir / "plan.json").write_text(json.dumps(plan, default=str))
    fixture = dense_step(run_dir.parent, "export.sqlite")
    monkeypatch.setenv("NSYS_FIXTURE", str(fixture))
    assert profiled.run_profiled(run_dir, 0, plan, _trainer(run_dir / "ran")) == 0
    done = json.loads((run_dir / "nsys" / profiled.DONE).read_text())
    assert done == {"missing_exports": [], "error": None}
    written = json.loads((run_dir / "overlap_report.json").read_text())
    assert written["timeline"] == str(run_dir / "overlap_timeline.png") and (run_dir / "overlap_timeline.png").is_file()
    assert written == {
        **overlap_report.report_of(overlap_report.measure(*overlap_report.run_inputs(run_dir))),
        "timeline": written["timeline"],
    }
    report, why = exposed.read(run_dir)  # what the nightly's column and rule 6 read
    assert why is None and exposed.shares(report) == {"tp": 0.4167, "cp": 0.0, "pp": 1.0, "dp": 0.25}
