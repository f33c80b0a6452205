"""Print one line with the counts of several pytest runs: ``N passed, N failed, N skipped``.

Usage: ``python scripts/junit_total.py test-artifacts/results/*.xml`` (the JUnit XML
files that scripts/test.sh asks each suite's pytest to write).
"""

import sys
import xml.etree.ElementTree as ET


def totals(paths: list[str]) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return counts


def main(paths: list[str]) -> int:
    c = totals(paths)
    failed = c["failures"] + c["errors"]
    passed = c["tests"] - failed - c["skipped"]
    print(f"{passed} passed, {failed} failed, {c['skipped']} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
