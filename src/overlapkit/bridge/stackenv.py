"""A candidate stack (`STACK="megatron-bridge==0.6.0 megatron-core==0.19.0"`) in its own environment, built by uv.

The candidate is this project with the given pins swapped into a copy of pyproject.toml, locked by `uv lock` from
this checkout's uv.lock (only what the new pins force moves), installed by `uv sync --frozen` into a virtual
environment of its own (the checkout's .venv is never touched) in the cache directory (OVERLAPKIT_STACKS, else
~/.cache/overlapkit/stacks) under a hash of the pins, uv.lock and pyproject.toml: built once, then reused. A stack
that does not install is one line from uv. The candidate python runs this checkout's src/ and recipes/.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from overlapkit import jsonio, paths
from overlapkit.errors import BadInput

STACKS_VAR = "OVERLAPKIT_STACKS"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
EXTRA = ("transformer-engine",)  # the gpu extra's package: not in the CPU lock, still a stack's part
MARKER = "stack.json"  # written last: an environment without it is half-built and rebuilt


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Stack:
    """The candidate's pins (normalised name → version), as typed."""

    pins: dict[str, str]

    @property
    def spec(self) -> str:
        return " ".join(f"{n}=={v}" for n, v in sorted(self.pins.items()))


def locked(lock: Path | None = None) -> dict[str, str]:
    """Every package of uv.lock: name → version."""
    data = tomllib.loads((lock or paths.REPO_ROOT / "uv.lock").read_text())
    return {_norm(p["name"]): p.get("version", "") for p in data.get("package", [])}


def parse(text: str, lock: Path | None = None) -> Stack:
    """STACK's text: space-separated `name==version` pins of packages this project installs (or transformer-engine)."""
    tokens = text.replace(",", " ").split()
    if not tokens:
        raise BadInput('STACK is empty: give pins, e.g. STACK="megatron-bridge==0.6.0 megatron-core==0.19.0"')
    known, pins = locked(lock), {}
    for tok in tokens:
        if not (m := PIN.match(tok)):
            raise BadInput(f"STACK: {tok!r} is not name==version (exact pins only, e.g. megatron-core==0.19.0)")
        name = _norm(m[1])
        if name not in known and name not in EXTRA:
            near = difflib.get_close_matches(name, [*known, *EXTRA], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BadInput(f"STACK: {m[1]} is not a package of this project's stack (uv.lock){hint}")
        if name in pins:
            raise BadInput(f"STACK: {m[1]} is pinned twice: give each package once")
        pins[name] = m[2]
    return Stack(pins)


def pinned_stack() -> Stack:
    """The checkout's own pins of Bridge and Core, as a Stack (the identical-stack case)."""
    have = locked()
    return Stack({n: have[n] for n in ("megatron-bridge", "megatron-core")})


def cache_root() -> Path:
    if env := os.environ.get(STACKS_VAR):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "overlapkit" / "stacks"


def key(stack: Stack, root: Path = paths.REPO_ROOT) -> str:
    h = hashlib.sha256(stack.spec.encode())
    for name in ("uv.lock", "pyproject.toml"):
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def swapped_pyproject(text: str, stack: Stack) -> str:
    """pyproject.toml's text with each pin of `stack` in place of the project's: a dependency line naming the package
    gets the new pin; a package the project does not list is added to its dependencies."""
    out, missing = text, dict(stack.pins)
    for name, version in stack.pins.items():
        pattern = re.compile(rf'^(\s*)"{re.escape(name)}(\[[^\]]*\])?[^"]*"', re.M | re.I)
        out, n = pattern.subn(lambda m, n=name, v=version: f'{m[1]}"{n}{m[2] or ""}=={v}"', out, count=1)
        if n:
            missing.pop(name)
    if missing:
        added = "".join(f'    "{n}=={v}",\n' for n, v in missing.items())
        out = out.replace("dependencies = [\n", "dependencies = [\n" + added, 1)
    return out


def uv_line(stderr: str) -> str:
    """uv's one line of why: the cause of a failed resolution, else its first error line."""
    lines = [ln.strip().lstrip("╰─▶ ").strip() for ln in stderr.splitlines() if ln.strip()]
    for prefix in ("cause:", "Because"):
        for ln in lines:
            if ln.startswith(prefix):
                return ln.removeprefix("cause:").strip()
    errors = [ln for ln in lines if ln.startswith(("error:", "×"))]
    return (errors or lines or ["no output"])[0].removeprefix("error:").lstrip("× ").strip()


def _run(cmd: list[str], cwd: Path, stack: Stack, env: dict) -> None:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise BadInput(f"stack {stack.spec} does not install: uv: {uv_line(out.stderr)}")


@dataclass(frozen=True)
class Env:
    """A built candidate environment: its python, its lock and what it holds."""

    root: Path
    stack: Stack
    built: bool  # True when this call built it, False when it was reused

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def lock(self) -> Path:
        return self.root / "project" / "uv.lock"


def build(stack: Stack, offline: bool = False, root: Path | None = None, say=None) -> Env:
    """The environment of `stack`, built by uv in the cache when absent (half a build is redone), else reused."""
    where = (root or cache_root()) / key(stack)
    if (where / MARKER).is_file() and (where / "venv" / "bin" / "python").exists():
        return Env(where, stack, built=False)
    if say:
        say(f"building the candidate stack {stack.spec} with uv into {where} (once: later runs reuse it)")
    shutil.rmtree(where, ignore_errors=True)
    project = where / "project"
    project.mkdir(parents=True)
    src = paths.REPO_ROOT
    (project / "pyproject.toml").write_text(swapped_pyproject((src / "pyproject.toml").read_text(), stack))
    shutil.copyfile(src / "uv.lock", project / "uv.lock")
    shutil.copyfile(src / "README.md", project / "README.md")  # pyproject names it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    env["UV_PROJECT_ENVIRONMENT"] = str(where / "venv")
    uv, flags = str(src / "tools" / "uv.sh"), ["--offline"] if offline else []
    try:
        _run([uv, "lock", "--quiet", *flags], project, stack, env)
        _run([uv, "sync", "--frozen", "--quiet", "--no-install-project", "--no-dev", *flags], project, stack, env)
    except BadInput:
        shutil.rmtree(where, ignore_errors=True)  # nothing half-built is left to take for a stack
        raise
    jsonio.write_json(where / MARKER, {"stack": stack.spec, "lock": "project/uv.lock"})
    return Env(where, stack, built=True)


def changed_packages(a: Path, b: Path) -> list[dict]:
    """Packages whose locked version differs between the locks `a` and `b` (added/removed: None on one side)."""
    la, lb = locked(a), locked(b)
    return [
        {"package": n, "pinned": la.get(n), "candidate": lb.get(n)}
        for n in sorted(set(la) | set(lb))
        if la.get(n) != lb.get(n) and n != "h100-overlap-recipes"
    ]


def pythonpath() -> dict:
    """The environment a stack's python plans in: this checkout's src/ and root (recipes/, launch/) first."""
    env = dict(os.environ)
    here = [str(paths.REPO_ROOT / "src"), str(paths.REPO_ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(here + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("VIRTUAL_ENV", None)
    return env
