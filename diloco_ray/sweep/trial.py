"""One sweep trial inside Ray Tune: a whole ``diloco-ray train`` run in a driver process of
its own, whose round records are reported to Tune as they land in its ``metrics.jsonl``.

Why a process, and not the trainer inside the trial's actor: Tune ends a trial it stops
early by ending that actor, and a job's placement groups live as long as its driver. A
trainer inside the actor would leave its groups holding the cluster's CPUs, and the next
trial would wait for them for ever. A driver per trial is a Ray job of its own: however it
ends, Ray frees its actors and groups with it. The trial stops its run (SIGTERM: the
trainer's clean stop) when it sees Tune's stop; when Tune ends the trial's actor first, the
run ends with it (Ray ends a worker's child processes; ``PR_SET_PDEATHSIG`` besides). A
trial stopped early so leaves the round records it wrote and no placement group
(tests/integration/test_sweep.py checks both).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from diloco_ray import files

# How often the trial looks for new round records: often enough that Tune hears of each
# round soon after it lands, even where rounds are short (the tiny default's).
POLL_S = 0.5
# How long a stopped trial's driver gets to stop cleanly before it is killed.
STOP_GRACE_S = 60.0


@dataclasses.dataclass(frozen=True)
class TrialPlan:
    """Where one trial's run reads and writes (all on the sweep driver's node).

    Args:
        config_path: the trial's full config as YAML.
        output_dir: the run's ``output_dir`` (absolute).
        console_log: where the run's console output goes.
        cwd: the folder the run starts in: the sweep's own, so that relative paths in the
            config (a data file, a model folder) mean what they meant there.
    """

    config_path: str
    output_dir: str
    console_log: str
    cwd: str = "."


class TrialFailed(RuntimeError):
    """The trial's run exited with an error; the message is its last error line."""


def run_trial(
    params: dict,
    plans: dict,
    address: str,
    report: Optional[Callable[[dict], None]] = None,
    stopped: Optional[Callable[[], bool]] = None,
) -> None:
    """Tune's function trainable: run ``plans[params["trial"]]`` and report every round
    that has an eval loss as ``{"round": n (1-based), "eval_loss", "train_loss", "seconds"}``.

    Args:
        params: Tune's trial parameters (``{"trial": name}``).
        plans: trial name -> :class:`TrialPlan`.
        address: the Ray cluster the run joins (the sweep's).
        report: where results go (default ``ray.tune.report``; tests pass a list's append).
        stopped: whether Tune has asked the trial to stop (default: :func:`tune_stopped`).
    """
    if report is None:
        from ray import tune

        report = tune.report
    stopped = stopped or tune_stopped
    plan = plans[params["trial"]]
    started = time.monotonic()
    proc = start_run(plan, address)
    try:
        follow(proc, plan.output_dir, lambda record: report(_result(record, started)), stopped)
    except BaseException:  # stopped by Tune (SystemExit from report) or interrupted
        stop(proc)
        raise
    if proc.poll() is None:  # Tune stopped the trial between two reports
        stop(proc)
        return
    if proc.returncode != 0:
        raise TrialFailed(failure(proc.returncode, plan.console_log))


def start_run(plan: TrialPlan, address: str) -> subprocess.Popen:
    """``python -m diloco_ray train CONFIG`` on the cluster at ``address``, its console to
    ``plan.console_log``."""
    env = {**os.environ, "RAY_ADDRESS": address}
    with files.open_fresh(plan.console_log) as log:  # never through a link at the name
        return subprocess.Popen(
            [sys.executable, "-m", "diloco_ray", "train", plan.config_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=plan.cwd,
            preexec_fn=_die_with_parent,
        )


def follow(
    proc: subprocess.Popen, output_dir: str, on_round: Callable[[dict], None], stopped: Callable[[], bool]
) -> None:
    """Hand each new round record of ``output_dir/metrics.jsonl`` to ``on_round`` until
    ``proc`` exits (then the records it wrote last) or ``stopped()`` says so."""
    path = os.path.join(output_dir, "metrics.jsonl")
    offset = 0
    while True:
        done = proc.poll() is not None
        offset = _read_rounds(path, offset, on_round)
        if done or stopped():
            return
        time.sleep(POLL_S)


def tune_stopped() -> bool:
    """Whether Tune has asked this trial to stop. Tune's own API tells a function trainable
    only at its next report, which for a trial between rounds may be long after the scheduler
    decided (or never, at the last one); it sets its session's stop event at once. That
    event is ``ray.train._internal``: where it is missing, the next report still stops the
    trial, and the run dies with the trial's actor (``PR_SET_PDEATHSIG``)."""
    try:
        from ray.train._internal.session import get_session
    except ImportError:
        return False
    event = getattr(get_session(), "stop_event", None)
    return bool(event is not None and event.is_set())


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (the trainer stops cleanly and its Ray job ends), then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def failure(status: int, console_log: str) -> str:
    """Why a run ended with ``status``, in one line."""
    if status < 0:
        return f"the run was killed by {signal.Signals(-status).name}; its console: {console_log}"
    return last_error_line(console_log) or f"the run exited with status {status}; its console: {console_log}"


def last_error_line(console_log: str) -> Optional[str]:
    """The run's one-line error (``diloco-ray: error: ...``), else the last line of its
    traceback, else None."""
    try:
        with open(console_log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if line.startswith("diloco-ray: error:")]
    if errors:
        return errors[-1].removeprefix("diloco-ray: error:").strip()
    if "Traceback (most recent call last):" in lines:
        return lines[-1][:500]
    return None


def _read_rounds(path: str, offset: int, on_round: Callable[[dict], None]) -> int:
    """Records after ``offset`` (whole lines only: the file is appended while read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].splitlines():
        record = json.loads(line)
        if record.get("event") == "round" and record.get("eval_loss") is not None:
            on_round(record)
    return offset + end


def _result(record: dict, started: float) -> dict:
    return {
        "round": int(record["round"]) + 1,
        "eval_loss": float(record["eval_loss"]),
        "train_loss": record.get("train_loss"),
        "seconds": time.monotonic() - started,
    }


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the trial's process dies (Linux; elsewhere
    the trial's own stop is all there is)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
