"""Forking a recipe for a new size: the layout search, the scaffolded file (builds, audits, registers), and bad
requests that fail with one line and leave no file behind.

Every fork writes into pytest's tmp_path (--recipes-dir) and the `clean_registry` fixture removes what it registered,
so the real recipes/ and the ten-recipe registry stay as they were. tests/e2e/test_fork_e2e.py forks with `make
new-recipe` into a temporary directory and plans the fork from new processes through RECIPES_PATH, as a user does.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launch import commands
from overlapkit import paths
from overlapkit.bridge import registry
from overlapkit.bridge.build import make_plan
from overlapkit.fork import scaffold
from overlapkit.sizing.hardware import HARDWARE

R70, R8 = "llama3_70b_pretrain_64gpu_h100_bf16", "llama3_8b_pretrain_8gpu_h100_bf16"
# The 34B: CodeLlama-34B's published transformer shape (codellama/CodeLlama-34b-hf config.json: hidden 8192, 48 layers,
# 64 heads, 8 KV heads, FFN 22016), the only Llama-family size between 13B and 70B. Its GQA 64/8 and hidden 8192 are
# Llama3 70B's, so forking the 70B recipe changes just layers and FFN, and keeps the Llama3 vocabulary and seq 8192.
NAME_34B = "llama3_34b_pretrain_32gpu_h100_bf16"
ARGS_34B = ["--from", R70, "--name", NAME_34B, "--layers", "48", "--ffn", "22016"]
# A 12B between Llama3 8B and 70B (hidden 5120, 40 heads): no Bridge userbuffers preset exists for h5120.
ARGS_12B = ["--from", R8, "--hidden", "5120", "--heads", "40", "--layers", "40", "--ffn", "17920"]


@pytest.fixture
def clean_registry():
    """The registry's entries; whatever a test registers is unregistered after it."""
    before = set(registry.names())  # discovers first: a snapshot of an undiscovered registry would be empty
    yield registry.REGISTRY
    for name in set(registry.REGISTRY) - before:
        registry.unregister(name)
    assert set(registry.REGISTRY) == before


def cli(capsys, tmp_path, *argv):
    try:
        code = commands.call("new-recipe", [*argv, "--recipes-dir", str(tmp_path)])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --- scaffold: the happy paths -------------------------------------------------------------------------------------


def test_fork_34b_writes_a_recipe_that_builds_audits_and_registers(capsys, tmp_path, clean_registry):
    code, out, err = cli(capsys, tmp_path, *ARGS_34B)
    assert code == 0, err
    path = tmp_path / f"{NAME_34B}.py"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    text = path.read_text()
    assert len(text.splitlines()) <= 40 and "forked from llama3_70b_pretrain_64gpu_h100_bf16" in text
    assert "from recipes.llama3_70b import base as _from_base" in text and 'h100_pretrain(base, "bf16"' in text
    assert "base = with_shape(_from_base, SHAPE)" in text and "def base" not in text  # the shape loop has one home
    entry = clean_registry[NAME_34B]
    assert entry.nodes == 4 and entry.model == "Llama3 34B"
    assert f"RECIPES_PATH={tmp_path}" in out  # written outside recipes/: the next process needs the path
    assert "audit: OK" in out and "fits" in out and "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192" in out
    p = make_plan(NAME_34B)
    assert (
        p.report.ok
        and [f for f in p.report.warnings if f.code != "stack_warns"] == []
        and p.layout["params_b"] == pytest.approx(35.3, abs=0.1)
    )
    m = p.cfg.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size) == (
        8192, 48, 64, 8, 22016)  # fmt: skip
    assert (p.layout["tp"], p.layout["pp"], p.layout["cp"], p.layout["dp"]) == (4, 2, 1, 4)  # test_layout_search: why
    assert "top candidates (ranked by predicted TFLOP/s/GPU" in out and "loses: within 2% of the best" in out
    assert ranked_as(out, p) == planned_as(p)  # the number the search ranked it by is the plan's
    assert p.report.row("tp_comm_overlap").state == "on" and p.report.row("overlap_grad_reduce").state == "on"
    # The file is lint-clean as written, so it can live in recipes/ under `make lint`.
    ruff = [sys.executable, "-m", "ruff"]
    cfg = ["--config", str(paths.REPO_ROOT / "pyproject.toml")]
    assert subprocess.run([*ruff, "check", *cfg, str(path)], capture_output=True).returncode == 0
    assert subprocess.run([*ruff, "format", "--check", *cfg, str(path)], capture_output=True).returncode == 0


def test_fork_for_h200_ranks_and_sizes_for_its_memory(capsys, tmp_path, clean_registry):
    """GPU=h200: the same 34B on 32 GPUs searched against an H200's 141 GB, planned for it, and said so."""
    code, out, err = cli(capsys, tmp_path, *ARGS_34B, "--gpu", "h200")
    assert code == 0, err
    assert "ranked by predicted TFLOP/s/GPU on H200 SXM" in out and "GPU=h200: an h100 recipe planned for H200" in out
    assert "Searched for H200 SXM (GPU=h200)" in " ".join((tmp_path / f"{NAME_34B}.py").read_text().split())
    p = make_plan(NAME_34B, gpu="h200")
    assert p.report.ok and p.memory.budget_gb == pytest.approx(HARDWARE["h200"].hbm_gb - 4)
    # TP1 PP4 CP2 (no TP collectives) where an H100 gets TP4 PP2: room that an H100 does not have
    assert (p.layout["tp"], p.layout["pp"], p.layout["cp"]) == (1, 4, 2), p.layout
    assert p.memory.total_gb > HARDWARE["h100"].hbm_gb - 4


def test_fork_fp8_with_a_pinned_pipeline_via_the_api(tmp_path, clean_registry):
    req = scaffold.ForkRequest(
        from_name=R70, name="llama3_34b_pretrain_32gpu_h100_fp8cs", shape={"layers": 48, "ffn": 22016},
        layout={"pp": 2}, recipes_dir=tmp_path,
    )  # fmt: skip
    res = scaffold.fork(req)
    assert res.path.exists() and res.plan.report.ok and res.plan.memory.fits
    assert res.choice.pp == 2 and res.choice.vpp > 1 and res.plan.report.row("overlap_p2p_comm").state == "on"
    assert res.choice.preset == "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"
    assert res.choice.prediction.to_dict() == make_plan(res.name).throughput.to_dict()  # FP8: one prediction too
    assert res.plan.layout["dtype"] == "fp8" and res.plan.report.row("fp8_param_gather").state == "on"


def test_fork_without_a_preset_writes_the_explicit_default_opt_in(capsys, tmp_path, clean_registry):
    name = "llama3_12b_pretrain_16gpu_h100_bf16"
    code, out, err = cli(capsys, tmp_path, *ARGS_12B, "--name", name, "--tp", "2")
    assert code == 0, err
    assert 'INTENT = OverlapIntent(tp_preset="default")' in (tmp_path / f"{name}.py").read_text()
    p = make_plan(name)
    assert p.report.ok and p.report.codes("warning") - {"stack_warns"} == {
        "tp_default_config"
    }  # declared, never silent


# --- scaffold: bad requests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--from", "llama3_70b", "--name", NAME_34B], "unknown recipe 'llama3_70b'; closest"),
        (["--from", R70, "--name", "llama3-34b"], "must be <model>_pretrain_<N>gpu_h100_<bf16|fp8cs>"),
        ([*ARGS_34B, "--gpus", "64"], "contradicts the name's 32gpu"),
        ([*ARGS_34B, "--dtype", "fp8cs"], "contradicts the name's _bf16"),
        (["--from", R8, "--name", R70], "already registered"),
        (["--from", R70, "--name", "llama3_x_pretrain_12gpu_h100_bf16"], "use a multiple of 8"),
        ([*ARGS_34B, "--heads", "60"], "does not divide"),
        ([*ARGS_34B, "--query-groups", "6"], "not divisible by query groups 6"),
        (["--from", R70, "--name", "llama3_70b_pretrain_8gpu_h100_bf16"], "use more GPUs"),
        ([*ARGS_34B, "--tp", "3"], "TP3 is not one of"),
        ([*ARGS_34B, "--tp", "4", "--pp", "1", "--cp", "1", "--gbs", "100"], "GBS 100 is not divisible by DP·MBS=8"),
        ([*ARGS_34B, "--hidden", "abc"], "'abc' is not a whole number ≥ 1"),
        ([*ARGS_34B, "--layers", "0"], "'0' is not a whole number ≥ 1"),
        (["--from", R70, "--name", "advfw_pretrain_８gpu_h100_bf16"], "must be <model>_pretrain_<N>gpu_h100_"),
        (["--from", R70, "--name", "llama3_" + "x" * 60 + "_pretrain_8gpu_h100_bf16"], "up to 64"),
        ([*ARGS_34B, "--hidden", "4100", "--heads", "32"], "hidden 4100 is not divisible by heads 32 (head dim)"),
    ],
)
def test_bad_request_fails_with_one_line_and_writes_nothing(capsys, tmp_path, clean_registry, argv, needle):
    before = set(clean_registry)
    code, out, err = cli(capsys, tmp_path, *argv)
    assert code == 2 and out == "" and needle in err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert list(tmp_path.iterdir()) == [] and set(clean_registry) == before


def test_a_name_clash_with_an_existing_file_is_refused(capsys, tmp_path, clean_registry):
    (tmp_path / f"{NAME_34B}.py").write_text("# someone else's recipe\n")
    code, _, err = cli(capsys, tmp_path, *ARGS_34B)
    assert code == 2 and "already exists" in err
    assert (tmp_path / f"{NAME_34B}.py").read_text() == "# someone else's recipe\n"


def test_a_missing_recipes_dir_is_refused(capsys, tmp_path, clean_registry):
    code, _, err = cli(capsys, tmp_path / "nope", *ARGS_34B)
    assert code == 2 and "is not a directory" in err and not (tmp_path / "nope").exists()


def _sabotage(monkeypatch, line: str):
    """Make the rendered builder run `line` first: a recipe that fails after the file was written."""
    real = scaffold.render
    monkeypatch.setattr(scaffold, "render", lambda *a, **k: real(*a, **k).replace("    return h100_pretrain(", line))


def test_audit_failure_exits_1_and_removes_the_file_and_the_registration(capsys, tmp_path, clean_registry, monkeypatch):
    before = set(clean_registry)
    sp_off = "    cfg = h100_pretrain(base, 'bf16', LAYOUT)\n    cfg.model.sequence_parallel = False\n"
    _sabotage(monkeypatch, sp_off + "    return cfg\n    return h100_pretrain(")
    code, out, err = cli(capsys, tmp_path, *ARGS_34B)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "fails its audit: [tp_overlap_dropped]" in err
    assert list(tmp_path.iterdir()) == [] and set(clean_registry) == before and f"recipes.{NAME_34B}" not in sys.modules


def test_a_recipe_that_raises_is_one_line_and_leaves_nothing(capsys, tmp_path, clean_registry, monkeypatch):
    _sabotage(monkeypatch, "    raise RuntimeError('boom\\n  second line')\n    return h100_pretrain(")
    code, _, err = cli(capsys, tmp_path, *ARGS_34B)
    assert code == 2 and "does not build: RuntimeError: boom second line" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [] and NAME_34B not in clean_registry


def test_model_label_and_name_pattern():
    assert scaffold.model_label("llama3_34b") == "Llama3 34B" and scaffold.model_label("gpt3_1.3b") == "Gpt3 1.3B"
    assert registry.NAME_RE.match(NAME_34B)["model"] == "llama3_34b"
    assert registry.NAME_RE.match("llama3_34b_pretrain_32gpu_h100_fp16") is None


# --- MoE forks: EP is searched (EXPERTS=, TOPK=, pinned EP=) -------------------------------------------------------

Q30 = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"
ARGS_MOE = ["--from", Q30, "--name", "qwen3_60b_a6b_pretrain_32gpu_h100_bf16", "--layers", "64", "--experts", "256"]


def test_moe_fork_searches_ep_and_keeps_the_ep_overlap_on(capsys, tmp_path, clean_registry):
    code, out, err = cli(capsys, tmp_path, *ARGS_MOE)
    assert code == 0, err
    text = (tmp_path / "qwen3_60b_a6b_pretrain_32gpu_h100_bf16.py").read_text()
    assert (
        "moe_pretrain(base" in text
        and "num_moe_experts=256" in text
        and "from recipes.qwen3_30b_a3b import KNOBS" in text
    )
    p = make_plan("qwen3_60b_a6b_pretrain_32gpu_h100_bf16")
    assert p.report.ok and p.memory.fits and p.layout["ep"] > 1 and 256 % p.layout["ep"] == 0
    assert p.report.row("ep_a2a_overlap").state == "on" and p.layout["experts"] == 256
    assert p.layout["model"] == "Qwen3 60B A6B"


def ranked_as(out: str, plan) -> str:
    """The search's line for the plan's layout in new-recipe's top candidates: its prediction as printed."""
    lay = plan.layout
    ep = f" EP{lay['ep']}" if lay.get("ep", 1) > 1 else ""
    key = f"TP{lay['tp']} PP{lay['pp']} CP{lay['cp']} VP{lay['vpp'] or '-'}{ep} DP{lay['dp']} MBS{lay['mbs']}"
    line = next(x for x in out.splitlines() if re.match(rf"\s+\d+\. {key} GBS{lay['gbs']}: ", x))
    return line.split(": ", 1)[1].split(";")[0]


def planned_as(plan) -> str:
    p = plan.throughput
    return f"{p.tflops_per_gpu:.0f} TFLOP/s/GPU, {p.tokens_per_gpu_s:,.0f} tokens/s/GPU, {p.step_s:.2f} s/step"


def test_the_docs_moe_fork_search_docstring_and_plan_say_one_number(capsys, tmp_path, clean_registry):
    """docs/forking.md's MoE example (issue 40): the search ranked its layout at 189 TFLOP/s, 20.86 s/step, and the
    plan of the file it wrote said 218, 18.08 s (the plan halved the router term for the base's TE CUDA graphs, the
    search did not; the docstring kept the search's). Now each layout is the fork's own config, predicted by the
    plan's function: the search's numbers, the file's docstring and make plan's are one."""
    name = ARGS_MOE[3]
    code, out, err = cli(capsys, tmp_path, *ARGS_MOE)
    assert code == 0, err
    p = make_plan(name)
    router = next(how for term, _, how in p.throughput.terms if term == "MoE router + permute")
    assert "TE CUDA graphs of the router and preprocess" in router  # the term the search left out
    assert ranked_as(out, p) == planned_as(p)
    doc = " ".join((tmp_path / f"{name}.py").read_text().split())
    assert f"predicted {p.throughput.tflops_per_gpu:.0f} TFLOP/s/GPU." in doc
    assert f"{p.throughput.tflops_per_gpu:.0f} TFLOP/s/GPU" in out.split("why: ", 1)[1].splitlines()[0]


def test_moe_fork_with_pinned_ep_and_topk(capsys, tmp_path, clean_registry):
    name = "qwen3_30b_a3b_pretrain_32gpu_h100_bf16"
    code, _, err = cli(capsys, tmp_path, "--from", Q30, "--name", name, "--ep", "8", "--topk", "4")
    assert code == 0, err
    p = make_plan(name)
    assert (p.layout["ep"], p.layout["topk"]) == (8, 4) and p.report.ok


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--from", R8, "--name", "llama3_8b_pretrain_16gpu_h100_bf16", "--experts", "8"], "needs an MoE FROM recipe"),
        (["--from", R8, "--name", "llama3_8b_pretrain_16gpu_h100_bf16", "--ep", "2"], "dense model"),
        ([*ARGS_MOE[:4], "--ep", "3"], "not divisible by EP3"),
        (["--from", Q30, "--name", "qwen3_30b_a3b_pretrain_24gpu_h100_bf16", "--topk", "200"], "exceeds the 128"),
    ],
)
def test_moe_fork_bad_requests_are_one_line_errors(capsys, tmp_path, clean_registry, argv, needle):
    code, out, err = cli(capsys, tmp_path, *argv)
    assert code == 2 and needle in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
