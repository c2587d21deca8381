"""Launch-time environment: derived from the layout, layered, recorded with provenance, handed to nemo_run.

Four layers, lowest to highest precedence; the highest layer that sets a variable wins:

1. `derived`  what the topology and GPU need (`derived_env`); the floor every layout gets.
2. `bridge`   the recipe config's `cfg.env_vars`, i.e. what Bridge's base recipe put there. A reviewed, model-specific
              choice beats our generic rule. (At run time Bridge applies them with `os.environ.setdefault`,
              training/config.py `apply_environment_variables`, so anything the launcher exports already wins.)
3. `recipe`   our `Recipe.env`: measured for this exact recipe, each with its reason and source.
4. `cluster`  the cluster profile's `env`: network/fabric facts (NCCL_IB_HCA, NCCL_SOCKET_IFNAME) and site workarounds
              that no recipe can know, so the site has the last word.

Every change of a lower layer's value is a `warning` conflict, except a recipe's measured value over our generic
derived one (why the recipe layer exists; the ledger still shows what it replaced), and CUDA_DEVICE_MAX_CONNECTIONS,
whose value is the overlap's correctness (kernel order): `connections` derives it from the layout, and `audit_rows`
makes a final value that differs, whichever layer set it, the audit's one `cuda_max_connections` error. Secrets
(overlapkit/secrets.py) never get a value here: a profile lists them by name, the ledger shows "<from caller env>",
a literal one in a layer is an audit error with its value dropped, and a credential-shaped shell value the ledger
would record is refused (one line).

A shell's variables can reach the job unrecorded (REACH): make run-local's executor copies os.environ, and a Slurm
job gets the user's login environment on the node (sbatch exports only PATH and the secrets: cluster/slurm.py). The
plan's value wins for a name it sets, so the shell's is silently ignored; a tuning name (NCCL_*, NVTE_*...) it does
not set reaches the job unrecorded. Both are reported as `shell_overrides`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from overlapkit.bridge.audit import AuditReport, Row
from overlapkit.errors import BadInput
from overlapkit.secrets import FIX, credential_kind, is_secret, secret_problem
from overlapkit.spec.findings import Finding
from overlapkit.spec.overlap import OFF, ON
from overlapkit.spec.topology import PINNED

LAYERS = ("derived", "bridge", "recipe", "cluster")
SECRET_VALUE = "<from caller env>"
HOPPER = ("h100", "h200", "h800", "gh200")
PERF = "megatron.bridge.perf_recipes.llama.h100.llama3"
COMMON = "megatron.bridge.recipes.utils.environment_utils.COMMON_RECIPE_ENV_VARS"
# Shell variables that change a run even when the plan does not set them, and how they get there (the docstring).
REACH = "make run-local's ranks get it, a Slurm job too where your login environment sets it"
TUNING_PREFIXES = ("NCCL_", "NVTE_", "TORCH_NCCL_", "CUDA_DEVICE_", "PYTORCH_CUDA_", "CUBLAS_", "UB_")
# Every layout: Bridge's common recipe defaults, with the reasons its source gives (the H100 perf recipes repeat them;
# TORCH_NCCL_HIGH_PRIORITY is also megatron.bridge.perf_recipes.environment.COMMON_PERF_ENV_VARS).
_COMMON = {
    "TORCH_NCCL_AVOID_RECORD_STREAMS": ("1", "consistent NCCL stream handling"),
    "TORCH_NCCL_HIGH_PRIORITY": ("1", "NCCL work on a high-priority stream"),
    "NCCL_NVLS_ENABLE": ("0", "no NCCL NVLink-SHARP user buffers in the baselines"),
    "NCCL_GRAPH_REGISTER": ("0", "no NCCL graph registration with the expandable allocator"),
    "PYTORCH_CUDA_ALLOC_CONF": ("expandable_segments:True", "let long runs grow allocator segments"),
}


@dataclass(frozen=True)
class EnvEntry:
    value: str
    reason: str  # one line, with its source
    error: str | None = None  # connections(): the audit error when no value can serve the layout


@dataclass
class Entry:
    name: str
    value: str
    layer: str
    reason: str
    overridden: list[tuple[str, str]] = field(default_factory=list)  # lower layers that set it: (layer, value)
    secret: bool = False


@dataclass(frozen=True)
class Conflict:
    name: str
    layers: tuple[str, ...]  # (lower, higher), or the one layer at fault
    values: tuple[str, ...]
    level: str  # "warning" | "error"
    message: str


@dataclass(frozen=True)
class ShellOverride:
    name: str
    shell_value: str
    plan_value: str | None  # None: the plan does not set it, so the shell's value reaches the job unrecorded
    message: str


QWEN_MOE = "megatron.bridge.perf_recipes.qwen.h100.qwen3_moe"
# Megatron Core's alltoall dispatcher orders the shared-expert GEMMs around the all-to-all so they overlap "when
# CUDA_DEVICE_MAX_CONNECTIONS>1" (megatron/core/transformer/moe/token_dispatcher.py): more queues, more overlap.
EP_QUEUES = "8"


def connections(plan) -> EnvEntry:
    """The one rule for CUDA_DEVICE_MAX_CONNECTIONS: 1 for TP/CP overlap (its kernels keep their issue order on one
    hardware queue); 8 for TP>1 without TP overlap but with the EP all-to-all overlap (its streams run beside compute,
    TP collectives keep a short queue); otherwise 32, so DP and EP communication run beside compute."""
    m, rm = plan.cfg.model, plan.resolved.model
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size or 1
    fsdp = bool(plan.cfg.ddp.use_megatron_fsdp)
    fsdp_note = "Megatron-FSDP asserts it is not 1 (megatron/bridge/training/config.py)"
    ep_overlap = bool(getattr(rm, "overlap_moe_expert_parallel_comm", False))
    if tp > 1 and cp == 1 and not fsdp and ep_overlap and not rm.tp_comm_overlap:
        why = f"TP={tp} without TP comm overlap (no userbuffers kernel order to keep), EP all-to-all overlap on: its "
        return EnvEntry(EP_QUEUES, why + f"streams need queues beside compute; {QWEN_MOE} 235B-A22B sets 8")
    if (tp > 1 or cp > 1) and not fsdp:
        why = f"TP={tp}/CP={cp} comm overlap needs compute and comm kernels kept in issue order (one hardware queue); "
        return EnvEntry("1", why + f"{PERF} sets 1 for its TP4 and CP2 layouts")
    if tp > 1 or cp > 1:
        fix = "use TP=CP=1 or ddp.use_megatron_fsdp=false"
        return EnvEntry(
            "32",
            f"{fsdp_note}, although TP={tp}/CP={cp} overlap wants 1 (an audit error)",
            f"{PINNED}: TP/CP overlap needs 1 but Megatron-FSDP refuses 1; {fix}",
        )
    why = f"TP=CP=1: 1 would serialise DP grad-reduce/param-gather with compute; {PERF} 8B fp8cs uses 32"
    if getattr(m, "num_moe_experts", None):
        why += f", {QWEN_MOE} 30B-A3B and the GPT-OSS 120B recipe too"
    return EnvEntry("32", why + (f"; {fsdp_note}" if fsdp else ""))


def derived_env(plan) -> dict[str, EnvEntry]:
    """What the layout needs, each with its reason and public source."""
    m, rm, rddp, gpu = plan.cfg.model, plan.resolved.model, plan.resolved.ddp, plan.target.gpu
    pp, cp = m.pipeline_model_parallel_size, m.context_parallel_size or 1
    if gpu not in HOPPER:
        raise ValueError(f"derived_env knows Hopper GPUs only ({', '.join(HOPPER)}), not {gpu!r}: add its rules")
    need = connections(plan)
    env = {PINNED: EnvEntry(need.value, need.reason)}
    if rm.tp_comm_overlap or rm.overlap_p2p_comm or rddp.overlap_grad_reduce or rddp.overlap_param_gather or cp > 1:
        margin = f"leave 20 SMs to the overlapped comm kernels during LayerNorm ({PERF}, all H100 layouts)"
        env["NVTE_FWD_LAYERNORM_SM_MARGIN"] = EnvEntry("20", margin)
        env["NVTE_BWD_LAYERNORM_SM_MARGIN"] = EnvEntry("20", margin)
    if pp > 1:
        why = f"PP={pp}: 2 MiB p2p chunks over the network ({PERF} 70B, 'Pipeline communication tuning')"
        env["NCCL_P2P_NET_CHUNKSIZE"] = EnvEntry("2097152", why)
    for name, (value, why) in _COMMON.items():
        env[name] = EnvEntry(value, f"{why} ({COMMON})")
    return env


def secret_names(profile) -> tuple[str, ...]:
    return tuple(profile.secrets) if profile else ()


@dataclass
class Ledger:
    entries: list[Entry] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    shell_overrides: list[ShellOverride] = field(default_factory=list)
    missing_secrets: list[str] = field(default_factory=list)

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == name)

    def values(self) -> dict[str, str]:
        """What the job exports; secrets are absent (an exported placeholder would shadow the real value)."""
        return {e.name: e.value for e in self.entries if not e.secret}

    @property
    def secrets(self) -> list[str]:
        return [e.name for e in self.entries if e.secret]

    def to_dict(self) -> dict:
        """Stable keys: the run directory's plan.json and the nightly read them."""
        env = [{**asdict(e), "overridden": [{"layer": la, "value": v} for la, v in e.overridden]} for e in self.entries]
        return {
            "precedence": list(LAYERS),
            "env": env,
            "conflicts": [{**asdict(c), "layers": list(c.layers), "values": list(c.values)} for c in self.conflicts],
            "shell_overrides": [asdict(s) for s in self.shell_overrides],
            "secrets": self.secrets,
            "missing_secrets": list(self.missing_secrets),
        }


def build_ledger(plan, profile=None, caller_env=None) -> Ledger:
    """Merge the four layers for `plan` and `profile`, recording every value's layer, reason and what it replaced."""
    caller_env = dict(os.environ if caller_env is None else caller_env)
    cluster = profile.env if profile else {}
    bridge = {}
    if plan.cfg.env_vars:
        from megatron.bridge.recipes.utils.environment_utils import COMMON_RECIPE_ENV_VARS

        for k, v in plan.cfg.env_vars.items():
            why = f": common default ({COMMON})" if k in COMMON_RECIPE_ENV_VARS else f" ({plan.recipe.name})"
            bridge[k] = (str(v), "Bridge base recipe's cfg.env_vars" + why)
    layers = [
        ("derived", {k: (e.value, e.reason) for k, e in derived_env(plan).items()}),
        ("bridge", bridge),
        ("recipe", {k: (str(v.value), v.reason or "recipe env (no reason given)") for k, v in plan.recipe.env.items()}),
        ("cluster", {k: (v, f"site setting in {profile.source}") for k, v in cluster.items()}),
    ]
    led, merged = Ledger(), {}
    for layer, values in layers:
        for name, (value, reason) in values.items():
            if why := secret_problem(name, value):  # the value is never kept, not even in a conflict
                msg = f"{name} has a literal value in the {layer} layer and {why}: {FIX}"
                led.conflicts.append(Conflict(name, (layer,), ("<redacted>",), "error", msg))
                continue
            if (prev := merged.get(name)) is None:
                merged[name] = Entry(name, value, layer, reason)
                continue
            tuned = (prev.layer, layer) == ("derived", "recipe")  # a recipe's measured value over the generic rule
            if prev.value != value and name != PINNED and not tuned:  # PINNED's final value is audit_rows' rule
                msg = f"{name}={value} ({layer}) replaces {prev.value} ({prev.layer})"
                led.conflicts.append(Conflict(name, (prev.layer, layer), (prev.value, value), "warning", msg))
            merged[name] = Entry(name, value, layer, reason, [*prev.overridden, (prev.layer, prev.value)])
    for name in secret_names(profile):
        why = f"secret listed by {profile.source}: passed by name from the submitting shell (sbatch --export=PATH,...)"
        merged[name] = Entry(name, SECRET_VALUE, "cluster", why, secret=True)
        if name not in caller_env:
            led.missing_secrets.append(name)
    led.entries = list(merged.values())
    led.shell_overrides = _shell_overrides(led, caller_env, set(secret_names(profile)))
    return led


def _shell_overrides(led: Ledger, caller_env: dict, secrets: set[str]) -> list[ShellOverride]:
    plan, out = led.values(), []
    for name, shell in sorted(caller_env.items()):
        if name in secrets or is_secret(name):
            continue
        recorded = name in plan or name.startswith(TUNING_PREFIXES)
        if recorded and (kind := credential_kind(shell)):  # the job may get it all the same (REACH)
            raise BadInput(
                f"{name} in your shell holds what looks like {kind}: it would reach the job and its records; unset it "
                f"(a secret goes by name: {FIX})"
            )
        if name in plan and plan[name] != shell:
            layer = led.entry(name).layer
            msg = (
                f"{name}={shell} is exported in this shell but the plan sets {plan[name]} ({layer}): "
                "the job gets the plan's value; unset yours or move it to the cluster profile"
            )
            out.append(ShellOverride(name, shell, plan[name], msg))
        elif name not in plan and name.startswith(TUNING_PREFIXES):
            msg = (
                f"{name}={shell} is exported in this shell and may reach the job unrecorded ({REACH}); "
                "unset it or put it in the cluster profile's env"
            )
            out.append(ShellOverride(name, shell, None, msg))
    return out


def audit_rows(plan, ledger: Ledger) -> AuditReport:
    """The launch environment's audit: the CUDA_DEVICE_MAX_CONNECTIONS row and its rule, then every layer conflict."""
    tp, cp = plan.cfg.model.tensor_model_parallel_size, plan.cfg.model.context_parallel_size or 1
    need, entry = connections(plan), next((e for e in ledger.entries if e.name == PINNED), None)
    value = entry.value if entry else None
    rep = AuditReport([Row(PINNED, ON if value is not None else OFF, f"{value} (TP={tp}, CP={cp})")])
    if need.error:
        rep.findings.append(Finding("error", "cuda_max_connections", need.error))
    elif value != need.value:
        where = f" ({entry.layer} layer)" if entry else ""
        if need.value == "1":
            msg = f"{PINNED}={value}{where} with TP={tp}/CP={cp} overlap: must be 1 so compute and comm kernels keep "
            msg += "their order"
        elif need.value == EP_QUEUES:
            msg = f"{PINNED}={value}{where} with TP={tp} and EP all-to-all overlap: use {EP_QUEUES}"
        else:
            msg = f"{PINNED}={value}{where} with TP=CP=1 serialises DP overlap: use {need.value}"
        rep.findings.append(Finding("error", "cuda_max_connections", f"{msg}; remove it from that layer"))
    if value == "1" and getattr(plan.resolved.model, "overlap_moe_expert_parallel_comm", False):
        # Megatron-LM #2719/#2730: the 1F1B EP overlap's dispatch/combine wait behind compute on one hardware queue.
        msg = f"EP all-to-all overlap with {PINNED}=1 (kept for TP={tp}/CP={cp} overlap's kernel order) hides less: "
        msg += "its all-to-all kernels queue behind compute on one hardware queue (Megatron-LM #2719)"
        rep.findings.append(Finding("warning", "ep_overlap_one_queue", msg))
    rep.findings += [Finding(c.level, "env_conflict", c.message) for c in ledger.conflicts]
    return rep
