"""Cluster profiles: one TOML file per cluster in `slurm/profiles/<name>.toml`, loaded into a frozen ClusterProfile
(spec/profile.py, whose validation is the profile's); every error is one line naming the fix."""

from __future__ import annotations

import dataclasses
import difflib
import re
import tomllib
from pathlib import Path

from pydantic import ValidationError

from overlapkit import jsonio
from overlapkit.errors import BadInput
from overlapkit.names import checked_name
from overlapkit.paths import REPO_ROOT, repo_relative
from overlapkit.spec import model
from overlapkit.spec.profile import MESSAGES, ClusterProfile, ProfileError
from overlapkit.spec.runopts import directory_problem

PROFILES_DIR = REPO_ROOT / "slurm" / "profiles"


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
    key = "name" if "name" in data else "the file's name"
    try:
        if "path" in data:  # the model's, not the file's: the file is where it was read from
            raise ProfileError(f"{where}: {MESSAGES[':unexpected_keyword_argument']('path', None)}")
        profile = ClusterProfile(**{**data, "name": name, "path": path})
        # the name is a path (runs/calibration/<name>.json, the nightly's folders): a name, or one line naming the fix
        checked_name(name, f"{where}: {key}", "name the cluster with letters, digits, '.', '_' or '-' (e.g. eos)")
    except ValidationError as exc:
        raise ProfileError(f"{where}: {model.problem(exc, data, MESSAGES)}") from None
    except BadInput as exc:
        raise ProfileError(str(exc)) from None
    return with_job_dir(profile, None, where)


def with_job_dir(profile: ClusterProfile, job_dir: str | None, where: str = "JOB_DIR") -> ClusterProfile:
    """`profile` with its job directory `job_dir` (None: its own), a directory or not yet made: runs go under it."""
    out = dataclasses.replace(profile, job_dir=job_dir) if job_dir else profile
    if problem := directory_problem(str(out.job_path)):
        raise ProfileError(f"{where}: job_dir: {problem}: give job_dir a directory on the shared filesystem")
    return out


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
    values = [
        (f.name, getattr(profile, f.name)) for f in dataclasses.fields(ClusterProfile) if f.name not in ("name", "path")
    ]
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
