"""A pytest JUnit XML report as the JSON of the GPU run: each test's outcome and time, and the
git commit the run was made from (benchmarks/gpu.sh).

    python benchmarks/junit_json.py REPORT.xml OUT.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_state  # noqa: E402

OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}


def cases(report: Path) -> list[dict]:
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((OUTCOMES[c.tag] for c in case if c.tag in OUTCOMES), "passed")
        found.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
            }
        )
    return found


def main() -> None:
    report, out = Path(sys.argv[1]), Path(sys.argv[2])
    tests = cases(report)
    out.write_text(json.dumps({"git": git_state(), "tests": tests}, indent=1) + "\n")
    print(dict(Counter(t["outcome"] for t in tests)), "->", out)


if __name__ == "__main__":
    main()
