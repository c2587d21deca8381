"""Truth table for the overlap core, on real ConfigContainers from Bridge's own recipe functions (CPU only).

Bridge's gating runs for real (CommOverlapConfig.finalize/setup, MixedPrecisionConfig.setup); the only thing we
set by hand is the *target's* Transformer Engine availability, through overlap.te_flag (this machine has no TE).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from megatron.bridge.perf_recipes.llama.h100.llama3 import llama3_8b_pretrain_8gpu_h100_fp8cs_config
from megatron.bridge.recipes.llama import llama3_70b_pretrain_config
from megatron.bridge.training import comm_overlap as co
from megatron.bridge.training.mixed_precision import bf16_with_fp8_current_scaling_mixed

from overlapkit.bridge import presets
from overlapkit.bridge.audit import audit
from overlapkit.bridge.overlap import apply_overlap_stack, resolve, te_flag
from overlapkit.spec.overlap import OverlapIntent
from overlapkit.spec.topology import LayoutError, Target

BF16_70B = "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192"
FP8_70B = "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192"


def make70(**intent):
    """Bridge's Llama3 70B pretrain recipe (TP4 PP4 VP5 CP2 = 32 GPUs per replica) with our full stack."""
    return apply_overlap_stack(llama3_70b_pretrain_config(), OverlapIntent(**intent))


def run(cfg, nodes=8, te=True, intent=None):
    target = Target(nodes=nodes, te_available=te)
    res = resolve(cfg, target)
    return res, audit(cfg, target, res, intent)


# --- the correct layout ------------------------------------------------------------------------------------------


def test_full_70b_layout_has_every_overlap_on_and_no_errors():
    res, rep = run(make70())
    assert rep.ok and rep.errors == [] and rep.warnings == []
    on = {r.name for r in rep.rows if r.state == "on"}
    assert {"tp_comm_overlap", "overlap_p2p_comm", "overlap_grad_reduce", "overlap_param_gather"} <= on
    assert res.data_parallel_size == 2
    assert (res.model.tp_comm_overlap, res.model.overlap_p2p_comm, res.model.batch_p2p_comm) == (True, True, False)
    assert (res.ddp.overlap_grad_reduce, res.ddp.overlap_param_gather, res.ddp.align_param_gather) == (True,) * 3
    assert BF16_70B in rep.row("tp_comm_overlap").detail


def test_preset_fields_reach_the_model_config():
    res, _ = run(make70())
    expected = {k: v for k, v in dataclasses.asdict(getattr(co, BF16_70B)).items() if v is not None}
    assert res.model.tp_comm_overlap_cfg == expected
    assert res.model.tp_comm_overlap_cfg["proj_fprop"]["method"] == "pipeline"
    assert res.model.tp_comm_bootstrap_backend == "nccl"


def test_resolve_leaves_the_recipe_untouched():
    cfg = make70()
    run(cfg)
    assert cfg.model.tp_comm_overlap is False and cfg.comm_overlap.data_parallel_size is None


def test_te_flag_restores_bridges_probe():
    before = co.HAVE_TE
    with te_flag(True):
        assert co.HAVE_TE is True
    assert co.HAVE_TE is before is False


# --- Bridge's TP gating: TP<2, SP off, TE missing -----------------------------------------------------------------


def test_tp1_with_tp_overlap_requested_is_dropped_loudly():
    cfg = make70()
    cfg.model.tensor_model_parallel_size = 1
    cfg.train.global_batch_size = 512
    res, rep = run(cfg)
    assert res.model.tp_comm_overlap is False
    assert rep.row("tp_comm_overlap").state == "n/a"
    assert "tp_overlap_dropped" in rep.codes("error")


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_both_directions(sp):
    cfg = make70()
    cfg.model.sequence_parallel = sp
    res, rep = run(cfg)
    assert res.model.tp_comm_overlap is sp
    assert rep.row("tp_comm_overlap").state == ("on" if sp else "off")
    assert ("tp_overlap_dropped" in rep.codes("error")) is (not sp)
    if not sp:
        assert "model.sequence_parallel=true" in rep.errors[0].message


@pytest.mark.parametrize("te", [False, True])
def test_te_on_the_target_both_directions(te):
    res, rep = run(make70(), te=te)
    assert res.model.tp_comm_overlap is te
    assert rep.ok is te
    if not te:
        assert "Transformer Engine is missing on the target" in rep.errors[0].message


def test_tp_overlap_switched_off_with_tp4_is_an_error_and_back_on_is_clean():
    cfg = make70()
    cfg.comm_overlap.tp_comm_overlap = False
    _, rep = run(cfg)
    assert rep.codes("error") == {"tp_overlap_off"} and rep.row("tp_comm_overlap").state == "off"
    cfg.comm_overlap.tp_comm_overlap = True
    assert run(cfg)[1].ok


# --- Pipeline p2p: PP=1, PP>1 with/without VPP ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pp", "vpp", "nodes", "p2p", "batch", "state"),
    [(1, None, 2, False, False, "n/a"), (4, 5, 8, True, False, "on"), (4, None, 8, False, True, "off")],
)
def test_pipeline_gating(pp, vpp, nodes, p2p, batch, state):
    cfg = make70()
    cfg.model.pipeline_model_parallel_size, cfg.model.virtual_pipeline_model_parallel_size = pp, vpp
    res, rep = run(cfg, nodes=nodes)
    assert (res.model.overlap_p2p_comm, res.model.batch_p2p_comm) == (p2p, batch)
    assert rep.row("overlap_p2p_comm").state == state
    assert ("p2p_overlap_off" in rep.codes("error")) is (state == "off")


def test_user_can_force_p2p_overlap_off_and_the_audit_says_so():
    cfg = make70()
    cfg.comm_overlap.overlap_p2p_comm = False
    res, rep = run(cfg)
    assert res.model.overlap_p2p_comm is False
    assert "comm_overlap.overlap_p2p_comm=true" in rep.errors[0].message


# --- DP overlap: DP=1 vs DP>1, defaults, user values win ------------------------------------------------------------


def test_dp1_makes_dp_overlap_na_with_a_warning():
    res, rep = run(make70(), nodes=4)  # 32 GPUs = one TP4·PP4·CP2 replica
    assert res.data_parallel_size == 1
    assert (res.ddp.overlap_grad_reduce, res.ddp.overlap_param_gather, res.ddp.bucket_size) == (False, False, None)
    assert rep.row("overlap_grad_reduce").state == "n/a" and rep.codes("warning") == {"dp1"} and rep.ok


def test_dp_gt1_gets_bridges_default_bucket_of_128m_parameters():
    res, rep = run(make70(), nodes=16)
    assert res.data_parallel_size == 4 and res.ddp.bucket_size == 128 * 1024 * 1024
    assert rep.row("bucket_size").detail == "134,217,728 params = 256 MB at bf16"


def test_user_bucket_size_wins_over_the_default():
    cfg = make70()
    cfg.comm_overlap.bucket_size = 40_000_000
    res, rep = run(cfg)
    assert res.ddp.bucket_size == 40_000_000 and rep.ok


@pytest.mark.parametrize("field", ["overlap_grad_reduce", "overlap_param_gather"])
def test_user_switching_dp_overlap_off_wins_and_fails_the_audit(field):
    cfg = make70()
    setattr(cfg.comm_overlap, field, False)
    res, rep = run(cfg)
    assert getattr(res.ddp, field) is False
    assert rep.row(field).state == "off" and f"{field}_off" in rep.codes("error")
    assert f"comm_overlap.{field}=true" in " ".join(f.message for f in rep.errors)


def test_user_switching_grad_reduce_on_wins_even_where_bridge_defaults_off():
    cfg = make70()
    cfg.comm_overlap.overlap_grad_reduce = True
    res, _ = run(cfg, nodes=4)  # DP=1: Bridge's default is off, the user's True wins
    assert res.ddp.overlap_grad_reduce is True and res.ddp.overlap_param_gather is False


def test_dp_overlap_needs_the_distributed_optimizer():
    cfg = make70()
    cfg.ddp.use_distributed_optimizer = False
    res, rep = run(cfg)
    assert res.ddp.bucket_size is None  # Bridge skipped its DP overlap setup: no default bucket was applied
    assert rep.codes("error") == {"no_distributed_optimizer"}
    assert rep.row("overlap_param_gather").state == "off"
    assert "ddp.use_distributed_optimizer=true" in rep.errors[0].message


# --- presets ------------------------------------------------------------------------------------------------------


def test_bf16_and_fp8_recipes_get_their_own_presets():
    assert presets.name_of(make70().comm_overlap.tp_comm_overlap_cfg) == BF16_70B
    cfg = llama3_70b_pretrain_config()
    cfg.mixed_precision = bf16_with_fp8_current_scaling_mixed()
    apply_overlap_stack(cfg)
    assert presets.name_of(cfg.comm_overlap.tp_comm_overlap_cfg) == FP8_70B
    assert cfg.mixed_precision.fp8_param_gather is True
    assert run(cfg)[1].row("fp8_param_gather").state == "on"


def test_presets_are_read_from_bridge_not_retyped():
    # Every userbuffers config Bridge defines is found (our name parser drops none), each parsed to the key its
    # name spells, and each name resolves to Bridge's own object.
    bridge = {
        n
        for n in dir(co)
        if n.startswith("userbuffers_") and isinstance(getattr(co, n), co.TransformerLayerTPOverlapCfg)
    }
    found = presets.exported_presets()
    assert set(found) == bridge and len(bridge) >= 15
    assert found["userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192"].key == presets.PresetKey(
        "h100", "bf16", 16384, 8, 2, 1, 8192)  # fmt: skip
    assert found[FP8_70B].key == presets.PresetKey("h100", "fp8", 8192, 4, None, 1, 8192)
    assert all(presets.preset_object(n) is getattr(co, n) for n in bridge)


def test_preset_contradicting_the_layout_is_an_error():
    cfg = make70()
    cfg.model.tensor_model_parallel_size = 8  # TP8 with an h8192_tp4 preset
    cfg.model.num_attention_heads = 64
    _, rep = run(cfg, nodes=16)
    assert rep.codes("error") == {"preset_mismatch"}
    assert "tp 4≠8" in rep.errors[0].message


def test_preset_tuned_for_another_micro_batch_is_a_warning():
    cfg = make70()
    cfg.train.micro_batch_size = 2
    _, rep = run(cfg)
    assert rep.ok and rep.codes("warning") == {"preset_tuning_mismatch"}


def test_no_preset_for_the_shape_is_a_one_line_error_naming_the_opt_in():
    cfg = llama3_70b_pretrain_config()
    cfg.model.hidden_size = 7168
    with pytest.raises(presets.PresetError) as exc:
        apply_overlap_stack(cfg)
    msg = str(exc.value)
    assert "\n" not in msg and "nearest: userbuffers_" in msg and "tp_preset='default'" in msg


@pytest.mark.parametrize("opt_in", [False, True])
def test_default_tp_config_needs_an_explicit_opt_in(opt_in):
    cfg = make70(tp_preset=presets.DEFAULT_TP_CONFIG) if opt_in else make70()
    cfg.comm_overlap.tp_comm_overlap_cfg = None
    intent = OverlapIntent(tp_preset=presets.DEFAULT_TP_CONFIG if opt_in else None)
    res, rep = run(cfg, intent=intent)
    assert res.model.tp_comm_overlap is True and res.model.tp_comm_overlap_cfg is None
    assert rep.ok is opt_in and "tp_default_config" in rep.codes()


# --- layout divisibility ---------------------------------------------------------------------------------------------


def test_sequence_length_not_divisible_by_tp():
    cfg = make70()
    cfg.model.seq_length = 8190
    assert "seq_not_divisible_tp" in run(cfg)[1].codes("error")


def test_vpp_with_pp1_is_an_error():
    cfg = make70()
    cfg.model.pipeline_model_parallel_size = 1
    assert "vpp_without_pp" in run(cfg, nodes=2)[1].codes("error")


@pytest.mark.parametrize("layout", [None, "given"])
def test_layers_must_divide_by_pp_times_vpp_unless_a_layout_is_given(layout):
    cfg = make70()
    cfg.model.virtual_pipeline_model_parallel_size = 3  # 80 layers / (4·3)
    cfg.model.pipeline_model_parallel_layout = layout and [["embedding"] + ["decoder"] * 7] + [["decoder"] * 7] * 11
    assert ("layers_not_divisible" in run(cfg)[1].codes("error")) is (layout is None)


def test_global_batch_not_divisible_by_dp_times_mbs():
    cfg = make70()
    cfg.train.global_batch_size = 511
    err = run(cfg)[1].errors
    assert [e.code for e in err] == ["gbs_not_divisible"] and "multiple of 2" in err[0].message


def test_nodes_that_do_not_divide_the_model_parallel_size():
    with pytest.raises(LayoutError, match="multiple of 32"):
        resolve(make70(), Target(nodes=3))


# --- bucket size ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket", "code"), [(2**30, "bucket_size_bytes"), (900_000_000, "bucket_size_single"), (50_000_000, None)]
)
def test_bucket_size_rules(bucket, code):
    cfg = make70()
    cfg.comm_overlap.bucket_size = bucket
    _, rep = run(cfg)
    assert rep.codes("error") == ({code} if code else set())


# --- mixed precision knobs -------------------------------------------------------------------------------------------


def test_fp8_param_gather_without_distributed_optimizer():
    cfg = llama3_8b_pretrain_8gpu_h100_fp8cs_config()
    apply_overlap_stack(cfg)
    cfg.ddp.use_distributed_optimizer = False
    assert "fp8_param_gather_without_dp_overlap" in run(cfg, nodes=1)[1].codes("error")


@pytest.mark.parametrize("ddp_value", [True, False])
def test_grad_reduce_in_fp32_on_ddp_must_agree_with_mixed_precision(ddp_value):
    cfg = make70()
    cfg.ddp.grad_reduce_in_fp32 = ddp_value
    res, rep = run(cfg)
    assert res.ddp.grad_reduce_in_fp32 is False  # mixed_precision.setup wins
    assert ("grad_reduce_fp32_conflict" in rep.codes("error")) is ddp_value


def test_grad_reduce_in_fp32_through_mixed_precision_turns_it_on():
    cfg = make70()
    cfg.mixed_precision.grad_reduce_in_fp32 = cfg.ddp.grad_reduce_in_fp32 = True
    res, rep = run(cfg)
    assert res.ddp.grad_reduce_in_fp32 is True and rep.ok
    assert rep.row("grad_reduce_in_fp32").state == "on" and "512 MB at fp32" in rep.row("bucket_size").detail


@pytest.mark.parametrize("save", [None, "/ckpt"])
def test_param_gather_with_optimizer_step_warns_with_checkpointing(save):
    cfg = make70(param_gather_with_optimizer_step=True)
    cfg.checkpoint.save = save
    res, rep = run(cfg)
    assert res.optimizer.overlap_param_gather_with_optimizer_step is True
    assert rep.row("overlap_param_gather_with_optimizer_step").state == "on"
    assert ("opt_step_with_checkpointing" in rep.codes("warning")) is bool(save)


def test_report_json_has_stable_keys():
    _, rep = run(make70())
    data = json.loads(json.dumps(rep.to_dict()))
    assert set(data) == {"ok", "rows", "errors", "warnings"}
    assert list(data["rows"])[:4] == [
        "tp_comm_overlap",
        "overlap_p2p_comm",
        "overlap_grad_reduce",
        "overlap_param_gather",
    ]
    assert all(set(v) == {"state", "detail"} for v in data["rows"].values())


# --- mixture of experts: Bridge's MoE overlap asserts as findings, both ways, on real Bridge recipes -------------

Q235 = "qwen3_235b_a22b_pretrain_256gpu_h100_bf16"  # TP2 PP8 VP4 EP32, EP a2a overlap + delayed wgrad


def moe_cfg(name=Q235):
    from overlapkit.bridge import registry

    return registry.get(name).build()  # Bridge's qwen3_moe recipe function, our layout and stack


def _flip(cfg, section, field, value):
    setattr(getattr(cfg, section), field, value)


# Each Bridge assert in CommOverlapConfig._get_model_comm_overlap_cfgs, tripped on purpose: (edits, finding code).
MOE_ASSERTS = [
    ([("model", "expert_model_parallel_size", 1)], "ep_overlap_needs_ep"),
    ([("model", "num_moe_experts", 1)], "ep_overlap_needs_experts"),
    ([("model", "moe_token_dispatcher_type", "allgather")], "ep_overlap_dispatcher"),
    ([("mixed_precision", "bf16", False)], "ep_overlap_dtype"),
    ([("model", "virtual_pipeline_model_parallel_size", None)], "ep_overlap_needs_vpp"),
    ([("model", "recompute_granularity", "full")], "ep_overlap_full_recompute"),
    ([("model", "recompute_method", "uniform")], "ep_overlap_recompute_method"),
    ([("model", "recompute_num_layers", 1)], "ep_overlap_recompute_layers"),
    ([("model", "recompute_granularity", "selective"), ("model", "recompute_modules", ["moe"])],
     "ep_overlap_recompute_moe"),
    ([("model", "moe_shared_expert_overlap", True)], "ep_overlap_shared_expert"),
    ([("model", "mtp_num_layers", 2)], "ep_overlap_mtp"),
    ([("comm_overlap", "overlap_moe_expert_parallel_comm", False)], "delay_wgrad_needs_ep_overlap"),
]  # fmt: skip


def test_moe_clean_case_has_the_ep_rows_and_bridge_asserts_nothing():
    from overlapkit.bridge import registry

    cfg = moe_cfg()
    res, rep = run(cfg, nodes=32, intent=registry.get(Q235).intent)  # the recipe keeps TP overlap off, declared
    assert res.bridge_asserts == [] and rep.ok, [f.message for f in rep.errors]
    states = {r.name: r.state for r in rep.rows}
    assert states["ep_a2a_overlap"] == states["delay_wgrad_compute"] == "on"
    assert (states["moe_shared_expert_overlap"], states["expert_dp_overlap"]) == ("n/a", "n/a")  # none; EDP=1
    assert rep.row("moe_dispatcher").detail == "alltoall"
    assert (res.model.overlap_moe_expert_parallel_comm, res.model.delay_wgrad_compute) == (True, True)


@pytest.mark.parametrize(("edits", "code"), MOE_ASSERTS, ids=[c for _, c in MOE_ASSERTS])
def test_each_moe_overlap_prerequisite_trips_bridges_assert_and_our_finding(edits, code):
    cfg = moe_cfg()
    for section, field, value in edits:
        _flip(cfg, section, field, value)
    res, rep = run(cfg, nodes=32)
    assert res.bridge_asserts, "Bridge's own setup did not assert: the finding would be a false alarm"
    finding = next(f for f in rep.errors if f.code == code)
    assert "\n" not in finding.message and "set " in finding.message  # one line naming the fix
    # Resolving went on without the EP overlap, so the rest of the stack is still reported.
    assert rep.row("overlap_grad_reduce").state == "on"


def test_delay_wgrad_needs_te_2_7_on_the_target_both_ways():
    old, new = Target(nodes=32, te_version="2.6.0"), Target(nodes=32, te_version="2.7.0")
    for target, tripped in ((old, True), (new, False)):
        cfg = moe_cfg()
        res = resolve(cfg, target)
        rep = audit(cfg, target, res)
        assert bool(res.bridge_asserts) is tripped and ("delay_wgrad_te_version" in rep.codes()) is tripped


def test_moe_divisibility_experts_by_ep_and_the_expert_grid():
    cfg = moe_cfg()
    cfg.model.expert_model_parallel_size = 48  # 128 experts; 2·48·8 = 768 does not divide 256 GPUs
    _, rep = run(cfg, nodes=32)
    assert {"experts_not_divisible_ep", "expert_world_not_divisible"} <= rep.codes("error")
    cfg.model.expert_model_parallel_size = 16
    _, rep = run(cfg, nodes=32)
    assert not {"experts_not_divisible_ep", "expert_world_not_divisible"} & rep.codes()
    assert rep.row("expert_dp_overlap").state == "on" and "expert-DP=2" in rep.row("expert_dp_overlap").detail


def test_dispatcher_backend_missing_is_an_error_on_a_gpu_node_and_a_note_on_a_cpu_one():
    from overlapkit.bridge import moe

    model = moe_cfg("deepseek_v3_pretrain_1024gpu_h100_bf16").model  # flex / hybridep
    assert model.moe_token_dispatcher_type == "flex" and model.moe_flex_dispatcher_backend == "hybridep"
    asked = []

    def missing(module):
        asked.append(module)
        return False

    level, msg = moe.backend_problem(model, gpu_node=True, have=missing)
    assert level == "error" and "model.moe_token_dispatcher_type=alltoall" in msg and asked == ["deep_ep"]
    assert moe.backend_problem(model, gpu_node=False, have=missing)[0] == "note"
    # deep_ep present: nothing is missing on either kind of node.
    assert moe.backend_problem(model, gpu_node=True, have=lambda module: True) is None
    assert moe.backend_problem(model, gpu_node=False, have=lambda module: True) is None
    assert moe.backend_problem(moe_cfg().model, gpu_node=True, have=missing) is None  # alltoall needs no backend
    # The default answer is this machine's own.
    assert moe.importable("json") and not moe.importable("no_such_module_here")


def test_dense_models_get_no_moe_rows():
    _, rep = run(make70())
    assert not {"ep_a2a_overlap", "moe_dispatcher", "expert_dp_overlap"} & {r.name for r in rep.rows}


def test_declared_off_overlaps_are_off_with_the_reason_and_undeclared_ones_are_errors():
    from overlapkit.bridge.build import make_plan

    p = make_plan("deepseek_v3_pretrain_1024gpu_h100_bf16")
    for name in ("tp_comm_overlap", "ep_a2a_overlap", "overlap_grad_reduce"):
        row = p.report.row(name)
        assert row.state == "off" and row.detail.startswith("kept off: NVIDIA's"), row
    assert p.report.ok
    # The same layout without the declaration: EP overlap off is an error with its fix.
    q = make_plan(
        Q235, sets="comm_overlap.overlap_moe_expert_parallel_comm=false comm_overlap.delay_wgrad_compute=false"
    )
    assert [f.fix for f in q.report.errors] == ["comm_overlap.overlap_moe_expert_parallel_comm=true"]


@pytest.mark.parametrize(
    "sets",
    [
        "model.recompute_granularity=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=2",
        "model.moe_shared_expert_overlap=true",
        "model.mtp_num_layers=2",
        "model.moe_token_dispatcher_type=allgather",
        "model.virtual_pipeline_model_parallel_size=null",
        "model.recompute_granularity=selective model.recompute_modules=[moe,layernorm]",
    ],
)
def test_set_flipping_a_moe_prerequisite_fails_with_a_fix_that_clears_it(sets):
    from overlapkit.bridge.build import make_plan

    bad = make_plan(Q235, sets=sets)
    moe_codes = [f for f in bad.report.errors if f.code.startswith("ep_overlap")]
    assert moe_codes and all(f.fix for f in moe_codes)
    fixed = make_plan(Q235, sets=f"{sets} {' '.join(f.fix for f in moe_codes)}")
    assert not {f.code for f in moe_codes} & fixed.report.codes(), fixed.report.errors
