"""`kill -9` of make's shell child during `make prep-data` (issue 26): make exits, and nothing tells uv and Python
below it but the make watcher (overlapkit.makewatch). Without it they tokenized on and published data.toml minutes
later; with it they stop within a second, publish nothing, and remove their work directory OUT/.prep-<host>-<pid>/."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from overlapkit import makewatch, paths

sys.path.insert(0, str(Path(__file__).parents[1] / "unit_tests" / "bridge"))
from data_fixtures import corpus_docs, make_tokenizer, write_corpus  # noqa: E402


def descendants(pid: int) -> list[int]:
    """`pid`'s children, grandchildren, ... (Linux /proc)."""
    kids = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and (stat := makewatch.proc_stat(int(p.name))) and stat[1].isdigit():
            kids.setdefault(int(stat[1]), []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        out += (more := kids.get(todo.pop(), []))
        todo += more
    return out


def wait_for(cond, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return cond()


def test_kill_9_of_makes_shell_child_stops_prep_data_without_publishing(tmp_path):
    docs = corpus_docs(300) * 200  # 60k documents: tokenizing outlasts the kill by seconds even on a fast machine
    corpus = write_corpus(tmp_path / "in" / "corpus.jsonl", docs)
    tok, out = make_tokenizer(tmp_path / "tok", docs[:300]), tmp_path / "out"
    make = subprocess.Popen(
        ["make", "-s", "prep-data", f"IN={corpus}", f"TOKENIZER={tok}", f"OUT={out}"],
        cwd=paths.REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    below: list[int] = []
    try:
        # the work directory exists once the preprocessor runs: the moment a kill leaves the most behind
        assert wait_for(lambda: any(out.glob(".prep-*")), timeout=600), make.stderr.read()[-2000:]
        below[:] = descendants(make.pid)
        shell = [p for p in below if (makewatch.proc_stat(p) or ["", ""])[1] == str(make.pid)]
        assert shell and len(below) >= 2, below  # make's child, and uv/Python under it
        os.kill(shell[0], signal.SIGKILL)
        make.wait(timeout=30)
        rest = [p for p in below if p != shell[0]]
        assert wait_for(lambda: not any(makewatch.alive(p) for p in rest), timeout=10), rest
        time.sleep(1)  # a survivor would publish now
        assert not (out / "data.toml").exists() and not list(out.glob(".prep-*")), sorted(out.iterdir())
        assert not list(out.glob("*.idx"))
    finally:  # whatever failed, nothing of this test outlives it
        for p in below:
            if makewatch.alive(p):
                os.kill(p, signal.SIGKILL)
        if make.poll() is None:
            make.kill()
