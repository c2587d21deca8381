"""`make docs` (`python tools/docs.py [--check]`): every figure the README and docs/ show is produced here by the
code that makes it, never typed.

A figure sits in a marked region of its page, `<!-- make docs: NAME -->` ... `<!-- /make docs -->`: a block (the
markers on lines of their own: a command's real output, a table) or a figure inside a sentence (both markers
inline). `make docs` rewrites every region with what REGIONS[NAME] produces today; tests/unit_tests/test_docs.py
runs the same code in-process and fails, naming `make docs`, when a committed region differs, so a model change
that moves a number fails until the docs are regenerated.

The outputs are the commands' own (launch/commands.py, in this process), as a 120-column terminal shows them, with
the published throughput constants (a `make calibrate` fit of this checkout is left out), the shipped recipes only,
no shell exports of launch variables, and placeholders for what changes from run to run (the run directory's time,
a scratch directory). What no test can produce, a wall time (`make bench`, the suite), is no region: it is a
measured fact with its date and command (docs/architecture.md, measured facts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from overlapkit import paths
from overlapkit.bridge import stack
from overlapkit.errors import BadInput

ROOT = paths.REPO_ROOT
WIDTH = 120  # the terminal the excerpts are shown at
REGION = re.compile(r"<!-- make docs: (?P<name>[a-z0-9-]+) -->(?P<body>.*?)<!-- /make docs -->", re.S)
# Launch variables a shell may export (the ledger shows them as overrides): not part of a doc's excerpt.
LAUNCH_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS", "NVTE_", "NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF")
R70 = "llama3_70b_pretrain_64gpu_h100_bf16"
Q30 = "qwen3_30b_a3b_pretrain_16gpu_h100_bf16"
FORK_34B = ["--from", R70, "--name", "llama3_34b_pretrain_32gpu_h100_bf16", "--layers", "48", "--ffn", "22016"]
FORK_MOE = ["--from", Q30, "--name", "qwen3_60b_a6b_pretrain_32gpu_h100_bf16", "--layers", "64", "--experts", "256"]
MOE_ERROR_SET = "model.recompute_granularity=full"
NCCLEP_SET = "model.moe_flex_dispatcher_backend=ncclep model.moe_expert_rank_capacity_factor=2.0"


STALE = "is not what the code produces today"


class DocsError(BadInput):
    """A page's regions do not match REGIONS (unknown, missing or doubled), or an excerpt's premise stopped holding."""


@dataclasses.dataclass
class Run:
    """One command's output in this process: exit status, stdout and stderr, the scratch directory it wrote in."""

    code: int
    out: str
    err: str
    scratch: str
    files: dict[str, str]  # name -> text of each recipe file it left in the scratch directory

    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.out.replace(self.scratch, "<scratch>").splitlines()]


@contextlib.contextmanager
def isolated():
    """What the excerpts must not depend on: this checkout's calibration, RECIPES_PATH, the shell's launch variables."""
    saved = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="okdocs-") as empty:
        from overlapkit.sizing import calibration

        for name in [n for n in os.environ if n.startswith(LAUNCH_VARS)] + ["RECIPES_PATH"]:
            os.environ.pop(name, None)
        os.environ[calibration.DIR_VAR] = empty  # no fit there: the published constants
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


def command_output(name: str, argv: list[str]) -> Run:
    """`python -m launch <name> <argv>` in this process (no plan server), at WIDTH columns, into a scratch directory
    (`--runs` or `--recipes-dir`, whichever the command takes, for what it writes)."""
    from launch import commands
    from overlapkit.bridge import registry
    from overlapkit.profile import overlap_render

    plain = overlap_render.console
    before = set(registry.names())
    with tempfile.TemporaryDirectory(prefix="okdocs-") as scratch:
        flag = {"plan": ["--runs", scratch], "new-recipe": ["--recipes-dir", scratch]}.get(name, [])
        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(overlap_render, "console", lambda file=None, width=None: plain(file, width or WIDTH)):
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = commands.call(name, [*argv, *flag])
        for added in set(registry.names()) - before:  # a fork registers its recipe: this process forgets it
            registry.unregister(added)
        files = {f.name: f.read_text() for f in Path(scratch).glob("*.py")}  # our own scratch directory
        return Run(code, out.getvalue(), err.getvalue(), scratch, files)


class Outputs:
    """The commands the regions quote, each run once per generation."""

    @functools.cached_property
    def plan_70b(self) -> list[str]:
        r = command_output("plan", [R70])
        _expect(r.code == 0, f"make plan RECIPE={R70} exited {r.code}: {r.err.strip()}")
        return [
            re.sub(r"^run directory: .*/([^/]+)-\d{8}-\d{6}$", r"run directory: runs/\1-<UTC time>", x)
            for x in r.lines()
        ]

    @functools.cached_property
    def recipes(self) -> list[str]:
        from overlapkit.bridge import registry

        r = command_output("recipes", [])
        others = {n for n in registry.names() if not registry.shipped(n)}
        return [x for x in r.lines() if not (x.split() and x.split()[0] in others)]

    @functools.cached_property
    def fork_34b(self) -> Run:
        return command_output("new-recipe", FORK_34B)

    @functools.cached_property
    def fork_moe(self) -> Run:
        return command_output("new-recipe", FORK_MOE)

    @functools.cached_property
    def plans(self) -> dict:
        """Every shipped recipe planned as `make recipes` plans it (no overrides, no shell exports)."""
        from overlapkit.bridge import registry
        from overlapkit.bridge.build import make_plan

        return {n: make_plan(n, caller_env={}) for n in registry.names() if registry.shipped(n)}


def _expect(ok: bool, why: str) -> None:
    if not ok:
        raise DocsError(f"make docs: {why}")


def fence(lines: list[str], lang: str = "") -> str:
    return "\n```" + lang + "\n" + "\n".join(lines) + "\n```\n"


# --- the plan excerpts ----------------------------------------------------------------------------------------------


def blocks(lines: list[str]) -> list[list[str]]:
    """A rendered plan as its blocks: a table (its title line through its bottom rule) or a single line."""
    out, i = [], 0
    while i < len(lines):
        if i + 1 < len(lines) and lines[i + 1].startswith("┏"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("└"))
            out.append(lines[i : end + 1])
            i = end + 1
        else:
            out.append([lines[i]])
            i += 1
    return out


def excerpt(lines: list[str], keep: tuple[str, ...], only: tuple[str, ...] = ("",), rows=None) -> list[str]:
    """The plan's lines with the tables whose title starts with one of `keep` shown (their rows cut by `rows`, a
    function of the table), the others named in one `… <titles> tables …` line before the single lines that
    followed them, and of those single lines only the ones starting with one of `only`."""
    out, elided, pending = [], [], []
    for b in blocks(lines):
        if len(b) > 1 and not b[0].startswith(keep):
            title = re.sub(r"\s*\(.*", "", b[0]).strip()
            elided.append(title[0].lower() + title[1:])
        elif len(b) == 1:
            pending += b if b[0].startswith(only) else []
        else:
            out += _elision(elided) + pending + (rows(b) if rows and b[0].startswith("Overlap stack") else b)
            elided, pending = [], []
    return out + _elision(elided) + pending


def _elision(titles: list[str]) -> list[str]:
    if not titles:
        return []
    names = titles[0] if len(titles) == 1 else f"{', '.join(titles[:-1])} and {titles[-1]}"
    return [f"… {names} {'tables' if len(titles) > 1 else 'table'} …"]


def table_rows(table: list[str]) -> list[tuple[str, str, list[str]]]:
    """(name, state, its lines) per row of a rendered overlap table (a wrapped row's lines together)."""
    rows = []
    for line in table[4:-1]:
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            rows.append((cells[0], cells[1], [line]))
        else:
            rows[-1][2].append(line)
    return rows


def cut_rows(table: list[str], shown: set[str]) -> list[str]:
    """The overlap table with only the `shown` rows, the others summed up in one line by state."""
    out, hidden = table[:4], []
    for name, state, lines in table_rows(table):
        if name in shown:
            if hidden:
                out.append(_summary(hidden))
                hidden = []
            out += lines
        else:
            hidden.append((name, state))
    return out + ([_summary(hidden)] if hidden else []) + table[-1:]


def _summary(hidden: list[tuple[str, str]]) -> str:
    by_state: dict[str, list[str]] = {}
    for name, state in hidden:
        by_state.setdefault(state, []).append(name)
    return f"… {len(hidden)} rows: " + "; ".join(f"{', '.join(n)} {s}" for s, n in by_state.items()) + " …"


README_ROWS = {"tp_comm_overlap", "overlap_p2p_comm", "overlap_grad_reduce", "overlap_param_gather"}


def readme_plan(o: Outputs) -> str:
    cut = functools.partial(cut_rows, shown=README_ROWS | {"CUDA_DEVICE_MAX_CONNECTIONS"})
    lines = excerpt(
        o.plan_70b,
        keep=("Overlap stack",),
        only=(R70, "64 GPUs", "memory (", "predicted on", "audit:", "run directory:"),
        rows=cut,
    )
    return fence([f"$ make plan RECIPE={R70}", *lines])


def plan_70b(o: Outputs) -> str:
    lines = excerpt(o.plan_70b, keep=("Overlap stack", "What each overlap"))
    return fence([f"$ make plan RECIPE={R70}", *lines])


def worth_pct(plan, key: str) -> str:
    """What overlap `key` (a field of sizing.throughput.Overlaps) is worth on `plan`, as `make plan` prints it."""
    _expect(key in plan.worth, f"{plan.recipe.name} has no {key} overlap worth: rewrite the sentence around it")
    return f"{plan.worth[key].delta_pct:+.1f}%"


def recipes_list(o: Outputs) -> str:
    return fence(["$ make recipes", *o.recipes])


def readme_recipes(o: Outputs) -> str:
    """README's recipe table: one row per model and size, its BF16 and FP8 recipes side by side."""
    from overlapkit.bridge.report import overlap_summary

    pairs: dict[str, dict] = {}
    for name, p in o.plans.items():
        family, _, dtype = name.rpartition("_")
        pairs.setdefault(family, {})[dtype] = p
    _expect(all(set(d) == {"bf16", "fp8cs"} for d in pairs.values()), "a recipe without its BF16/FP8 twin")
    lines = [
        "| recipe | model | GPUs | TP/PP/CP/VP/EP/DP | overlaps on | TFLOP/s bf16, fp8 |",
        "|---|---|---|---|---|---|",
    ]
    for family, d in sorted(pairs.items(), key=lambda kv: _size(kv[1]["bf16"])):
        bf, fp = d["bf16"], d["fp8cs"]
        lay = [_layout(bf), _layout(fp)]
        on = [set(overlap_summary(p.report).split()) - {"FP8-AG"} for p in (bf, fp)]
        layout = lay[0] + (f" (fp8: {lay[1]})" if lay[1] != lay[0] else "")
        ovl = " ".join(x for x in overlap_summary(bf.report).split() if x in on[0])
        diff = [f"no {x}" for x in sorted(on[0] - on[1])] + [f"+{x}" for x in sorted(on[1] - on[0])]
        ovl += f" (fp8: {', '.join(diff)})" if diff else ""
        tflops = f"{bf.throughput.tflops_per_gpu:.0f}, {fp.throughput.tflops_per_gpu:.0f}"
        model = bf.to_dict()["layout"]["model"]
        lines.append(f"| `{family}_*` | {model} | {bf.target.world_size} | {layout} | {ovl} | {tflops} |")
    return "\n" + "\n".join(lines) + "\n"


def _layout(p) -> str:
    lay = p.to_dict()["layout"]
    return f"{lay['tp']}/{lay['pp']}/{lay['cp']}/{lay['vpp'] or '-'}/{lay.get('ep', 1)}/{lay['dp']}"


def _size(p) -> tuple:
    """Dense models first, then MoE; each by parameter count, then GPUs."""
    lay = p.to_dict()["layout"]
    return ("ep" in lay, lay["params_b"], p.target.world_size)


# --- forking.md -----------------------------------------------------------------------------------------------------


def fork_moe(o: Outputs) -> str:
    r = o.fork_moe
    _expect(r.code == 0, f"the MoE fork example exited {r.code}: {r.err.strip()}")
    cmd = "$ make new-recipe FROM={} NAME={} LAYERS={} EXPERTS={}".format(*FORK_MOE[1::2])
    return fence([cmd, *r.lines()[1:3]])


def fork_34b(o: Outputs) -> str:
    r = o.fork_34b
    _expect(r.code == 0, f"the 34B fork example exited {r.code}: {r.err.strip()}")
    cmd = [
        f"$ python -m launch new-recipe {' '.join(FORK_34B[:4])} \\",
        f"      {' '.join(FORK_34B[4:])} --recipes-dir <scratch>",
    ]
    return fence([*cmd, *r.lines()])


def fork_34b_file(o: Outputs) -> str:
    r = o.fork_34b
    text = r.files.get(f"{FORK_34B[3]}.py")
    _expect(text is not None, f"the 34B fork wrote no {FORK_34B[3]}.py")
    return fence(text.rstrip("\n").splitlines(), "python")


def fork_34b_why(o: Outputs) -> str:
    """Why the search picks the 34B's layout, in the search's own words (each candidate's `loses`) and figures."""
    from launch import new_recipe
    from overlapkit.fork import layout_search, scaffold

    args = new_recipe.parse(FORK_34B)
    new_recipe.check(args)  # as make new-recipe checks it: GPU= read, the request made
    req = args.request
    recipe, gbs, _ = scaffold.from_recipe(req, "bf16")  # the fork's own config at each layout, as the search ranks it
    shape = recipe.shape
    cands = layout_search.search(recipe, 32, gbs=gbs, top=10**6)  # every layout that fits, ranked, with `loses`
    chosen, best = cands[0], max(cands, key=lambda c: c.tflops)
    lead = max((c for c in cands if not layout_search.tight(c) and c.dp > 1), key=lambda c: c.tflops)
    old = next((c for c in cands if (c.tp, c.pp, c.cp, c.mbs) == (4, 1, 2, 1)), None)
    _expect(old is not None and chosen.exact_preset and best is not chosen, "the 34B example's premises changed")
    passes = [shape.layers // c.pp * (c.gbs // (c.dp * c.mbs)) for c in (old, chosen)]
    text = (
        f"Why {chosen.describe()}: of the {len(cands)} layouts that fit, the best prediction is {best.describe()} "
        f"({best.tflops:.0f} TFLOP/s/GPU), which ranks in place {cands.index(best) + 1}: {best.loses}. A layout "
        "with 10% of the memory budget free ranks before any without, and then one with DP>1 before DP1 (no DP "
        f"overlap, which the audit warns about). Of those, the best prediction is {lead.describe()} ({lead.tflops:.0f} "
        "TFLOP/s/GPU); every layout within 2% of it is a tie, broken by the rules: an exact Bridge userbuffers "
        f"preset (`{chosen.preset}`), then the smallest PP ({chosen.pp}), then the largest VPP that keeps ≥ 2 "
        f"layers per chunk ({chosen.vpp}). The rules alone used to choose {old.describe()} "
        f"({old.memory.total_gb:.1f} GB): {old.loses}, because each GPU then runs {shape.layers} layers × "
        f"{old.gbs // (old.dp * old.mbs)} microbatches per step, {passes[0] / passes[1]:.0f}× the layer passes of "
        f"PP{chosen.pp}, and pays the per-layer non-GEMM time on each. The file it wrote:"
    )
    return "\n" + textwrap.fill(text, 120, break_long_words=False, break_on_hyphens=False) + "\n"


FORK_ERRORS = [
    [*FORK_34B, "--heads", "60"],
    ["--from", R70, "--name", "llama3_70b_pretrain_8gpu_h100_bf16"],
    ["--from", R70, "--name", R70],
    [*FORK_34B, "--gpus", "64"],
]


def fork_errors(o: Outputs) -> str:
    lines = []
    for argv in FORK_ERRORS:
        r = command_output("new-recipe", argv)
        _expect(r.code == 2 and r.err.startswith("error: "), f"new-recipe {' '.join(argv)} exited {r.code}")
        lines += [f"$ python -m launch new-recipe {' '.join(argv)}", *r.err.rstrip("\n").splitlines()]
    return fence(lines)


def memory_table(o: Outputs) -> str:
    head = "| recipe | TP/PP/CP/VP/DP | weights | grads | optimizer | activations | logits | userbuffers | reserve "
    head += "| total GiB | free |"
    lines = [head, "|---|---|" + "---:|" * 9]
    for name, p in sorted(o.plans.items()):
        lay, m = p.to_dict()["layout"], p.memory
        if "ep" in lay:
            continue  # MoE memory terms: docs/moe.md
        terms = (
            m.weights_gb,
            m.grads_gb,
            m.optimizer_gb,
            m.activations_gb,
            m.logits_gb,
            m.comm_buffers_gb,
            m.reserve_gb,
        )
        split = f"{lay['tp']}/{lay['pp']}/{lay['cp']}/{lay['vpp'] or '-'}/{lay['dp']}"
        cells = " | ".join(f"{x:.1f}" for x in (*terms, m.total_gb, m.headroom_gb))
        lines.append(f"| `{name}` | {split} | {cells} |")
    return "\n" + "\n".join(lines) + "\n"


# --- moe.md ---------------------------------------------------------------------------------------------------------

MOE_MODELS = ("qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "gpt_oss_120b")


def _moe_plan(o: Outputs, model: str):
    return next(p for n, p in o.plans.items() if n.startswith(model + "_pretrain_") and n.endswith("_bf16"))


BACKENDS = {"hybridep": "HybridEP", "deepep": "DeepEP"}
KEPT_OFF = {"tp_comm_overlap": "TP", "overlap_p2p_comm": "p2p", "overlap_grad_reduce": "DP grad-reduce"}
KEPT_OFF["ep_a2a_overlap"] = "EP"


def moe_cells(p) -> tuple[str, ...]:
    """One MoE recipe's row of docs/moe.md's table: layout, dispatcher, EP overlap, kept off, connections."""
    lay, m, state = p.to_dict()["layout"], p.cfg.model, {r.name: r.state for r in p.report.rows}
    vp = f" VP{lay['vpp']}" if lay["vpp"] else ""
    layout = f"TP{lay['tp']} PP{lay['pp']}{vp} EP{lay['ep']}, expert-DP {lay['expert_dp']}"
    kind = m.moe_token_dispatcher_type
    dispatcher = f"flex / {BACKENDS.get(m.moe_flex_dispatcher_backend, m.moe_flex_dispatcher_backend)}"
    ep = state.get("ep_a2a_overlap", "n/a") + (" + delayed wgrad" if state.get("delay_wgrad_compute") == "on" else "")
    off = [KEPT_OFF[name] for name in KEPT_OFF if p.intent.why_off(name)]
    kept = (", ".join(off[:-1]) + " and " + off[-1] if len(off) > 1 else off[0]) + " overlap" if off else "–"
    conns = next((str(e.value) for e in p.ledger.entries if e.name == "CUDA_DEVICE_MAX_CONNECTIONS"), "–")
    return layout, dispatcher if kind == "flex" else kind, ep, kept, conns


def moe_table(o: Outputs) -> str:
    head = "| recipe | layout (EP, expert-DP) | dispatcher | EP overlap | kept off, as NVIDIA does | "
    lines = [head + "CUDA_DEVICE_MAX_CONNECTIONS |", "|---" * 6 + "|"]
    for model in MOE_MODELS:
        twins = {n: moe_cells(p) for n, p in o.plans.items() if n.startswith(model + "_pretrain_")}
        names = sorted(twins)
        if len(set(twins.values())) == 1:  # both precisions alike: one row
            family = names[0].rpartition("_")[0]
            names = [f"{family}_{{{','.join(n.rpartition('_')[2] for n in sorted(twins))}}}"]
            twins = {names[0]: next(iter(twins.values()))}
        lines += [f"| `{n}` | " + " | ".join(twins[n]) + " |" for n in names]
    return "\n" + "\n".join(lines) + "\n"


def moe_params(o: Outputs) -> str:
    """The 235B header's parameter count, as `make plan` prints it."""
    from overlapkit.bridge.report import render_plan

    plan, out = _moe_plan(o, "qwen3_235b_a22b"), io.StringIO()
    from overlapkit.profile.overlap_render import console

    render_plan(plan, console(file=out, width=WIDTH))
    found = re.search(r"[\d.]+B params \(.*?experts\)", " ".join(out.getvalue().split()))  # one line
    _expect(found is not None, "the 235B plan's header shows no parameter count")
    return f"`{found.group(0)}`"


def moe_totals(o: Outputs) -> str:
    return ", ".join(f"{_moe_plan(o, m).to_dict()['layout']['params_b']}B" for m in MOE_MODELS)


def moe_error(o: Outputs) -> str:
    r = command_output("plan", [Q30, "--set", MOE_ERROR_SET])
    _expect(r.code == 1, f"make plan RECIPE={Q30} SET={MOE_ERROR_SET} exited {r.code}, not 1")
    errors = [x for x in r.err.splitlines() if x.startswith("error: ")]
    make_line = next(i for i, x in enumerate(_makefile(), 1) if x.startswith("plan:")) + 1  # its recipe line
    cmd = f'$ make plan RECIPE={Q30} SET="{MOE_ERROR_SET}" 2>&1 >/dev/null'
    return fence([cmd, *errors, f"make: *** [Makefile:{make_line}: plan] Error 1"])


def plan_ncclep(o: Outputs) -> str:
    """Issue 42's example: Core's start-up warning turns the claimed EP overlap's row off, and the plan fails."""
    r = command_output("plan", [Q30, "--set", NCCLEP_SET])
    _expect(r.code == 1, f"make plan RECIPE={Q30} SET={NCCLEP_SET} exited {r.code}, not 1")
    rows = [
        x
        for b in blocks(r.lines())
        if len(b) > 1
        for n, _, lines in table_rows(b)
        if n == "ep_a2a_overlap"
        for x in lines
    ]
    _expect(bool(rows), "the ncclep plan shows no ep_a2a_overlap row")
    errors = [x for x in r.err.splitlines() if x.startswith("error: ")]
    return fence([f'$ make plan RECIPE={Q30} SET="{NCCLEP_SET}"', "…", *rows, "…", *errors])


def _makefile() -> list[str]:
    from overlapkit import jsonio

    return jsonio.read_bytes(ROOT / "Makefile").decode().splitlines()


# --- throughput.md, gpu_check.md ------------------------------------------------------------------------------------


@functools.cache
def _published_rows():
    from overlapkit.bridge import published

    points = published.load()
    return published.rows(points, published.inputs_of(points))


def throughput_constants(o: Outputs) -> str:
    from overlapkit.bridge import published

    return "\n" + published.constants_table()


def throughput_validation(o: Outputs) -> str:
    from overlapkit.bridge import published

    return "\n" + published.table(_published_rows())


def throughput_bands(o: Outputs) -> str:
    from overlapkit.bridge import published
    from overlapkit.sizing import calibration

    return "\n" + published.bands_table(calibration.BANDS)


def _gpu_cut():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_cut", ROOT / "bench" / "gpu_cut.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpucut_list(o: Outputs) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _gpu_cut().list_cuts()
    return fence([x for x in out.getvalue().splitlines() if not x.startswith(" ")])


# Why each setting differs between our cut and Bridge's: the doc's words, checked against what the configs show.
CUT_REASONS = {
    "ddp.check_for_nan_in_grad": "NVIDIA's perf recipes drop the check for speed; ours keeps it",
    "tokenizer.use_tokenizer_vocab_size": "ours sizes the vocabulary from the tokenizer (the same 128256 for Llama)",
    "model.should_pad_vocab": "Bridge's pads the vocabulary to `make_vocab_size_divisible_by`; ours takes the "
    "tokenizer's (128256 is already a multiple of 128)",
    "ddp.align_param_gather": "ours keeps it on, as the overlap stack sets it; a no-op on one GPU",
    "model.moe_token_dispatcher_type": "NVIDIA's Llama perf recipes set `alltoall`; a dense model has no MoE layer "
    "to dispatch for",
}


def gpucut_differs(o: Outputs) -> str:
    from overlapkit.bridge import gpucut

    seen: dict[str, list] = {}
    for key in gpucut.CUTS:
        ours, bridge = (gpucut.build(key, s) for s in gpucut.SIDES)
        for field, a, b in gpucut.differences(ours, bridge):
            seen.setdefault(field, [a, b, []])[2].append(f"`{key}`")
    new = sorted(set(seen) - set(CUT_REASONS))
    _expect(not new, f"the cuts differ in {new}, which CUT_REASONS in tools/docs.py does not explain: add why")
    lines = ["| setting | ours | Bridge's | cuts | why |", "|---|---|---|---|---|"]
    for field, (a, b, cuts) in seen.items():
        lines.append(f"| `{field}` | `{a!r}` | `{b!r}` | {', '.join(cuts)} | {CUT_REASONS[field]} |")
    return "\n" + "\n".join(lines) + "\n"


# --- the regions and their pages ------------------------------------------------------------------------------------


def worth_70b_tp(o: Outputs) -> str:
    return worth_pct(o.plans[R70], "tp")


def worth_q30_ep(o: Outputs) -> str:
    return worth_pct(o.plans[Q30], "ep")


REGIONS: dict[str, tuple[str, Callable[[Outputs], str]]] = {
    "readme-plan": ("README.md", readme_plan),
    "readme-recipes": ("README.md", readme_recipes),
    "plan-70b": ("docs/plan.md", plan_70b),
    "plan-worth-tp": ("docs/plan.md", worth_70b_tp),
    "plan-worth-ep": ("docs/plan.md", worth_q30_ep),
    "plan-recipes": ("docs/plan.md", recipes_list),
    "plan-ncclep": ("docs/plan.md", plan_ncclep),
    "fork-moe": ("docs/forking.md", fork_moe),
    "fork-34b": ("docs/forking.md", fork_34b),
    "fork-34b-why": ("docs/forking.md", fork_34b_why),
    "fork-34b-file": ("docs/forking.md", fork_34b_file),
    "fork-errors": ("docs/forking.md", fork_errors),
    "fork-memory": ("docs/forking.md", memory_table),
    "moe-table": ("docs/moe.md", moe_table),
    "moe-error": ("docs/moe.md", moe_error),
    "moe-params": ("docs/moe.md", moe_params),
    "moe-totals": ("docs/moe.md", moe_totals),
    "throughput-constants": ("docs/throughput.md", throughput_constants),
    "throughput-validation": ("docs/throughput.md", throughput_validation),
    "throughput-bands": ("docs/throughput.md", throughput_bands),
    "gpucut-list": ("docs/gpu_check.md", gpucut_list),
    "gpucut-differs": ("docs/gpu_check.md", gpucut_differs),
}


def produce(names=None) -> dict[str, str]:
    """name -> the body its region holds today (every region, or `names`), all from one set of runs."""
    stack.import_bridge()
    o = Outputs()
    with isolated():
        return {n: REGIONS[n][1](o) for n in names or REGIONS}


def pages() -> dict[str, str]:
    """Every page that holds a region, or should: README.md and docs/*.md, by their path in the checkout."""
    from overlapkit import jsonio

    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): jsonio.read_bytes(p).decode() for p in paths}


def problems(texts: dict[str, str], produced: dict[str, str]) -> list[str]:
    """What differs between the pages' regions and what the code produces: each a line naming page and region."""
    out, found = [], {}
    for page, text in texts.items():
        for m in REGION.finditer(text):
            name = m["name"]
            if name not in REGIONS:
                out.append(f"{page}: region {name!r} has no generator in tools/docs.py REGIONS")
            elif REGIONS[name][0] != page or name in found:
                out.append(f"{page}: region {name!r} belongs once to {REGIONS[name][0]}")
            elif name in produced and m["body"] != produced[name]:
                out.append(f"{page}: region {name!r} {STALE}")
            found[name] = page
    out += [f"{REGIONS[n][0]}: region {n!r} is missing" for n in produced if n not in found]
    return out


def rewrite(text: str, produced: dict[str, str]) -> str:
    def body(m):
        new = produced.get(m["name"], m["body"])
        return f"<!-- make docs: {m['name']} -->{new}<!-- /make docs -->"

    return REGION.sub(body, text)


def parse(argv):
    from launch.args import Parser

    p = Parser(prog="make docs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing: list the regions that are not today's")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Exit status: 0 written (or, --check, all today's), 1 --check found stale regions, 2 a region is unknown,
    missing or doubled, or an excerpt's premise stopped holding (one line each)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    from overlapkit import jsonio

    texts, produced = pages(), produce()
    found = problems(texts, produced)
    broken = [line for line in found if not line.endswith(STALE)]  # no rewrite mends these: REGIONS or the page
    if broken or args.check:
        for line in found:
            print(f"{'error' if line in broken else 'stale'}: {line}", file=sys.stderr)
        return 2 if broken else 1 if found else 0
    changed = [page for page, text in texts.items() if rewrite(text, produced) != text]
    for page in changed:
        jsonio.write_text(ROOT / page, rewrite(texts[page], produced))
    print(
        f"make docs: rewrote {', '.join(changed)}" if changed else f"make docs: all {len(produced)} regions are today's"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
