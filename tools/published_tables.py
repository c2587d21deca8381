"""Regenerate docs/throughput.md's tables from NVIDIA's published H100 runs (src/overlapkit/bridge/published.py): the
refitted constants, the validation tables (the runs, then the MLPerf scaling series) and the leave-one-out bands,
then the verdict against issue #25's bar.
`make docs` writes the same tables into docs/throughput.md (tools/docs.py); tests/unit_tests/sizing/test_throughput.py
and tests/unit_tests/test_docs.py fail until they match.

    .venv/bin/python tools/published_tables.py

Exit 1 when a run is out of the bar (each line says which).
"""

from __future__ import annotations

import sys

from overlapkit.bridge import published, stack
from overlapkit.sizing import calibration


def main() -> int:
    stack.import_bridge()
    points = published.load()
    inputs = published.inputs_of(points)
    print(published.constants_table(calibration.rounded(published.refit(points, inputs))))
    rows = published.rows(points, inputs)
    print(published.table(rows))
    print(published.bands_table(published.bands(rows)), end="")
    for key, (why, step) in published.UNSTEADY.items():
        print(f"not fitted, judged on its first steps ({step} s): {key}: {why}")
    for line in published.verdict(rows):
        print(f"out of bar: {line}")
    return 1 if published.verdict(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
