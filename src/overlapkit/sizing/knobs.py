"""The settings a plan sets that move its step time but that the throughput model does not price: each with the way
it moves the step and why the model leaves it out (docs/throughput.md, "What the model does not price").

The model prices the layout, the precision, recompute of core attention and whole layers, the overlaps, the
dispatcher's traffic, the busiest EP rank under random routing, and TE CUDA graphs of the MoE router and preprocess
on the flex dispatcher (sizing/moe_time.py GRAPHED_SHARE). Everything below it reads from the plan's config and
names instead: `make plan` prints them under "not modelled", plan.json carries them under
`throughput.not_modelled`.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlapkit.sizing import moe_time

# Megatron Core's selective-recompute modules whose forward the model prices (throughput.compute_terms).
PRICED_RECOMPUTE = {"core_attn"}


@dataclass(frozen=True)
class Knob:
    setting: str  # "model.cuda_graph_modules=[attn]"
    direction: str  # "faster", "slower", "either way"
    why: str


def not_modelled(m, train) -> list[Knob]:
    """What the plan's model config `m` (as Bridge resolved it) and `train` set that moves the step and the model does
    not price."""
    out = []
    graphed = moe_time.graph_modules(m)
    priced = {"moe_router", "moe_preprocess"} if graphed and moe_time.graphed_router(m) else set()
    if rest := sorted(graphed - priced):  # CUDA graphs beyond the router and preprocess the model prices
        why = (
            "host launch time of the captured kernels removed; Megatron-Bridge's CUDA-graph guide measures neutral to "
            "~25% shorter steps, neutral on Qwen3 30B-A3B with the alltoall dispatcher"
        )
        if priced:
            why = "beyond the router and preprocess the model prices: " + why
        out.append(Knob(f"model.cuda_graph_impl={m.cuda_graph_impl} cuda_graph_modules={rest}", "faster", why))
    if getattr(m, "num_moe_experts", None):
        for fusion, what in (("moe_router_fusion", "router top-k"), ("moe_permute_fusion", "permute/unpermute")):
            if not getattr(m, fusion, False):
                out.append(Knob(f"model.{fusion}=False", "slower", f"unfused {what}; every published run fuses"))
        if m.moe_token_dispatcher_type == "flex":
            backend = getattr(m, "moe_flex_dispatcher_backend", None)
            sms = getattr(m, f"moe_{backend}_num_sms", None) if backend else None
            why = (
                "SMs the dispatch kernels hold are taken from overlapped GEMMs; the all-to-all is priced at the fitted "
                "link efficiency whatever the SM count"
            )
            out.append(Knob(f"model.moe_flex_dispatcher_backend={backend} ({sms} SMs)", "either way", why))
            if backend == "ncclep":  # new in Core 0.19: TE's NCCL EP path, no published run to fit it on
                why = (
                    "TE's NCCL EP dispatch/combine (transformer_engine.pytorch.ep) is priced as the DeepEP/HybridEP "
                    "traffic; no published H100 run uses it, so its speed against DeepEP is not modelled"
                )
                out.append(Knob("model.moe_flex_dispatcher_backend=ncclep", "either way", why))
        if getattr(m, "moe_shared_expert_intermediate_size", None) and getattr(m, "moe_shared_expert_overlap", False):
            why = "shared experts beside the dispatch; priced in series"
            out.append(Knob("model.moe_shared_expert_overlap=True", "faster", why))
        if not getattr(m, "moe_router_force_load_balancing", False):
            why = "a learned router's imbalance; the busiest EP rank is priced under random routing, as the published "
            why += "runs force it"
            out.append(Knob("model.moe_router_force_load_balancing=False", "slower", why))
    if m.recompute_granularity == "selective":
        if mods := sorted(set(m.recompute_modules or ["core_attn"]) - PRICED_RECOMPUTE):
            why = "their forward re-runs in the backward; not priced"
            out.append(Knob(f"model.recompute_modules={mods}", "slower", why))
    if getattr(train, "manual_gc", False):
        why = "a collection on every rank at once instead of random pauses; not priced"
        out.append(Knob(f"train.manual_gc=True (every {train.manual_gc_interval} steps)", "slower on those steps", why))
    else:
        out.append(Knob("train.manual_gc=False", "slower", "Python's collector pauses ranks at random; not priced"))
    if getattr(m, "delay_wgrad_compute", False):
        out.append(Knob("model.delay_wgrad_compute=True", "either way", "Bridge measured it neutral; not priced"))
    return out
