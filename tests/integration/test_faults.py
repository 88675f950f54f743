"""Faults from outside the fault plan, each checked against the round records and the
final state: the driver SIGKILLed mid-round and resumed from an in-flight snapshot, scaling
from a callback and from another process with a lost step board in the same run; and every
stream position trained on exactly once. The fault plan's faults are in test_fault_kinds.py and test_chaos.py."""

import glob
import json
import os
import signal
import subprocess
import sys

import pytest
import ray
from conftest import EXACT_JOB, ROOT, applied_positions, max_abs_diff, resume_cli, subprocess_env, tiny_config

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.observe.metrics import read_events
from diloco_ray.runtime.rank import RankWorker

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The keys every round record holds (docs/interface.md, metrics.jsonl).
ROUND_RECORD_KEYS = [
    "round",
    "replicas",
    "replica_ids",
    "dropped",
    "inner_steps",
    "tokens",
    "train_loss",
    "eval_loss",
    "outer_lr",
    "pseudo_grad_norm",
    "bytes_up",
    "bytes_down",
    "round_seconds",
    "sync_seconds",
]
# The lockstep job test_fault_kinds.py compares with (conftest.EXACT_JOB).
EXACT = EXACT_JOB


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


MID_ROUND_KILL_SCRIPT = """
import json, os, signal, sys, time
from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.runtime.rank import RankWorker
class KillDriverMidRound(RankWorker):
    driver_pid = os.getpid()   # the class travels to the actors by value, and this with it

    def _save_snapshot(self, snapshots, plan, step, loss_sum, tokens):
        super()._save_snapshot(snapshots, plan, step, loss_sum, tokens)
        if self.replica_id == 0 and "round-00000002" in snapshots.folder and step == 2:
            os.kill(self.driver_pid, signal.SIGKILL)
            time.sleep(60)   # Ray ends this actor with its driver's job

class Trainer(DilocoFSDPTrainer):
    worker_cls = KillDriverMidRound

Trainer(TrainerConfig(**json.loads(sys.argv[1]))).train()
"""


def test_driver_killed_mid_round_resumes_from_inflight_snapshot(ray_local, tmp_path, uninterrupted):
    # The fault-free run is test_fault_kinds.py's (made once a session):
    # checkpoint_steps does not change the weights, so a snapshot every two steps may differ.
    reference = uninterrupted(**EXACT)
    killed = tiny_config(tmp_path / "killed", **{**EXACT, "checkpoint_steps": 2})
    run_until_killed(MID_ROUND_KILL_SCRIPT, killed)
    assert [r["round"] for r in read_events(killed.output_dir, "round")] == [0, 1]

    resume_cli(killed)
    rounds = read_events(killed.output_dir, "round")
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    # Replica 0's slot went on from its step-2 snapshot (saved just before the kill; replica
    # 1's only if it got that far). A resumed run's replicas take the slots in the order they
    # are ready, so the one that took slot 0 may be either id.
    assert 2 in rounds[2]["resumed_steps"].values(), rounds[2]["resumed_steps"]
    worst = max_abs_diff(killed.output_dir, reference.output_dir)
    assert worst <= 1e-5, f"resumed run differs from the uninterrupted one by {worst}"
    # Snapshots of rounds a round checkpoint covers are cleaned up.
    assert not os.path.exists(os.path.join(killed.output_dir, "checkpoints", "inflight", "round-00000002"))


def test_scale_from_another_process_and_from_a_callback_and_a_lost_step_board(ray_local, tmp_path):
    """Two to three replicas, asked from another process (as a user at a terminal would),
    then down to one and back up to two from a callback: each takes effect at the next
    boundary; a replica that joins mid-run is new and was set up while the others trained;
    every round record holds the contract's keys; every stream position trained once.
    The step board is killed at round 0's end: that costs step events, not the run."""

    class Scaler:
        def on_round_end(self, trainer, record):
            if record["round"] == 0:  # a separate process
                ray.kill(trainer.board)
                r = subprocess.run(
                    [sys.executable, "-m", "diloco_ray", "scale", trainer.config.output_dir, "3"],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    env=subprocess_env(),
                )
                assert r.returncode == 0, r.stderr
            trainer.scale({1: 1, 2: 2}.get(record["round"], trainer.target_replicas))

    cfg = tiny_config(
        tmp_path / "run",
        max_replicas=3,
        diloco_loops=4,
        logging_steps=2,
        eval_batches=0,
        log_with="tensorboard",
        join_timeout_s=120,
    )
    result = DilocoFSDPTrainer(cfg, callbacks=[Scaler()]).train()
    assert [r["replicas"] for r in result.rounds] == [2, 3, 1, 2]
    assert sorted(result.rounds[1]["replica_ids"]) == [0, 1, 2]
    scale_events = [e for e in read_events(cfg.output_dir, "membership") if e["action"] == "scale"]
    assert [e["target"] for e in scale_events] == [3]  # only the other process's request is an event
    joins = [e for e in read_events(cfg.output_dir, "membership") if e["action"] == "join"]
    # The first two join in whichever order their set-up finishes; the later ones are new.
    assert sorted(e["replica_id"] for e in joins[:2]) == [0, 1]
    assert [e["replica_id"] for e in joins[2:]] == [2, 3] and all(e["start_seconds"] > 0 for e in joins[2:])
    assert glob.glob(os.path.join(cfg.output_dir, "logs", "events.out.tfevents.*"))
    for rec in read_events(cfg.output_dir, "round"):
        assert all(k in rec for k in ROUND_RECORD_KEYS)
        assert rec["eval_loss"] is None
        assert rec["bytes_up"] > 0 and (rec["bytes_down"] > 0 or rec["round"] == 0)  # round 0: kept, not loaded
    positions = applied_positions(result.rounds)
    assert sorted(positions) == list(range(len(positions)))
    warnings = read_events(cfg.output_dir, "warning")
    assert len(warnings) == 1 and "step board died" in warnings[0]["message"]
    rounds_with_steps = {e["round"] for e in read_events(cfg.output_dir, "step")}
    assert {0, 2} <= rounds_with_steps  # before the loss, and again with the new board

    missing = subprocess.run(
        [sys.executable, "-m", "diloco_ray", "scale", str(tmp_path / "nothing"), "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert missing.returncode == 2 and "holds no run" in missing.stderr


class LoseOneMessage(RankWorker):
    """Replica 1 loses the messages of its second period after its stats went out (its
    process gone in that moment, as far as the servers can tell): with overlap the two
    leave by separate calls."""

    sends = 0

    def message(self, attempt):
        self.sends += 1
        if self.replica_id == 1 and self.sends == 2:
            self.outbox.take(attempt)  # made, never delivered
            raise RuntimeError("the rank went away between its stats and its messages")
        return super().message(attempt)


def test_a_message_lost_after_its_stats_is_rejected_as_lost_in_transit(ray_local, tmp_path):
    """The rule for a message that never arrives from a replica that reported: the servers
    reject it as lost in transit and apply the others; the replica trains on."""

    class Trainer(DilocoFSDPTrainer):
        worker_cls = LoseOneMessage

    cfg = tiny_config(tmp_path / "run", sync_fragments=2, overlap_communication=True, diloco_loops=3)
    rounds = Trainer(cfg).train().rounds
    assert [r["round"] for r in rounds] == [0, 1, 2] and [r["replicas"] for r in rounds] == [1, 2, 2]
    assert list(rounds[0]["rejected"]) == ["1"] and "lost in transit" in rounds[0]["rejected"]["1"]
    assert rounds[1]["rejected"] == {} and rounds[2]["rejected"] == {}
