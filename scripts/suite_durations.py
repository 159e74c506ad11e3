#!/usr/bin/env python
"""Per-file durations of a test run, from pytest's JUnit XML report.

    pytest --junitxml=reports/junit.xml             # the whole suite (CI's command, with a report)
    pytest -m "not slow" --junitxml=reports/quick.xml
    python scripts/suite_durations.py reports/junit.xml

Prints a Markdown table: each test file's tests, their summed time (setup, call and teardown, as pytest
reports them) and its share, slowest first, then the run's wall time. With pytest-xdist's 2 workers the sum
over files is about twice the wall time. docs/testing.md shows the table of a full run.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python scripts/suite_durations.py REPORT.xml")
    try:
        root = ET.parse(argv[0]).getroot()
    except (OSError, ET.ParseError) as error:
        sys.exit(f"error: cannot read {argv[0]}: {error}")
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    seconds, counts, outcomes = defaultdict(float), defaultdict(int), defaultdict(int)
    for suite in suites:
        for case in suite.iter("testcase"):
            name = case.get("classname", "").split(".")[-1] or "?"
            file = f"tests/{name}.py" if name.startswith("test_") else name
            seconds[file] += float(case.get("time", 0))
            counts[file] += 1
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            outcomes[outcome] += 1
    total = sum(seconds.values()) or 1.0
    wall = sum(float(s.get("time", 0)) for s in suites)
    print("| file | tests | seconds | share |\n|---|---|---|---|")
    for file in sorted(seconds, key=seconds.get, reverse=True):
        print(f"| {file} | {counts[file]} | {seconds[file]:.0f} | {seconds[file] / total:.1%} |")
    print(f"\n{sum(counts.values())} tests ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}); "
          f"{total:.0f} s summed over the files, {wall:.0f} s ({wall / 60:.1f} min) of wall time.")


if __name__ == "__main__":
    main(sys.argv[1:])
