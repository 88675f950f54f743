"""Every fault of the fault plan, in both sync modes, as a real run: each kind and target
fires, and the run ends the way its documented rule says (docs/faults.md, Faults: what each
one costs), not only that it finished.

* replica faults (``kill``, ``freeze``, ``slow``, ``slowdown``, ``nan``, ``drop_link``):
  who is dropped and why, who stays, what is discounted, and no stream position twice;
* a parameter server SIGKILLed (two servers; then the driver SIGKILLed in the same run) and
  the driver SIGTERMed (a spot preemption; in sync mode through the CLI): the run goes on
  (or is resumed) from a checkpoint to the weights of a run without the fault, to 1e-5. In
  decoupled mode these runs keep the replicas in lockstep (``min_quorum`` = replicas), where
  the result does not depend on timing and so is exactly checkable.
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
from conftest import (
    EXACT_JOB,
    ROOT,
    TWO_SERVERS,
    applied_positions,
    max_abs_diff,
    paced,
    subprocess_env,
    tiny_config,
)

from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.config.fault_plan import KINDS, REGION_REHEARSALS
from diloco_ray.observe.metrics import read_events
from diloco_ray.persist import checkpoint
from diloco_ray.runtime.rank_period import BEAT_S

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MODES = {"sync": {}, "decoupled": {"sync_mode": "decoupled"}}
# Short periods; a stall is judged after 4 s without a step (ranks beat every BEAT_S = 2 s).
BASE = dict(diloco_loops=3, max_steps=4, eval_batches=1, stall_timeout_s=4.0, abort_grace_s=2.0, logging_steps=1)


def paced_by_rounds(replica: int, first_round: int, seconds: float = 0.3, rounds: int = 40) -> list[dict]:
    """Decoupled: a replica that must still be merging while another is found stalled (or
    arrives late) is paced (conftest.paced), over more rounds' worth: a tiny period takes
    milliseconds. A pacing fault is not itself checked (``slowdown`` is, below)."""
    return [{**f, "pace": True} for f in paced(replica, range(first_round, first_round + rounds), seconds)]


LONGER = {"diloco_loops": 10}

# Each mode's runs: (extra fields, faults). Faults that do not interfere share a run, each
# on its own replica or round and checked against its own rule; every kind fires in both
# modes (test_the_runs_hold_every_replica_fault_in_both_modes).
RUNS = {
    "sync": {
        # No deadline: the round waits for the slow ones; the frozen one is judged by its
        # missing step beats; the killed one is left out.
        "slow-slowdown-freeze-kill": (
            {"num_replicas": 3},
            [
                {"kind": "slow", "replica": 1, "round": 0, "step": 0, "seconds": 0.3},
                {"kind": "slowdown", "replica": 1, "round": 1, "factor": 4, "against": 0},
                {"kind": "freeze", "replica": 2, "round": 1, "step": 1},
                {"kind": "kill", "replica": 0, "round": 2, "step": 1},
            ],
        ),
        # The synchronous rule for a link that never delivers is the round's deadline.
        "nan-drop_link": (
            {"round_timeout_s": 2.5},
            [
                {"kind": "nan", "replica": 1, "round": 0, "step": 1},
                {"kind": "drop_link", "replica": 0, "round": 1},
            ],
        ),
    },
    "decoupled": {
        "slowdown-nan": (
            {},
            [
                {"kind": "slowdown", "replica": 1, "round": 0, "factor": 4, "against": 0},
                {"kind": "nan", "replica": 0, "round": 1, "step": 1},
            ],
        ),
        # Replica 1's first period 4 x 0.9 s longer than replica 0's, both paced by a fixed time
        # a step (no load changes the gap, where a multiple of the step's own time does): replica
        # 0 arrives first, and the first merge's wait for replica 1 (replica 0's period standing
        # in for its pace, plus max(0.25 s, a quarter of a period)) ends before replica 1 arrives
        # unless the first period's own work (start-up included) takes 14 s, which a load of
        # 10 on 2 cores reached with half this gap. Replica 0 needs 20 periods of at least
        # 0.4 s for the run, twice replica 1's 4 s of pacing, so it is still merging when
        # replica 1 arrives.
        "slow": (
            LONGER,
            [
                *paced_by_rounds(replica=0, first_round=0, seconds=0.1),
                {"kind": "slow", "replica": 1, "round": 0, "step": 0, "seconds": 1.0},
            ],
        ),
        # Replica 0's periods take at least 0.8 s, so the run's 10 rounds' worth outlast the time
        # replica 1's dropped link takes to be found (no step for stall_timeout_s, then
        # abort_grace_s), and replica 1 is merged again before the end.
        "drop_link": (
            LONGER,
            [*paced_by_rounds(replica=0, first_round=0, seconds=0.2), {"kind": "drop_link", "replica": 1, "round": 1}],
        ),
        # Replica 0 and replica 2's replacement (id 3) are paced, or they would end the run
        # before the frozen one is found stalled (>= stall_timeout_s + abort_grace_s after it
        # froze); by a fixed time, as a multiple of a busy machine's step can outlast
        # stall_timeout_s (the paced replica is then dropped as frozen).
        "freeze-kill": (
            {**LONGER, "num_replicas": 3},
            [
                *paced_by_rounds(replica=0, first_round=0),
                *paced_by_rounds(replica=3, first_round=2),
                {"kind": "freeze", "replica": 1, "round": 1, "step": 1},
                {"kind": "kill", "replica": 2, "round": 1, "step": 1},
            ],
        ),
    },
}
# A checkpoint every two rounds' worth, replicas in lockstep (a server is lost of TWO_SERVERS).
EXACT = EXACT_JOB
LOCKSTEP = {"sync": {}, "decoupled": {"sync_mode": "decoupled", "min_quorum": 2}}


def leaves(output_dir) -> dict:
    return {e["replica_id"]: e["reason"] for e in read_events(output_dir, "membership") if e["action"] == "leave"}


def no_position_twice(rounds) -> bool:
    positions = applied_positions(rounds)
    return len(positions) == len(set(positions))


def step_seconds(output_dir, replica: int, since: int = 0) -> float:
    """The median time between a replica's step events (logging_steps = 1) from round ``since`` on."""
    times = [e["time"] for e in read_events(output_dir, "step") if e["replica"] == replica and e["round"] >= since]
    return statistics.median(b - a for a, b in zip(times, times[1:]) if b > a)


def check_kill(mode, out, rounds, fault):
    victim = fault["replica"]
    assert leaves(out)[victim] == "failed"
    hit = next(i for i, r in enumerate(rounds) if victim in r["dropped"])
    assert all(victim not in r["replica_ids"] for r in rounds[hit:])


def check_freeze(mode, out, rounds, fault):
    frozen = fault["replica"]
    assert leaves(out)[frozen] == "unresponsive" and any(frozen in r["dropped"] for r in rounds)
    # Dropped within its deadlines: no step for stall_timeout_s, then abort_grace_s to answer.
    last_step = max(e["time"] for e in read_events(out, "step") if e["replica"] == frozen)
    left = next(
        e["time"] for e in read_events(out, "membership") if e["action"] == "leave" and e["replica_id"] == frozen
    )
    # Not before stall_timeout_s (its last beat may precede its last step by up to BEAT_S), and
    # by its deadlines, not by the run's end: the others still trained after it left. No bound
    # in seconds above: a busy machine's driver polls late by any amount (the deadlines
    # themselves, on a clock the tests control: tests/unit/driver, test_*_loop.py).
    assert left - last_step >= BASE["stall_timeout_s"] - BEAT_S, left - last_step
    assert left < max(e["time"] for e in read_events(out, "step") if e["replica"] != frozen)


def check_slow(mode, out, rounds, fault):
    slow = fault["replica"]
    assert slow not in leaves(out)
    if mode == "sync":  # the round waits for all: each of its steps from ``step`` on is longer
        assert slow in rounds[0]["replica_ids"] and not rounds[0]["dropped"] and not rounds[0]["late"]
        assert rounds[0]["round_seconds"] >= (BASE["max_steps"] - fault["step"]) * fault["seconds"]
    else:  # nobody waits for the straggler: the paced replica's first arrival is merged alone,
        # the slow one later, as stale as the rule says: delayed momentum (the default) counts
        # the whole rounds' worth merged since it started (at work 0), the cycles the first
        # one's merges completed before.
        assert rounds[0]["replica_ids"] == [1 - slow]
        at = next(i for i, r in enumerate(rounds) if slow in r["replica_ids"])
        assert at >= 1 and rounds[at]["staleness"][str(slow)] == math.floor(rounds[at - 1]["work"] + 1e-9)


def check_slowdown(mode, out, rounds, fault):
    slowed = fault["replica"]
    assert slowed not in leaves(out)
    # It fired: from its round on, the slowed replica steps slower than one without a slow
    # fault (``against``). Not by a set multiple: ``factor`` multiplies the replica's own
    # step, and on a saturated machine the replica that sleeps computes faster than the busy
    # one, so a slowed replica's steps can be less than twice as long as the other's. The
    # multiple itself, on a clock the test controls: tests/unit/runtime/test_injected_faults.py.
    since = fault["round"]
    assert step_seconds(out, slowed, since) > step_seconds(out, fault["against"], since)


def check_nan(mode, out, rounds, fault):
    poisoned = fault["replica"]
    hit = next(i for i, r in enumerate(rounds) if str(poisoned) in r["rejected"])
    assert rounds[hit]["rejected"][str(poisoned)].startswith("non-finite")
    assert poisoned not in leaves(out)
    # Reset and reloaded, it is applied from its next period on (test_poison_recovery: every path).
    assert all(str(poisoned) not in r["rejected"] for r in rounds[hit + 1 :])
    if mode == "sync":
        assert poisoned in rounds[hit + 1]["replica_ids"]
    else:
        assert any(poisoned in r["replica_ids"] for r in rounds[hit + 1 :])
    assert all(np.isfinite(r["eval_loss"]) for r in rounds if r["eval_loss"] is not None)


def check_drop_link(mode, out, rounds, fault):
    cut = fault["replica"]
    assert cut not in leaves(out)  # told to stop, it answers: it stays
    if mode == "sync":
        hit = next(i for i, r in enumerate(rounds) if r["late"] == [cut])
    else:  # stopped after stall_timeout_s without a step
        hit = next(i for i, r in enumerate(rounds) if r["wasted_steps"] > 0)
    assert any(cut in r["replica_ids"] for r in rounds[hit + 1 :])


TERMINAL = {"kill": "failed", "freeze": "unresponsive"}
# Keys of RUNS' faults for the checks, not for the plan.
TEST_ONLY = ("pace", "against")


def test_the_runs_hold_every_replica_fault_in_both_modes():
    for mode, runs in RUNS.items():
        kinds = {f["kind"] for _, faults in runs.values() for f in faults if not f.get("pace")}
        assert kinds == set(KINDS["replica"]) - set(REGION_REHEARSALS), mode  # (those: test_region_screening)


@pytest.mark.parametrize("mode,run", [(m, r) for m in RUNS for r in RUNS[m]])
def test_every_replica_fault_fires_in_both_modes(ray_local, tmp_path, mode, run):
    """One run per group of faults that do not interfere; each fault is checked against its
    rule, only the terminal ones (kill, freeze) leave, and no stream position is trained twice."""
    extra, faults = RUNS[mode][run]
    plan = [{k: v for k, v in f.items() if k not in TEST_ONLY} for f in faults]
    cfg = tiny_config(tmp_path / "run", **{**BASE, **MODES[mode], **extra}, fault_plan=plan)
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert rounds[-1].get("work", len(rounds)) >= cfg.diloco_loops - 1e-9
    checked = [f for f in faults if not f.get("pace")]
    assert leaves(cfg.output_dir) == {f["replica"]: TERMINAL[f["kind"]] for f in checked if f["kind"] in TERMINAL}
    for fault in checked:
        globals()[f"check_{fault['kind']}"](mode, cfg.output_dir, rounds, fault)
    assert no_position_twice(rounds)


@pytest.fixture(scope="module")
def fault_free(ray_local, uninterrupted):
    """Per mode, the lockstep run a lost server or driver must reproduce (built on demand)."""
    return lambda mode: uninterrupted(**EXACT, **LOCKSTEP[mode])


def run_cli(cfg, folder) -> subprocess.CompletedProcess:
    """``diloco-ray train`` on ``cfg`` in a process of its own (a driver fault ends it), on
    this module's Ray."""
    cfg.to_yaml(str(folder / "run.yaml"))
    command = [sys.executable, "-m", "diloco_ray", "train", str(folder / "run.yaml")]
    return subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)


def stop_by_sigterm(cfg, tmp_path, mode) -> None:
    """Run ``cfg``, whose plan SIGTERMs the driver while round 2 trains: it stops cleanly, the
    replicas rewind to their period's start and round 2 is checkpointed. Sync: a spot
    preemption (`ray job stop`) of the CLI, exit 128 + SIGTERM and one line; decoupled: the
    Python API in this process, which SIGTERM stops as it stops the CLI."""
    if mode == "sync":
        proc = run_cli(cfg, tmp_path)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
        assert "stopped by SIGTERM at round 2" in proc.stderr and "round-00000002" in proc.stderr
    else:
        trainer = DilocoFSDPTrainer(cfg, stop_on_sigterm=True)
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        assert trainer.stopped_by == "SIGTERM" and trainer.stop_checkpoint.endswith("round-00000002")
    assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1]


def resumed(cfg, **fields) -> TrainerConfig:
    """The run's saved config, resumed as a user would, with ``fields`` instead of its plan."""
    return TrainerConfig.from_yaml(
        os.path.join(cfg.output_dir, "config.yaml"),
        overrides={"resume_from": cfg.output_dir, "fault_plan": None, **fields},
    )


@pytest.mark.parametrize("mode", MODES)
def test_driver_and_server_faults_resume_to_the_weights_of_a_run_without_them(fault_free, tmp_path, mode):
    """One job, three runs. (1) The driver is SIGTERMed while round 2 trains (see
    :func:`stop_by_sigterm`). (2) Resumed from that checkpoint, server 1 of 2 is SIGKILLed
    while round 3 trains (the servers come back from that round-2 checkpoint, rounds 2 and 3
    run again and their records are rewritten), then the driver is SIGKILLed while round 4
    trains, which leaves the round-4 checkpoint. In decoupled mode the last resume starts
    there, so the final weights hold the restored servers' rounds 2 and 3 (test_chaos checks
    a synchronous restore exactly); in sync mode that checkpoint is damaged first: the resume
    notices and falls back to round 2. (3) Every way, the last resumed run (in this process,
    on the module's Ray) ends with the fault-free weights, no stream position trained twice."""
    reference = fault_free(mode)
    cfg = tiny_config(
        tmp_path / "run",
        **EXACT,
        **LOCKSTEP[mode],
        **TWO_SERVERS,
        fault_plan=[{"kind": "term", "target": "driver", "round": 2}],
    )
    stop_by_sigterm(cfg, tmp_path, mode)

    kills = [
        {"kind": "kill", "target": "server", "round": 3, "index": 1},
        {"kind": "kill", "target": "driver", "round": 4},
    ]
    killed = resumed(cfg, fault_plan=kills)
    proc = run_cli(killed, tmp_path)  # in a process of its own: it dies
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    restarts = read_events(cfg.output_dir, "server")
    assert len(restarts) == 1 and restarts[0]["from"].endswith("round-00000002")
    assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1, 2, 3]
    newest = checkpoint.list_checkpoints(os.path.join(cfg.output_dir, "checkpoints"))[-1]
    assert newest.endswith("round-00000004")
    damaged = mode == "sync"
    if damaged:
        with open(os.path.join(newest, "global-0-of-2.safetensors"), "r+b") as f:
            f.seek(-8, os.SEEK_END)
            f.write(b"\x00" * 8)

    DilocoFSDPTrainer(resumed(cfg)).train()
    events = read_events(cfg.output_dir, "checkpoint")
    assert [e["round"] for e in events if e["action"] == "resume"] == [2, 2 if damaged else 4]
    assert any(e["action"] == "skipped" for e in events) == damaged
    rounds = read_events(cfg.output_dir, "round")
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    assert max_abs_diff(cfg.output_dir, reference.output_dir) <= 1e-5
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(len(positions)))
