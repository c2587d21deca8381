"""Make variables typed carelessly or hostilely, answered in one line before any work: a yes/no variable (FORCE=,
DRYRUN=) is one of the words or refused, never guessed; WORKERS= is a number of processes this machine can run, and
those processes end with prep-data however it ends; a profile whose job_dir is a file is named. In process (the
entry's main with the Makefile's own arguments), except the fork that must die with its parent."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from data_fixtures import corpus_docs, make_tokenizer, write_corpus

from overlapkit import makewatch
from overlapkit.bridge import dataprep
from overlapkit.cluster.profiles import parse_profile
from overlapkit.spec.profile import ProfileError
from overlapkit.spec.runopts import switch


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-prep")
    docs = corpus_docs(40)
    out = root / "out"
    out.mkdir()
    (out / dataprep.SPEC).write_text("# an earlier run's data spec\n")
    corpus, tok = write_corpus(root / "corpus.jsonl", docs), make_tokenizer(root / "tok", docs)
    return {"IN": corpus, "TOKENIZER": tok, "OUT": out}


def _vars(corpus, **more) -> list[str]:
    return [f"{k}={v}" for k, v in {**corpus, **more}.items()]


@pytest.mark.parametrize("force", ["off", "OFF", "no", "0", "false", ""])
def test_force_off_in_any_spelling_keeps_the_data_toml(corpus, make_here, force):
    code, out, err = make_here("prep-data", *_vars(corpus, FORCE=force))
    assert code == 2 and not out and err.count("\n") == 1
    assert "data.toml exists: FORCE=1 overwrites it" in err
    assert (corpus["OUT"] / dataprep.SPEC).read_text() == "# an earlier run's data spec\n"


@pytest.mark.parametrize("force", ["maybe", "1 ", "y", "2", "of"])
def test_a_yes_no_word_that_is_neither_is_refused(corpus, make_here, force):
    if force.strip() in ("1",):  # surrounding blanks are not a different word
        assert switch(force) is True
        return
    code, out, err = make_here("prep-data", *_vars(corpus, FORCE=force))
    assert code == 2 and err.count("\n") == 1 and f"argument --force: {force!r} is neither on (1, true, yes, on)" in err
    assert (corpus["OUT"] / dataprep.SPEC).read_text() == "# an earlier run's data spec\n"


def test_the_yes_no_words():
    assert [switch(w) for w in ("1", "true", "Yes", "ON", " on ")] == [True] * 5
    assert [switch(w) for w in ("", "0", "False", "no", "OFF", "  ")] == [False] * 6


@pytest.mark.parametrize("workers", ["²", "100000", "0", "-1", "1.5", "٣", "9" * 30])
def test_workers_is_a_number_of_processes_this_machine_runs(corpus, make_here, workers):
    code, out, err = make_here("prep-data", *_vars(corpus, WORKERS=workers, FORCE="1"))
    assert code == 2 and not out and err.count("\n") == 1, err
    assert f"WORKERS={workers!r}: a whole number of tokenizing processes from 1 to " in err
    assert "invalid literal" not in err
    assert dataprep.worker_count("1") == 1 and dataprep.worker_count("") == 1


def test_a_profile_whose_job_dir_is_a_file(tmp_path):
    afile = tmp_path / "jobs"
    afile.write_text("")
    base = {"account": "a", "partition": "p"}
    with pytest.raises(ProfileError, match=f"job_dir: {afile} is a file, not a directory: give job_dir a directory"):
        parse_profile({**base, "job_dir": str(afile)}, name="x")
    with pytest.raises(ProfileError, match="job_dir: .* cannot be used as a directory \\(Not a directory\\)"):
        parse_profile({**base, "job_dir": str(afile / "sub")}, name="x")
    assert parse_profile({**base, "job_dir": str(tmp_path / "new")}, name="x").job_path == tmp_path / "new"


def test_a_make_pid_that_is_not_a_number_is_not_watched(monkeypatch):
    """No watcher on a pid that is none, nor on a number that is no ancestor; this process's parent, a real
    ancestor, is watched (so the first half can fail: a watch_make that watched anything would start one)."""
    monkeypatch.setattr(makewatch, "_WATCHING", [])
    for pid in ("²", "abc", "-1", "9" * 40, "", "0x1f", "999999999"):  # the last: a number, no ancestor
        monkeypatch.setenv(makewatch.MAKE_PID, pid)
        makewatch.watch_make()  # no traceback
        assert makewatch._WATCHING == [], pid
    monkeypatch.setattr(makewatch, "_watch_parent", lambda pid, poll=0: None)  # the thread, not its SIGTERM
    monkeypatch.setenv(makewatch.MAKE_PID, str(os.getppid()))
    makewatch.watch_make()
    assert len(makewatch._WATCHING) == 1


def test_forked_workers_die_with_their_owner_however_it_ends():
    """The owner forks a worker (as a multiprocessing pool does) and exits with os._exit (prep-data's way out after
    a signal, which skips every cleanup): the worker is gone within a second, not left sleeping under init."""
    code = (
        "import os, sys, time\n"
        "from overlapkit import makewatch\n"
        "makewatch.children_die_with_me()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "print(pid, flush=True); time.sleep(0.3); os._exit(143)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 5
    while makewatch.alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.returncode == 143 and not makewatch.alive(worker)


def test_pids_and_counts_that_are_not_ascii_numbers_are_never_int(tmp_path):
    import socket

    from overlapkit.cluster import runlock
    from overlapkit.spec import topology

    lock = tmp_path / runlock.LOCK
    lock.write_text("{}")
    for pid in ("²", "abc", True, -1.5):
        assert runlock.stale(lock, {"host": socket.gethostname(), "pid": pid}) is False  # young: age decides
    stale_dir = tmp_path / f"{dataprep.WORK_PREFIX}{socket.gethostname()}-²"
    stale_dir.mkdir()
    assert dataprep.clear_stale(tmp_path) == [] and stale_dir.is_dir()
    assert topology.env_int("R", environ={"R": "²"}) is None and topology.env_int("R", environ={"R": "3"}) == 3


def test_a_data_spec_through_a_link_loop_or_with_a_bad_cache_is_one_line(corpus, tmp_path):
    from overlapkit.bridge import data

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(data.DataError, match=f"DATA={loop}/data.toml: {loop}/data.toml is behind a symbolic link loop"):
        data.load(loop / "data.toml")
    spec = tmp_path / "data.toml"
    spec.write_text(f'tokenizer = "{corpus["TOKENIZER"]}"\ncache = 5\n[[blend]]\nprefix = "x"\n')
    with pytest.raises(data.DataError, match=r"cache = 5: a directory path"):
        data.load(spec)
    with pytest.raises(data.DataError, match=f"OUT={loop}/out: .* is behind a symbolic link loop: fix the link"):
        dataprep.check(str(corpus["IN"]), str(corpus["TOKENIZER"]), str(loop / "out"), "text", "1", True)
