"""Cluster profiles: where a recipe runs (account, partition, container, mounts, network env, secrets by name).

One TOML file per cluster in `slurm/profiles/<name>.toml`, loaded into a frozen `ClusterProfile`. Every error is one
line that names the fix. Secrets are listed by *name* only (`secrets = ["WANDB_API_KEY"]`): their values stay in the
submitting shell, which sbatch passes to the job by name (`--export=PATH,<secrets>`: cluster/slurm.py export_list),
and are never written anywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from overlapkit import jsonio
from overlapkit.bridge.runopts import directory_problem
from overlapkit.errors import BadInput
from overlapkit.names import checked_name
from overlapkit.paths import REPO_ROOT, in_checkout, repo_relative
from overlapkit.secrets import FIX, credential_kind, secret_problem
from overlapkit.spec.request import Cluster

PROFILES_DIR = REPO_ROOT / "slurm" / "profiles"
# Megatron Bridge v0.6.0's release notes are titled "NeMo Framework 26.08 — Megatron Bridge Release Notes"
# (github.com/NVIDIA-NeMo/Megatron-Bridge/releases/tag/v0.6.0), following 26.04 → 0.4.0 and 26.06 → 0.5.0
# (docs/releases/software-versions.md, roadmap issue #3754). Nothing in the installed 0.6.2 wheel names a tag, and a
# patch tag (26.08.0x) may carry 0.6.2 exactly: check `pip show megatron-bridge` inside the image before a real run.
DEFAULT_CONTAINER = "nvcr.io/nvidia/nemo:26.08"
DEFAULT_JOB_DIR = "runs/slurm"  # relative paths are under the checkout, runs/... under paths.runs_root()
# Userbuffers (TP overlap) bootstrap over MPI when TE's NCCL bootstrap is off; pmix is what Slurm's srun offers.
DEFAULT_SRUN_ARGS = ("--mpi=pmix",)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(\d+-([01]?\d|2[0-3])|\d+):[0-5]\d:[0-5]\d$")  # HH:MM:SS or D-HH:MM:SS (sbatch --time)
# nemo_run writes `export NAME=value` into the sbatch script without quoting (core/execution/slurm.py), so a value
# with spaces or shell characters would be split or executed.
_UNSAFE = re.compile(r"[\s'\"`$;&|<>()\\]")


class ProfileError(BadInput):
    """One-line, user-facing."""


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    account: str
    partition: str
    container_image: str | None = DEFAULT_CONTAINER  # None: no pyxis/enroot (`container_image = ""` in TOML)
    container_mounts: tuple[str, ...] = ()
    gpus_per_node: int = 8
    time_limit: str | None = None  # None: the recipe's time_limit
    srun_args: tuple[str, ...] = DEFAULT_SRUN_ARGS
    exclusive: bool = True  # whole nodes: a shared node's traffic would skew the overlap
    env: dict[str, str] = field(default_factory=dict)  # network env (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...)
    secrets: tuple[str, ...] = ()  # names only; values come from the submitting shell
    job_dir: str = DEFAULT_JOB_DIR  # where nemo_run writes experiments (LocalTunnel/SSHTunnel job_dir)
    # The interpreter each rank runs: the container's `python`, or a venv path; "{repo}" is this checkout.
    python: str = "python"
    # W&B for RUN_NAME runs: project (and entity) here, the key by name only (secrets = ["WANDB_API_KEY"]).
    wandb_project: str | None = None
    wandb_entity: str | None = None
    # Keep Bridge loaded in a plan server on the machine where make runs (launch/plan_server.py, docs/plan.md):
    # off unless the profile says so, since that machine is often a cluster's shared login node.
    plan_server: bool = False
    # What the nightly profiles its runs with (nightly/nightly.py): Nsight Systems, or Bridge's PyTorch profiler on a
    # cluster without nsys (`profiler = "torch"`); either leaves the overlap report the night reads.
    profiler: str = "nsys"
    path: Path | None = field(default=None, compare=False)

    @property
    def job_path(self) -> Path:
        p = Path(self.job_dir).expanduser()
        return p if p.is_absolute() else in_checkout(p)

    @property
    def source(self) -> str:
        return repo_relative(self.path) if self.path else f"profile {self.name} (in memory)"

    def resolved(self, laid_out: bool = False) -> Cluster:
        """What a plan reads of this profile (spec/request.py's Cluster): its job directory made absolute; `laid_out`:
        the job's environment is laid out on it (make submit)."""
        where = (self.name, self.source, str(self.job_path), self.time_limit, self.wandb_project, self.wandb_entity)
        return Cluster(*where, dict(self.env), self.secrets, laid_out)

    def to_dict(self) -> dict:
        return {
            f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else list(v) if isinstance(v, tuple) else v
            for f in fields(self)
        }


_KEYS = [f.name for f in fields(ClusterProfile) if f.name != "path"]
_REQUIRED = ("account", "partition")
_STRINGS = (
    "name",
    "account",
    "partition",
    "container_image",
    "time_limit",
    "job_dir",
    "python",
    "wandb_project",
    "wandb_entity",
    "profiler",
)
PROFILER_CHOICES = {"nsys": "nsys", "torch": "torch_profile"}  # the profile's word → the run's key (runopts.PROFILERS)


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(name_or_path: str | Path) -> ClusterProfile:
    """`local`, `example-eos`, or a path to a .toml file."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not (text.endswith(".toml") or "/" in text):
        path = PROFILES_DIR / f"{text}.toml"
    if not path.is_file():
        avail = list_profiles()
        close = difflib.get_close_matches(path.stem, avail, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ProfileError(
            f"unknown cluster profile {text!r}; {hint}available: {', '.join(avail) or 'none'} "
            f"(add slurm/profiles/<name>.toml)"
        )
    try:
        data = tomllib.loads(jsonio.read_bytes(path, PROFILE_LIMIT).decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{repo_relative(path)}: invalid TOML: {' '.join(str(exc).split())}") from None
    return parse_profile(data, name=data.get("name", path.stem), path=path)


PROFILE_LIMIT = 1 << 20  # a profile is a few hundred bytes; a planted FIFO or a huge file is refused, never read


def parse_profile(data: dict, *, name: str, path: Path | None = None) -> ClusterProfile:
    """Validate a profile's TOML table; every error is one line naming the file, the key and the fix."""
    where = repo_relative(path) if path else f"profile {name}"

    def fail(msg: str):
        raise ProfileError(f"{where}: {msg}")

    for key in data:
        if key not in _KEYS:
            close = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.5)
            fail(f"unknown key {key!r}; " + (f"did you mean {close[0]}?" if close else f"valid: {', '.join(_KEYS)}"))
    for key in _REQUIRED:
        if key not in data:
            fail(f'missing key {key!r}: add {key} = "..." (sinfo -s / sacctmgr show assoc list yours)')
    out: dict = {"name": name, "path": path}
    for key in _STRINGS:
        if key in data:
            if not isinstance(data[key], str):
                fail(f'{key} = {data[key]!r}: expected a string, e.g. {key} = "..."')
            out[key] = data[key]
    # the name is a path (runs/calibration/<name>.json, the nightly's folders): a name, or one line naming the fix
    key = "name" if "name" in data else "the file's name"
    try:
        checked_name(name, f"{where}: {key}", "name the cluster with letters, digits, '.', '_' or '-' (e.g. eos)")
    except BadInput as exc:
        raise ProfileError(str(exc)) from None
    if "container_image" in out:
        out["container_image"] = out["container_image"] or None
    if out.get("profiler", "nsys") not in PROFILER_CHOICES:
        fail(f'profiler = {out["profiler"]!r}: use "nsys" (Nsight Systems) or "torch" (the PyTorch profiler, no nsys)')
    if out.get("time_limit") is not None and not _TIME.match(out["time_limit"]):
        fail(f'time_limit = {out["time_limit"]!r}: use HH:MM:SS or D-HH:MM:SS, e.g. "04:00:00" or "1-00:00:00"')
    for key in ("container_mounts", "srun_args", "secrets"):
        if key in data:
            value = data[key]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                fail(f'{key} = {value!r}: expected a list of strings, e.g. {key} = ["..."]')
            out[key] = tuple(value)
    for mount in out.get("container_mounts", ()):
        if ":" not in mount:
            fail(f'container_mounts entry {mount!r}: use SRC:DST[:FLAGS], e.g. "/lustre:/lustre"')
    for secret in out.get("secrets", ()):
        if not _ENV_NAME.match(secret):
            fail(f"secrets entry {secret!r} is not an environment variable name (letters, digits, _)")
    if "gpus_per_node" in data:
        gpn = data["gpus_per_node"]
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
            fail(f"gpus_per_node = {gpn!r}: expected a positive integer (8 on an H100 node)")
        out["gpus_per_node"] = gpn
    for key in ("exclusive", "plan_server"):
        if key in data:
            if not isinstance(data[key], bool):
                fail(f"{key} = {data[key]!r}: expected true or false")
            out[key] = data[key]
    if "env" in data and not isinstance(data["env"], dict):
        fail(f'env = {data["env"]!r}: expected a table, e.g. [env] NCCL_IB_HCA = "mlx5"')
    for key, value in data.get("env", {}).items():
        if why := secret_problem(key, value):
            fail(f"env.{key} has a literal value and {why}: {FIX}")
        if not _ENV_NAME.match(key):
            fail(f"env key {key!r} is not an environment variable name (letters, digits, _)")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            fail(f'env.{key} = {value!r}: expected a string or integer, e.g. {key} = "1"')
        if _UNSAFE.search(str(value)):
            fail(
                f"env.{key} = {str(value)!r}: nemo_run writes `export {key}=value` unquoted into the sbatch "
                "script; use a value without spaces, quotes or shell characters"
            )
        out.setdefault("env", {})[key] = str(value)
    _refuse_literal_secrets(out, fail)
    both = set(out.get("env", {})) & set(out.get("secrets", ()))
    if both:
        fail(f"{sorted(both)[0]} is in both env and secrets: keep it in secrets only")
    return with_job_dir(ClusterProfile(**out), out.get("job_dir"), where)


def with_job_dir(profile: ClusterProfile, job_dir: str | None, where: str = "JOB_DIR") -> ClusterProfile:
    """`profile` with its job directory `job_dir` (None: its own), which must be a directory or not exist yet: runs,
    checkpoints and logs all go under it."""
    out = dataclasses.replace(profile, job_dir=job_dir) if job_dir else profile
    if problem := directory_problem(str(out.job_path)):
        raise ProfileError(f"{where}: job_dir: {problem}: give job_dir a directory on the shared filesystem")
    return out


_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def _refuse_literal_secrets(out: dict, fail) -> None:
    """srun's `--export=ALL,NAME=value` or a bare NAME=value puts the value in the sbatch script's srun line, and any
    string of the profile may carry a pasted credential: refuse both (the env table is checked entry by entry)."""
    for arg in out.get("srun_args", ()):
        for part in arg.removeprefix("--export=").split(",") if arg.startswith("--export=") else [arg]:
            m = _ASSIGNMENT.match(part)
            if m and (why := secret_problem(m.group(1), m.group(2))):
                fail(f"srun_args {m.group(1)}=...: {why}; {FIX}")
    for key in (*_STRINGS, "container_mounts", "srun_args"):
        for value in out.get(key) if isinstance(out.get(key), tuple) else [out.get(key)]:
            if value and (kind := credential_kind(value)):
                fail(f"{key} holds what looks like {kind}: keep credentials out of profiles ({FIX})")


# The example profile's placeholders (slurm/profiles/example-eos.toml), and any <...> left in a value: a copied,
# unedited profile would queue under an account that is not the user's, or make its placeholder job directory.
_PLACEHOLDER = re.compile(r"\bmy-(account|team|project|user|cluster)\b|CHANGE|<[^<>]*>")
# What to put instead, by key (the example's own CHANGE comments say the same).
_PUT = {
    "account": "your Slurm account (sacctmgr show assoc user=$USER format=account)",
    "partition": "a partition you may use (sinfo -s)",
    "job_dir": "a directory on the shared filesystem every node sees",
    "container_mounts": "SRC:DST mounts of your site's shared filesystem",
    "wandb_project": "your W&B project, or remove the line",
    "wandb_entity": "your W&B team, or remove the line",
}


def placeholder_problem(profile: ClusterProfile) -> str | None:
    """The first value of `profile` still holding a placeholder, as `file:line: key = value ...: put <what>` (one
    line), else None. What a submission (dry run included) and a script for sbatch refuse; a plan may use one."""
    values = [(f.name, getattr(profile, f.name)) for f in fields(ClusterProfile) if f.name not in ("name", "path")]
    values += [(f"env.{k}", v) for k, v in profile.env.items()]
    for key, value in values:
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, str) and _PLACEHOLDER.search(item):
                put = _PUT.get(key, "your site's value")
                return f"{_line_of(profile, key, item)}: {key} = {item!r} is a placeholder: put {put}"
    return None


def _line_of(profile: ClusterProfile, key: str, value: str) -> str:
    """`file:line` of `value` in the profile's file (the first line that states it), or the profile's source."""
    if profile.path is None:
        return profile.source
    try:
        lines = jsonio.read_bytes(profile.path, PROFILE_LIMIT).decode().splitlines()
    except (OSError, BadInput, UnicodeDecodeError):
        return profile.source
    quoted = (f'"{value}"', f"'{value}'")
    bare = key.removeprefix("env.")
    for i, line in enumerate(lines, 1):
        stated = line.split("#")[0]  # a value in a comment is not the profile's
        if any(q in stated for q in quoted) and (bare in stated or "=" not in stated):
            return f"{profile.source}:{i}"
    return profile.source
