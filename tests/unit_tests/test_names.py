"""Names are names (overlapkit/names.py): the one check of a value that becomes a path, and the one check that a
path written stays in its folder."""

from __future__ import annotations

import pytest

from overlapkit.errors import BadInput
from overlapkit.names import MAX_LEN, checked_name, inside


@pytest.mark.parametrize("good", ["eos", "local", "a", "llama3_8b", "run-1.2", "X" * MAX_LEN, "7b"])
def test_a_name_passes(good):
    assert checked_name(good, "RUN_NAME") == good


@pytest.mark.parametrize(
    "bad",
    ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "-rf", "a..b", "a b", "x\n", "é", "X" * (MAX_LEN + 1), "a\\b"],
)
def test_anything_else_is_one_line_naming_the_rule_and_the_fix(bad):
    with pytest.raises(BadInput) as err:
        checked_name(bad, "slurm/profiles/x.toml: name", "name the cluster with letters, digits, '.', '_' or '-'")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("slurm/profiles/x.toml: name=") and msg.endswith("'_' or '-'")
    assert "letters, digits" in msg


def test_a_non_string_is_not_a_name():
    for value, kind in ((3, "int"), (None, "NoneType")):
        with pytest.raises(BadInput, match=rf"^RUN_NAME='{value!r}': not a string \({kind}\): it names a file"):
            checked_name(value, "RUN_NAME")


def test_inside_keeps_a_path_in_its_folder_and_names_a_link_or_dotdot_that_leaves(tmp_path):
    root = tmp_path / "jobs"
    root.mkdir()
    assert inside(root, "runs", "a") == root / "runs" / "a"  # as given, not resolved: messages show what was typed
    assert inside(root) == root
    with pytest.raises(BadInput, match=r"outside .*jobs: remove the link or the '\.\.'"):
        inside(root, "..", "elsewhere")
    (root / "runs").symlink_to(tmp_path / "other")  # planted by a co-user in a shared job directory
    with pytest.raises(BadInput, match="resolves to .*other"):
        inside(root, "runs")
    (tmp_path / "jobs2").mkdir()
    (tmp_path / "jobs2" / "runs").symlink_to(tmp_path / "jobs2" / "real")  # a link that stays inside is fine
    assert inside(tmp_path / "jobs2", "runs") == tmp_path / "jobs2" / "runs"
