"""Fill `.whl/` with the wheels a 1-GPU Bridge training check needs on the lent H200 but that its image lacks.

Run with the project venv: `.venv/bin/python tools/device_wheels.py [--dry-run] [--module NAME] [--budget-mib N]`.
Rules from the workplace's device notes (/work/.library/device/README.md, nvidia-h200): the device reaches no index,
so missing packages travel as wheels fetched here with `pip download --no-deps` for cp312/manylinux x86-64; two
versions of one name stop the whole install; the travelling tree is capped at 64 MiB. What the image already holds is
tools/device_packages.txt (from KINDS.md).
How: a probe imports the check's modules in the venv while *blocking* every distribution the device lacks; a
distribution whose blocked import breaks a module is required (carried), one whose absence the code tolerates (a
guarded `try: import`, e.g. flashinfer's 280 MiB of cubins) stays behind, as it would be absent on the device.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WHL = ROOT / ".whl"
# The GPU check's imports; `overlapkit.bridge.stack` is followed by its import_bridge() (offline, with the TE stub).
MODULES = """overlapkit.bridge.stack recipes megatron.bridge.training.pretrain megatron.bridge.training.gpt_step
megatron.bridge.training.setup megatron.bridge.training.train megatron.bridge.models.gpt_provider
megatron.bridge.perf_recipes.llama.h100.llama3 megatron.bridge.perf_recipes.llama.h100.llama31
megatron.bridge.recipes.gpt.h100.gpt3_175b megatron.core.datasets.gpt_dataset
megatron.core.datasets.blended_megatron_dataset_builder""".split()
# The README's platform set; pip matches manylinux_2_N exactly, so a second try adds other N (README: up to 39).
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
PLATFORMS += ["manylinux1_x86_64"]
MORE_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (24, 31, 34, 35, 39)]
# Platform builds the device's own CUDA stack must provide (README: too big; its CUDA build must be used).
NEVER = re.compile(r"^(torch|triton|nvidia-(cu|nccl|nvjitlink|nvshmem|nvtx).*|cuda-(bindings|core|pathfinder))$")
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
ENV.update(sys_platform="linux", platform_machine="x86_64", platform_system="Linux")


def norm(name: str) -> str:  # PEP 503
    return re.sub(r"[-_.]+", "-", name).lower()


PROBE = r"""
import importlib, importlib.metadata as md, json, os, re, sys
a = json.loads(sys.argv[1]); sys.path[:0] = a["path"]; block = set(a["block"])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
owner = {os.path.normpath(d.locate_file(f)): norm(d.metadata["Name"])
         for d in md.distributions() for f in d.files or []}
hits = {}  # blocked module name -> distribution
class Hide:  # wraps each finder: a module whose file belongs to a blocked distribution is "not found", as if absent
    def __init__(self, inner): self.inner = inner
    def __getattr__(self, name): return getattr(self.inner, name)  # find_distributions, invalidate_caches
    def find_spec(self, name, path=None, target=None):
        spec = self.inner.find_spec(name, path, target)
        if spec is not None and (d := owner.get(os.path.normpath(spec.origin or ""))) in block:
            hits[name] = d; return None
        return spec
sys.meta_path[:] = [Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
required, missing, errors = set(), {}, {}
for m in a["modules"]:
    while True:
        try:
            mod = importlib.import_module(m)
            if m == "overlapkit.bridge.stack": mod.import_bridge()
        except Exception as e:
            chain, seen = [e], []  # the blocked import may be wrapped (sympy, transformers' lazy modules re-raise)
            while chain and (x := chain.pop(0)) is not None and x not in seen:
                seen.append(x); chain += [x.__cause__, x.__context__]
            hit = next((x.name for x in seen if isinstance(x, ImportError) and x.name in hits), None)
            if hit:  # a hard import of a blocked distribution: carry it and try again
                required.add(d := hits.pop(hit)); block.discard(d); continue
            if isinstance(e, ModuleNotFoundError) and e.name: missing[e.name] = m
            else: errors[m] = repr(e)
        break
pd, loaded = md.packages_distributions(), set()
for name, mod in list(sys.modules.items()):
    # By file where there is one: top names are ambiguous for namespaces (megatron, google, cuda) and for copies
    # vendored inside another distribution (setuptools' _vendor), which travel with it.
    if f := getattr(mod, "__file__", None): d = owner.get(os.path.normpath(f))
    else: d = norm(ds[0]) if len(ds := pd.get(name.partition(".")[0], [])) == 1 else None
    if d: loaded.add(d)
print("PROBE" + json.dumps(dict(required=sorted(required), loaded=sorted(loaded), missing=missing, errors=errors)))
"""


def probe(modules, block, overlay):  # a fresh process each time: a failed import leaves half-built modules behind
    path = [str(ROOT / "src"), str(ROOT), *map(str, overlay)]
    arg = json.dumps({"path": path, "block": sorted(block), "modules": modules})
    out = subprocess.run([sys.executable, "-c", PROBE, arg], capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("PROBE")), None)
    if line is None:
        sys.exit(f"probe failed:\n{out.stderr[-3000:]}")
    return json.loads(line[5:])


def pip_download(req, dest, platforms):  # the README's command; `python3` here need not be 3.12
    cmd = ["python3", "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp", *(x for p in platforms for x in ("--platform", p)), "-d", str(dest)]
    return subprocess.run([*cmd, req], capture_output=True, text=True).returncode == 0


def wheel_of(name, version, folder):  # version "" matches any
    stem = f"{re.sub(r'[-_.]+', '_', name)}-".lower() + (f"{version}-" if version else "")
    return next((p for p in Path(folder).glob("*.whl") if p.name.lower().startswith(stem)), None)


def fetch(name, ver, tmp):
    """The wheel of name==ver in .whl: kept, copied from tmp, downloaded, or built here from a pure-Python sdist."""
    if have := wheel_of(name, ver, WHL) or wheel_of(name, ver, tmp):
        return (have if have.parent == WHL else Path(shutil.copy(have, WHL))), ""
    if any(pip_download(f"{name}=={ver}", WHL, p) for p in (PLATFORMS, PLATFORMS + MORE_PLATFORMS)):
        return wheel_of(name, ver, WHL), ""
    # No wheel on PyPI (e.g. antlr4-python3-runtime 4.9.3, omegaconf's parser): a wheel built here from the sdist
    # runs on the device only if it is pure Python, whatever Python built it.
    cmd = ["python3", "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", name, f"{name}=={ver}", "-w", str(tmp)]
    subprocess.run(cmd, capture_output=True)
    if (built := wheel_of(name, ver, tmp)) and built.name.endswith("-none-any.whl"):
        return Path(shutil.copy(built, WHL)), "pure-Python wheel built here"
    return None, "sdist only on PyPI, not pure Python: build it for cp312 x86-64 by hand"


def lock_size(entry):
    """Size uv.lock records for the wheel pip would pick: manylinux x86-64 or pure Python, cp312/abi3/py3."""
    ws = [w for w in entry.get("wheels", []) if re.search(r"(manylinux\w*x86_64|none-any)\.whl$", w["url"])]
    ws = [w for w in ws if re.search(r"-(cp312|cp3\d*-abi3|py3\w*)-", w["url"])] or ws
    return max((w.get("size", 0) for w in ws), default=0)


def discover(modules, dists, device, lock, tmp):
    """Probe until nothing new is required; a module installed nowhere here is fetched into an overlay first."""
    block, overlay, extra = set(dists) - set(device), [], {}  # extra: name -> (version, why) of those fetched
    while True:
        res = probe(modules, block, overlay)
        block -= set(res["required"])
        if not res["missing"] and not res["required"]:
            return res, extra
        for mod in res["missing"]:  # uv.lock overrides it away (nvidia-resiliency-ext), or a fetched wheel needs it
            name = norm(mod.partition(".")[0])
            reqs = [r for d in dists.values() for r in map(Requirement, d.requires or []) if norm(r.name) == name]
            spec = ",".join(str(r.specifier) for r in reqs if r.specifier)  # e.g. megatron-core's ==0.6.0 pin
            req = f"{name}=={lock[name]['version']}" if name in lock else name + spec
            if name in extra or not reqs or not pip_download(req, tmp, PLATFORMS + MORE_PLATFORMS):
                sys.exit(f"{mod} is missing here and no requirement names it, or {req} has no wheel: install it")
            whl = wheel_of(name, "", tmp)
            extra[name] = (whl.name.split("-")[1], f"missing on device; not in uv.lock: {req}")
            zipfile.ZipFile(whl).extractall(site := tmp / f"site-{name}")
            overlay.append(site)
            dists.update({norm(d.metadata["Name"]): d for d in md.distributions(path=[str(site)])})


def excluded(why, loaded, dists, device, warnings):
    """Add device packages whose known version a carried distribution's Requires-Dist excludes (to a fixpoint)."""
    changed = True
    while changed:
        changed = False
        for carrier in sorted(why):
            for r in map(Requirement, dists[carrier].requires or []):
                n, dev = norm(r.name), device.get(norm(r.name))
                if n in why or n not in loaded or dev is None or not (r.marker is None or r.marker.evaluate(ENV)):
                    continue
                if not r.specifier.contains(dev, prereleases=True):
                    msg = f"device version {dev} excluded by {carrier}'s {r.name}{r.specifier}"
                    if NEVER.match(n):
                        warnings.append(f"WARNING: {msg}; not carried (the device's own build must be used)")
                    else:
                        why[n], changed = msg, True


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", default=[], help="another module the check imports (repeatable)")
    ap.add_argument("--budget-mib", type=float, default=60.0)
    ap.add_argument("--dry-run", action="store_true", help="probe and list (sizes from uv.lock), download nothing")
    return ap.parse_args()


def main() -> int:
    args = _args()
    lines = [x.strip() for x in (ROOT / "tools" / "device_packages.txt").read_text().splitlines()]
    # name -> the version KINDS.md's pip-list row gives, or None
    device = {norm(n): v or None for n, _, v in (x.partition("==") for x in lines if x and not x.startswith("#"))}
    lock = {norm(p["name"]): p for p in tomllib.loads((ROOT / "uv.lock").read_text())["package"]}
    dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
    with tempfile.TemporaryDirectory(prefix="device_wheels-") as t:
        res, extra = discover(MODULES + args.module, dists, device, lock, tmp := Path(t))
        if res["errors"]:
            sys.exit("imports failed: " + "; ".join(f"{m}: {e}" for m, e in res["errors"].items()))
        loaded = (set(res["loaded"]) & set(dists)) | set(extra)
        why = {n: extra[n][1] if n in extra else "missing on device" for n in loaded if n not in device}
        excluded(why, loaded, dists, device, warnings := [])
        rows, failed = [], []
        WHL.mkdir(exist_ok=True)
        for name in sorted(why):
            ver = extra[name][0] if name in extra else dists[name].version
            entry = lock.get(name, {})
            notes = ["sdist only on PyPI"] if entry and not entry.get("wheels") else []
            if args.dry_run:  # uv.lock's size of the wheel pip would pick, else a wheel already here, else the sdist's
                here = [w for w in (wheel_of(name, ver, WHL), wheel_of(name, ver, tmp)) if w]
                size = lock_size(entry) or (here[0].stat().st_size if here else entry.get("sdist", {}).get("size", 0))
            else:
                path, note = fetch(name, ver, tmp)
                if path is None:
                    failed.append(f"{name}=={ver}: {note}")
                    continue
                size, notes = path.stat().st_size, notes + ([note] if note else [])
                if (glibc := min(map(int, re.findall(r"manylinux_2_(\d+)_", path.name)), default=0)) > 28:
                    notes.append(f"needs glibc >= 2.{glibc} on the device")  # pip refuses the wheel on an older one
            rows.append((name, ver, size, "; ".join([why[name], *notes])))
    if not args.dry_run:  # one version per name: two stop the device's whole install (README)
        keep = {wheel_of(n, v, WHL).name for n, v, *_ in rows}
        for stale in sorted(set(WHL.glob("*.whl")) - {WHL / k for k in keep}):
            print(f"removing stale {stale.name}")
            stale.unlink()
    width, total = max((len(r[0]) for r in rows), default=5), sum(r[2] for r in rows)
    for name, ver, size, reason in rows:
        print(f"{name:<{width}}  {ver:<12} {size / 2**20:7.2f} MiB  {reason}")
    print(f"{'total':<{width}}  {len(rows):<12} {total / 2**20:7.2f} MiB  (budget {args.budget_mib:g} MiB)")
    print("from the device image (loaded, not carried):", " ".join(sorted(loaded - set(why))))
    for warning in warnings:
        print(warning)
    if failed:
        print("NOT carried (fix by hand, then rerun):", *failed, sep="\n  ")
    if total > args.budget_mib * 2**20:
        big = ", ".join(f"{r[0]} {r[2] / 2**20:.0f} MiB" for r in sorted(rows, key=lambda r: -r[2])[:3])
        print(f"over budget: stub or guard the imports that pull in the biggest ({big}), or raise --budget-mib")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
