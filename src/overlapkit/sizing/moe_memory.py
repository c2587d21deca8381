"""The mixture-of-experts and multi-latent-attention terms of the memory estimate (sizing/memory.py).

Weights: a layer's non-expert parameters (attention, router, shared experts, norms) are split by TP, its routed
experts by EP·ETP (each EP rank holds experts/EP whole experts; ETP splits each one). Optimizer: Megatron's
distributed optimizer shards the non-expert states over DP·CP and the expert states over the expert-data-parallel
group (ETP·EP·PP·expert-DP = world), so a layout with expert-DP 1 keeps every expert's Adam states unsharded.

Activations per layer, in (tokens·h) units like memory.layer_activation_bytes: each token is dispatched to top-k
experts, so the expert MLP stores k copies of its input (permuted, then the FC1 input), k FC1 outputs of width moe_ffn
(both halves when gated) and k FC2 inputs; the router keeps its fp32 logits and probabilities (2·4·E/h); shared
experts store a dense MLP's terms. With sequence parallelism and ETP=1 a TP rank dispatches only its s/TP tokens, so
the whole layer divides by TP as a dense one does. MLA stores the compressed query/KV latents and its up-projected
Q (qk_head + qk_rope per head), K and V (v_head per head) instead of GQA's Q, K, V. Selective recompute, as
Megatron Core applies it (transformer_layer.py, multi_latent_attention.py, moe/experts.py): "mla_up_proj" recomputes
Q, K, V from the latents; "mlp" recomputes dense (non-MoE) MLPs; "moe_act" the experts' activation (their FC2 input);
"layernorm" the norms' outputs (the linear inputs).
"""

from __future__ import annotations


def attention_terms(w, lin: int) -> dict[str, float]:
    """MLA's stored tensors per layer in (tokens·h) units, replacing GQA's Q/K/V terms."""
    h, a = w.hidden, w.heads
    qk, v = a * (w.qk_head + w.qk_rope) / h, a * w.v_head / h
    up = 0 if "mla_up_proj" in w.recompute_modules else 1  # Q, K, V recomputed from the latents
    return {
        "norm inputs (2 norms)": 4,
        "QKV input": lin,
        "MLA latents (q, kv) + their norms": 2 * 2 * (w.q_lora + w.kv_lora + w.qk_rope) / h,
        "Q + attention output": up * 2 * qk + 2 * v + (v if w.dtype == "fp8" else 0),
        "K + V (MLA)": up * (2 * qk + 2 * v),
        "flash-attn log-sum-exp (fp32)": 4 * a / h,
    }


def mlp_terms(w, lin: int) -> dict[str, float]:
    """The MLP's stored tensors per layer, averaged over dense and MoE layers, in (tokens·h) units."""
    h, k = w.hidden, w.topk
    share = w.moe_layers / w.layers
    f, ef, sf = w.ffn / h, w.moe_ffn / h, w.shared_ffn / h
    act = 4 if w.gated else 2
    mods = w.recompute_modules
    d = 0 if "mlp" in mods else 1 - share  # dense MLPs recomputed
    e = 0 if "moe_act" in mods else 1  # expert activations recomputed
    return {
        "FC1 input": 0 if "layernorm" in mods else lin,  # the pre-MLP norm's output: router, shared experts, dense FC1
        "router logits + probs (fp32)": share * 8 * w.experts / h,
        "dispatched tokens (top-k copies, experts' FC1 input)": share * lin * k,
        "FC1 output": d * act * f + share * act * (k * ef + sf),
        "FC2 input": lin * (d * f + share * (e * k * ef + sf)),
    }
