"""The 1-GPU cuts (src/overlapkit/bridge/gpucut.py) and the bench that trains them (bench/gpu_cut.py), on CPU.

Real Bridge configs throughout: every cut is built from our registered recipe and from Bridge's own H100 recipe,
validated by Bridge's `ConfigContainer.validate()`, and its model is built by Bridge's provider into Megatron Core
modules. What cannot exist here is the GPU: the model is built on the meta device with CPU initialisation (megatron
otherwise allocates on `torch.cuda.current_device()`), and training itself is the `gpu`-marked test in tests/gpu/.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from nightly_fixtures import bridge_log, curve

from overlapkit import paths
from overlapkit.bridge import gpucut
from overlapkit.bridge.build import workload_of
from overlapkit.sizing import memory
from overlapkit.spec.shape import ModelShape, dtype_of
from overlapkit.spec.topology import Target

REPO = paths.REPO_ROOT
CASES = [(k, s) for k in gpucut.CUTS for s in gpucut.SIDES] or [(None, "ours")]  # none: build(None) fails


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_cut_bench", REPO / "bench" / "gpu_cut.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.mark.parametrize("key,side", CASES)
def test_cut_is_one_gpu_no_te_and_bridge_validates_it(key, side):
    cut, cfg = gpucut.CUTS[key], gpucut.build(key, side)
    m = cfg.model
    assert (m.num_layers, m.seq_length, cfg.dataset.seq_length) == (cut.layers, cut.layout.seq, cut.layout.seq)
    layout = (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size)
    assert layout == (1, 1, 1) and m.virtual_pipeline_model_parallel_size is None and not m.sequence_parallel
    from megatron.bridge.models.gpt_provider import local_layer_spec

    assert m.transformer_layer_spec is local_layer_spec
    te_only = (m.apply_rope_fusion, m.gradient_accumulation_fusion, m.cross_entropy_loss_fusion, m.tp_comm_overlap)
    assert not any(te_only) and m.cross_entropy_fusion_impl == "native" and m.fp8 is None
    assert cfg.comm_overlap is None and dtype_of(cfg) == "bf16"
    assert (cfg.train.train_iters, cfg.train.micro_batch_size, cfg.train.global_batch_size) == (20, 1, cut.layout.gbs)
    assert cfg.logger.log_interval == 1 and cfg.logger.log_throughput and cfg.checkpoint.save is None
    assert cfg.rng.seed == 1234
    cfg.validate()  # Bridge's own cross-field checks (scheduler vs iterations, parallel sizes, precision)
    assert cfg.dataset.mock  # finalize: no blend -> megatron-core's MockGPTDataset


SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length")


@pytest.mark.parametrize("key", sorted(gpucut.CUTS) or [None])  # no cut at all: build(None) fails, never a pass
def test_both_sides_cut_the_same_shape(key):
    ours, bridge = (gpucut.build(key, s) for s in gpucut.SIDES)
    assert [getattr(ours.model, f) for f in SHAPE] == [getattr(bridge.model, f) for f in SHAPE]
    diff = {name for name, _, _ in gpucut.differences(ours, bridge)}
    assert not diff & {f"model.{f}" for f in SHAPE}
    assert "model.tensor_model_parallel_size" not in diff and "train.global_batch_size" not in diff


def test_differences_name_the_knobs_that_differ():
    ours, bridge = (gpucut.build("llama3_8b", s) for s in gpucut.SIDES)
    assert gpucut.differences(ours, gpucut.build("llama3_8b", "ours")) == []
    diff = {name: (a, b) for name, a, b in gpucut.differences(ours, bridge)}
    assert diff["ddp.check_for_nan_in_grad"] == (True, False)  # our safety check; NVIDIA's perf recipe drops it
    # Bridge's GPT3 recipe sets ddp.grad_reduce_in_fp32=True, which its mixed_precision (False) overwrites when
    # training starts: not a real difference, so not reported.
    gpt3 = {name for name, _, _ in gpucut.differences(*(gpucut.build("gpt3_175b", s) for s in gpucut.SIDES))}
    assert gpucut.build("gpt3_175b", "bridge").ddp.grad_reduce_in_fp32 and "ddp.grad_reduce_in_fp32" not in gpt3
    ours.model.hidden_dropout = 0.25
    assert ("model.hidden_dropout", 0.25, bridge.model.hidden_dropout) in gpucut.differences(ours, bridge)


def test_unknown_cut_or_side_is_a_one_line_error():
    with pytest.raises(KeyError, match="use one of llama3_8b"):
        gpucut.build("llama3_13b", "ours")
    with pytest.raises(ValueError, match="use one of ours, bridge"):
        gpucut.build("llama3_8b", "nemo")


def test_estimates_gate_the_card():
    est = {k: gpucut.estimate(gpucut.build(k, "ours"), "h100") for k in gpucut.CUTS}
    assert [k for k, e in est.items() if not e.fits] == ["llama31_405b"]  # as CUTS documents
    assert gpucut.estimate(gpucut.build("llama31_405b", "ours"), "h200").fits
    assert not gpucut.estimate(gpucut.build("llama3_8b", "ours"), "h100", hbm_gb=24.0).fits  # measured card wins
    # Unfused attention is what makes the cut's activations large: the same cut with flash attention is smaller.
    w = workload_of(gpucut.build("llama3_70b", "ours"), Target(nodes=1, gpus_per_node=1))
    flash, unfused = (memory.estimate_workload(dataclasses.replace(w, attention=a)) for a in ("flash", "unfused"))
    assert unfused.activations_gb > 2 * flash.activations_gb


@pytest.mark.parametrize("key,side", CASES)
def test_cut_builds_megatron_core_local_spec_model(key, side, one_rank):
    from megatron.bridge.training.setup import _validate_and_set_vocab_size
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cfg = gpucut.build(key, side)
    cfg.validate()  # finalizes the provider (init methods), as Bridge's setup does before building the model
    m = cfg.model
    # Bridge's setup sizes the vocabulary from the tokenizer (mock data: NullTokenizer) — the same two calls here.
    m.vocab_size, m.should_pad_vocab = _validate_and_set_vocab_size(
        m.vocab_size, build_tokenizer(cfg.tokenizer).vocab_size, cfg.tokenizer.use_tokenizer_vocab_size
    )
    m.init_model_with_meta_device = m.use_cpu_initialization = True  # no GPU to allocate on (see module docstring)
    m._pg_collection = one_rank
    model = m.provide()
    roots = {type(x).__module__.split(".")[0] for x in model.modules()}
    assert roots == {"megatron", "torch"}, roots  # nothing from transformer_engine or apex
    layers = model.decoder.layers
    assert len(layers) == gpucut.CUTS[key].layers
    assert all(type(layer.self_attention.core_attention) is DotProductAttention for layer in layers)
    n = sum(p.numel() for p in model.parameters())
    # The shape the memory estimate counted: GEMM weights, norms and embeddings. GPT3 adds a learned position
    # embedding (2048 × 12288) and biases, which the estimate leaves out: 0.6% of this 2-layer cut.
    assert abs(n - ModelShape.of(cfg).total_params) / n < (0.01 if key == "gpt3_175b" else 1e-4)


def _log(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_classify_and_table_from_bridge_printed_logs(bench, tmp_path):
    n = 20
    ours = _log(tmp_path, "llama3_8b.ours.log", bridge_log(curve(n), [400.0] * n, tflops=[300.0] * n, world=1))
    ref = _log(tmp_path, "llama3_8b.bridge.log", bridge_log(curve(n), [380.0] * n, tflops=[320.0] * n, world=1))
    res = {"llama3_8b": {"ours": bench.classify(ours, "ours", 0, n, 60.0),
                         "bridge": bench.classify(ref, "bridge", 0, n, 58.0)}}  # fmt: skip
    assert [r["status"] for r in res["llama3_8b"].values()] == ["ok", "ok"]
    assert res["llama3_8b"]["ours"]["summary"]["tflops_per_gpu"] == pytest.approx(300.0, rel=1e-3)
    line = bench.table(res, "header").splitlines()[-1]
    row = line.split()
    assert row[:3] == ["llama3_8b", "4", "2048"] and "0.94" in row  # 300 / 320
    assert line.endswith("│ ok · vs golden: ours no_golden, bridge no_golden")


def test_classify_failures(bench, tmp_path):
    n = 20
    short = _log(tmp_path, "a.log", bridge_log(curve(8), [400.0] * 8, world=1, train_iters=n))
    assert bench.classify(short, "ours", "timeout", n, 1.0)["status"] == "failed (rc timeout, 8/20 iterations)"
    oom = _log(tmp_path, "b.log", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert bench.classify(oom, "ours", 1, n, 1.0)["status"] == "failed (cuda_oom, 0/20 iterations)"
    nan = _log(tmp_path, "c.log", bridge_log(curve(n)[:-1] + [float("nan")], [400.0] * n, world=1))
    assert bench.classify(nan, "ours", 0, n, 1.0)["status"] == "failed (NaN loss, 20/20 iterations)"
    why = "needs 121.2 GB, this card gives 75.6 GB"
    skip = _log(tmp_path, "d.log", f"CUT-SKIP: {why}\n")
    assert bench.classify(skip, "ours", bench.SKIP_RC, n, 1.0)["status"] == f"skipped: {why}"
    assert bench.classify(skip, "ours", 1, n, 1.0)["status"].startswith("failed")  # a skip line needs its exit code


def test_list_prints_every_cut_with_estimate_and_differences(bench, capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    for key, cut in gpucut.CUTS.items():
        assert (
            f"{key}: {cut.layers} layer" in out
            and f"seq {cut.layout.seq}, GBS {cut.layout.gbs}" in out
            and cut.reference in out
        )
    assert "H100 121.2 GB does NOT fit, H200 121.2 GB fits" in out and "differs: ddp.check_for_nan_in_grad" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: tests/gpu runs the bench")
def test_without_gpu_the_bench_says_so_in_one_line(bench, capsys, tmp_path):
    assert bench.main(["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no CUDA GPU here") and "--list" in err[0]
    assert not (tmp_path / "x").exists()


def test_sides_are_judged_against_goldens_that_bless_writes(bench, tmp_path, capsys):
    n, run, goldens = 20, tmp_path / "run", tmp_path / "goldens"
    run.mkdir()

    def side_log(name, ms, tflops):
        return _log(run, name, bridge_log(curve(n), [ms] * n, tflops=[tflops] * n, world=1))

    log = side_log("llama3_8b.ours.log", 400.0, 300.0)
    first = bench.classify(log, "ours", 0, n, 60.0)
    assert first["vs_golden"] == "no_golden"
    oom = {"side": "bridge", "status": "failed (cuda_oom, 0/20 iterations)"}
    doc = {"device": "NVIDIA H200", "gpu": "h200", "iters": n, "label": gpucut.LABEL, "versions": {"torch": "2.11.0"},
           "results": {"llama3_8b": {"ours": first, "bridge": oom}}}  # fmt: skip
    (run / "results.json").write_text(json.dumps(doc))
    assert bench.bless(run, goldens) == 0
    assert "not blessed: llama3_8b bridge: failed (cuda_oom" in capsys.readouterr().out
    assert [p.name for p in (goldens / "h200").iterdir()] == ["llama3_8b.ours.json"]
    g = json.loads((goldens / "h200" / "llama3_8b.ours.json").read_text())
    assert g["recipe"] == "llama3_8b.ours" and g["layout"]["layers"] == 4 and g["versions"] == {"torch": "2.11.0"}
    assert g["tflops_per_gpu"] == pytest.approx(300.0, rel=1e-3) and len(g["loss"]) == n
    # The nightly's rules: the same run passes; 10 % slower is a regression; 10 % faster fails as well.
    assert bench.classify(log, "ours", 0, n, 1.0, g)["vs_golden"] == "pass"
    slow = bench.classify(side_log("slow.log", 440.0, 272.7), "ours", 0, n, 1.0, g)
    assert slow["vs_golden"] == "regression" and "step_time_ms" in slow["golden_reasons"][0]
    fast = bench.classify(side_log("fast.log", 360.0, 333.3), "ours", 0, n, 1.0, g)
    assert fast["vs_golden"] == "unexpected_improvement"
    row = bench.table({"llama3_8b": {"ours": fast, "bridge": first}}, "h").splitlines()[-1]
    assert row.endswith("ok · vs golden: ours unexpected_improvement, bridge no_golden")


def test_bless_needs_a_run_directory(bench, tmp_path, capsys):
    assert bench.bless(tmp_path, tmp_path / "goldens") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no results.json" in err[0] and not (tmp_path / "goldens").exists()


def test_a_gpu_without_nvidia_resiliency_ext_is_a_one_line_error(bench, capsys, tmp_path, monkeypatch):
    """This venv really lacks nvidia-resiliency-ext (pyproject overrides it out); only the GPU is pretended."""
    assert importlib.util.find_spec("nvidia_resiliency_ext") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nvidia-resiliency-ext==0.6.0" in err[0] and not (tmp_path / "x").exists()


def test_results_record_the_stack_versions(bench):
    from overlapkit.bridge import stack

    v = bench._versions()
    assert all(v[k] == stack.PINNED[k] for k in ("megatron-core", "megatron-bridge"))
    assert set(v) == {"torch", "megatron-core", "megatron-bridge", "transformers"}


def test_a_timeout_kills_the_whole_process_group(bench, tmp_path):
    """torchrun's worker is a grandchild: a timeout must not leave it holding the GPU. A real grandchild here."""
    pid_file = tmp_path / "grandchild.pid"
    cmd = ["bash", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; wait"]
    assert bench.run_logged(cmd, tmp_path / "t.log", timeout=2) == "timeout"
    assert (tmp_path / "t.log").read_text() == "started\n"
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")

    def running() -> bool:  # gone, or a zombie waiting for its new parent (PID 1 here) to reap it: not running
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5  # SIGKILL is asynchronous: a loaded machine may show the state a moment late
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()
    assert bench.run_logged(["bash", "-c", "exit 3"], tmp_path / "u.log", timeout=10) == 3
