"""Which overlap class (tp, cp, pp, dp, ep) each GPU activity of a profile belongs to, and the rule that decided.

A kernel's name says what kind of transfer it is; the plan says which parallelism can issue that kind; where both
leave two classes (PP p2p, CP ring exchange and the EP all-to-all all run as NCCL SendRecv), the trace decides: the
NVTX range the kernel was launched in, then the stream (PyTorch's ProcessGroupNCCL gives each process group its own
NCCL stream per device, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp getNCCLStream, so a stream is one
communicator). What no rule decides is "unclassified", with its candidates: reported, never dropped or guessed.
Compute is every kernel that is not communication.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from overlapkit.profile.nsys_sqlite import MEMCPY_PTOP, Activity, Profile

CLASSES = ("tp", "cp", "pp", "dp", "ep")

# NCCL's device kernels: ncclDevKernel_<Coll>_<RedOp>_<Type>_<Algo>_<Proto> and ncclDevKernel_SendRecv since 2.19
# (NVIDIA/nccl src/device/generate.py), ncclKernel_<Coll>_<Algo>_<Proto>_<RedOp>_<Type> up to 2.18 (v2.18.6
# src/collectives/device/common.h); 2.28 adds AllGatherV (an uneven all-gather). RCCL's one kernel,
# ncclDevKernel_Generic[_1|_2|_4] (ROCm/rccl src/device/common.h), names no collective: every class is a candidate.
NCCL = re.compile(
    r"\bnccl(?:Dev)?Kernel_(AllGatherV|AllGather|ReduceScatter|AllReduce|SendRecv|Broadcast|Reduce|Generic)(?=_|\(|$)"
)
# NCCL >= 2.27's symmetric-memory kernels, e.g. ncclSymkDevKernel_AllReduce_AGxLL_R_sum_bf16
# (NVIDIA/nccl src/device/symmetric/generate.py).
NCCL_SYMK = re.compile(r"\bncclSymkDevKernel_(AllGather|ReduceScatter|AllReduce)(?=_|\(|$)")
# Transformer Engine's userbuffers kernels (TP comm overlap): userbuffers_*_rr_rs / _rr_ag / _rw and the p2p
# kuserbuffers_pushsend, _pullrecv, ... (TE v2.4 common/comm_gemm_overlap/userbuffers/userbuffers.cu).
USERBUFFERS = re.compile(r"\bk?userbuffers_\w+")
# Expert-parallel dispatch/combine libraries, by C++ namespace: DeepEP's deep_ep:: (csrc/kernels/, v1.2.1) and
# hybrid_ep:: (its hybrid-ep branch), Megatron's flex-dispatcher backends (core 0.19 moe/fused_a2a.py); DeepSeek's
# own dpsk::ep:: (deepseek-ai/profile-data); AMD's primus_turbo::deep_ep:: (AMD-AGI/Primus-Turbo); NCCL EP's
# nccl_ep:: and its extern "C" JIT kernels nccl_ep_jit_*_kernel (NVIDIA/nccl contrib/nccl_ep/, core 0.19's third
# flex backend).
DEEPEP = re.compile(r"\b(deep_ep|hybrid_ep|dpsk::ep|nccl_ep)::|\bnccl_ep_jit_\w+_kernel\b")
# Names that look like communication: one no rule above knows is reported (a warning), never silently compute.
COMM_LIKE = re.compile(
    r"nccl|rccl|nvshmem|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|send_?recv|broadcast", re.IGNORECASE
)
# A PyTorch trace names an NCCL kernel's process group (torch_trace.py) and Megatron names its groups (core 0.19
# parallel_state.py initialize_model_parallel, group_desc=): the first prefix that starts the description wins, after
# HIERARCHICAL_ and INTRA_[PARTIAL_] (sub-groups of the same kind) are dropped. Mixed groups (MODEL_PARALLEL_GROUP,
# TENSOR_AND_DATA_PARALLEL_GROUP, ...) and torch's default_pg decide nothing: the name rules then do.
GROUPS = (
    ("EXPERT_DATA_PARALLEL_GROUP", "dp"),
    ("EXPERT_MODEL_PARALLEL_GROUP", "ep"),
    ("EXPERT_TENSOR_PARALLEL_GROUP", "tp"),
    ("DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", "dp"),
    ("DATA_PARALLEL_GROUP", "dp"),
    ("CONTEXT_PARALLEL_GROUP", "cp"),
    ("TENSOR_MODEL_PARALLEL_GROUP", "tp"),
    ("PIPELINE_MODEL_PARALLEL_GROUP", "pp"),
    ("EMBEDDING_GROUP", "pp"),  # the tied embedding's gradient all-reduce, first and last stage
    ("POSITION_EMBEDDING_GROUP", "pp"),
)


@functools.lru_cache(maxsize=4096)
def group_class(desc: str) -> str | None:
    d = re.sub(r"^(HIERARCHICAL_)?(INTRA_PARTIAL_|INTRA_)?", "", desc or "")
    return next((cls for prefix, cls in GROUPS if d.startswith(prefix)), None)


# With profiling.nvtx_ranges, Megatron names a range <module>.<function> (core 0.19 utils.py nvtx_decorator), and
# every pipeline send/recv runs in one of p2p_communication's (its P2PCommunicator methods are decorated).
NVTX_PP = "pipeline_parallel.p2p_communication"
# TE's context-parallel attention, K/V ring (attention/dot_product_attention/context_parallel.py, v2.4), in a range
NVTX_CP = ("context_parallel", "AttnFuncWithCP")
NVTX_EP = ("token_dispatcher", "moe_layer", "dispatch", "combine")


@dataclass(frozen=True)
class Layout:
    """What the plan says about who can communicate: sizes, the MoE dispatcher, which overlaps are on."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    gpus: int
    dispatcher: str  # "alltoall", "allgather", "flex / deepep", "flex / hybridep (...)", "" for a dense model
    states: dict  # audit row name → "on" / "off" / "n/a"

    @classmethod
    def of_plan(cls, plan: dict) -> Layout:
        lay, rows = plan["layout"], plan.get("audit", {}).get("rows", {})
        sizes = {k: lay[k] for k in ("tp", "pp", "dp", "gpus")} | {k: lay.get(k) or 1 for k in ("cp", "ep")}
        dispatcher = rows.get("moe_dispatcher", {}).get("detail", "")
        return cls(**sizes, dispatcher=dispatcher, states={k: v["state"] for k, v in rows.items()})

    def candidates(self, op: str) -> tuple[str, ...]:
        """The classes that issue NCCL collective `op` in this layout (size > 1 only)."""
        a2a = self.ep > 1 and not self.dispatcher.startswith(("flex", "allgather"))
        gather = self.ep > 1 and self.dispatcher.startswith("allgather")
        who = {
            # sequence parallel without userbuffers (TP), the distributed optimizer (DP), the allgather dispatcher
            # (EP: core 0.19 moe/token_dispatcher.py MoEAllGatherTokenDispatcher)
            "AllGather": ("tp", "dp") + (("ep",) if gather else ()),
            "ReduceScatter": ("tp", "dp") + (("ep",) if gather else ()),
            # TP without sequence parallel, DP without the distributed optimizer
            "AllReduce": ("tp", "dp"),
            # pipeline p2p, CP's K/V ring (cp_comm_type p2p), the alltoall dispatcher (NCCL has no all-to-all
            # kernel: torch's all_to_all_single is grouped send/recv, src/collectives.cc v2.21)
            "SendRecv": ("pp", "cp") + (("ep",) if a2a else ()),
            # each batch's broadcast_data in the TP group (core tensor_parallel/data.py); without TP, torch DDP's
            # per-forward buffer broadcast (distributed.py _sync_buffers). Megatron's DDP broadcasts only at setup.
            "Broadcast": ("tp",) if self.tp > 1 else ("dp",),
            "Reduce": ("dp",),
        }
        who["AllGatherV"] = who["AllGather"]
        who["Generic"] = tuple(dict.fromkeys(c for cs in who.values() for c in cs))  # RCCL: any collective
        return tuple(c for c in who[op] if getattr(self, c) > 1)


# Where a kind names no class of this layout, the class it would be in a layout that has one: reported as a class
# the plan says cannot exist, so a profile of another layout is told apart from a classification miss.
NATURAL = {"AllGather": "dp", "ReduceScatter": "dp", "AllReduce": "dp", "SendRecv": "pp", "Broadcast": "tp"}
NATURAL |= {"Reduce": "dp", "AllGatherV": "dp", "Generic": "dp"}


def kind_of(a: Activity) -> str | None:
    """The communication kind of an activity (an NCCL collective, "userbuffers", "ce_p2p", "deepep"), or None."""
    if a.copy_kind is not None:
        return "ce_p2p" if a.copy_kind == MEMCPY_PTOP else "copy"
    return name_kind(a.name)


@functools.lru_cache(maxsize=1 << 20)  # a profile repeats each name thousands of times; bounded against hostile ones
def name_kind(name: str) -> str | None:
    """The communication kind a kernel name says, or None (compute)."""
    if m := NCCL.search(name) or NCCL_SYMK.search(name):
        return m.group(1)
    if USERBUFFERS.search(name):
        return "userbuffers"
    return "deepep" if DEEPEP.search(name) else None


@dataclass
class Decision:
    cls: str | None  # None: unclassified
    rule: str
    candidates: tuple[str, ...] = ()


class Ranges:
    """The NVTX ranges that can decide a class (their text names PP, CP or EP work), per launching thread, found by
    bisection: a range holding time t starts in [t - the longest range, t]."""

    KEYS = (NVTX_PP, *NVTX_CP, *NVTX_EP)

    def __init__(self, prof: Profile):
        deciding = [r for r in prof.ranges if any(k in r.text for k in self.KEYS)]
        self.by_tid = defaultdict(list)
        for r in sorted(deciding, key=lambda r: r.start):
            self.by_tid[r.tid].append(r)
        self.starts = {tid: [r.start for r in rs] for tid, rs in self.by_tid.items()}
        self.longest = {tid: max(r.end - r.start for r in rs) for tid, rs in self.by_tid.items()}
        self.megatron = any(NVTX_PP in r.text for r in prof.ranges)


def classify(prof: Profile, lay: Layout) -> dict[int, Decision]:
    """{id(activity): Decision} for every communication activity of the profile (kernels and P2P copies): each by
    itself first (_first_rule), then the undecided NCCL kernels by their stream, since each process group has its own
    stream: a stream whose decided kernels are all of one class gives it to the rest; then, a kernel whose other
    candidates already run on other streams of the device takes the one left. Repeated until nothing changes."""
    ranges = Ranges(prof)
    out, pending, fixed = {}, [], {}  # fixed: the decision of a kind that no per-kernel rule can change
    nccl = []  # the NCCL kernels, whose streams are their process groups' (not userbuffers' or DeepEP's own)
    for a in (*prof.kernels, *prof.memcpys):
        kind = kind_of(a)
        if kind is None or kind == "copy":
            continue
        if (d := None if a.group else fixed.get(kind)) is None:
            d = _first_rule(prof, a, kind, lay, ranges)
            if not a.group and d.rule.startswith(("name:", "plan:")):
                fixed[kind] = d
        out[id(a)] = d
        if d.cls is None:
            pending.append(a)
        if kind not in ("userbuffers", "deepep", "ce_p2p"):
            nccl.append(a)
    changed = True
    while changed and pending:
        owners = defaultdict(Counter)  # (device, stream) → the classes decided for its NCCL kernels
        for a in nccl:
            if (cls := out[id(a)].cls) is not None:
                owners[(a.device, a.stream)][cls] += 1
        changed, still = False, []
        for a in pending:
            d = out[id(a)]
            seen = owners.get((a.device, a.stream), Counter())
            elsewhere = {c for (dev, st), cnt in owners.items() if dev == a.device and st != a.stream for c in cnt}
            left = [c for c in d.candidates if c not in elsewhere]
            if len(seen) == 1 and (cls := next(iter(seen))) in d.candidates:
                rule = f"stream: its stream carries only {cls.upper()} NCCL kernels otherwise"
            elif not seen and len(left) == 1:
                cls = left[0]
                others = "/".join(c.upper() for c in d.candidates if c != cls)
                rule = f"stream: {others} run on other streams of this GPU, and this stream has no other class"
            else:
                still.append(a)
                continue
            out[id(a)], changed = Decision(cls, rule, d.candidates), True
        pending = still
    return out


def _first_rule(prof: Profile, a: Activity, kind: str, lay: Layout, ranges: Ranges) -> Decision:
    """The rules that decide one activity by itself, in order: its process group (PyTorch traces), its kernel name,
    the classes the plan's layout leaves for its kind, then the deciding NVTX ranges open on its launching thread when
    it was launched (innermost first)."""
    if a.group and (cls := group_class(a.group)):
        return Decision(cls, f"group: NCCL {kind} in Megatron's {a.group.split('_GROUP')[0]} process group")
    if kind in ("userbuffers", "ce_p2p"):
        what = "Transformer Engine userbuffers kernel" if kind == "userbuffers" else "peer-to-peer copy-engine memcpy"
        return Decision("tp", f"name: {what} (TP comm overlap's ring exchange / reduce-scatter / all-gather)")
    if kind == "deepep":
        return Decision("ep", "name: DeepEP-family dispatch or combine kernel (deep_ep, hybrid_ep, dpsk::ep)")
    if not (cands := lay.candidates(kind)):
        return Decision(NATURAL[kind], f"name: NCCL {kind}, which no parallelism of this layout issues")
    if len(cands) == 1:
        return Decision(cands[0], f"plan: only {cands[0].upper()} issues NCCL {kind} in this layout")
    launch = prof.launches.get(a.correlation)
    if launch is not None and (tid := launch[1]) in ranges.by_tid:
        t, starts = launch[0], ranges.starts[tid]
        lo, hi = bisect.bisect_left(starts, t - ranges.longest[tid]), bisect.bisect_right(starts, t)
        inside = [r for r in ranges.by_tid[tid][lo:hi] if r.end >= t]
        for text in [r.text for r in sorted(inside, key=lambda r: r.end - r.start)]:
            for cls, keys in (("pp", (NVTX_PP,)), ("cp", NVTX_CP), ("ep", NVTX_EP)):
                if cls in cands and any(k in text for k in keys):
                    return Decision(cls, f"nvtx: launched in range {text!r}")
    # Megatron's ranges are in this trace and this kernel's launch is known: outside every p2p range, it is not PP.
    rest = tuple(c for c in cands if c != "pp")
    if ranges.megatron and launch is not None and "pp" in cands and len(rest) == 1:
        return Decision(rest[0], f"nvtx: outside every {NVTX_PP} range, where Megatron issues all PP p2p")
    return Decision(None, f"NCCL {kind}: {' or '.join(cands)}", cands)
