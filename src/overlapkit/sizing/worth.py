"""What each overlap is worth: the predicted step time with that one overlap off, everything else as planned.

The same model (sizing/throughput.py `Inputs.predict`, on the plan's own inputs), called once more per overlap that is
on with exactly that field of `Overlaps` flipped to off: the difference is what the overlap hides on this layout. A
user reads which overlap the run depends on (make plan), and the nightly which one a slowdown looks like
(nightly/rules.py `likely_overlap`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from overlapkit.sizing import throughput


@dataclass(frozen=True)
class Worth:
    overlap: str  # the Overlaps field
    step_s: float  # the plan's predicted step, every overlap as planned
    off_step_s: float  # the same with this overlap off

    @property
    def delta_s(self) -> float:
        return self.off_step_s - self.step_s

    @property
    def delta_pct(self) -> float:
        """The step time it adds when off, in percent of the planned step."""
        return 100 * self.delta_s / self.step_s

    def to_dict(self) -> dict:
        return {
            "row": throughput.ROWS[self.overlap],
            "off_step_s": round(self.off_step_s, 4),
            "delta_s": round(self.delta_s, 4),
            "delta_pct": round(self.delta_pct, 2),
        }


def overlap_worth(inputs: throughput.Inputs, base: throughput.Prediction | None = None) -> dict[str, Worth]:
    """{field: Worth} for each overlap that is on in `inputs.overlaps`, largest worth first: `inputs.predict` with
    that one field off, every other input (constants, GPU, experts, bucket) as planned. `base`: the prediction with
    the overlaps as given, when already made."""
    base = base or inputs.predict()
    out = []
    for f in dataclasses.fields(inputs.overlaps):
        if getattr(inputs.overlaps, f.name):
            off = inputs.predict(overlaps=dataclasses.replace(inputs.overlaps, **{f.name: False}))
            out.append(Worth(f.name, base.step_s, off.step_s))
    return {x.overlap: x for x in sorted(out, key=lambda x: -x.delta_s)}
