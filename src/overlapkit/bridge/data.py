"""The data spec (`DATA=<data.toml>`, written by `make prep-data`; the file's model: spec/dataspec.py): the files it
names checked one by one before the Bridge import, then applied with Bridge's own GPTDatasetConfig and TokenizerConfig.
Every problem is one DataError line naming the fix. Nothing here writes a dataset file (prep-data: bridge/dataprep.py).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from overlapkit.errors import BadInput
from overlapkit.spec import model
from overlapkit.spec.dataspec import MESSAGES, SPLITS, DataToml, Entry

# Megatron Core's .idx layout (megatron-core 0.19.2, datasets/indexed_dataset.py, _IndexWriter.write): magic, <Q
# version 1, <B dtype code, <Q sequence count, <Q document count, then int32 sequence lengths, int64 sequence pointers
# (each sequence's byte offset in the .bin: the running sum of length × itemsize from 0) and int64 document indices.
IDX_MAGIC = b"MMIDIDX\x00\x00"
# DType codes of that file (indexed_dataset.DType).
DTYPES = dict(enumerate(("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"), start=1))


class DataError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class Prefix:
    path: str  # absolute, without .bin/.idx
    weight: float
    tokens: int
    documents: int
    dtype: str


@dataclass(frozen=True)
class DataSpec:
    source: str
    tokenizer: str
    vocab: int  # the tokenizer's, added tokens included
    cache: str
    split: str | None
    blend: tuple[Prefix, ...] = ()
    per_split: dict = dataclasses.field(default_factory=dict)  # split → tuple[Prefix, ...]

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.blend or [p for ps in self.per_split.values() for p in ps])

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "tokenizer": self.tokenizer,
            "vocab": self.vocab,
            "cache": self.cache,
            "split": self.split,
            "tokens": self.tokens,
            "blend": [dataclasses.asdict(p) for p in self.blend] or None,
            "blend_per_split": {s: [dataclasses.asdict(p) for p in ps] for s, ps in self.per_split.items()} or None,
        }


def _fail(where: str, msg: str):
    raise DataError(f"{where}: {msg}")


def read_idx(prefix: str, where: str) -> tuple[int, int, str, int]:
    """(tokens, documents, dtype name, largest id the dtype holds) from `<prefix>.idx`; checks `.bin` beside it."""
    idx, binf = Path(prefix + ".idx"), Path(prefix + ".bin")
    for f in (binf, idx):
        if not f.is_file():
            _fail(where, f"{f} is missing: run make prep-data (or fix the prefix; it names <prefix>.bin/.idx)")
    with idx.open("rb") as fh:
        head = fh.read(9 + 8 + 1 + 8 + 8)
    if len(head) < 34 or head[:9] != IDX_MAGIC:
        _fail(where, f"{idx} is not a Megatron index (bad header): rebuild it with make prep-data FORCE=1")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in DTYPES:
        _fail(where, f"{idx}: index version {version}, dtype code {code} unknown: rebuild it with make prep-data")
    if idx.stat().st_size < 34 + 4 * seqs + 8 * seqs + 8 * docs:
        _fail(where, f"{idx} is truncated (an interrupted write?): rebuild it with make prep-data FORCE=1")
    lengths = np.memmap(idx, dtype=np.int32, mode="r", offset=34, shape=(seqs,)) if seqs else np.zeros(0, np.int32)
    name = DTYPES[code]
    # The largest token id the dtype holds exactly: an integer's max, a float's 2^(mantissa bits + 1).
    largest = int(np.iinfo(name).max) if np.dtype(name).kind in "iu" else 2 ** (np.finfo(name).nmant + 1)
    tokens = int(lengths.sum(dtype=np.int64))
    if binf.stat().st_size != tokens * np.dtype(name).itemsize:
        _fail(where, f"{binf} holds {binf.stat().st_size} bytes, its index says {tokens} {name} tokens: rebuild it")
    if seqs:
        # The sequence pointers must be the ones Megatron writes for these lengths (each sequence starts where the one
        # before ends, the first at byte 0), so that every read stays inside the .bin: one pass over two arrays.
        pointers = np.memmap(idx, dtype=np.int64, mode="r", offset=34 + 4 * seqs, shape=(seqs,))
        starts = np.zeros(seqs, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=starts[1:])
        if (lengths < 0).any() or not np.array_equal(pointers, starts * np.dtype(name).itemsize):
            bad = f"{idx}'s sequence pointers do not match its lengths (a corrupt index)"
            _fail(where, f"{bad}: rebuild it with make prep-data FORCE=1")
    return tokens, max(docs - 1, 0), name, largest


def tokenizer_vocab(path: Path, where: str) -> int:
    """The vocabulary of a local HF tokenizer directory (added tokens included), read with `tokenizers`."""
    if not (path / "tokenizer.json").is_file():
        _fail(where, f"tokenizer {path} has no tokenizer.json: give a local Hugging Face tokenizer directory")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # tokenizers raises its own Exception type on a malformed file
        _fail(where, f"tokenizer {path}/tokenizer.json does not load ({str(exc).splitlines()[0]}): re-save it")


def _prefixes(entries: list[Entry], base: Path, where: str, vocab: int) -> tuple[Prefix, ...]:
    out = []
    for e in entries:
        prefix = str(resolved(base / e.prefix, where)).removesuffix(".bin").removesuffix(".idx")
        if prefix in [p.path for p in out]:
            _fail(where, f"{e.prefix} is listed twice in one blend: list each dataset once (its weight sets its share)")
        tokens, docs, dtype, largest = read_idx(prefix, where)
        if vocab - 1 > largest:
            bad = f"{prefix}.idx stores {dtype} tokens (ids ≤ {largest}) but the tokenizer has {vocab}"
            _fail(where, f"{bad}: re-run make prep-data with this tokenizer")
        out.append(Prefix(prefix, e.weight, tokens, docs, dtype))
    return tuple(out)


def resolved(path: Path, where: str) -> Path:
    """`path` made absolute through its links; a link loop is one line, not Python's RuntimeError."""
    try:
        return path.resolve()
    except RuntimeError:  # pathlib (Python 3.12): "Symlink loop from ..."
        _fail(where, f"{path} is behind a symbolic link loop: fix the link")
    except OSError as exc:
        _fail(where, f"{path} cannot be resolved ({exc.strerror}): fix the path")


def load(path: str | Path) -> DataSpec:
    """Parse and check a data.toml (files, headers, dtype against the tokenizer, weights, cache)."""
    where = f"DATA={path}"
    src = resolved(Path(path).expanduser(), where)
    if not src.is_file():
        _fail(where, "no such file: give the data.toml that make prep-data wrote (OUT/data.toml)")
    try:
        raw = tomllib.loads(src.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        _fail(where, f"invalid TOML: {' '.join(str(exc).split())}")
    try:
        spec = DataToml.model_validate(raw)
    except ValidationError as exc:
        _fail(where, model.problem(exc, raw, MESSAGES))
    base = src.parent
    tok = resolved(base / spec.tokenizer, where)
    vocab = tokenizer_vocab(tok, where)
    cache = resolved(base / spec.cache, where)
    probe = next(p for p in (cache, *cache.parents) if p.exists())  # where Megatron would create it
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        _fail(where, f"index cache {cache} is not writable (Megatron writes its sample indices there): set cache")
    if spec.blend:
        blend = _prefixes(spec.blend, base, where, vocab)
        return DataSpec(str(src), str(tok), vocab, str(cache), spec.split, blend=blend)
    table = spec.blend_per_split
    per = {s: _prefixes(getattr(table, s), base, where, vocab) for s in SPLITS if getattr(table, s) is not None}
    return DataSpec(str(src), str(tok), vocab, str(cache), None, per_split=per)


def _blend(prefixes) -> tuple[list[str], list[float]]:
    return [p.path for p in prefixes], [p.weight for p in prefixes]


def apply(cfg, spec: DataSpec) -> None:
    """Point `cfg` at the data: GPTDatasetConfig blend/split/path_to_cache, a HuggingFaceTokenizer TokenizerConfig."""
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    if (model_vocab := getattr(cfg.model, "vocab_size", None)) and spec.vocab > model_vocab:
        raise DataError(
            f"DATA={spec.source}: tokenizer vocabulary {spec.vocab} > the model's {model_vocab}: "
            "use the model's tokenizer, or SET model.vocab_size"
        )
    per = [(_blend(spec.per_split[s]) if s in spec.per_split else None) for s in SPLITS] if spec.per_split else None
    cfg.dataset = dataclasses.replace(
        cfg.dataset,
        blend=_blend(spec.blend) if spec.blend else None,
        blend_per_split=per,
        split=spec.split,
        path_to_cache=spec.cache,
    )
    cfg.tokenizer = TokenizerConfig(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=spec.tokenizer,
        make_vocab_size_divisible_by=cfg.tokenizer.make_vocab_size_divisible_by,
    )


def consumption(cfg, spec: DataSpec | None) -> dict:
    """What the run reads: tokens consumed (iterations × GBS × sequence) against the train split's tokens."""
    t = cfg.train
    consumed = (t.train_iters or 0) * t.global_batch_size * cfg.model.seq_length
    if spec is None:
        return {"mock": True, "consumed_tokens": consumed}
    train = sum(p.tokens for p in spec.per_split.get("train", ()))
    if not spec.per_split:  # the split's train share of one blend
        shares = [float(x) for x in (spec.split or "1").replace("/", ",").split(",")]
        train = int(spec.tokens * shares[0] / sum(shares))
    return {
        "mock": False,
        "consumed_tokens": consumed,
        "train_tokens": train,
        "epochs": round(consumed / train, 2) if train else None,
        **spec.to_dict(),
    }
