"""The data path on CPU with real parts: `make prep-data` (nvidia-modelopt's preprocessor) on a small corpus with a
tokenizer trained offline, Megatron Core's IndexedDataset reading the result, Bridge's GPTDatasetConfig from the data
spec feeding BlendedMegatronDatasetBuilder for train/valid/test, and a drawn sample decoding back to corpus text.
Then every data-spec problem the audit names, each on a real file."""

from __future__ import annotations

import copy
import dataclasses
import os
import socket
import subprocess
import tracemalloc

import numpy as np
import pytest
from data_fixtures import build_dataset, corpus_docs, make_tokenizer, write_corpus, write_spec

from overlapkit import paths
from overlapkit.bridge import data, dataprep, runopts
from overlapkit.bridge.build import make_plan
from overlapkit.spec.runopts import RunOptions

R8 = "llama3_8b_pretrain_8gpu_h100_bf16"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    docs = corpus_docs()
    tok = make_tokenizer(root / "tok", docs)
    corpus = write_corpus(root / "in" / "corpus.jsonl", docs)
    out = subprocess.run(["make", "-s", "prep-data", f"IN={corpus}", f"TOKENIZER={tok}", f"OUT={root / 'out'}"],
                         cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # What prep-data wrote, listed now: a test that builds the datasets adds Megatron's index-cache/ beside them.
    wrote = sorted(p.name for p in (root / "out").iterdir())
    return {
        "root": root,
        "docs": docs,
        "tok": tok,
        "corpus": corpus,
        "out": root / "out",
        "stdout": out.stdout,
        "wrote": wrote,
    }


def test_prep_data_writes_a_dataset_megatron_reads_and_a_spec(prepared):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = prepared["out"]
    assert "Processed" in prepared["stdout"] and "wrote 1 dataset(s)" in prepared["stdout"]  # progress, result
    assert prepared["wrote"] == ["corpus_text.bin", "corpus_text.idx", "data.toml"]
    ds = IndexedDataset(str(out / "corpus_text"))
    assert len(ds) == len(prepared["docs"])
    spec = data.load(out / "data.toml")
    assert spec.tokens == int(ds.sequence_lengths.sum()) and spec.blend[0].dtype == "uint16"
    assert spec.vocab == 320 and spec.tokenizer == str(prepared["tok"].resolve())


def test_the_spec_builds_train_valid_test_with_bridge_and_a_sample_decodes_to_corpus_text(prepared):
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    spec = data.load(prepared["out"] / "data.toml")
    plan = make_plan(R8, run=RunOptions(data=spec.to_dict()))
    cfg = plan.cfg
    assert cfg.dataset.blend == ([str(prepared["out"] / "corpus_text")], [1.0])
    assert cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer" and cfg.tokenizer.tokenizer_model == spec.tokenizer
    tokenizer = build_tokenizer(cfg.tokenizer)
    ds_cfg = dataclasses.replace(cfg.dataset, seq_length=32, split="80,10,10")  # a short sequence for a tiny corpus
    ds_cfg.tokenizer = tokenizer
    ds_cfg.finalize()
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [16, 4, 4], lambda: True, ds_cfg).build()
    assert len(train) >= 16 and len(valid) >= 4 and len(test) >= 4
    text = tokenizer.detokenize(train[3]["tokens"].tolist())
    pieces = [p.strip() for p in text.split("<eos>") if p.strip()]
    whole = "\n".join(prepared["docs"])
    assert pieces and all(p in whole for p in pieces), pieces  # each piece is corpus text, across document breaks
    assert any(p in prepared["docs"] for p in pieces[1:-1]) or len(pieces) <= 2


def test_prep_data_refuses_to_overwrite_without_force(prepared):
    args = (str(prepared["corpus"]), str(prepared["tok"]), str(prepared["out"]), "text", "1")
    with pytest.raises(dataprep.PrepError, match="data.toml exists: FORCE=1 overwrites it"):
        dataprep.check(*args, force=False)
    assert dataprep.check(*args, force=True)[1] == prepared["out"]


def test_an_interrupted_prep_leaves_nothing_that_looks_complete(prepared, tmp_path):
    docs = prepared["docs"]
    write_corpus(tmp_path / "in" / "a.jsonl", docs[:50])
    write_corpus(tmp_path / "in" / "b.jsonl", docs[50:100])
    calls = []

    def log(msg):  # the second file's progress line: Ctrl-C after the first file was really tokenized
        calls.append(msg)
        if msg.startswith("[2/2]"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dataprep.prep(str(tmp_path / "in"), str(prepared["tok"]), str(tmp_path / "out"), log=log)
    assert calls[0].startswith("[1/2] a.jsonl") and list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_bin", "corpus.bin is missing: run make prep-data"),
        ("bad_header", "is not a Megatron index (bad header)"),
        ("truncated_bin", "its index says"),
        ("dtype_too_small", "stores uint8 tokens (ids ≤ 255) but the tokenizer has 320"),
        ("zero_weight", "weights must be positive numbers"),
        ("text_weight", "weights must be positive numbers"),
        ("both_blends", "set exactly one of [[blend]]"),
        ("unwritable_cache", "is not writable"),
        ("bad_split", "three non-negative numbers"),
        ("unknown_key", "unknown key 'blends'"),
        ("no_tokenizer", "has no tokenizer.json"),
        ("bad_toml", "invalid TOML"),
    ],
)
def test_each_data_spec_problem_is_one_line_naming_the_fix(prepared, tmp_path, case, message):
    d, tok = tmp_path, prepared["tok"]
    ids = [[5, 6, 7, 1], [8, 9, 1]]
    prefix = build_dataset(d / "corpus", ids, dtype=np.uint8 if case == "dtype_too_small" else None)
    entries, extra = [("corpus", 1.0)], ""
    if case == "missing_bin":
        (d / "corpus.bin").unlink()
    elif case == "bad_header":
        (d / "corpus.idx").write_bytes(b"NOTANIDX" + (d / "corpus.idx").read_bytes()[8:])
    elif case == "truncated_bin":
        (d / "corpus.bin").write_bytes((d / "corpus.bin").read_bytes()[:-2])
    elif case in ("zero_weight", "text_weight"):
        entries = [("corpus", 0 if case == "zero_weight" else '"x"')]
    elif case == "both_blends":
        extra = '[blend_per_split]\ntrain = [{prefix = "corpus", weight = 1}]'
    elif case == "unwritable_cache":  # under a regular file: not creatable, even for root (who ignores modes)
        extra = 'cache = "corpus.idx/cache"'
    elif case == "bad_split":
        extra = 'split = "90,10"'
    elif case == "unknown_key":
        extra = "blends = 1"
    elif case == "no_tokenizer":
        tok = d
    spec = write_spec(d / "data.toml", tok, entries, extra)
    text = spec.read_text()
    if case in ("unwritable_cache", "bad_split"):  # replace the default line instead of repeating the key
        key = extra.split(" =")[0]
        text = "\n".join(line for line in text.splitlines() if not line.startswith(f"{key} =") or line == extra)
    if case == "bad_toml":
        text += "tokenizer = [unclosed\n"
    spec.write_text(text + "\n")
    assert prefix.with_suffix(".idx").exists()
    with pytest.raises(data.DataError) as err:
        data.load(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_tokenizer_larger_than_the_model_is_refused_and_few_tokens_warn_with_epochs(prepared):
    spec = data.load(prepared["out"] / "data.toml")
    cfg = copy.deepcopy(make_plan(R8).cfg)
    cfg.model.vocab_size = 100
    with pytest.raises(data.DataError, match="tokenizer vocabulary 320 > the model's 100"):
        data.apply(cfg, spec)
    plan = make_plan(R8, run=RunOptions(data=spec.to_dict()), sets="train.train_iters=10")
    warn = [f for f in plan.report.warnings if f.code == "data_epochs"]
    d = plan.to_dict()["data"]
    assert d["consumed_tokens"] == 10 * 128 * 8192 and d["epochs"] == round(d["consumed_tokens"] / d["train_tokens"], 2)
    assert warn and f"{d['epochs']:.2f} epochs" in warn[0].message


def test_mock_stays_the_default_and_the_plan_says_so():
    d = make_plan(R8).to_dict()
    assert d["data"]["mock"] is True and "data: mock (benchmark)" in runopts.lines(d)


def test_the_spec_counts_exactly_the_documents_the_index_holds(prepared):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    header = (prepared["out"] / "data.toml").read_text().splitlines()[0]
    assert f": {len(IndexedDataset(str(prepared['out'] / 'corpus_text')))} documents," in header, header


def test_an_index_whose_count_differs_from_its_input_is_not_published(prepared, tmp_path):
    work, out = tmp_path / ".prep-x", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    prefix = build_dataset(work / "c_text", [[5, 6, 1], [7, 1]])
    with pytest.raises(dataprep.PrepError, match=r"c_text.idx holds 2 documents, its input 3: not published"):
        dataprep._publish([str(prefix)], work, out, prepared["tok"], [3], log=print)
    assert list(out.iterdir()) == []


def test_a_dead_runs_work_directory_is_removed_a_live_or_foreign_one_kept(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    dead = tmp_path / f".prep-{host}-{gone.pid}"
    live = tmp_path / f".prep-{host}-{os.getpid()}"
    foreign = tmp_path / f".prep-elsewhere-{gone.pid}"
    for d in (dead, live, foreign):
        (d / "x").mkdir(parents=True)
    assert dataprep.clear_stale(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, foreign])
    assert dataprep.work_dir(tmp_path) == live  # this run's own name


def test_a_newline_free_input_is_read_in_bounded_memory(tmp_path):
    big = tmp_path / "one.jsonl"
    with big.open("wb") as f:  # 40 MB without a newline: read whole, the check would hold all of it
        f.write(b'{"text": "')
        for _ in range(40):
            f.write(b"a" * (1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(dataprep.PrepError, match=r"one.jsonl:1: a line over 4 MiB"):
            dataprep.count_docs(big, "text")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * dataprep.LINE_LIMIT, peak  # a line bound, its read buffer: never the 40 MB
