"""Faults from outside the fault plan, each checked against the round records and the
final state: the driver SIGKILLed mid-round and resumed from an in-flight snapshot, scaling
from a callback and from another process, a lost step board; and every stream position
trained on exactly once. The fault plan's faults are in test_fault_kinds.py and test_chaos.py."""

import json
import os
import signal
import subprocess
import sys

import pytest
import ray
from conftest import ROOT, applied_positions, max_abs_diff, resume_cli, subprocess_env, tiny_config

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.observe.metrics import read_events

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def run_until_killed(script, cfg, *args):
    """Run ``script`` (which SIGKILLs its own driver) in a fresh process; check it died so."""
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cfg.to_dict()), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]


def test_scale_two_three_two(ray_local, tmp_path):
    class Scaler:
        def on_round_end(self, trainer, record):
            if record["round"] == 1:
                trainer.scale(3)
            if record["round"] == 2:
                trainer.scale(2)

    cfg = tiny_config(tmp_path / "run", max_replicas=3, diloco_loops=4, eval_batches=0, join_timeout_s=120)
    result = DilocoFSDPTrainer(cfg, callbacks=[Scaler()]).train()
    assert [r["replicas"] for r in result.rounds] == [2, 2, 3, 2]
    assert sorted(result.rounds[2]["replica_ids"]) == [0, 1, 2]
    joins = [e for e in read_events(cfg.output_dir, "membership") if e["action"] == "join"]
    # The first two join in whichever order their set-up finishes; the third is new.
    assert sorted(e["replica_id"] for e in joins) == [0, 1, 2]
    assert joins[-1]["replica_id"] == 2 and joins[-1]["start_seconds"] > 0
    positions = applied_positions(result.rounds)
    assert sorted(positions) == list(range(len(positions)))


MID_ROUND_KILL_SCRIPT = """
import json, os, signal, sys, time
from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.runtime.rank import RankWorker
class KillDriverMidRound(RankWorker):
    driver_pid = os.getpid()   # the class travels to the actors by value, and this with it

    def _save_snapshot(self, snapshots, plan, step, loss_sum, tokens):
        super()._save_snapshot(snapshots, plan, step, loss_sum, tokens)
        if self.replica_id == 0 and "round-00000002" in snapshots.folder and step == 4:
            os.kill(self.driver_pid, signal.SIGKILL)
            time.sleep(60)   # Ray ends this actor with its driver's job

DilocoFSDPTrainer(TrainerConfig(**json.loads(sys.argv[1])), worker_cls=KillDriverMidRound).train()
"""


def test_driver_killed_mid_round_resumes_from_inflight_snapshot(ray_local, tmp_path):
    common = dict(diloco_loops=4, max_steps=6, checkpoint_steps=2, eval_batches=1)
    reference = tiny_config(tmp_path / "reference", **common)
    DilocoFSDPTrainer(reference).train()

    killed = tiny_config(tmp_path / "killed", **common)
    run_until_killed(MID_ROUND_KILL_SCRIPT, killed)
    assert [r["round"] for r in read_events(killed.output_dir, "round")] == [0, 1]

    resume_cli(killed)
    rounds = read_events(killed.output_dir, "round")
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[2]["resumed_steps"]["0"] == 4  # replica 0 went on from its step-4 snapshot
    worst = max_abs_diff(killed.output_dir, reference.output_dir)
    assert worst <= 1e-5, f"resumed run differs from the uninterrupted one by {worst}"
    # Snapshots of rounds a round checkpoint covers are cleaned up.
    assert not os.path.exists(os.path.join(killed.output_dir, "checkpoints", "inflight", "round-00000002"))


def test_scale_request_from_another_process(ray_local, tmp_path):
    class AskFromOutside:
        def on_round_end(self, trainer, record):
            if record["round"] == 0:  # a separate process, as a user at a terminal would
                r = subprocess.run(
                    [sys.executable, "-m", "diloco_ray", "scale", trainer.config.output_dir, "3"],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    env=subprocess_env(),
                )
                assert r.returncode == 0, r.stderr

    cfg = tiny_config(tmp_path / "run", max_replicas=3, diloco_loops=3, eval_batches=0, join_timeout_s=120)
    result = DilocoFSDPTrainer(cfg, callbacks=[AskFromOutside()]).train()
    assert [r["replicas"] for r in result.rounds] == [2, 3, 3]
    scale_events = [e for e in read_events(cfg.output_dir, "membership") if e["action"] == "scale"]
    assert [e["target"] for e in scale_events] == [3]

    missing = subprocess.run(
        [sys.executable, "-m", "diloco_ray", "scale", str(tmp_path / "nothing"), "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert missing.returncode == 2 and "holds no run" in missing.stderr


def test_a_lost_step_board_costs_step_events_not_the_run(ray_local, tmp_path):
    class KillBoard:
        def on_round_end(self, trainer, record):
            if record["round"] == 0:
                ray.kill(trainer.board)

    cfg = tiny_config(tmp_path / "run", diloco_loops=3, max_steps=4, logging_steps=2, eval_batches=0)
    result = DilocoFSDPTrainer(cfg, callbacks=[KillBoard()]).train()
    assert [r["round"] for r in result.rounds] == [0, 1, 2]
    warnings = read_events(cfg.output_dir, "warning")
    assert len(warnings) == 1 and "step board died" in warnings[0]["message"]
    rounds_with_steps = {e["round"] for e in read_events(cfg.output_dir, "step")}
    assert {0, 2} <= rounds_with_steps  # before the loss, and again with the new board
