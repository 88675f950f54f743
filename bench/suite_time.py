"""Where a test suite's time goes: ``python bench/suite_time.py JUNIT_XML BASETEMP``.

Reads a finished ``python -m pytest --junitxml=JUNIT_XML --basetemp=BASETEMP`` run and
prints, as one JSON object:

* ``test_seconds`` by module, largest first (each test's set-up, call and tear-down, as
  pytest timed them; under ``-n 2`` two workers add theirs, so the total is about twice
  the wall time);
* ``runs``: every training run that left an ``output_dir`` under BASETEMP, split into its
  start-up (its ``config.yaml`` written to its first event in ``metrics.jsonl``: Ray
  actors started, models built, servers seeded) and its training (first event to last).

A run resumed into the same folder counts once, from its first start to its last event.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter


def module_seconds(junit_xml: str) -> dict[str, float]:
    """Seconds per test module (``tests.integration.test_x``), largest first."""
    seconds: Counter = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        seconds[case.get("classname") or "?"] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in seconds.most_common()}


def event_times(metrics: str) -> list[float]:
    """The ``time`` of every record in a ``metrics.jsonl`` (a torn last line is skipped)."""
    times = []
    with open(metrics) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record.get("time"), (int, float)):
                times.append(float(record["time"]))
    return times


def run_split(basetemp: str) -> dict:
    """Start-up and training seconds summed over every run folder under ``basetemp``."""
    runs = startup = training = 0.0
    for folder, _, files in os.walk(basetemp):
        if "config.yaml" not in files or "metrics.jsonl" not in files:
            continue
        times = event_times(os.path.join(folder, "metrics.jsonl"))
        started = os.path.getmtime(os.path.join(folder, "config.yaml"))
        if not times or min(times) < started:  # config.yaml rewritten by a later resume
            continue
        runs += 1
        startup += min(times) - started
        training += max(times) - min(times)
    return {"runs": int(runs), "startup_seconds": round(startup, 1), "training_seconds": round(training, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml")
    parser.add_argument("basetemp")
    args = parser.parse_args(argv)
    modules = module_seconds(args.junit_xml)
    total = round(sum(modules.values()), 1)
    print(json.dumps({"test_seconds": total, "modules": modules, "runs": run_split(args.basetemp)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
