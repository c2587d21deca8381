"""A cluster profile (`slurm/profiles/<name>.toml`, read by cluster/profiles.py): its typed model, whose validation is
the profile's, each error one line naming the key and the fix. Secrets are listed by *name* only (`secrets =
["WANDB_API_KEY"]`): their values stay in the submitting shell, which sbatch passes to the job by name
(`--export=PATH,<secrets>`: cluster/slurm.py export_list), and are never written anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator
from pydantic.dataclasses import dataclass

from overlapkit.errors import BadInput
from overlapkit.paths import in_checkout, repo_relative
from overlapkit.secrets import FIX, credential_kind, secret_problem
from overlapkit.spec.model import STRICT

# Megatron Bridge v0.6.0's release notes are titled "NeMo Framework 26.08 — Megatron Bridge Release Notes"
# (github.com/NVIDIA-NeMo/Megatron-Bridge/releases/tag/v0.6.0), following 26.04 → 0.4.0 and 26.06 → 0.5.0
# (docs/releases/software-versions.md, roadmap issue #3754). Nothing in the installed 0.6.2 wheel names a tag, and a
# patch tag (26.08.0x) may carry 0.6.2 exactly: check `pip show megatron-bridge` inside the image before a real run.
DEFAULT_CONTAINER = "nvcr.io/nvidia/nemo:26.08"
DEFAULT_JOB_DIR = "runs/slurm"  # relative paths are under the checkout, runs/... under paths.runs_root()
# Userbuffers (TP overlap) bootstrap over MPI when TE's NCCL bootstrap is off; pmix is what Slurm's srun offers.
DEFAULT_SRUN_ARGS = ("--mpi=pmix",)
PROFILER_CHOICES = {"nsys": "nsys", "torch": "torch_profile"}  # the profile's word → the run's key (runopts.PROFILERS)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(\d+-([01]?\d|2[0-3])|\d+):[0-5]\d:[0-5]\d$")  # HH:MM:SS or D-HH:MM:SS (sbatch --time)
# nemo_run writes `export NAME=value` into the sbatch script without quoting (core/execution/slurm.py), so a value
# with spaces or shell characters would be split or executed.
_UNSAFE = re.compile(r"[\s'\"`$;&|<>()\\]")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


class ProfileError(BadInput):
    """One-line, user-facing."""


def _check(test, message: str):
    def check(value):
        if not test(value):
            raise ValueError(message.format(value=value))
        return value

    return AfterValidator(check)


_MOUNT = 'container_mounts entry {value!r}: use SRC:DST[:FLAGS], e.g. "/lustre:/lustre"'
_SECRET = "secrets entry {value!r} is not an environment variable name (letters, digits, _)"
_TIME_FIX = 'time_limit = {value!r}: use HH:MM:SS or D-HH:MM:SS, e.g. "04:00:00" or "1-00:00:00"'
Mount = Annotated[str, _check(lambda m: ":" in m, _MOUNT)]
SecretName = Annotated[str, _check(_ENV_NAME.match, _SECRET)]
TimeLimit = Annotated[str, _check(_TIME.match, _TIME_FIX)]


@dataclass(frozen=True, config=STRICT)
class ClusterProfile:
    """Where a recipe runs: account, partition, container, mounts, network env, secrets by name."""

    name: str
    account: str
    partition: str
    container_image: str | None = DEFAULT_CONTAINER  # None: no pyxis/enroot (`container_image = ""` in TOML)
    container_mounts: tuple[Mount, ...] = Field(default=(), strict=False)
    gpus_per_node: int = Field(default=8, gt=0)
    time_limit: TimeLimit | None = None  # None: the recipe's time_limit
    srun_args: tuple[str, ...] = Field(default=DEFAULT_SRUN_ARGS, strict=False)
    exclusive: bool = True  # whole nodes: a shared node's traffic would skew the overlap
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # network env (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...)
    secrets: tuple[SecretName, ...] = Field(default=(), strict=False)  # names only; values: the submitting shell's
    job_dir: str = DEFAULT_JOB_DIR  # where nemo_run writes experiments (LocalTunnel/SSHTunnel job_dir)
    # The interpreter each rank runs: the container's `python`, or a venv path; "{repo}" is this checkout.
    python: str = "python"
    # W&B for RUN_NAME runs: project (and entity) here, the key by name only (secrets = ["WANDB_API_KEY"]).
    wandb_project: str | None = None
    wandb_entity: str | None = None
    # Keep Bridge loaded in a plan server on the machine where make runs (overlapkit/cluster/plan_server.py,
    # docs/plan.md): off unless the profile says so, since that machine is often a cluster's shared login node.
    plan_server: bool = False
    # What the nightly profiles its runs with (nightly/nightly.py): Nsight Systems, or Bridge's PyTorch profiler on a
    # cluster without nsys (`profiler = "torch"`); either leaves the overlap report the night reads.
    profiler: Literal["nsys", "torch"] = "nsys"
    path: Path | None = dataclasses.field(default=None, compare=False)

    @field_validator("container_image")
    @classmethod
    def _no_image(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, env) -> dict[str, str]:
        if not isinstance(env, dict):
            raise ValueError(f'env = {env!r}: expected a table, e.g. [env] NCCL_IB_HCA = "mlx5"')
        for key, value in env.items():
            if why := secret_problem(key, value):
                raise ValueError(f"env.{key} has a literal value and {why}: {FIX}")
            if not _ENV_NAME.match(key):
                raise ValueError(f"env key {key!r} is not an environment variable name (letters, digits, _)")
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise ValueError(f'env.{key} = {value!r}: expected a string or integer, e.g. {key} = "1"')
            if _UNSAFE.search(str(value)):
                raise ValueError(
                    f"env.{key} = {str(value)!r}: nemo_run writes `export {key}=value` unquoted into the sbatch "
                    "script; use a value without spaces, quotes or shell characters"
                )
        return {key: str(value) for key, value in env.items()}

    def __post_init__(self):
        """srun's `--export=ALL,NAME=value` or a bare NAME=value puts the value in the sbatch script's srun line, and
        any string of the profile may carry a pasted credential: refuse both (the env table is checked entry by
        entry); a name in both env and secrets is kept in secrets only."""
        for arg in self.srun_args:
            for part in arg.removeprefix("--export=").split(",") if arg.startswith("--export=") else [arg]:
                m = _ASSIGNMENT.match(part)
                if m and (why := secret_problem(m.group(1), m.group(2))):
                    raise ValueError(f"srun_args {m.group(1)}=...: {why}; {FIX}")
        skip = ("secrets", "env", "path")  # secrets are names, env is checked entry by entry
        for key, value in [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip]:
            for item in value if isinstance(value, tuple) else [value]:
                if item and (kind := credential_kind(item)):
                    raise ValueError(f"{key} holds what looks like {kind}: keep credentials out of profiles ({FIX})")
        if both := set(self.env) & set(self.secrets):
            raise ValueError(f"{sorted(both)[0]} is in both env and secrets: keep it in secrets only")

    @property
    def job_path(self) -> Path:
        return in_checkout(self.job_dir)

    @property
    def source(self) -> str:
        return repo_relative(self.path) if self.path else f"profile {self.name} (in memory)"

    def resolved(self, laid_out: bool = False):
        """What a plan reads of this profile (spec/request.py's Cluster): its job directory made absolute; `laid_out`:
        the job's environment is laid out on it (make submit)."""
        from overlapkit.spec.request import Cluster

        where = (self.name, self.source, str(self.job_path), self.time_limit, self.wandb_project, self.wandb_entity)
        return Cluster(*where, dict(self.env), tuple(self.secrets), laid_out)


KEYS = [f.name for f in dataclasses.fields(ClusterProfile) if f.name != "path"]


def _unknown(key: str, _value) -> str:
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.5)
    return f"unknown key {key!r}; " + (f"did you mean {close[0]}?" if close else f"valid: {', '.join(KEYS)}")


_LIST = '{key} = {value!r}: expected a list of strings, e.g. {key} = ["..."]'
MESSAGES = {
    ":unexpected_keyword_argument": _unknown,
    ":missing": 'missing key {key!r}: add {key} = "..." (sinfo -s / sacctmgr show assoc list yours)',
    ":string_type": '{key} = {value!r}: expected a string, e.g. {key} = "..."',
    ":bool_type": "{key} = {value!r}: expected true or false",
    "gpus_per_node": "gpus_per_node = {value!r}: expected a positive integer (8 on an H100 node)",
    "profiler": 'profiler = {value!r}: use "nsys" (Nsight Systems) or "torch" (the PyTorch profiler, no nsys)',
    **dict.fromkeys(("container_mounts", "srun_args", "secrets"), _LIST),
}
