"""What the throughput model prices beyond the layout, and what it names instead: TE CUDA graphs of the MoE router and
preprocess (priced on the flex dispatcher only), GPT-OSS's output layer on its last pipeline stage, and the
"not modelled" lines every shipped recipe's plan prints. Expected seconds are computed here from the constants and
Bridge's FLOPs, not read from the terms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from overlapkit.bridge import registry
from overlapkit.bridge.build import make_plan, prediction_inputs
from overlapkit.sizing import calibration, hardware, knobs, moe_time

QWEN_BF16 = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"  # Bridge's 16-GPU recipe: TE graphs of moe_router + preprocess
GPT_OSS = "gpt_oss_120b_pretrain_64gpu_h100_bf16"  # PP4, no virtual pipeline, 201k vocabulary


def _model(impl="transformer_engine", modules=("moe_router", "moe_preprocess"), dispatcher="flex", scope=None):
    return SimpleNamespace(
        cuda_graph_impl=impl,
        cuda_graph_modules=list(modules),
        cuda_graph_scope=scope,
        moe_token_dispatcher_type=dispatcher,
    )


def test_which_graphs_the_model_prices():
    assert moe_time.graphed_router(_model())
    assert moe_time.graphed_router(_model(modules=()))  # an empty list captures the whole layer
    assert moe_time.graphed_router(_model(modules=(), scope=["moe_router", "moe_preprocess"]))  # the deprecated name
    assert not moe_time.graphed_router(_model(dispatcher="alltoall"))  # Bridge measured no gain there
    assert not moe_time.graphed_router(_model(impl="none"))
    assert not moe_time.graphed_router(_model(modules=("attn",)))
    assert not moe_time.graphed_router(_model(modules=("moe_router",), impl="local"))


def _host_s(plan) -> float:
    """The MoE layers' per-token host time of `plan`, ungraphed: moe_token_s × tokens per rank × MoE passes."""
    w = prediction_inputs(plan).w
    moe = prediction_inputs(plan).moe
    return calibration.FITTED.moe_token_s * w.seq * w.mbs / (w.cp * w.tp) * moe.layers / w.pp * w.microbatches


def test_graphing_the_router_takes_graphed_share_of_the_moe_host_time():
    graphed = make_plan(QWEN_BF16, caller_env={})
    eager = make_plan(QWEN_BF16, sets="model.cuda_graph_impl=none", caller_env={})
    assert prediction_inputs(graphed).moe.graphed and not prediction_inputs(eager).moe.graphed

    def router(p):
        return sum(s for n, s, _ in p.throughput.terms if n == "MoE router + permute")

    assert router(eager) - router(graphed) == pytest.approx(moe_time.GRAPHED_SHARE * _host_s(eager), rel=1e-6)
    assert graphed.throughput.step_s < eager.throughput.step_s
    assert not any("cuda_graph" in k.setting for k in graphed.not_modelled)  # priced, so not named
    attn = make_plan(QWEN_BF16, sets="model.cuda_graph_modules=[moe_router,moe_preprocess,attn]", caller_env={})
    named = [k for k in attn.not_modelled if "cuda_graph" in k.setting]
    assert len(named) == 1 and "['attn']" in named[0].setting and named[0].direction == "faster"


def test_the_output_layer_weighs_on_gpt_oss_last_stage_only():
    plan = make_plan(GPT_OSS, caller_env={})
    inp = prediction_inputs(plan)
    w, f = inp.w, inp.flops
    rate = hardware.hardware("h100").peak_tflops["bf16"] * 1e12 * calibration.FITTED.gemm_bf16
    expected = f.logits / rate * w.gbs / (w.tp * w.pp * w.cp * w.dp) * (w.pp - 1)
    got = [s for n, s, _ in plan.throughput.terms if n == "output layer on the last stage"]
    assert got == [pytest.approx(expected, rel=1e-6)] and expected / plan.throughput.step_s > 0.05
    loss_slot = make_plan(GPT_OSS, sets="model.account_for_loss_in_pipeline_split=true", caller_env={})
    assert "output layer on the last stage" not in {n for n, _, _ in loss_slot.throughput.terms}
    interleaved = make_plan("llama3_70b_pretrain_64gpu_h100_bf16", caller_env={})  # VPP: see throughput.compute_terms
    assert "output layer on the last stage" not in {n for n, _, _ in interleaved.throughput.terms}


@pytest.mark.parametrize("name", registry.names())
def test_every_shipped_recipe_names_what_the_model_does_not_price(name):
    plan = make_plan(name, caller_env={})
    knobs = plan.to_dict()["throughput"]["not_modelled"]
    assert knobs and all(k["direction"] and k["why"] for k in knobs)
    settings = " ".join(k["setting"] for k in knobs)
    assert "manual_gc" in settings
    if registry.get(name).model.startswith(("Qwen3", "DeepSeek", "GPT-OSS")):
        assert "moe_router_force_load_balancing=False" in settings  # the learned router: slower than priced


def test_recompute_beyond_core_attention_is_named_slower():
    plan = make_plan(GPT_OSS, caller_env={})  # selective recompute of layernorm and moe_act
    named = [k for k in knobs.not_modelled(plan.resolved.model, plan.cfg.train) if "recompute_modules" in k.setting]
    assert len(named) == 1 and named[0].direction == "slower"
    assert "layernorm" in named[0].setting and "moe_act" in named[0].setting
    assert not any(m in named[0].setting for m in knobs.PRICED_RECOMPUTE)  # priced: not named
