"""Unit tests for diloco_ray.sweep.trial: a trial follows its run's records, reports the rounds
that have an eval loss, says why a run failed, and stops its run when Tune stops it (no Ray:
a small script stands in for ``diloco-ray train``)."""

import json
import os
import subprocess
import sys
import time

import pytest

from diloco_ray.sweep import trial as trial_mod
from diloco_ray.sweep.trial import TrialFailed, TrialPlan, failure, follow, last_error_line, run_trial, stop

# Writes three round records (round 1 without an eval) to metrics.jsonl, the last one in two
# pieces, then exits with the status given.
FAKE_RUN = """
import json, os, sys, time
out, status = sys.argv[1], int(sys.argv[2])
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    for r, loss in ((0, 2.0), (1, None), (2, 1.5)):
        line = json.dumps({"event": "round", "round": r, "eval_loss": loss, "train_loss": 3.0 - r})
        f.write(line[:10]); f.flush(); time.sleep(0.05); f.write(line[10:] + "\\n"); f.flush()
        f.write(json.dumps({"event": "step", "round": r}) + "\\n"); f.flush()
if status:
    print("round 1/3 ...")
    print("diloco-ray: error: lr: -1 is not allowed; give a number > 0", file=sys.stderr)
sys.exit(status)
"""


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)

    def start(status):
        def start_run(plan, address):
            log = open(plan.console_log, "w")
            return subprocess.Popen(
                [sys.executable, str(script), plan.output_dir, str(status)], stdout=log, stderr=subprocess.STDOUT
            )

        monkeypatch.setattr(trial_mod, "start_run", start_run)
        monkeypatch.setattr(trial_mod, "POLL_S", 0.02)
        return TrialPlan(str(tmp_path / "cfg.yaml"), str(tmp_path / "run"), str(tmp_path / "run.log"))

    return start


def test_every_round_with_an_eval_is_reported_once_in_order(fake_run):
    plan = fake_run(0)
    reports = []
    run_trial({"trial": "t"}, {"t": plan}, "127.0.0.1:1", report=reports.append)
    assert [(r["round"], r["eval_loss"], r["train_loss"]) for r in reports] == [(1, 2.0, 3.0), (3, 1.5, 1.0)]
    assert all(r["seconds"] > 0 for r in reports)


def test_a_failed_run_raises_its_one_line_error(fake_run):
    plan = fake_run(2)
    reports = []
    with pytest.raises(TrialFailed, match="^lr: -1 is not allowed; give a number > 0$"):
        run_trial({"trial": "t"}, {"t": plan}, "127.0.0.1:1", report=reports.append)
    assert len(reports) == 2  # what it ran is reported before the failure


def test_without_an_error_line_the_traceback_or_the_status_says_it(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("round 1/3\nTraceback (most recent call last):\n  ...\nRuntimeError: boom\n\n")
    assert last_error_line(str(log)) == "RuntimeError: boom"
    assert last_error_line(str(tmp_path / "missing.log")) is None
    plain = tmp_path / "plain.log"
    plain.write_text("round 1/3  train_loss 2.0\n")
    assert failure(1, str(plain)) == f"the run exited with status 1; its console: {plain}"
    assert failure(-9, str(plain)) == f"the run was killed by SIGKILL; its console: {plain}"


def started_with(handler: str) -> subprocess.Popen:
    """A Python process that sets ``handler`` for SIGTERM, says so on stdout, and sleeps."""
    code = f"import signal,sys,time; signal.signal(signal.SIGTERM, {handler}); print('set', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "set\n"  # its handler is in place, however slow its start
    return proc


def test_a_stopped_trial_stops_its_run_cleanly_first(tmp_path):
    """SIGTERM first (the trainer's clean stop); a run that ignores it is killed after the grace."""
    handled = started_with("lambda *a: sys.exit(143)")
    ignoring = started_with("signal.SIG_IGN")
    stop(handled, grace_s=5)
    assert handled.returncode == 143
    started = time.monotonic()
    stop(ignoring, grace_s=0.5)
    assert ignoring.returncode == -9 and time.monotonic() - started < 5


def test_tune_stopping_the_trial_stops_its_run(fake_run, tmp_path):
    """Tune ends a trial it stops with SystemExit from ``report``: the run is stopped too."""
    plan = fake_run(0)

    def report(result):
        raise SystemExit(0)

    stopped = []
    real_stop = trial_mod.stop
    trial_mod.stop = lambda proc, grace_s=60: stopped.append(proc) or real_stop(proc, grace_s)
    try:
        with pytest.raises(SystemExit):
            run_trial({"trial": "t"}, {"t": plan}, "127.0.0.1:1", report=report)
    finally:
        trial_mod.stop = real_stop
    assert len(stopped) == 1 and stopped[0].poll() is not None


def test_a_trial_stopped_between_reports_stops_its_run(fake_run, tmp_path):
    """Tune decided between two rounds: the trial notices without waiting for a report."""
    plan = fake_run(0)
    reports = []
    run_trial({"trial": "t"}, {"t": plan}, "127.0.0.1:1", report=reports.append, stopped=lambda: len(reports) > 0)
    assert len(reports) == 1


def test_follow_reads_only_whole_lines(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    path = out / "metrics.jsonl"
    path.write_text(json.dumps({"event": "round", "round": 0, "eval_loss": 1.0}) + "\n" + '{"event": "rou')
    seen = []
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    follow(done, str(out), seen.append, stopped=lambda: False)
    assert [r["round"] for r in seen] == [0]
    assert os.path.getsize(path) > 0
