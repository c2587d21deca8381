"""The docs, checked: the README stays a short front page with the two set-up commands, every relative link in
README.md and docs/*.md resolves to a file in the repository, no excerpt carries a path of the machine it was made
on, every `make <target>` they show is a Makefile target that a test runs or that UNTESTED names with the
reason no test runs it, and every figure in a marked region is what the code produces today (tools/docs.py:
`make docs` rewrites them)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import make_targets
import pytest

from overlapkit import paths

REPO = paths.REPO_ROOT
_spec = importlib.util.spec_from_file_location("docs_tool", REPO / "tools" / "docs.py")  # `make docs`, a script
docs = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up there
_spec.loader.exec_module(docs)
README = REPO / "README.md"
README_MAX_BYTES = 12_000
SETUP_COMMANDS = ("make plan RECIPE=llama3_70b_pretrain_64gpu_h100_bf16", "make test")

# Absolute paths an excerpt may show because the product itself uses them, with the file that uses each.
ALLOWED_PATHS = {
    "/tmp/overlapkit-slurm": "slurm/local/start.sh",  # the local dev Slurm's default LOCAL_SLURM_DIR
    # the plan server's socket directory without XDG_RUNTIME_DIR
    "/tmp/overlapkit-<uid>": "src/overlapkit/cluster/plan_server.py",
    "/tmp/site": "tools/gpu_check_on_device.sh",  # where the lent GPU machine's carried wheels are installed
}
# Directories that only exist on the machine a doc was written on: a home, a workspace, pytest's or any temp dir.
MACHINE_PATH = re.compile(r"(?<![\w.~<>$}/-])/(?:work|root|home|Users|tmp|private/var|var/folders)/[^\s`\"')\]|,;]*")

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A file of the repository a page or a profile's comment names by its path (`overlapkit/x.py` is src/overlapkit/x.py).
CITED = re.compile(
    r"(?<![\w./<>-])((?:src/)?overlapkit/[\w/]+\.py|(?:launch|tools|bench|recipes|tests|slurm)/[\w./-]+\."
    r"(?:py|sh|toml|md|sbatch))"
)
CITING = [*make_targets.DOCS, *sorted((REPO / "slurm" / "profiles").glob("*.toml"))]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_readme_is_short_and_has_the_two_setup_commands():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes > {README_MAX_BYTES}: move detail to docs/"
    code = "\n".join(make_targets.code_of(README.read_text()))
    missing = [c for c in SETUP_COMMANDS if c not in code]
    assert not missing, f"README.md does not show {missing}"


@pytest.mark.parametrize("doc", make_targets.DOCS, ids=_rel)
def test_relative_links_resolve_inside_the_repository(doc):
    bad = []
    for target in LINK.findall(make_targets.FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the same page
        path = target.split("#", 1)[0]
        resolved = (doc.parent / path).resolve()
        if path.startswith("/") or not resolved.is_relative_to(REPO) or not resolved.is_file():
            bad.append(target)
    assert not bad, f"{_rel(doc)}: links that do not resolve to a file in the repository: {bad}"


@pytest.mark.parametrize("doc", CITING, ids=_rel)
def test_every_file_cited_by_its_path_exists(doc):
    cited = CITED.findall(doc.read_text())
    gone = sorted({c for c in cited if not (REPO / ("src/" + c if c.startswith("overlapkit/") else c)).is_file()})
    assert not gone, f"{_rel(doc)} cites files the repository does not have (moved?): {gone}"


def test_the_citation_detector_sees_what_it_claims():
    text = "see overlapkit/profiles.py DEFAULT_CONTAINER, `src/overlapkit/cluster/profiles.py`, <dir>/launch/x.py"
    assert CITED.findall(text) == ["overlapkit/profiles.py", "src/overlapkit/cluster/profiles.py"]


@pytest.mark.parametrize("doc", make_targets.DOCS, ids=_rel)
def test_no_machine_paths_in_excerpts(doc):
    text = doc.read_text()
    for allowed in ALLOWED_PATHS:
        text = text.replace(allowed, "<allowed>")
    found = sorted(set(MACHINE_PATH.findall(text)))
    assert not found, f"{_rel(doc)} shows paths of the machine it was written on: {found}; use <placeholder>s"


def test_allowed_paths_are_the_products_own():
    for path, user in ALLOWED_PATHS.items():
        assert path in (REPO / user).read_text(), f"{path} is not in {user}: drop it from ALLOWED_PATHS"
        assert any(path in d.read_text() for d in make_targets.DOCS), f"no doc shows {path}: drop it from ALLOWED_PATHS"


def test_every_make_target_shown_is_a_target_and_every_reason_is_for_a_shown_target():
    """The half of the docs' rule that needs no run; the other half (shown targets are run by a test) is the last
    test of a whole run, below."""
    every_other_target = make_targets.makefile_targets() - set(make_targets.UNTESTED)
    assert make_targets.judge(make_targets.shown_targets(), every_other_target) == []


def test_make_help_lists_every_target_and_the_run_is_recorded():
    """`make help` (the default goal) lists each target with its ## comment; the audit hook saw this test run it."""
    out = subprocess.run(["make", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    commented = re.findall(r"^([a-z][a-z0-9-]*):.*?## (.+)$", (REPO / "Makefile").read_text(), re.M)
    assert len(commented) == len(make_targets.makefile_targets()) > 20
    for target, comment in commented:
        assert re.search(rf"^  make {re.escape(target)} +{re.escape(comment)}$", out, re.M), target
    assert "help" in make_targets.made


@pytest.mark.parametrize(
    ("argv", "cwd", "run"),
    [
        (["make", "-s", "plan", "RECIPE=x", "FORMAT=json"], REPO, ["plan"]),
        (["/usr/bin/make", "submit", "PREFLIGHT=1", "nightly-report"], REPO, ["submit", "nightly-report"]),
        (["make", "-s"], REPO, ["help"]),
        (["make", "-C", str(REPO), "recipes"], "/", ["recipes"]),
        (["make", "--directory=..", "recipes"], REPO / "docs", ["recipes"]),
        (["make", "plan"], "/", []),  # another directory's Makefile
        (["make", "-C", "/tmp", "plan"], REPO, []),
        (["make", "-f", "other.mk", "plan"], REPO, []),
        (["make", "-n", "plan"], REPO, []),  # a dry run runs no recipe
        (["make", "-q", "plan"], REPO, []),
        (["bash", "-c", "make plan"], REPO, []),  # not make itself: its make is another process's
        (["makex", "plan"], REPO, []),
    ],
)
def test_a_make_run_is_told_from_argv_and_directory(argv, cwd, run):
    assert make_targets.targets_run(argv, cwd) == run


def test_the_rule_names_each_kind_of_break():
    targets = make_targets.makefile_targets()
    everything_run = targets - set(make_targets.UNTESTED)
    shown = {t: {"README.md"} for t in targets}
    assert make_targets.judge(shown, everything_run) == []
    problems = make_targets.judge({**shown, "nonesuch": {"docs/x.md"}}, everything_run - {"plan"} | {"lint"})
    assert problems == [
        "`make nonesuch` shown in ['docs/x.md'] is not a Makefile target",
        "`make plan` shown in ['README.md']: no test ran it (add a test, or its reason to UNTESTED)",
        "a test ran `make lint`: drop it from UNTESTED",
    ]
    del shown["bench"]
    assert make_targets.judge(shown, everything_run) == ["UNTESTED names bench, which no doc shows"]


def test_the_detectors_see_what_they_claim():
    """The doc detectors on known cases: a prose `make`, an error line's target, a machine path."""
    assert make_targets.MAKE_CALL.findall("make -s prep-data IN=x; make: *** [Makefile:70: plan] Error 1") == [
        "prep-data"
    ]
    assert MACHINE_PATH.findall("run directory /work/main/runs/x and <checkout>/runs/y, cd /root/a") == [
        "/work/main/runs/x",
        "/root/a",
    ]
    assert MACHINE_PATH.findall("tmp_path /tmp/pytest-of-root/p0/x and 2>&1 >/dev/null") == ["/tmp/pytest-of-root/p0/x"]


def test_every_generated_figure_is_what_the_code_produces_today():
    """Each marked region of README.md and docs/*.md against what tools/docs.py produces in this process (the
    commands' real output, the plans' predictions): a model change that moves a number fails here until `make docs`
    is run."""
    stale = docs.problems(docs.pages(), docs.produce())
    assert not stale, "the docs are not today's: run `make docs` (and commit what it rewrites)\n" + "\n".join(stale)


def test_the_docs_check_names_each_kind_of_break_and_make_docs_mends_them():
    produced = {"plan-worth-tp": "+6.0%", "readme-plan": "\n```\n$ make plan\n```\n"}
    texts = {
        "docs/plan.md": "TP overlap (<!-- make docs: plan-worth-tp -->+5%<!-- /make docs -->), then\n",
        "README.md": "<!-- make docs: nonesuch -->\nx\n<!-- /make docs -->\n",
        "docs/moe.md": "<!-- make docs: plan-worth-tp -->+6.0%<!-- /make docs -->",
    }
    assert docs.problems(texts, produced) == [
        "docs/plan.md: region 'plan-worth-tp' is not what the code produces today",
        "README.md: region 'nonesuch' has no generator in tools/docs.py REGIONS",
        "docs/moe.md: region 'plan-worth-tp' belongs once to docs/plan.md",
        "README.md: region 'readme-plan' is missing",
    ]
    mended = docs.rewrite(texts["docs/plan.md"], produced)
    assert mended == "TP overlap (<!-- make docs: plan-worth-tp -->+6.0%<!-- /make docs -->), then\n"
    assert docs.problems({"docs/plan.md": mended}, {"plan-worth-tp": "+6.0%"}) == []


def test_the_judge_waits_for_every_other_test_and_takes_what_every_process_ran(tmp_path, monkeypatch):
    """The ledger the judge reads (tests/make_targets.py): one file a process, a line a test that ended there."""
    monkeypatch.setattr(make_targets, "LEDGER", tmp_path)
    line = dict(test="t::a", made=["plan"], partial=[])
    (tmp_path / "11.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "12.jsonl").write_text(json.dumps(dict(test="t::b", made=["submit"], partial=["t::x skipped"])) + "\n")
    ran, partial = make_targets.session_ran({"t::a", "t::b"})
    assert {"plan", "submit"} <= ran and "t::x skipped" in partial
    with pytest.raises(AssertionError, match=r"^1 tests have not ended, e.g. \['t::c'\]"):
        make_targets.session_ran({"t::a", "t::c"}, timeout=0)


def test_every_make_target_the_docs_show_is_run_by_a_test(request):
    """The docs' rule on what this session ran (tests/make_targets.py): every `make <target>` a doc shows, some test
    ran through make. tests/conftest.py hands this test out last, after any shuffle, and it waits for every other
    test of the session to end, in any worker, so it sees all their makes; it judges only a whole run, since part of
    the suite runs part of the targets."""
    others = {item.nodeid for item in request.session.items} - {request.node.nodeid}
    ran, partial = make_targets.session_ran(others)
    if why := make_targets.whole_run(partial):
        pytest.skip(f"not the whole suite ({why}): the docs' targets are judged on a whole run")
    assert make_targets.judge(make_targets.shown_targets(), ran) == []
