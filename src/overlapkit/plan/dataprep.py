"""`make prep-data`: JSONL → Megatron indexed datasets (`.bin`/`.idx`) and the data spec `OUT/data.toml`.

The tokenizing and the binary format are nvidia-modelopt's `megatron_preprocess_data` (which writes through Megatron
Core's IndexedDatasetBuilder); this module checks the request, runs it in a hidden work directory inside OUT, checks
each result with plan/data.py's reader, and only then moves the files into OUT (each `.bin` before its `.idx`) and
writes data.toml last, atomically. An interrupted run leaves no data.toml and no `.idx` without its `.bin`: nothing
that looks complete. Existing outputs are kept unless FORCE=1.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import shutil
from pathlib import Path

from overlapkit import stack
from overlapkit.plan import data

SPEC = "data.toml"
WORK_PREFIX = ".prep-"  # OUT/.prep-<pid>/: the preprocessor's output until it is checked


class PrepError(ValueError):
    """One-line, user-facing."""


def inputs(path: str) -> list[Path]:
    p = Path(path or "").expanduser()
    if not path:
        raise PrepError("IN= is required: a .jsonl (or .jsonl.gz) file or a directory of them")
    if p.is_dir():
        files = sorted([*p.glob("*.jsonl"), *p.glob("*.jsonl.gz")])
        if not files:
            raise PrepError(f"IN={path}: no .jsonl or .jsonl.gz files in this directory")
        return files
    if not p.is_file() or not p.name.endswith((".jsonl", ".jsonl.gz")):
        raise PrepError(f"IN={path}: not a .jsonl/.jsonl.gz file or a directory of them")
    return [p]


def _open(f: Path):
    return gzip.open(f, "rt", encoding="utf-8") if f.suffix == ".gz" else f.open(encoding="utf-8")


def count_docs(f: Path, key: str) -> int:
    """Documents in `f`; the first must be a JSON object with `key` (a wrong KEY= is the common mistake)."""
    n = 0
    with _open(f) as fh:
        for line in fh:
            if n == 0:
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    raise PrepError(f"{f}: line 1 is not JSON: IN= takes JSON Lines, one document per line") from None
                if not isinstance(first, dict) or key not in first:
                    keys = ", ".join(first) if isinstance(first, dict) else "none"
                    raise PrepError(f"{f}: no key {key!r} in line 1 (its keys: {keys}): set KEY=")
            n += 1
    if not n:
        raise PrepError(f"{f} is empty")
    return n


def check(in_path: str, tokenizer: str, out: str, key: str, workers: str, force: bool) -> tuple[list[Path], Path]:
    """Everything about the request, before anything is written: returns (input files, OUT)."""
    files = inputs(in_path)
    if not tokenizer:
        raise PrepError("TOKENIZER= is required: a local Hugging Face tokenizer directory (tokenizer.json)")
    data.tokenizer_vocab(Path(tokenizer).expanduser(), f"TOKENIZER={tokenizer}")
    if not out:
        raise PrepError("OUT= is required: the directory for the .bin/.idx files and data.toml")
    if not (workers or "1").isdigit() or int(workers or 1) < 1:
        raise PrepError(f"WORKERS={workers!r}: a whole number of tokenizing processes ≥ 1")
    if not key:
        raise PrepError("KEY= is empty: the JSON key holding each document's text (default text)")
    target = Path(out).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise PrepError(f"OUT={out} is a file: give a directory")
    existing = [target / SPEC] + [target / f"{_stem(f)}_{key}.{ext}" for f in files for ext in ("bin", "idx")]
    if not force and (clash := [p for p in existing if p.exists()]):
        raise PrepError(f"{clash[0]} exists: FORCE=1 overwrites it (or choose another OUT=)")
    return files, target


def _stem(f: Path) -> str:
    """modelopt's output name for an input file: its stem without .jsonl(.gz)."""
    return f.name.removesuffix(".gz").removesuffix(".jsonl")


def _clear_stale(out: Path) -> None:
    """Work directories of earlier runs that died (kill -9): their pid is gone."""
    for d in out.glob(f"{WORK_PREFIX}*"):
        pid = d.name[len(WORK_PREFIX) :]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def spec_text(tokenizer: Path, prefixes: list[tuple[str, int]], docs: int) -> str:
    total = sum(t for _, t in prefixes) or 1
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    out = [
        f"# written by make prep-data at {stamp}: {docs} documents, {total} tokens (plan/data.py reads it)",
        f"tokenizer = {json.dumps(str(tokenizer))}",
        "# train,valid,test shares of the blend (Megatron's split); or replace [[blend]] with [blend_per_split]",
        'split = "98,1,1"',
        "# Megatron's sample-index cache (GPTDatasetConfig.path_to_cache): must be writable",
        'cache = "index-cache"',
    ]
    for name, tokens in prefixes:  # weights: each file's share of the tokens, its natural proportion
        out += ["", "[[blend]]", f"prefix = {json.dumps(name)}", f"weight = {tokens / total:.6f}"]
    return "\n".join(out) + "\n"


def prep(in_path, tokenizer, out, key="text", workers="1", force=False, log=print) -> Path:
    """Run the preprocessor into OUT/.prep-<pid>/, check, move into OUT, write OUT/data.toml; returns its path."""
    files, target = check(in_path, tokenizer, out, key, workers, force)
    docs = {f: count_docs(f, key) for f in files}
    tok = Path(tokenizer).expanduser().resolve()
    target.mkdir(parents=True, exist_ok=True)
    _clear_stale(target)
    work = target / f"{WORK_PREFIX}{os.getpid()}"
    stack.offline_env()
    stack.quiet_logs()  # the preprocessor imports Megatron Core: its CPU-only notices are not news here
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        from modelopt.torch.utils.plugins.megatron_preprocess_data import megatron_preprocess_data

        made = []
        for i, f in enumerate(files, 1):
            log(f"[{i}/{len(files)}] {f.name}: {docs[f]} documents")
            with stack.silenced():
                made += megatron_preprocess_data(
                    jsonl_paths=[str(f)],
                    output_dir=work,
                    tokenizer_name_or_path=str(tok),
                    json_keys=[key],
                    append_eod=True,
                    workers=int(workers or 1),
                    log_interval=max(1, docs[f] // 20),
                )
        return _publish(made, work, target, tok, sum(docs.values()), log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(made: list[str], work: Path, target: Path, tok: Path, docs: int, log) -> Path:
    vocab = data.tokenizer_vocab(tok, f"TOKENIZER={tok}")
    checked = []
    for prefix in made:
        tokens, _, dtype, largest = data.read_idx(prefix, "prep-data")
        if vocab - 1 > largest:
            raise PrepError(f"{prefix}: {dtype} tokens cannot hold ids up to {vocab - 1}; not published")
        checked.append((Path(prefix).name, tokens))
    for name, _ in checked:  # .bin first: an .idx in OUT always has its .bin
        for ext in ("bin", "idx"):
            os.replace(work / f"{name}.{ext}", target / f"{name}.{ext}")
    spec = target / SPEC
    tmp = target / f"{SPEC}.tmp"
    tmp.write_text(spec_text(tok, checked, docs))
    tmp.replace(spec)
    log(f"wrote {len(checked)} dataset(s), {sum(t for _, t in checked):,} tokens, and {spec}")
    return spec
