"""Bad DATA, RUN_NAME, SEGMENTS, NSYS and prep-data input, and files that are not what a command reads (night.json,
submission.json, a log), as a user types it, through `make` in new processes: one line each naming the fix, no
traceback, exit 2 (make's `Error 2`), answered before the Bridge import, and nothing written (no run directory, no
prep-data output)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from overlapkit import paths
from overlapkit.bridge import dataprep
from overlapkit.cluster.profiles import load_profile

sys.path.insert(0, str(Path(__file__).parents[1] / "unit_tests" / "bridge"))
from data_fixtures import build_dataset, corpus_docs, make_tokenizer, write_corpus, write_spec  # noqa: E402

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    tok = make_tokenizer(d / "tok", corpus_docs(100))
    build_dataset(d / "good", [[5, 6, 7, 1]] * 10)
    build_dataset(d / "small", [[5, 6, 7, 1]] * 10, dtype=np.uint8)
    build_dataset(d / "nobin", [[5, 6, 1]])
    (d / "nobin.bin").unlink()
    build_dataset(d / "badhdr", [[5, 6, 1]])
    (d / "badhdr.idx").write_bytes(b"GARBAGE!" + (d / "badhdr.idx").read_bytes()[8:])
    specs = {
        "missing_bin": write_spec(d / "missing_bin.toml", tok, [("nobin", 1)]),
        "bad_header": write_spec(d / "bad_header.toml", tok, [("badhdr", 1)]),
        "dtype": write_spec(d / "dtype.toml", tok, [("small", 1)]),
        "weight": write_spec(d / "weight.toml", tok, [("good", -1)]),
        "both": write_spec(d / "both.toml", tok, [("good", 1)], '[blend_per_split]\ntrain = [{prefix = "good"}]'),
        "no_tokenizer": write_spec(d / "no_tokenizer.toml", d, [("good", 1)]),
    }
    build_dataset(d / "badptr", [[5, 6, 7, 1]] * 10)  # lengths and .bin size agree; the 10th pointer is 1e12
    raw = bytearray((d / "badptr.idx").read_bytes())
    raw[34 + 4 * 10 + 8 * 9 : 34 + 4 * 10 + 8 * 10] = (10**12).to_bytes(8, "little")
    (d / "badptr.idx").write_bytes(bytes(raw))
    specs |= {
        "inf_weight": write_spec(d / "inf_weight.toml", tok, [("good", "inf")]),
        "twice": write_spec(d / "twice.toml", tok, [("good", 1), ("good", 1e308)]),
        "pointers": write_spec(d / "pointers.toml", tok, [("badptr", 1)]),
    }
    for name, split in (("zero_train", "0,50,50"), ("superscript", "9²,1,1")):
        text = write_spec(d / f"{name}.toml", tok, [("good", 1)]).read_text()
        (d / f"{name}.toml").write_text(text.replace('split = "90,5,5"', f'split = "{split}"'))
        specs[name] = d / f"{name}.toml"
    cache = d / "cache.toml"
    cache.write_text(
        write_spec(cache, tok, [("good", 1)]).read_text().replace('cache = "index-cache"', 'cache = "good.idx/c"')
    )
    specs["cache"] = cache
    (d / "broken.toml").write_text("tokenizer = [\n")
    specs["toml"] = d / "broken.toml"
    corpus = write_corpus(d / "in" / "c.jsonl", corpus_docs(5))
    hostile_inputs(d, tok)
    (d / "out").mkdir()
    (d / "out" / "data.toml").write_text("# an earlier prep-data\n")
    return {"d": d, "tok": tok, "corpus": corpus, **specs}


def hostile_inputs(d: Path, tok: Path) -> None:
    """JSONL whose later line is bad, a tokenizer without its EOS token, and JSON files that are not what they should
    be: each case of issue 26, on a real file."""
    good = [json.dumps({"text": t}) for t in corpus_docs(6)]
    lines = {
        "nokey": [*good[:4], '{"body": "x"}', *good[4:]],
        "null": [*good[:4], '{"text": null}', *good[4:]],
        "middle": [*good[:4], '{"text": "cut', *good[4:]],
        "blank": [*good[:4], "", *good[4:]],
        "number": [*good[:4], '{"text": 7}', *good[4:]],
    }
    for name, body in lines.items():
        (d / "in" / f"{name}.jsonl").write_text("\n".join(body) + "\n")
    (d / "in" / "binary.jsonl").write_bytes(("\n".join(good[:3]) + "\n").encode() + bytes(range(128, 256)) * 30)
    (d / "in" / "long.jsonl").write_bytes(b'{"text": "' + b"a" * (dataprep.LINE_LIMIT + 1) + b'"}\n')
    (d / "in" / "cut.jsonl.gz").write_bytes(gzip.compress("\n".join(good).encode())[:-12])
    (d / "tokonly").mkdir()
    shutil.copy(tok / "tokenizer.json", d / "tokonly")
    (d / "nonight").mkdir()
    for name, text in {"notjson": "not json", "nokeys": '{"stamp": "x"}', "badentries": NIGHT_BAD_ENTRIES}.items():
        (d / name).mkdir()
        (d / name / "night.json").write_text(text)
    (d / "binrun").mkdir()
    (d / "binrun" / "submission.json").write_bytes(bytes(range(128, 256)))
    (d / "emptyrun").mkdir()
    (d / "random.log").write_bytes(bytes(range(256)) * 40)


NIGHT_BAD_ENTRIES = '{"job_dir": "j", "preflight_only": true, "entries": [{"job_id": "5"}]}'
NOT_NIGHT = "it should be the night's record that make nightly writes: give NIGHT=<a night directory"
NOT_RUN = "it should be the run's submission record that make submit writes: give RUN=<a run directory"
PREP = ["TOKENIZER={tok}", "OUT={d}/p"]

BAD = [
    ("plan", ["RUN_NAME=a b"], "RUN_NAME='a b': letters, digits"),
    ("submit", ["RUN_NAME=../x"], "RUN_NAME='../x'"),
    ("submit", ["SEGMENTS=3"], "SEGMENTS=3 needs RUN_NAME=<name>"),
    ("submit", ["RUN_NAME=x", "SEGMENTS=0"], "SEGMENTS='0': a whole number of chained jobs from 1 to 100"),
    ("submit", ["RUN_NAME=x", "SEGMENTS=two"], "SEGMENTS='two'"),
    ("plan", ["RUN_NAME=x", "SEGMENTS=1000"], "SEGMENTS='1000'"),
    ("sbatch", ["RUN_NAME=x", "SEGMENTS=2"], "SEGMENTS=2 is for make submit"),
    ("plan", ["NSYS=12:10"], "NSYS='12:10': use <start>:<end> iterations with start < end"),
    ("plan", ["NSYS=10"], "NSYS='10'"),
    ("submit", ["NSYS=10:12", "NSYS_RANKS=a"], "NSYS_RANKS='a': comma-separated global ranks"),
    ("plan", ["NSYS_RANKS=0"], "NSYS_RANKS= without NSYS"),
    ("plan", ["DATA=/no/such/data.toml"], "no such file: give the data.toml that make prep-data wrote"),
    ("plan", ["DATA={missing_bin}"], "nobin.bin is missing: run make prep-data"),
    ("submit", ["DATA={bad_header}"], "is not a Megatron index (bad header)"),
    ("plan", ["DATA={dtype}"], "stores uint8 tokens (ids ≤ 255) but the tokenizer has 320"),
    ("plan", ["DATA={weight}"], "weights must be positive numbers"),
    ("sbatch", ["DATA={both}"], "set exactly one of [[blend]] (with split) and [blend_per_split]"),
    ("plan", ["DATA={cache}"], "is not writable (Megatron writes its sample indices there)"),
    ("run-local", ["DATA={no_tokenizer}"], "has no tokenizer.json"),
    ("plan", ["DATA={toml}"], "invalid TOML"),
    ("plan", ["DATA={inf_weight}"], "weight inf of good: weights must be positive numbers"),
    ("plan", ["DATA={twice}"], "good is listed twice in one blend: list each dataset once"),
    ("plan", ["DATA={pointers}"], "badptr.idx's sequence pointers do not match its lengths (a corrupt index)"),
    ("plan", ["DATA={zero_train}"], "split = '0,50,50': the train share is 0"),
    ("plan", ["DATA={superscript}"], "superscript.toml: split = '9²,1,1': three non-negative numbers"),
    ("plan", ["NSYS=1:99999999999999999999"], "NSYS='1:99999999999999999999': iterations are at most"),
    ("plan", ["NSYS=10:20", "NSYS_RANKS=99999"], "NSYS_RANKS=99999: rank 99999 is beyond the run's 8 ranks"),
    ("submit", ["NSYS=1:5", "NSYS_RANKS=0,8"], "rank 8 is beyond the run's 8 ranks: use ranks 0..7"),
    ("prep-data", ["IN=/no/such.jsonl", "TOKENIZER={tok}", "OUT={d}/o1"], "IN=/no/such.jsonl: not a .jsonl"),
    (
        "prep-data",
        ["IN={corpus}", "TOKENIZER={tok}", "OUT={d}/o2", "KEY=body"],
        "c.jsonl:1: no key 'body' (its keys: text, id): set KEY=",
    ),
    ("prep-data", ["IN={corpus}", "TOKENIZER={tok}", "OUT={d}/out"], "data.toml exists: FORCE=1 overwrites it"),
    ("prep-data", ["IN={corpus}", "TOKENIZER={d}", "OUT={d}/o3"], "has no tokenizer.json"),
    ("prep-data", ["IN={corpus}", "TOKENIZER={tok}", "OUT={d}/o4", "WORKERS=0"], "WORKERS='0'"),
    ("prep-data", ["IN={d}/in/nokey.jsonl", *PREP], "nokey.jsonl:5: no key 'text' (its keys: body): give every line"),
    ("prep-data", ["IN={d}/in/null.jsonl", *PREP], "null.jsonl:5: 'text' is null, not a string"),
    ("prep-data", ["IN={d}/in/number.jsonl", *PREP], "number.jsonl:5: 'text' is a JSON int, not a string"),
    ("prep-data", ["IN={d}/in/middle.jsonl", *PREP], "middle.jsonl:5: not JSON (Unterminated string"),
    ("prep-data", ["IN={d}/in/blank.jsonl", *PREP], "blank.jsonl:5: an empty line: remove it"),
    ("prep-data", ["IN={d}/in/binary.jsonl", *PREP], "binary.jsonl:4: byte 1 of the line is not UTF-8"),
    ("prep-data", ["IN={d}/in/long.jsonl", *PREP], "long.jsonl:1: a line over 4 MiB"),
    ("prep-data", ["IN={d}/in/cut.jsonl.gz", *PREP], "cut.jsonl.gz: cannot be read"),
    ("prep-data", ["IN={corpus}", "TOKENIZER={d}/tokonly", "OUT={d}/p"], "no end-of-document token (eos_token in"),
    ("nightly-report", ["NIGHT={d}/nonight"], f"nonight/night.json: no such file; {NOT_NIGHT}"),
    ("nightly-report", ["NIGHT={d}/notjson"], f"night.json: is not JSON (Expecting value); {NOT_NIGHT}"),
    ("nightly-report", ["NIGHT={d}/nokeys"], f"night.json: lacks 'job_dir', 'preflight_only', 'entries'; {NOT_NIGHT}"),
    ("nightly-report", ["NIGHT={d}/badentries"], "night.json: its entries are not runs"),
    ("nightly-report", ["JOB_DIR={d}"], "/nightly: run make nightly first, or give NIGHT=<dir>"),
    ("status", ["RUN={d}/binrun"], f"submission.json: is not text (byte 1 is not UTF-8); {NOT_RUN}"),
    ("cancel", ["RUN={d}/binrun"], f"submission.json: is not text (byte 1 is not UTF-8); {NOT_RUN}"),
    ("status", ["RUN={d}/emptyrun"], f"emptyrun/submission.json: no such file; {NOT_RUN}"),
    ("parse-log", ["LOG={d}/random.log"], "random.log: binary (NUL bytes), not a training log"),
]


def written(d: Path) -> set[Path]:
    roots = [paths.runs_root(), load_profile("local").job_path / "runs", d]
    return {p for r in roots if r.is_dir() for p in r.rglob("*")}


# Typed through make in a new process: one case per target (make's `Error 2` line, no traceback in a new process).
THROUGH_MAKE = {
    "plan-RUN_NAME=a b",
    "submit-RUN_NAME=../x",
    "sbatch-RUN_NAME=x SEGMENTS=2",
    "run-local-DATA={no_tokenizer}",
    "prep-data-IN=/no/such.jsonl TOKENIZER={tok} OUT={d}/o1",
    "prep-data-IN={d}/in/middle.jsonl TOKENIZER={tok} OUT={d}/p",
    "nightly-report-NIGHT={d}/nonight",
    "status-RUN={d}/emptyrun",
}
IDS = [f"{t}-{' '.join(a)}" for t, a, _ in BAD]
assert THROUGH_MAKE <= set(IDS), THROUGH_MAKE - set(IDS)  # a misspelt id would move no case


def one_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]


def variables(files, target: str, args: list[str]) -> list[str]:
    planned = target in ("plan", "submit", "sbatch", "run-local") and not any(a.startswith("RECIPE=") for a in args)
    recipe = [f"RECIPE={R8}"] if planned else []
    return recipe + [a.format(**{k: str(v) for k, v in files.items()}) for a in args]


@pytest.mark.parametrize(("target", "args", "needle"), [b for b, i in zip(BAD, IDS, strict=True) if i in THROUGH_MAKE])
def test_bad_run_input_through_make_is_one_line_and_writes_nothing(files, target, args, needle):
    before = written(files["d"])
    out = subprocess.run(
        ["make", target, *variables(files, target, args)],
        cwd=paths.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours = one_line(out.stderr)
    assert out.returncode == 2 and "Error 2" in out.stderr, out.stderr
    assert len(ours) == 1 and ours[0].startswith("error: ") and needle in ours[0], ours
    assert "Traceback" not in out.stdout + out.stderr
    assert written(files["d"]) == before


@pytest.mark.parametrize(
    ("target", "args", "needle"), [b for b, i in zip(BAD, IDS, strict=True) if i not in THROUGH_MAKE]
)
def test_bad_run_input_is_one_line_and_writes_nothing(files, make_here, target, args, needle):
    before = written(files["d"])
    code, out, err = make_here(target, *variables(files, target, args))
    assert code == 2 and len(one_line(err)) == 1 and err.startswith("error: ") and needle in err, err
    assert "Traceback" not in out + err
    assert written(files["d"]) == before
