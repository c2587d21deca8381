"""The one reader of a run directory's plan.json (bridge/build.py writes it): every command that reads a plan back (make
status, make bless, the nightly's report, the overlap report, make calibrate, the in-job entry) gets it through
`read_plan`, checked by the model `Plan`, or one line naming the file, the field and the fix. No torch, no Bridge:
launch/entry.py reads the plan before anything may import torch. What is checked is what a reader relies on; a
plan.json that is a link is refused as one (make plan writes a file).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, create_model, model_validator

from overlapkit import jsonio
from overlapkit.spec import model

PLAN = "plan.json"
ROLE = "the run's plan that make plan/submit writes"
FIX = "plan it again (make plan), or give RUN= a run directory make plan/submit wrote"
# The layout's sizes: each a whole number ≥ 1 (vpp: none without interleaving; the MoE ones only on MoE plans).
SIZES = ("nodes", "gpus", "tp", "pp", "cp", "dp", "mbs", "gbs", "seq")
OPTIONAL_SIZES = ("vpp", "ep", "etp", "expert_dp", "experts", "topk")
Step = Annotated[int, Field(ge=0)]


class _Part(BaseModel):
    """What a reader relies on of a part of the plan; the rest of it is kept as written."""

    model_config = ConfigDict(strict=True, extra="allow")


class _World(_Part):
    @model_validator(mode="after")
    def _world(self):
        if self.gpus != (world := self.tp * self.pp * self.cp * self.dp):
            raise ValueError(f"layout.gpus is {self.gpus}, not tp×pp×cp×dp = {world}")
        return self


Sizes = {key: (PositiveInt, ...) for key in SIZES} | {key: (PositiveInt | None, None) for key in OPTIONAL_SIZES}
Layout = create_model("Layout", __base__=_World, **Sizes)


class Row(_Part):
    state: str


class Audit(_Part):
    rows: dict[str, Row]
    errors: list[dict] = []
    warnings: list[dict] = []


class Window(_Part):
    """The profiler's window (NSYS or TORCH_PROFILE): the overlap report and the nightly read it."""

    steps: list[Step] = Field(min_length=2, max_length=2)
    ranks: list[Step]


class Run(_Part):
    checkpoint_dir: str | None = None
    train_iters: PositiveInt | None = None
    nsys: Window | None = None
    torch_profile: Window | None = None


class Plan(_Part):
    recipe: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")  # a module name under recipes/ (or a fork's)
    layout: Layout
    audit: Audit
    run: Run | None = None


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:60]


_WINDOW = "{key} is not {{steps: [start, end], ranks: [rank, ...]}} of whole numbers"
MESSAGES = {
    "recipe": "recipe is {value!r}, not a recipe's name (letters, digits, _ . -)",
    **{f"layout.{key}": "{key} is {value!r}, not a whole number ≥ 1" for key in SIZES},
    **{f"layout.{key}": "{key} is {value!r}, not a whole number ≥ 1 (or null)" for key in OPTIONAL_SIZES},
    "audit.rows": "audit.rows is not an object of {{name: {{state, detail}}}}",
    **dict.fromkeys(("audit.errors", "audit.warnings"), "{key} is not a list of findings"),
    "run.checkpoint_dir": lambda key, value: f"{key} is {_kind(value)}, not a path",
    "run.train_iters": "{key} is {value!r}, not a whole number ≥ 1",
    **dict.fromkeys(("run.nsys", "run.torch_profile"), _WINDOW),
    **dict.fromkeys(("layout", "audit", "run"), lambda key, value: f"{key} is {_kind(value)}, not an object"),
}


def read_plan(run_dir: Path) -> dict:
    """`run_dir`/plan.json (or the file itself), checked; a FileProblem (one line) for anything a reader cannot use."""
    path = Path(run_dir)
    path = path if path.name == PLAN and not path.is_dir() else path / PLAN
    if path.is_symlink():
        raise jsonio.file_problem(path, f"is a symbolic link (to {os.readlink(path)!r})", ROLE, FIX)
    plan = jsonio.read_json(path, role=ROLE, fix=FIX, keys=("recipe", "layout", "audit"))
    try:
        Plan.model_validate(plan)
    except ValidationError as exc:  # the field, its value, what it should be
        raise jsonio.file_problem(path, model.problem(exc, plan, MESSAGES), ROLE, FIX) from None
    return plan
