"""Real data for the data tests, made offline: a byte-level BPE tokenizer trained with the `tokenizers` library on a
small corpus (the Hub is not reachable), saved as a local Hugging Face tokenizer directory, and, where a test needs a
dataset without the preprocessor, Megatron Core's own IndexedDatasetBuilder (never the binary format by hand)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("the quick brown fox jumps over the lazy dog while seven wise owls watch the river flow past old stone "
         "bridges under a pale morning sky").split()  # fmt: skip


def corpus_docs(n: int = 300) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(24 + i % 19)) for i in range(n)]


def write_corpus(path: Path, docs: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_tokenizer(out: Path, docs: list[str], vocab: int = 320) -> Path:
    """A local HF tokenizer directory (tokenizer.json + tokenizer_config.json) with <eos>, trained on `docs`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(docs, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(out)
    return out


def build_dataset(prefix: Path, docs: list[list[int]], dtype=None) -> Path:
    """<prefix>.bin/.idx through Megatron Core's IndexedDatasetBuilder (dtype: numpy type, default uint16)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype or np.uint16)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_spec(path: Path, tokenizer: Path, prefixes: list[tuple[str, float]], extra: str = "") -> Path:
    lines = [f'tokenizer = "{tokenizer}"', 'split = "90,5,5"', 'cache = "index-cache"', extra]
    for p, w in prefixes:
        lines += ["[[blend]]", f'prefix = "{p}"', f"weight = {w}"]
    path.write_text("\n".join(lines) + "\n")
    return path
