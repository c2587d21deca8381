"""The request parsed from what the user typed, every check that can be made before the Bridge import made (one line
per bad value), into spec/request.py's PlanRequest; and the request again from values a caller holds (`loose`) or
from a run directory's overrides.json (`from_record`). Standard library only at import: it answers in under a second.
"""

from __future__ import annotations

import dataclasses

from overlapkit.errors import BadInput
from overlapkit.sizing import hardware
from overlapkit.spec import runopts
from overlapkit.spec.request import PlanRequest


def parse(
    recipe: str,
    nodes: str = "",
    sets: str = "",
    run: dict | None = None,
    *,
    listing: bool = False,
    action: str = "plan",
    gpu: str = "",
) -> PlanRequest:
    """The typed request, every pre-import check made (in this order: NODES, the recipe's name, SET, the run
    options). `run`: the run options' text by runopts.parse's keywords (run_name, segments, nsys, nsys_ranks, data);
    None leaves them out of the check (make overlap-report: a run that has been). `listing`: `make recipes`,
    which names no recipe. `gpu`: GPU= as typed (empty: h100)."""
    from overlapkit.bridge import inputs, registry

    count = inputs.parse_nodes(nodes)
    chip = hardware.parse_gpu(gpu)
    if not listing:
        if not recipe:
            raise BadInput(f"no recipe given: make {action} RECIPE=<name> (make recipes lists them)")
        registry.check_declared(recipe)
    pairs = inputs.check_sets(sets)
    opts = runopts.RunOptions() if run is None else run_options(**run)  # None: not even DATA's module is imported
    return PlanRequest(recipe, count, tuple(pairs), opts, chip)


def run_options(data="", **typed) -> runopts.RunOptions:
    """The run options as typed (runopts.parse's keywords), then DATA: its data.toml, files and headers."""
    from overlapkit.bridge import data as data_spec

    opts = runopts.parse(**typed)
    return dataclasses.replace(opts, data=data_spec.load(data).to_dict()) if (data or "").strip() else opts


def loose(
    name: str,
    nodes: int | None = None,
    sets=None,
    run: runopts.RunOptions | None = None,
    gpu: str = hardware.DEFAULT_GPU,
) -> PlanRequest:
    """A request from values a caller already holds (tests, listings, forks): SET as text or KEY=VALUE tokens."""
    from overlapkit.bridge import overrides

    return PlanRequest(name, nodes, tuple(overrides.parse(sets)), run or runopts.RunOptions(), hardware.parse_gpu(gpu))


def from_record(rec: dict, recipe: str, nodes: int | None, extra_sets=()) -> PlanRequest:
    """The request again in the job, from the run directory's overrides.json (its run options already bound) and the
    run plugins' KEY=VALUE overrides after the typed ones."""
    sets = [f"{k}={v}" for k, v in rec["set"]] + list(extra_sets)
    gpu = rec.get("gpu", hardware.DEFAULT_GPU)  # a record from before GPU= was planned for the default
    return loose(recipe, nodes, sets, runopts.RunOptions.from_dict(rec["run"]), gpu=gpu)
