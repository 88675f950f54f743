"""bench/suite_time.py: a run folder's start-up and training split, and seconds per module."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import suite_time  # noqa: E402

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.integration.test_a" name="one" time="10.5"/>
<testcase classname="tests.integration.test_a" name="two" time="4.5"/>
<testcase classname="tests.unit.test_b" name="three" time="0.25"/>
</testsuite></testsuites>"""


def run_folder(path, written_at: float, times: list) -> None:
    os.makedirs(path)
    with open(path / "config.yaml", "w") as f:
        f.write("seed: 0\n")
    os.utime(path / "config.yaml", (written_at, written_at))
    with open(path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"event": "round", "time": t}) + "\n" for t in times)
        f.write('{"torn')  # a last line cut short


def test_module_seconds_add_up_each_modules_tests(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert suite_time.module_seconds(str(tmp_path / "junit.xml")) == {
        "tests.integration.test_a": 15.0,
        "tests.unit.test_b": 0.2,
    }


def test_a_run_splits_at_its_first_event(tmp_path):
    run_folder(tmp_path / "a" / "run", 1000.0, [1008.0, 1010.0, 1011.5])  # 8 s to start, 3.5 s to train
    run_folder(tmp_path / "b", 2000.0, [2002.0, 2003.0])
    run_folder(tmp_path / "resumed", 3000.0, [2990.0, 3005.0])  # config.yaml rewritten after its first event
    (tmp_path / "no_metrics").mkdir()
    (tmp_path / "no_metrics" / "config.yaml").write_text("seed: 0\n")
    assert suite_time.run_split(str(tmp_path)) == {"runs": 2, "startup_seconds": 10.0, "training_seconds": 4.5}
