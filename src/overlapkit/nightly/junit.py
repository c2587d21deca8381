"""The night's verdicts as JUnit XML (`junit.xml` beside report.md), the file CI dashboards read: Jenkins' `junit`
step, GitLab's `artifacts:reports:junit`.

One <testcase> per recipe (classname `nightly.<cluster>`): passed (the verdict's notes in <system-out>), <failure>
(message: the rule that fired, type: the verdict) or <skipped>. JUnit XML has no official schema; this follows the
Jenkins xUnit plugin's junit-10.xsd, as pytest's junitxml does. A night records no per-run wall time, so `time` is
0; `errors` is 0: every verdict that is not a pass, infrastructure failures included, is a failure of the night.
"""

from __future__ import annotations

import datetime as dt
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

from overlapkit import jsonio
from overlapkit.nightly import rules as regress


def to_xml(night: dict, results: list[dict]) -> ET.Element:
    """<testsuites><testsuite name="nightly.<cluster>">, one testcase per result, with the counts set on both."""
    classname = f"nightly.{night.get('cluster', 'unknown')}"
    try:  # the night's UTC stamp (YYYYmmdd-HHMMSS) as ISO 8601, which the schema's xs:dateTime wants
        timestamp = dt.datetime.strptime(night.get("stamp"), "%Y%m%d-%H%M%S").isoformat()
    except (TypeError, ValueError):
        timestamp = dt.datetime.now(dt.UTC).replace(tzinfo=None).isoformat(timespec="seconds")
    root = ET.Element("testsuites", name=f"nightly regression {night.get('stamp', '')}".strip())
    suite = ET.SubElement(
        root, "testsuite", name=classname, timestamp=timestamp, hostname=socket.gethostname(), time="0"
    )
    props = ET.SubElement(suite, "properties")
    for key in ("stamp", "cluster", "preflight_only", "iters", "checks"):
        if key in night:
            ET.SubElement(props, "property", name=key, value=str(night[key]))
    counts = {"tests": len(results), "failures": 0, "errors": 0, "skipped": 0}
    for res in results:  # one testcase each: passed, <failure> or <skipped>
        case = ET.SubElement(suite, "testcase", name=res["recipe"], classname=classname, time="0")
        if res.get("skipped"):
            ET.SubElement(case, "skipped", message=res["skipped"])
            counts["skipped"] += 1
            continue
        v = res["verdict"]
        where = f"Slurm job {res.get('job_id')} ({res.get('state')}), run directory {res.get('run_dir')}"
        notes = list(v["reasons"])
        if res.get("golden") is None and regress.NO_GOLDEN not in notes:
            notes.append(regress.NO_GOLDEN)
        if v["ok"]:
            ET.SubElement(case, "system-out").text = "\n".join([f"{v['status']}: {where}", *notes])
            continue
        failure = ET.SubElement(case, "failure", message=(v["reasons"] or [v["status"]])[0], type=v["status"])
        failure.text = "\n".join([*notes, where])
        counts["failures"] += 1
    suite.attrib.update({k: str(v) for k, v in counts.items()})
    root.attrib.update({k: str(v) for k, v in counts.items() if k != "skipped"}, time="0")
    return root


def write(night_dir: Path, night: dict, results: list[dict]) -> Path:
    """`<night>/junit.xml`, written atomically (jsonio.write_text): a dashboard never reads half a file."""
    root = to_xml(night, results)
    ET.indent(root)
    return jsonio.write_text(Path(night_dir) / "junit.xml", ET.tostring(root, encoding="utf-8", xml_declaration=True))
