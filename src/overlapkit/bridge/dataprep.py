"""`make prep-data`: JSONL → Megatron indexed datasets (`.bin`/`.idx`) and the data spec `OUT/data.toml`.

The tokenizing and the binary format are nvidia-modelopt's `megatron_preprocess_data` (Megatron Core's
IndexedDatasetBuilder); this module checks the request, runs it in a hidden work directory inside OUT, checks each
result with bridge/data.py's reader, then moves the files into OUT (each `.bin` before its `.idx`) and writes
data.toml last, atomically: an interrupted run leaves nothing that looks complete. FORCE=1 overwrites outputs.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
import re
import shutil
import socket
import zlib
from pathlib import Path

from overlapkit import jsonio, makewatch
from overlapkit.bridge import data, stack
from overlapkit.errors import BadInput

SPEC = "data.toml"
WORK_PREFIX = ".prep-"  # OUT/.prep-<host>-<pid>/: the preprocessor's output until it is checked


class PrepError(BadInput):
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


# A document is one JSONL line, tokenized whole: transformers 5.12.1's fast tokenizer took ~170 bytes per input byte
# here per worker (a 4 MiB line 0.69 GB, a 50 MB line 9 GB). 4 MiB (~1.5M tokens) keeps a worker under ~0.7 GB and is
# far beyond any real document; the check reads a line at most this long, so a newline-free file costs no more.
LINE_LIMIT = 4 << 20  # bytes


def count_docs(f: Path, key: str) -> int:
    """Documents in `f`, every line checked (file:line in the error) as modelopt's reader and encoder take it: UTF-8,
    at most LINE_LIMIT bytes, a JSON object whose `key` is a string. The preprocessor would skip a malformed line and
    fail on a missing key deep in its pool; nothing is tokenized until the whole input is good."""
    opener, n = gzip.open if f.name.endswith(".gz") else open, 0
    try:
        with opener(f, "rb") as fh:
            for n, raw in enumerate(iter(lambda: fh.readline(LINE_LIMIT + 2), b""), 1):
                body, where = raw[:-2] if raw.endswith(b"\r\n") else raw.removesuffix(b"\n"), f"{f}:{n}"
                if len(body) > LINE_LIMIT:
                    raise PrepError(
                        f"{where}: a line over {LINE_LIMIT >> 20} MiB (one document is tokenized whole, ~170 bytes "
                        "of memory a byte): split the document into several lines"
                    )
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PrepError(
                        f"{where}: byte {exc.start + 1} of the line is not UTF-8 (a binary file, or another "
                        "encoding): IN= takes UTF-8 JSON Lines; convert it (iconv -t UTF-8)"
                    ) from None
                if "\r" in text:  # the preprocessor's reader ends a line there too: one line here would be two there
                    raise PrepError(f"{where}: a carriage return inside the line: end lines with \\n only (dos2unix)")
                if text.startswith("\ufeff"):
                    raise PrepError(f"{where}: starts with a UTF-8 byte-order mark: save the file as UTF-8 without BOM")
                if not text.strip():
                    raise PrepError(f"{where}: an empty line: remove it (each line is one document)")
                try:
                    doc = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise PrepError(
                        f"{where}: not JSON ({exc.msg}, column {exc.colno}): fix or remove the line"
                    ) from None
                except RecursionError:
                    raise PrepError(f"{where}: JSON nested too deep to read: fix or remove the line") from None
                if not isinstance(doc, dict) or key not in doc:
                    kind = f"a JSON {type(doc).__name__}, no keys"
                    keys = ", ".join(map(str, doc))[:200] if isinstance(doc, dict) else kind
                    fix = "set KEY=" if n == 1 else "give every line the key, or remove the line"
                    raise PrepError(f"{where}: no key {key!r} (its keys: {keys or 'none'}): {fix}")
                if not isinstance(doc[key], str):
                    what = "null" if doc[key] is None else f"a JSON {type(doc[key]).__name__}"
                    raise PrepError(f"{where}: {key!r} is {what}, not a string: each document's text is a string")
    except (OSError, EOFError, zlib.error) as exc:  # gzip: BadGzipFile is an OSError, a cut stream an EOFError
        raise PrepError(f"{f}: cannot be read ({exc}): give a readable .jsonl or a whole .jsonl.gz") from None
    if not n:
        raise PrepError(f"{f} is empty: give a JSONL file with one document per line")
    return n


def check(in_path: str, tokenizer: str, out: str, key: str, workers: str, force: bool) -> tuple[list[Path], Path]:
    """Everything about the request, before anything is written: returns (input files, OUT)."""
    from tokenizers import Tokenizer

    files = inputs(in_path)
    if not tokenizer:
        raise PrepError("TOKENIZER= is required: a local Hugging Face tokenizer directory (tokenizer.json)")
    tok, where = Path(tokenizer).expanduser(), f"TOKENIZER={tokenizer}"
    data.tokenizer_vocab(tok, where)
    # The end-of-document token modelopt's append_eod adds (the tokenizer's eos_token_id): named by
    # tokenizer_config.json or special_tokens_map.json, as transformers reads it, and in tokenizer.json's vocabulary
    # (transformers would add an unknown one as a new id, past the vocabulary data.toml records).
    eos = None
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = jsonio.read_json(
            tok / file, role=f"the tokenizer's {file}", fix="re-save the tokenizer", missing_ok=True, foreign=True
        )
        value = (cfg or {}).get("eos_token")
        eos = value.get("content") if isinstance(value, dict) else value
        if eos is not None:
            break
    if not isinstance(eos, str) or not eos:
        raise PrepError(
            f"{where}: no end-of-document token (eos_token in tokenizer_config.json): prep-data appends one after "
            "each document; save the tokenizer with save_pretrained(..., eos_token=...) or add "
            '"eos_token": "<its EOS token>" to tokenizer_config.json'
        )
    if Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id(eos) is None:
        raise PrepError(f"{where}: eos_token {eos!r} is not in tokenizer.json's vocabulary: name its EOS token")
    if not out:
        raise PrepError("OUT= is required: the directory for the .bin/.idx files and data.toml")
    worker_count(workers)
    if not key:
        raise PrepError("KEY= is empty: the JSON key holding each document's text (default text)")
    target = data.resolved(Path(out).expanduser(), f"OUT={out}")
    if target.exists() and not target.is_dir():
        raise PrepError(f"OUT={out} is a file: give a directory")
    stems = [f.name.removesuffix(".gz").removesuffix(".jsonl") for f in files]  # modelopt's output names
    existing = [target / SPEC] + [target / f"{stem}_{key}.{ext}" for stem in stems for ext in ("bin", "idx")]
    if not force and (clash := [p for p in existing if p.exists()]):
        raise PrepError(f"{clash[0]} exists: FORCE=1 overwrites it (or choose another OUT=)")
    return files, target


def worker_count(workers: str) -> int:
    """WORKERS= as a number of tokenizing processes, 1 up to this machine's CPUs (more only queue for the cores)."""
    cap = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    text = (workers or "1").strip()
    if not re.fullmatch(r"[0-9]{1,6}", text) or not 1 <= int(text) <= cap:
        raise PrepError(f"WORKERS={workers!r}: a whole number of tokenizing processes from 1 to {cap} (the CPUs here)")
    return int(text)


def work_dir(out: Path) -> Path:
    """OUT/.prep-<host>-<pid>/: this run's. The host too: OUT may be on a filesystem other machines write."""
    return out / f"{WORK_PREFIX}{socket.gethostname()}-{os.getpid()}"


def clear_stale(out: Path) -> list[Path]:
    """Remove the work directories of dead earlier runs on this host (kill -9 leaves one), not another host's (its
    pid means nothing here); returns those removed."""
    gone = []
    for d in out.glob(f"{WORK_PREFIX}*"):
        host, _, pid = d.name[len(WORK_PREFIX) :].rpartition("-")
        if host == socket.gethostname() and re.fullmatch(r"[0-9]{1,9}", pid) and not makewatch.alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def prep(in_path, tokenizer, out, key="text", workers="1", force=False, log=print) -> Path:
    """Run the preprocessor into OUT/.prep-<pid>/, check, move into OUT, write OUT/data.toml; returns its path."""
    files, target = check(in_path, tokenizer, out, key, workers, force)
    docs = {f: count_docs(f, key) for f in files}
    tok = Path(tokenizer).expanduser().resolve()
    target.mkdir(parents=True, exist_ok=True)
    for d in clear_stale(target):
        log(f"removed {d.name}: the work directory of an earlier run that was killed")
    work = work_dir(target)
    makewatch.children_die_with_me()  # its pool's workers end with this process, whatever ends it
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
                    workers=worker_count(workers),
                    log_interval=max(1, docs[f] // 20),
                )
        return _publish(made, work, target, tok, [docs[f] for f in files], log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _publish(made: list[str], work: Path, target: Path, tok: Path, docs: list[int], log) -> Path:
    """Check each made dataset against its input and the tokenizer, move it into OUT (.bin before .idx), then write
    OUT/data.toml last: the blend weighted by each file's tokens."""
    vocab = data.tokenizer_vocab(tok, f"TOKENIZER={tok}")
    checked = []
    for prefix, want in zip(made, docs, strict=True):  # one prefix per input file, in order (one key)
        tokens, held, dtype, largest = data.read_idx(prefix, "prep-data")
        if vocab - 1 > largest:
            raise PrepError(f"{prefix}: {dtype} tokens cannot hold ids up to {vocab - 1}; not published")
        if held != want:  # every line was checked first: a difference is the preprocessor's, never published
            raise PrepError(f"{prefix}.idx holds {held} documents, its input {want}: not published")
        checked.append((Path(prefix).name, tokens))
    for name, _ in checked:  # .bin first: an .idx in OUT always has its .bin
        for ext in ("bin", "idx"):
            os.replace(work / f"{name}.{ext}", target / f"{name}.{ext}")
    total = sum(t for _, t in checked) or 1
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    text = [
        f"# written by make prep-data at {stamp}: {sum(docs)} documents, {total} tokens (bridge/data.py reads it)",
        f"tokenizer = {json.dumps(str(tok))}",
        "# train,valid,test shares of the blend (Megatron's split); or replace [[blend]] with [blend_per_split]",
        'split = "98,1,1"',
        "# Megatron's sample-index cache (GPTDatasetConfig.path_to_cache): must be writable",
        'cache = "index-cache"',
    ]
    for name, tokens in checked:  # weights: each file's share of the tokens, its natural proportion
        text += ["", "[[blend]]", f"prefix = {json.dumps(name)}", f"weight = {tokens / total:.6f}"]
    spec = jsonio.write_text(target / SPEC, "\n".join(text) + "\n")
    log(f"wrote {len(checked)} dataset(s), {sum(t for _, t in checked):,} tokens, and {spec}")
    return spec
