"""The env-var plugin, its provenance ledger and cluster profiles, on real recipe plans and real nemo_run objects.

Plans come from `make_plan` (Bridge builds and resolves them for real); executors and tasks are nemo_run's own
classes. The caller's environment is always passed explicitly, so the machine's shell cannot change a result.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re
from functools import cache
from pathlib import Path

import megatron
import nemo_run as run
import pytest

from overlapkit.bridge import submission
from overlapkit.bridge.build import make_plan
from overlapkit.bridge.env import (
    LAYERS,
    PINNED,
    SECRET_VALUE,
    audit_rows,
    build_ledger,
    derived_env,
    secret_names,
)
from overlapkit.bridge.plugin import EnvVarPlugin
from overlapkit.bridge.report import ledger_rows, render_ledger
from overlapkit.cluster.profiles import list_profiles, load_profile
from overlapkit.profile.overlap_render import console
from overlapkit.spec.profile import DEFAULT_CONTAINER, ClusterProfile, ProfileError
from recipes._base import EnvVar

B8, F8, B70, F70 = (
    "llama3_8b_pretrain_8gpu_h100_bf16",
    "llama3_8b_pretrain_8gpu_h100_fp8cs",
    "llama3_70b_pretrain_64gpu_h100_bf16",
    "llama3_70b_pretrain_64gpu_h100_fp8cs",
)
MARGINS = ("NVTE_FWD_LAYERNORM_SM_MARGIN", "NVTE_BWD_LAYERNORM_SM_MARGIN")
CHUNK = "NCCL_P2P_NET_CHUNKSIZE"
COMMON = {
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "TORCH_NCCL_HIGH_PRIORITY": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_GRAPH_REGISTER": "0",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
REAL_SECRET = "sk-real-wandb-0123456789"
# Made-up credentials of the shapes overlapkit/secrets.py lists, under innocuous names in profiles, layers and shells.
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
SLACK = "xoxb-1234567890-0987654321-AbCdEfGhIjKl"


@cache
def plan(name: str, sets: str = ""):
    """Built once per (recipe, overrides); tests that change a layer work on `layered`'s copy."""
    return make_plan(name, sets=sets)


def layered(name: str, *, bridge=None, recipe=None):
    """A copy of `plan(name)` with extra Bridge cfg.env_vars and Recipe.env entries (the cached plan stays clean)."""
    p = plan(name)
    cfg = copy.copy(p.cfg)
    cfg.env_vars = {**p.cfg.env_vars, **(bridge or {})}
    return dataclasses.replace(p, cfg=cfg, recipe=dataclasses.replace(p.recipe, env={**p.recipe.env, **(recipe or {})}))


def profile(**kw) -> ClusterProfile:
    return ClusterProfile(**{"name": "test", "account": "acct", "partition": "batch", **kw})


def rendered(ledger) -> str:
    buf = io.StringIO()
    render_ledger(ledger, console(file=buf, width=240))
    return buf.getvalue()


# --- derived layer: one row per topology -------------------------------------------------------------------------

TOPOLOGY = [
    # recipe, overrides, CUDA_DEVICE_MAX_CONNECTIONS, LayerNorm SM margins set, NCCL_P2P_NET_CHUNKSIZE set
    pytest.param(B70, "", "1", True, True, id="tp4-pp4-cp2"),
    pytest.param(F70, "", "1", True, True, id="tp4-pp8-cp1"),
    pytest.param(B8, "", "1", True, False, id="tp1-pp1-cp2"),
    pytest.param(F8, "", "32", True, False, id="tp1-pp1-cp1"),
    pytest.param(F8, "model.tensor_model_parallel_size=2 model.sequence_parallel=true", "1", True, False, id="tp2-cp1"),
    pytest.param(B8, "model.context_parallel_size=1", "32", True, False, id="cp2-to-cp1"),
    pytest.param(
        B70,
        "model.pipeline_model_parallel_size=1 model.virtual_pipeline_model_parallel_size=null",
        "1",
        True,
        False,
        id="tp4-pp1",
    ),
    pytest.param(F8, "ddp.use_megatron_fsdp=true", "32", True, False, id="fsdp-tp1-cp1"),
    pytest.param(
        F8,
        "comm_overlap.overlap_grad_reduce=false comm_overlap.overlap_param_gather=false",
        "32",
        False,
        False,
        id="no-overlap",
    ),
]


@pytest.mark.parametrize("name, sets, cuda, margins, chunk", TOPOLOGY)
def test_derived_env_per_topology(name, sets, cuda, margins, chunk):
    env = derived_env(plan(name, sets))
    assert env[PINNED].value == cuda
    assert all((m in env) is margins for m in MARGINS)
    assert all(env[m].value == "20" for m in MARGINS if margins)
    assert (CHUNK in env) is chunk and (not chunk or env[CHUNK].value == "2097152")
    assert {k: env[k].value for k in COMMON} == COMMON


def test_8b_bf16_gets_1_and_8b_fp8_gets_32_with_cited_sources():
    bf16, fp8 = derived_env(plan(B8))[PINNED], derived_env(plan(F8))[PINNED]
    assert (bf16.value, fp8.value) == ("1", "32")
    assert "CP=2" in bf16.reason and "megatron.bridge.perf_recipes.llama.h100.llama3" in bf16.reason
    assert "serialise DP" in fp8.reason and "8B fp8cs uses 32" in fp8.reason


def test_fsdp_reason_cites_bridges_assert():
    reason = derived_env(plan(F8, "ddp.use_megatron_fsdp=true"))[PINNED].reason
    assert "Megatron-FSDP asserts it is not 1" in reason and "training/config.py" in reason


# A reason cites its source as a module path (megatron.bridge.perf_recipes.llama.h100.llama3, or a module's attribute:
# ...environment_utils.COMMON_RECIPE_ENV_VARS) or as a file path (megatron/bridge/training/config.py).
CITATION = re.compile(r"megatron[./][\w./]*\w")


def _installed_source(cite: str) -> bool:
    """Does `cite` name a file of the installed Megatron Bridge / Core (a dotted name: a module, or a module and one
    of its top-level names)? Resolved under the installed `megatron` package directories, without importing."""
    roots = [Path(d).parent for d in megatron.__path__]
    if "/" in cite:
        return any((root / cite).is_file() for root in roots)
    parts = cite.split(".")
    for root in roots:
        for cut in (len(parts), len(parts) - 1):
            base = root.joinpath(*parts[:cut])
            for file in (base.with_suffix(".py"), base / "__init__.py"):
                if file.is_file():
                    rest = parts[cut:]
                    return not rest or re.search(rf"^{rest[0]}\b", file.read_text(), re.M) is not None
    return False


def test_every_derived_reason_cites_a_megatron_source_that_is_installed():
    for p in (plan(B70), plan(F8), plan(F8, "ddp.use_megatron_fsdp=true")):
        for name, entry in derived_env(p).items():
            cites = CITATION.findall(entry.reason)
            assert cites, f"{name}: no Megatron source cited in {entry.reason!r}"
            for cite in cites:
                assert _installed_source(cite), f"{name} cites {cite}: not in the installed Megatron packages"


# --- the ledger: layers, provenance, conflicts ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [B8, F8, B70, F70])
def test_shipped_recipes_have_no_conflicts_and_pass_the_env_audit(name):
    p = plan(name)
    led = build_ledger(p, caller_env={})
    assert led.conflicts == [] and led.shell_overrides == [] and led.secrets == []
    rep = audit_rows(p, led)
    assert rep.findings == []
    assert rep.row("CUDA_DEVICE_MAX_CONNECTIONS").detail.startswith(led.values()[PINNED])


def test_every_entry_records_a_layer_and_a_reason():
    led = build_ledger(plan(F8), load_profile("example-eos"), caller_env={"WANDB_API_KEY": REAL_SECRET})
    assert {e.layer for e in led.entries} == set(LAYERS)
    for e in led.entries:
        assert e.layer in LAYERS and e.reason.strip(), e.name
    cta, hca = led.entry("NCCL_CTA_POLICY"), led.entry("NCCL_IB_HCA")
    assert cta.layer == "recipe" and "8B FP8 baseline" in cta.reason
    assert hca.layer == "cluster" and "slurm/profiles/example-eos.toml" in hca.reason


def test_bridge_layer_agrees_with_derived_and_cites_common_recipe_env_vars():
    led = build_ledger(plan(B8), caller_env={})
    e = led.entry("TORCH_NCCL_HIGH_PRIORITY")
    assert (e.value, e.layer, e.overridden) == ("1", "bridge", [("derived", "1")])
    assert "COMMON_RECIPE_ENV_VARS" in e.reason
    assert led.entry(PINNED).layer == "derived"  # Bridge's base recipe does not set it


def test_precedence_derived_lt_bridge_lt_recipe_lt_cluster():
    p = layered(
        B70,
        bridge={CHUNK: 1048576, "NCCL_ALGO": "Tree"},
        recipe={CHUNK: EnvVar(524288, "measured on our fabric"), "NCCL_ALGO": EnvVar("Ring", "measured")},
    )
    led = build_ledger(p, profile(env={CHUNK: "4194304"}), caller_env={})
    chunk, algo = led.entry(CHUNK), led.entry("NCCL_ALGO")
    assert (chunk.value, chunk.layer) == ("4194304", "cluster")
    assert chunk.overridden == [("derived", "2097152"), ("bridge", "1048576"), ("recipe", "524288")]
    assert (algo.value, algo.layer, algo.reason) == ("Ring", "recipe", "measured")
    assert led.values()[CHUNK] == "4194304" and led.values()["NCCL_ALGO"] == "Ring"
    warned = [(c.name, c.layers, c.values, c.level) for c in led.conflicts]
    assert warned == [  # in layer order, then in each layer's own order
        (CHUNK, ("derived", "bridge"), ("2097152", "1048576"), "warning"),
        (CHUNK, ("bridge", "recipe"), ("1048576", "524288"), "warning"),
        ("NCCL_ALGO", ("bridge", "recipe"), ("Tree", "Ring"), "warning"),
        (CHUNK, ("recipe", "cluster"), ("524288", "4194304"), "warning"),
    ]


def cuda_errors(p, led) -> list[str]:
    """The env audit's CUDA_DEVICE_MAX_CONNECTIONS errors for plan `p` with ledger `led` (the rule's one home)."""
    return [f.message for f in audit_rows(p, led).errors if f.code == "cuda_max_connections"]


def test_cluster_overriding_cuda_max_connections_is_an_error_and_the_audit_sees_it():
    p = plan(B70)
    led = build_ledger(p, profile(env={PINNED: "32"}), caller_env={})
    assert led.values()[PINNED] == "32" and led.entry(PINNED).overridden == [("derived", "1")]
    assert led.conflicts == []  # the value is the audit rule's, not a layer warning: reported once
    (msg,) = cuda_errors(p, led)
    assert "=32 (cluster layer) with TP=4/CP=2 overlap: must be 1" in msg and "remove it from that layer" in msg


def test_bridge_setting_cuda_max_connections_1_on_tp1_cp1_is_an_error_and_same_value_is_not():
    bad_plan = layered(F8, bridge={PINNED: 1})
    bad = build_ledger(bad_plan, caller_env={})
    assert cuda_errors(bad_plan, bad) == [f"{PINNED}=1 (bridge layer) with TP=CP=1 serialises DP overlap: use 32; "
                                          "remove it from that layer"]  # fmt: skip
    same_plan = layered(F8, recipe={PINNED: EnvVar(32, "pinned by hand")})
    same = build_ledger(same_plan, caller_env={})
    assert same.conflicts == [] and same.entry(PINNED).layer == "recipe" and cuda_errors(same_plan, same) == []


def test_fsdp_with_cp2_is_an_error_naming_both_sides():
    p = plan(B8, "ddp.use_megatron_fsdp=true")
    led = build_ledger(p, caller_env={})
    assert led.values()[PINNED] == "32"
    (msg,) = cuda_errors(p, led)
    assert "Megatron-FSDP refuses 1" in msg and "ddp.use_megatron_fsdp=false" in msg


def test_shell_overrides_are_reported_from_the_given_caller_env():
    env = {"NCCL_NVLS_ENABLE": "1", "NCCL_ALGO": "Ring", "NCCL_GRAPH_REGISTER": "0", "HOME": "/root", "HF_TOKEN": "x"}
    led = build_ledger(plan(B70), caller_env=env)
    got = [(s.name, s.shell_value, s.plan_value) for s in led.shell_overrides]
    assert got == [("NCCL_ALGO", "Ring", None), ("NCCL_NVLS_ENABLE", "1", "0")]
    assert "unset" in led.shell_overrides[1].message and "--export=ALL" not in led.shell_overrides[0].message
    said = led.shell_overrides[0].message  # what the scripts now do: sbatch passes PATH and the secrets, no more
    assert "may reach the job unrecorded (make run-local's ranks get it" in said and "login environment" in said


def test_to_dict_has_stable_keys_and_is_json():
    led = build_ledger(plan(B70), profile(env={CHUNK: "4194304"}), caller_env={"NCCL_ALGO": "Ring"})
    d = json.loads(json.dumps(led.to_dict()))
    assert list(d) == ["precedence", "env", "conflicts", "shell_overrides", "secrets", "missing_secrets"]
    assert d["precedence"] == ["derived", "bridge", "recipe", "cluster"]
    assert list(d["env"][0]) == ["name", "value", "layer", "reason", "overridden", "secret"]
    assert list(d["conflicts"][0]) == ["name", "layers", "values", "level", "message"]
    assert list(d["shell_overrides"][0]) == ["name", "shell_value", "plan_value", "message"]
    chunk = next(e for e in d["env"] if e["name"] == CHUNK)
    assert chunk["overridden"] == [{"layer": "derived", "value": "2097152"}] and chunk["layer"] == "cluster"


def test_rows_and_render_show_value_layer_and_reason():
    led = build_ledger(plan(B70), profile(env={CHUNK: "4194304"}), caller_env={})
    row = next(r for r in ledger_rows(led) if r[0] == CHUNK)
    assert row[:4] == (CHUNK, "4194304", "cluster", "derived=2097152") and "site setting in profile test" in row[4]
    text = rendered(led)
    assert "derived < bridge < recipe < cluster" in text and "[over derived=2097152]" in text
    assert "warning [env:NCCL_P2P_NET_CHUNKSIZE]" in text


# --- secrets -------------------------------------------------------------------------------------------------------


def test_secrets_pass_by_name_and_their_values_are_never_recorded(tmp_path):
    prof = load_profile("example-eos")
    caller = {"WANDB_API_KEY": REAL_SECRET, "MY_SERVICE_TOKEN": "tok-456", "NCCL_ALGO": "Ring"}
    led = build_ledger(plan(F8), prof, caller_env=caller)
    assert secret_names(prof) == ("WANDB_API_KEY", "HF_TOKEN")
    assert led.entry("WANDB_API_KEY").value == SECRET_VALUE and led.entry("WANDB_API_KEY").secret
    assert led.secrets == ["WANDB_API_KEY", "HF_TOKEN"] and led.missing_secrets == ["HF_TOKEN"]
    assert "WANDB_API_KEY" not in led.values() and "HF_TOKEN" not in led.values()
    executor = run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=str(tmp_path)))
    EnvVarPlugin(env=led.values()).setup(run.Script(inline="echo hi"), executor)
    text = "\n".join(
        [json.dumps(led.to_dict()), json.dumps(led.values()), json.dumps(executor.env_vars), rendered(led)]
    )
    for leaked in (REAL_SECRET, "tok-456"):
        assert leaked not in text
    assert "WANDB_API_KEY" not in executor.env_vars and executor.env_vars["NCCL_IB_HCA"].startswith("mlx5_0")


def _errors(led):
    return [c for c in led.conflicts if c.level == "error"]


def test_a_literal_secret_in_a_layer_is_an_error_and_is_dropped():
    led = build_ledger(layered(B8, recipe={"HF_TOKEN": EnvVar("hf_literal_abc", "oops")}), caller_env={})
    assert [(c.name, c.layers, c.values, c.level) for c in _errors(led)] == [
        ("HF_TOKEN", ("recipe",), ("<redacted>",), "error")
    ]
    assert "put its name in secrets = [...]" in _errors(led)[0].message
    assert "hf_literal_abc" not in json.dumps(led.to_dict()) + rendered(led)


def test_a_credential_shaped_value_in_a_layer_is_an_error_and_is_dropped():
    led = build_ledger(layered(B8, recipe={"NCCL_HINT": EnvVar(SLACK, "pasted")}), caller_env={})
    assert [(c.name, c.values, c.level) for c in _errors(led)] == [("NCCL_HINT", ("<redacted>",), "error")]
    assert "looks like a Slack token" in _errors(led)[0].message and SLACK not in json.dumps(led.to_dict())


@pytest.mark.parametrize("value", ["hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", JWT, SLACK])
def test_a_credential_in_a_recorded_shell_variable_is_refused_unechoed(value):
    """The ledger records the caller's NCCL_* (and every name the plan sets) with its value: a credential-shaped one
    is refused, in one line naming the variable and the fix, never the value."""
    with pytest.raises(ValueError) as exc:
        build_ledger(plan(F8), caller_env={"NCCL_COLLNET_HINT": value})
    assert str(exc.value).startswith("NCCL_COLLNET_HINT in your shell holds what looks like a")
    assert "put its name in secrets = [...]" in str(exc.value) and value not in str(exc.value)
    assert build_ledger(plan(F8), caller_env={"UNRELATED": value}).shell_overrides == []  # not recorded: not ours


def test_plugin_refuses_a_secret_name():
    with pytest.raises(ValueError, match="WANDB_API_KEY looks like a secret"):
        EnvVarPlugin(env={"WANDB_API_KEY": "abc"})
    with pytest.raises(ValueError, match="the value of NCCL_HINT looks like a JSON Web Token"):
        EnvVarPlugin(env={"NCCL_HINT": JWT})


# --- the nemo_run plugin -------------------------------------------------------------------------------------------


def _noop(x: int = 1) -> int:
    return x


def test_plugin_merges_into_slurm_executor_without_mutating_shared_dicts(tmp_path):
    led = build_ledger(plan(B70), caller_env={})
    plugin = EnvVarPlugin(env=led.values())
    before = dict(plugin.env)
    shared = {"FOO": "bar", PINNED: "8"}
    executor = run.SlurmExecutor(account="acct", env_vars=shared, tunnel=run.LocalTunnel(job_dir=str(tmp_path)))
    task = run.Script(inline="echo hi")
    task_before = copy.deepcopy(task)
    plugin.setup(task, executor)
    assert executor.env_vars == {"FOO": "bar", **led.values()} and executor.env_vars[PINNED] == "1"
    assert shared == {"FOO": "bar", PINNED: "8"} and executor.env_vars is not shared
    assert plugin.env == before and task == task_before


def test_plugin_merges_into_local_executor_with_a_partial_task():
    led = build_ledger(plan(F8), profile(env={"NCCL_SOCKET_IFNAME": "lo"}), caller_env={})
    plugin = EnvVarPlugin(env=led.values())
    executor = run.LocalExecutor(ntasks_per_node=8)
    task = run.Partial(_noop, x=2)
    plugin.setup(task, executor)
    assert executor.env_vars[PINNED] == "32" and executor.env_vars["NCCL_SOCKET_IFNAME"] == "lo"
    assert executor.env_vars == led.values() and task.x == 2
    source = led.values()
    own = EnvVarPlugin(env=source)
    source[PINNED] = "changed"  # the plugin holds its own copy: later edits do not reach a submitted job
    assert own.env[PINNED] == "32"


# --- cluster profiles ----------------------------------------------------------------------------------------------


def test_shipped_profiles_load():
    assert {"local", "example-eos"} <= set(list_profiles())
    local, eos = load_profile("local"), load_profile("example-eos")
    assert (local.account, local.partition, local.container_image) == ("root", "local", None)
    assert local.srun_args == ("--mpi=pmix",) and local.gpus_per_node == 8 and local.secrets == ()
    assert local.job_path.parts[-2:] == ("runs", "slurm")
    assert eos.container_image == DEFAULT_CONTAINER == "nvcr.io/nvidia/nemo:26.08"
    assert eos.container_mounts == ("/lustre:/lustre",) and eos.exclusive is True
    assert eos.secrets == ("WANDB_API_KEY", "HF_TOKEN") and eos.env["NCCL_IB_TIMEOUT"] == "22"


def _write(tmp_path, text: str):
    path = tmp_path / "site.toml"
    path.write_text('account = "a"\npartition = "p"\n' + text)
    return path


BAD_PROFILES = [
    pytest.param('acount = "x"\n', "unknown key 'acount'; did you mean account?", id="unknown-key"),
    pytest.param('time_limit = "4:00"\n', "use HH:MM:SS or D-HH:MM:SS", id="bad-time"),
    pytest.param('time_limit = "1-25:00:00"\n', "use HH:MM:SS or D-HH:MM:SS", id="bad-day-hours"),
    pytest.param(
        '[env]\nWANDB_API_KEY = "abc"\n',
        "env.WANDB_API_KEY has a literal value and WANDB_API_KEY looks like a secret by its name: put its name in "
        "secrets = [...] and export it in your shell",
        id="literal-secret",
    ),
    # Secret by a name that is not Bridge's spelling: KEY, TOKEN, SECRET, PASS(WORD), CREDENTIAL anywhere.
    pytest.param('[env]\nWANDB_APIKEY = "abc"\n', "WANDB_APIKEY looks like a secret by its name", id="apikey"),
    pytest.param('[env]\nMY_TOKEN_FILE = "x"\n', "MY_TOKEN_FILE looks like a secret by its name", id="token-inside"),
    pytest.param('[env]\nDB_PASSWD = "x"\n', "DB_PASSWD looks like a secret by its name", id="passwd"),
    pytest.param('[env]\nGCP_CREDENTIALS = "x"\n', "GCP_CREDENTIALS looks like a secret", id="credentials"),
    # A credential by its format, whatever the name.
    pytest.param(
        '[env]\nLOGGER_URL = "hf_abcdefghijklmnopqrstuvwxyz0123456789"\n',
        "the value of LOGGER_URL looks like a Hugging Face token",
        id="hf-format",
    ),
    pytest.param(
        '[env]\nTRACKER = "0123456789abcdef0123456789abcdef01234567"\n', "looks like a W&B API key", id="wandb-format"
    ),
    pytest.param(
        '[env]\nREPO = "ghp_abcdefghijklmnopqrstuvwxyz0123456789"\n', "looks like a GitHub token", id="github-format"
    ),
    pytest.param('[env]\nS3 = "AKIAABCDEFGHIJKLMNOP"\n', "looks like an AWS access key", id="aws-format"),
    pytest.param(
        f'[env]\nNCCL_HINT = "{JWT}"\n', "the value of NCCL_HINT looks like a JSON Web Token", id="jwt-format"
    ),
    pytest.param(f'[env]\nNOTIFY = "{SLACK}"\n', "the value of NOTIFY looks like a Slack token", id="slack-format"),
    pytest.param(
        f'srun_args = ["--export=ALL,NCCL_HINT={JWT}"]\n',
        "srun_args NCCL_HINT=...: the value of NCCL_HINT looks like a JSON Web Token; put its name in secrets",
        id="srun-jwt",
    ),
    pytest.param(
        f'srun_args = ["--comment={SLACK}"]\n', "srun_args holds what looks like a Slack token", id="srun-slack"
    ),
    pytest.param(f'wandb_entity = "{SLACK}"\n', "wandb_entity holds what looks like a Slack token", id="entity-slack"),
    # srun's --export or a bare NAME=value would put the value on the srun line of the sbatch script.
    pytest.param(
        'srun_args = ["--mpi=pmix", "--export=ALL,WANDB_API_KEY=abc"]\n',
        "srun_args WANDB_API_KEY=...: WANDB_API_KEY looks like a secret by its name",
        id="srun-export",
    ),
    pytest.param('srun_args = ["HF_TOKEN=abc"]\n', "srun_args HF_TOKEN=...", id="srun-assignment"),
    pytest.param(
        'container_mounts = ["/data:/data:hf_abcdefghijklmnopqrstuvwxyz0123456789"]\n',
        "container_mounts holds what looks like a Hugging Face token",
        id="mount-credential",
    ),
    pytest.param("gpus_per_node = 0\n", "gpus_per_node = 0: expected a positive integer", id="zero-gpus"),
    pytest.param('gpus_per_node = "8"\n', "expected a positive integer", id="gpus-as-string"),
    pytest.param('exclusive = "yes"\n', "exclusive = 'yes': expected true or false", id="bool-as-string"),
    pytest.param(
        'profiler = "pytorch"\n', 'profiler = \'pytorch\': use "nsys" (Nsight Systems) or "torch"', id="profiler"
    ),
    pytest.param('srun_args = "--mpi=pmix"\n', "expected a list of strings", id="args-not-list"),
    pytest.param('container_mounts = ["/lustre"]\n', "use SRC:DST[:FLAGS]", id="bad-mount"),
    pytest.param('[env]\nNCCL_IB_HCA = "mlx5_0 mlx5_1"\n', "unquoted into the sbatch script", id="unsafe-value"),
    pytest.param('secrets = ["HF_TOKEN"]\n[env]\nNCCL_X = true\n', "expected a string or integer", id="env-bool"),
    pytest.param('account = "dup"\n', "invalid TOML", id="invalid-toml"),
]


@pytest.mark.parametrize("text, fix", BAD_PROFILES)
def test_profile_errors_are_one_line_and_name_the_fix(tmp_path, text, fix):
    with pytest.raises(ProfileError) as exc:
        load_profile(_write(tmp_path, text))
    msg = str(exc.value)
    assert "\n" not in msg and fix in msg and msg.split(": ")[0].endswith("site.toml")


def test_missing_account_and_unknown_profile_are_one_line(tmp_path):
    (tmp_path / "bare.toml").write_text('partition = "p"\n')
    with pytest.raises(ProfileError, match=r"missing key 'account': add account = "):
        load_profile(tmp_path / "bare.toml")
    with pytest.raises(ProfileError) as exc:
        load_profile("eos")
    msg = str(exc.value)
    assert "\n" not in msg and "unknown cluster profile 'eos'" in msg and "example-eos, local" in msg


def test_profile_defaults_and_empty_container(tmp_path):
    prof = load_profile(_write(tmp_path, 'time_limit = "1-00:00:00"\ncontainer_image = ""\n'))
    assert (prof.name, prof.time_limit, prof.container_image, prof.exclusive) == ("site", "1-00:00:00", None, True)
    assert load_profile(_write(tmp_path, "")).container_image == DEFAULT_CONTAINER
    assert prof.profiler == "nsys" and load_profile(_write(tmp_path, 'profiler = "torch"\n')).profiler == "torch"


# --- CUDA_DEVICE_MAX_CONNECTIONS for the MoE recipes: NVIDIA's value, derived, and still an error where it breaks ---

# NVIDIA's H100 perf recipes' values (megatron/bridge/perf_recipes/{qwen,deepseek,gpt_oss}/h100/*.py `env_vars`).
NVIDIA_CDMC = {
    "qwen3_30b_a3b_pretrain_16gpu_h100_bf16": "32",  # TP1, EP16, EP overlap
    "qwen3_30b_a3b_pretrain_16gpu_h100_fp8cs": "32",  # TP1, EP16
    "qwen3_235b_a22b_pretrain_256gpu_h100_bf16": "8",  # TP2 without TP overlap, EP overlap
    "qwen3_235b_a22b_pretrain_256gpu_h100_fp8cs": "8",
    "deepseek_v3_pretrain_1024gpu_h100_bf16": "1",  # TP2 without TP or EP overlap
    "deepseek_v3_pretrain_1024gpu_h100_fp8cs": "1",
    "gpt_oss_120b_pretrain_64gpu_h100_bf16": "32",  # TP1, PP4
    "gpt_oss_120b_pretrain_64gpu_h100_fp8cs": "32",
}


@pytest.mark.parametrize("name", sorted(NVIDIA_CDMC))
def test_cuda_max_connections_rule_reproduces_nvidias_value_with_its_reason(name, planned):
    p = planned(name)
    entry = p.ledger.entry(PINNED)
    assert (entry.value, entry.layer) == (NVIDIA_CDMC[name], "derived") and p.report.ok
    assert "perf_recipes" in entry.reason  # the source is named in the ledger


def test_cuda_max_connections_has_one_home_that_every_reader_follows(monkeypatch, tmp_path):
    """env.connections is the rule's one home: answering a value no rule gives (7), the ledger, the audit row and the
    env the plugin hands a real nemo_run executor all say 7. A second rule anywhere on that path keeps its own value."""
    from overlapkit.bridge import env

    monkeypatch.setattr(env, "connections", lambda plan: env.EnvEntry("7", "a probe of the one home"))
    led = build_ledger(plan(B70), load_profile("example-eos"), caller_env={})
    assert (led.entry(PINNED).value, led.entry(PINNED).reason) == ("7", "a probe of the one home")
    rep = audit_rows(plan(B70), led)
    assert rep.rows[0].detail == "7 (TP=4, CP=2)" and not [f for f in rep.findings if f.code == "cuda_max_connections"]
    executor = run.SlurmExecutor(account="acct", tunnel=run.LocalTunnel(job_dir=str(tmp_path)))
    EnvVarPlugin(env=led.values()).setup(run.Script(inline="echo hi"), executor)
    assert executor.env_vars[PINNED] == "7"


def test_ep_overlap_value_8_is_an_error_where_tp_overlap_or_cp_needs_1_and_1_is_an_error_where_8_is_needed():
    q = make_plan("qwen3_235b_a22b_pretrain_256gpu_h100_bf16", caller_env={})
    one = build_ledger(q, profile(env={PINNED: "1"}), caller_env={})
    assert cuda_errors(q, one) == [f"{PINNED}=1 (cluster layer) with TP=2 and EP all-to-all overlap: use 8; remove it "
                                   "from that layer"]  # fmt: skip
    cp2 = make_plan("qwen3_235b_a22b_pretrain_256gpu_h100_bf16", sets="model.context_parallel_size=2", caller_env={})
    eight = build_ledger(cp2, profile(env={PINNED: "8"}), caller_env={})
    assert "must be 1" in cuda_errors(cp2, eight)[0]  # CP overlap needs one hardware queue whatever EP does
    tp_on = make_plan(B70, caller_env={})
    assert "must be 1" in cuda_errors(tp_on, build_ledger(tp_on, profile(env={PINNED: "8"}), caller_env={}))[0]


# --- the path-based task: Bridge's run plugins unchanged, overrides through the run directory's JSON file --------


def _chain_sub(tmp_path, sets="", **run):
    from overlapkit.spec import runopts

    prof = dataclasses.replace(load_profile("local"), job_dir=str(tmp_path / "jobs"))
    opts = runopts.RunOptions(**{"run_name": "p", **run})
    return submission.prepare(B8, prof, sets=sets, preflight_only=True, caller_env={}, run=opts)


def test_bridges_plugins_set_up_our_path_based_task_unchanged(tmp_path):
    from overlapkit.cluster import submit

    sub = _chain_sub(tmp_path, nsys=(10, 12), nsys_ranks=(0, 3))
    executor = submit.slurm_executor(sub)
    task = run.Script(path=submit.ENTRY, args=submit.entry_args(sub.plan, sub.run_dir, True, "full", 2),
                      entrypoint="python")  # fmt: skip
    for plugin in sub.plugins():
        plugin.setup(task, executor)
    assert executor.signal == "TERM@300" and not executor.get_launcher().nsys_profile  # entry.py runs nsys itself
    assert task.args[task.args.index("--segment") + 1] == "2"
    assert "train.exit_signal_handler=True" in task.args and not any(a.startswith("profiling.") for a in task.args)
    record = json.loads((sub.run_dir / "overrides.json").read_text())
    assert record["run"]["nsys"] == [10, 12] and record["run"]["nsys_ranks"] == [0, 3]  # the job's runopts.apply
    assert executor.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_a_blend_with_spaces_sent_through_set_arrives_intact_in_the_job(tmp_path):
    """SET → overrides.json → launch/entry.py's rebuild, plus a plugin's command-line override on top."""
    from launch import entry

    blend = "dataset.blend='[[/data/my corpus/a_text_document, /data/b], [0.3, 0.7]]'"
    sub = _chain_sub(tmp_path, sets=f"{blend} logger.wandb_exp_name='two words' "
                                    "tokenizer.hf_tokenizer_kwargs='{use_fast: true, padding_side: left}'")  # fmt: skip
    record = json.loads((sub.run_dir / "overrides.json").read_text())
    assert record["set"][0] == ["dataset.blend", "[[/data/my corpus/a_text_document, /data/b], [0.3, 0.7]]"]
    args = entry._args([*submit_args(sub), "train.exit_signal_handler=True"])
    cfg = entry.rebuild(args).cfg
    assert cfg.dataset.blend == [["/data/my corpus/a_text_document", "/data/b"], [0.3, 0.7]]
    assert cfg.logger.wandb_exp_name == "two words" and cfg.train.exit_signal_handler is True
    assert cfg.tokenizer.hf_tokenizer_kwargs == {"use_fast": True, "padding_side": "left"}
    assert cfg.checkpoint.save == cfg.checkpoint.load == str(tmp_path / "jobs" / "checkpoints" / "p")


def submit_args(sub):
    from overlapkit.cluster import submit

    return submit.entry_args(sub.plan, sub.run_dir, True, "full")
