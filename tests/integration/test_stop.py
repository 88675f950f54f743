"""SIGTERM of the driver (a spot preemption, ``ray job stop``): it stops cleanly with a
checkpoint of the last completed round, leaves no Ray process behind, and a resume from
that checkpoint ends with the same weights as a run never stopped."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import EXACT_JOB, ROOT, max_abs_diff, tiny_config

from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.observe.metrics import read_events
from diloco_ray.persist import checkpoint

pytestmark = pytest.mark.integration
# A checkpoint every other round: the one at round 3 is written only because of the stop.
# Two servers: the fault-free run is test_fault_kinds.py's synchronous one (made once a session).
COMMON = EXACT_JOB


def sessions() -> set[str]:
    return {d for d in os.listdir("/tmp/ray") if d.startswith("session_2")} if os.path.isdir("/tmp/ray") else set()


def processes_naming(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a Ray session's name)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if marker in line:
            found.append(line[:160])
    return found


def test_sigterm_checkpoints_the_last_round_and_resumes_exactly(ray_local, tmp_path, uninterrupted):
    reference = uninterrupted(**COMMON)

    # Slow round 3 down so SIGTERM lands in the middle of it.
    cfg = tiny_config(
        tmp_path / "stopped",
        **COMMON,
        fault_plan=[{"kind": "slow", "replica": 0, "round": 3, "step": 1, "seconds": 3.0}],
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "RAY_TMPDIR": "/tmp"}
    env.pop("RAY_ADDRESS", None)
    cfg.to_yaml(str(tmp_path / "stopped.yaml"))
    before = sessions()
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_ray", "train", str(tmp_path / "stopped.yaml")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline:
        if os.path.exists(metrics) and any(
            json.loads(line).get("event") == "round" and json.loads(line)["round"] == 2
            for line in open(metrics)
            if line.strip()
        ):
            break
        time.sleep(0.2)
    time.sleep(1.5)  # into round 2's slow steps
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM at round 3" in err and "round-00000003" in err
    root = os.path.join(cfg.output_dir, "checkpoints")
    newest = checkpoint.list_checkpoints(root)[-1]
    assert os.path.basename(newest) == "round-00000003" and checkpoint.verify(newest) is None
    assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1, 2]
    # The run's own Ray (every process of its session) went down with it.
    started = sessions() - before
    assert len(started) == 1
    marker, deadline = started.pop(), time.monotonic() + 2
    while processes_naming(marker) and time.monotonic() < deadline:  # gone within 2 s
        time.sleep(0.1)
    assert processes_naming(marker) == []

    # Resumed in this process, on the module's Ray (test_faults resumes through the CLI).
    saved = TrainerConfig.from_yaml(
        os.path.join(cfg.output_dir, "config.yaml"), overrides={"resume_from": cfg.output_dir, "fault_plan": None}
    )
    DilocoFSDPTrainer(saved).train()
    assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1, 2, 3, 4]
    assert max_abs_diff(cfg.output_dir, reference.output_dir) <= 1e-5
