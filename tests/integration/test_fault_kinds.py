"""Every fault of the fault plan, in both sync modes, as a real run: each kind and target
fires, and the run ends the way its documented rule says (README, Faults: what each one
costs), not only that it finished.

* replica faults (``kill``, ``freeze``, ``slow``, ``slowdown``, ``nan``, ``drop_link``):
  who is dropped and why, who stays, what is discounted, and no stream position twice;
* a parameter server SIGKILLed (two servers) and the driver SIGKILLed or SIGTERMed: the
  run goes on (or is resumed) from a checkpoint to the weights of a run without the fault,
  to 1e-5. In decoupled mode these runs keep the replicas in lockstep (``min_quorum`` =
  replicas), where the result does not depend on timing and so is exactly checkable.
"""

import math
import os
import signal
import statistics
import subprocess
import sys

import numpy as np
import pytest
import ray
from conftest import ROOT, applied_positions, max_abs_diff, subprocess_env, tiny_config

from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.observe.metrics import read_events
from diloco_ray.persist import checkpoint
from diloco_ray.runtime.rank import BEAT_S

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODES = {"sync": {}, "decoupled": {"sync_mode": "decoupled"}}
# Short periods; a stall is judged after 4 s without a step (ranks beat every BEAT_S = 2 s).
BASE = dict(diloco_loops=3, max_steps=4, eval_batches=1, stall_timeout_s=4.0, abort_grace_s=2.0, logging_steps=1)
# Decoupled: the other replica must still be merging when the faulty one is found stalled
# (or arrives late). A tiny period takes milliseconds, so it is paced: every step 20x as long.
LONGER = {"decoupled": {"diloco_loops": 10}}


def pace(fault: dict, mode: str) -> list:
    """The fault, and in decoupled mode the other replica slowed down to a steady pace."""
    other = {"kind": "slowdown", "replica": 1 - fault["replica"], "round": 0, "factor": 20}
    return [fault, other] if mode == "decoupled" and fault["kind"] != "slowdown" else [fault]


REPLICA_FAULTS = {
    "kill": ({"kind": "kill", "replica": 1, "round": 1, "step": 1}, {}),
    "freeze": ({"kind": "freeze", "replica": 1, "round": 1, "step": 1}, LONGER),
    "slow": ({"kind": "slow", "replica": 1, "round": 0, "step": 0, "seconds": 0.3}, {}),
    "slowdown": ({"kind": "slowdown", "replica": 1, "round": 0, "factor": 4}, {}),
    "nan": ({"kind": "nan", "replica": 0, "round": 1, "step": 1}, {}),
    # The synchronous rule for a link that never delivers is the round's deadline.
    "drop_link": ({"kind": "drop_link", "replica": 0, "round": 1}, {"sync": {"round_timeout_s": 2.5}, **LONGER}),
}
# A checkpoint every two rounds' worth, two servers, replicas in lockstep.
EXACT = dict(diloco_loops=5, max_steps=4, checkpoint_steps=8, num_param_servers=2, eval_batches=1)
LOCKSTEP = {"sync": {}, "decoupled": {"sync_mode": "decoupled", "min_quorum": 2}}


def leaves(output_dir) -> dict:
    return {e["replica_id"]: e["reason"] for e in read_events(output_dir, "membership") if e["action"] == "leave"}


def no_position_twice(rounds) -> bool:
    positions = applied_positions(rounds)
    return len(positions) == len(set(positions))


def step_seconds(output_dir, replica: int) -> float:
    """The median time between a replica's step events (logging_steps = 1)."""
    times = [e["time"] for e in read_events(output_dir, "step") if e["replica"] == replica]
    return statistics.median(b - a for a, b in zip(times, times[1:]) if b > a)


def check_kill(mode, out, rounds):
    assert leaves(out) == {1: "failed"}
    hit = next(i for i, r in enumerate(rounds) if 1 in r["dropped"])
    assert all(1 not in r["replica_ids"] for r in rounds[hit:])


def check_freeze(mode, out, rounds):
    assert leaves(out) == {1: "unresponsive"} and any(1 in r["dropped"] for r in rounds)
    # Dropped within its deadlines: no step for stall_timeout_s, then abort_grace_s to answer.
    last_step = max(e["time"] for e in read_events(out, "step") if e["replica"] == 1)
    left = next(e["time"] for e in read_events(out, "membership") if e["action"] == "leave")
    assert left - last_step <= BASE["stall_timeout_s"] + BASE["abort_grace_s"] + BEAT_S + 3.0


def check_slow(mode, out, rounds):
    assert not leaves(out)
    if mode == "sync":  # the round waits: four steps 0.3 s longer each
        assert sorted(rounds[0]["replica_ids"]) == [0, 1] and rounds[0]["round_seconds"] >= 4 * 0.3
    else:  # nobody waits for the straggler: the first arrival is merged alone (which one comes
        # first depends on the pacing of the other, see pace), the other later, as stale as the
        # rule says: delayed momentum (the default) counts the whole rounds' worth merged since
        # it started (at work 0), the cycles the first one's merges completed before.
        assert len(rounds[0]["replica_ids"]) == 1
        other = 1 - rounds[0]["replica_ids"][0]
        at = next(i for i, r in enumerate(rounds) if other in r["replica_ids"])
        assert at >= 1 and rounds[at]["staleness"][str(other)] == math.floor(rounds[at - 1]["work"] + 1e-9)


def check_slowdown(mode, out, rounds):
    assert not leaves(out)
    assert step_seconds(out, 1) >= 2.0 * step_seconds(out, 0)  # 4x as long, measured on a busy machine


def check_nan(mode, out, rounds):
    hit = next(i for i, r in enumerate(rounds) if "0" in r["rejected"])
    assert rounds[hit]["rejected"]["0"].startswith("non-finite")
    assert not leaves(out) and any(0 in r["replica_ids"] for r in rounds[hit + 1 :])  # reset, and trains on
    assert all(np.isfinite(r["eval_loss"]) for r in rounds if r["eval_loss"] is not None)


def check_drop_link(mode, out, rounds):
    assert not leaves(out)  # told to stop, it answers: it stays
    if mode == "sync":
        hit = next(i for i, r in enumerate(rounds) if r["late"] == [0])
    else:  # stopped after stall_timeout_s without a step
        hit = next(i for i, r in enumerate(rounds) if r["wasted_steps"] > 0)
    assert any(0 in r["replica_ids"] for r in rounds[hit + 1 :])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", REPLICA_FAULTS)
def test_every_replica_fault_fires_in_both_modes(ray_local, tmp_path, kind, mode):
    fault, extra = REPLICA_FAULTS[kind]
    cfg = tiny_config(tmp_path / "run", **{**BASE, **MODES[mode], **extra.get(mode, {})}, fault_plan=pace(fault, mode))
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert rounds[-1].get("work", len(rounds)) >= cfg.diloco_loops - 1e-9
    globals()[f"check_{kind}"](mode, cfg.output_dir, rounds)
    assert no_position_twice(rounds)


@pytest.fixture(scope="module")
def fault_free(ray_local, uninterrupted):
    """Per mode, the lockstep run a lost server or driver must reproduce (built on demand;
    test_stop.py compares with the synchronous one too)."""
    return lambda mode: uninterrupted(**EXACT, **LOCKSTEP[mode])


@pytest.mark.parametrize("mode", MODES)
def test_a_killed_server_is_restored_and_the_run_ends_as_without_the_fault(fault_free, tmp_path, mode):
    """Server 1 of 2 is SIGKILLed while round (merge) 3 trains: the servers come back from the
    round-2 checkpoint, rounds 2 and 3 run again (their records are rewritten), and the final
    weights are the fault-free run's."""
    reference = fault_free(mode)
    plan = [{"kind": "kill", "target": "server", "round": 3, "index": 1}]
    cfg = tiny_config(tmp_path / "run", **EXACT, **LOCKSTEP[mode], fault_plan=plan)
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    restarts = read_events(cfg.output_dir, "server")
    assert len(restarts) == 1 and restarts[0]["from"].endswith("round-00000002")
    recorded = read_events(cfg.output_dir, "round")
    assert [r["round"] for r in recorded] == [0, 1, 2, 3, 4] == [r["round"] for r in rounds]
    assert max_abs_diff(cfg.output_dir, reference.output_dir) <= 1e-5
    positions = applied_positions(recorded)
    assert sorted(positions) == list(range(len(positions)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["kill", "term"])
def test_a_driver_fault_resumes_to_the_weights_of_a_run_without_it(fault_free, tmp_path, mode, kind):
    """The driver is SIGKILLed, or SIGTERMed, while round (merge) 3 trains. SIGTERM stops it
    cleanly: the replicas rewind to their period's start and round 3 is checkpointed. SIGKILL
    leaves the round-2 checkpoint, which is then damaged, so the resume notices and falls back
    to round 0. Either way the resumed run ends with the fault-free weights."""
    reference = fault_free(mode)
    cfg = tiny_config(
        tmp_path / "run", **EXACT, **LOCKSTEP[mode], fault_plan=[{"kind": kind, "target": "driver", "round": 3}]
    )
    if kind == "kill":  # in a process of its own: it dies
        cfg.to_yaml(str(tmp_path / "run.yaml"))
        proc = subprocess.run(
            [sys.executable, "-m", "diloco_ray", "train", str(tmp_path / "run.yaml")],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    else:  # SIGTERM stops this process's trainer as it stops the CLI's (test_stop.py runs the CLI)
        trainer = DilocoFSDPTrainer(cfg, stop_on_sigterm=True)
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert trainer.stopped_by == "SIGTERM" and trainer.stop_checkpoint.endswith("round-00000003")
    assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1, 2]
    newest = checkpoint.list_checkpoints(os.path.join(cfg.output_dir, "checkpoints"))[-1]
    if kind == "kill":
        assert newest.endswith("round-00000002")
        with open(os.path.join(newest, "global-0-of-2.safetensors"), "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"\x00" * 8)
        resumes_from = 0
    else:
        assert newest.endswith("round-00000003")
        resumes_from = 3
    # Resumed in this process, on the module's Ray, as a user would: the saved config, no faults.
    saved = TrainerConfig.from_yaml(
        os.path.join(cfg.output_dir, "config.yaml"), overrides={"resume_from": cfg.output_dir, "fault_plan": None}
    )
    DilocoFSDPTrainer(saved).train()
    events = read_events(cfg.output_dir, "checkpoint")
    assert [e["round"] for e in events if e["action"] == "resume"] == [resumes_from]
    assert any(e["action"] == "skipped" for e in events) == (kind == "kill")  # the damaged one
    rounds = read_events(cfg.output_dir, "round")
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    assert max_abs_diff(cfg.output_dir, reference.output_dir) <= 1e-5
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(len(positions)))
