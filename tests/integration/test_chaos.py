"""The chaos suite: faults of the fault plan (:mod:`diloco_ray.config.fault_plan`) injected at
a given replica, rank, round and step, and the result checked against what the math
says: the same final weights as the run without the fault where the rules promise it
(a re-run round, a server restored from a checkpoint), else the documented rule (a lost
replica's round is lost, a poisoned replica is reset, a frozen one is dropped), and in
every case each stream position trained on exactly once.
"""

import sys

import numpy as np
import pytest
import ray
from conftest import KillOnceTheSpareIsReady, applied_positions, final_weights, max_abs_diff, tiny_config
from ray.exceptions import RayActorError

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.observe.metrics import read_events
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import ServerGroup

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Two replicas that must both report (a round with one is run again), a checkpoint every
# round (so a lost server can be restored), four short rounds; int8 both ways with error
# feedback, so a re-run must also restore residuals and leave the server's copy of what
# replicas hold alone.
EXACT = dict(
    diloco_loops=4,
    max_steps=4,
    num_replicas=2,
    min_replicas=2,
    checkpoint_steps=4,
    eval_batches=1,
    round_timeout_s=3.0,
    pseudo_grad_compression="int8",
    error_feedback=True,
    weights_compression="int8",
    compression_block=64,
)


@pytest.fixture(scope="module")
def fault_free(ray_local, tmp_path_factory):
    """The run every exact fault test must reproduce."""
    cfg = tiny_config(tmp_path_factory.mktemp("chaos") / "fault_free", **EXACT)
    return DilocoFSDPTrainer(cfg).train()


def once_each(rounds) -> bool:
    positions = applied_positions(rounds)
    return sorted(positions) == list(range(len(positions)))


def leaves(output_dir) -> dict:
    return {e["replica_id"]: e["reason"] for e in read_events(output_dir, "membership") if e["action"] == "leave"}


def test_a_straggler_then_a_lost_server_rerun_their_rounds_exactly(fault_free, tmp_path):
    """Two faults whose rule is "run the round again", one round each:

    * round 1: replica 1 is late for the deadline, so with min_replicas=2 the round runs
      again. The re-run starts both replicas from the round's global weights and inner state
      (bug: they kept their trained weights) and is not stopped by the first attempt's abort
      (bug: every retry stopped at step 0);
    * round 2: the parameter server dies while it trains: it is restored from the round-2
      checkpoint (with what replicas hold and their residuals) and the round runs again.

    So the run equals the fault-free one."""
    plan = [
        # Three steps 1.5 s longer each: past round_timeout_s whatever the machine's load.
        {"kind": "slow", "replica": 1, "round": 1, "step": 1, "seconds": 1.5},
        {"kind": "kill", "target": "server", "round": 2},
    ]
    cfg = tiny_config(tmp_path / "run", **EXACT, fault_plan=plan)
    result = DilocoFSDPTrainer(cfg).train()
    assert [r["round"] for r in result.rounds] == [0, 1, 2, 3]
    assert all(sorted(r["replica_ids"]) == [0, 1] for r in result.rounds)
    assert result.rounds[1]["wasted_steps"] > 0  # the first attempt's work was thrown away
    restarts = read_events(cfg.output_dir, "server")
    assert len(restarts) == 1 and restarts[0]["from"].endswith("round-00000002")
    assert max_abs_diff(cfg.output_dir, fault_free.output_dir) <= 1e-6
    assert once_each(result.rounds) and not leaves(cfg.output_dir)


def test_poison_then_a_dropped_link_then_a_freeze(ray_local, tmp_path):
    """Three faults in one run, one round each, each checked against its rule:

    * round 1: a NaN step poisons replica 1's AdamW moments. It is rejected in that round
      only: its inner state is reset (bug: it diverged again every round and, in slot 0,
      kept swallowing the data handed out again);
    * round 2: replica 0's pseudo-gradient never leaves: the round goes on without it,
      and it is back (not replaced) for round 3;
    * round 3: replica 1 is frozen (SIGSTOP) mid-round: it cannot answer its abort, so it
      is dropped as unresponsive after abort_grace_s and a new replica takes its place.
    """
    plan = [
        {"kind": "nan", "replica": 1, "round": 1, "step": 2},
        {"kind": "drop_link", "replica": 0, "round": 2},
        {"kind": "freeze", "replica": 1, "round": 3, "step": 1},
    ]
    # The deadline is for the faulted replicas, which never answer: its length changes
    # nothing but the wait, so it is long enough for a healthy round on a loaded machine
    # (round 4's new replica sets up its optimizer in its first period).
    cfg = tiny_config(
        tmp_path / "run",
        diloco_loops=5,
        max_steps=4,
        eval_batches=1,
        round_timeout_s=10.0,
        abort_grace_s=1.0,
        join_timeout_s=60.0,
        fault_plan=plan,
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert [sorted(r["rejected"]) for r in rounds] == [[], ["1"], [], [], []]
    assert rounds[1]["rejected"]["1"].startswith("non-finite")
    assert rounds[1]["replica_ids"] == [0] and rounds[1]["dropped"] == [1]
    assert rounds[2]["replica_ids"] == [1] and rounds[2]["late"] == [0]
    assert rounds[3]["replica_ids"] == [0] and rounds[3]["dropped"] == [1]
    assert leaves(cfg.output_dir) == {1: "unresponsive"}
    assert sorted(rounds[4]["replica_ids"]) == [0, 2]
    assert all(np.isfinite(r["eval_loss"]) for r in rounds)
    assert all(t.isfinite().all() for t in final_weights(cfg.output_dir).values())
    assert once_each(rounds)


def test_streaming_replica_killed_after_its_first_fragment(ray_local, tmp_path):
    """sync_fragments=2: replica 1 dies in round 1 after fragment 0 applied its update.
    The rule: its round of data counts as trained (handing it out again would train it
    into fragment 0 twice); a replacement joins."""
    cfg = tiny_config(
        tmp_path / "run",
        diloco_loops=3,
        max_steps=4,
        sync_fragments=2,
        eval_batches=0,
        join_timeout_s=60.0,
        fault_plan=[{"kind": "kill", "replica": 1, "round": 1, "step": 3}],
    )
    result = DilocoFSDPTrainer(cfg).train()
    round1 = result.rounds[1]
    assert round1["fragments"][0]["replicas"] == 2 and round1["fragments"][1]["replicas"] == 1
    assert sorted(round1["data_ranges"]) == ["0", "1"]  # replica 1's data is not handed out again
    assert leaves(cfg.output_dir) == {1: "failed"}
    assert once_each(result.rounds)


def test_a_slow_replica_with_a_time_budget_contributes_every_round(ray_local, tmp_path):
    """inner_time_s: replica 1, each of its steps 2 s slower every round, runs the steps
    that fit its budget instead of missing the deadline; it is applied every round with
    fewer steps, and what it had no time for is handed out again first, so every stream
    position is still trained on exactly once. The budget leaves replica 0 a second a step,
    several times a tiny step even on a busy machine, so only replica 1 leaves data behind."""
    slow = [{"kind": "slow", "replica": 1, "round": r, "seconds": 2.0} for r in range(3)]
    cfg = tiny_config(
        tmp_path / "run",
        diloco_loops=3,
        max_steps=6,
        min_replicas=2,
        eval_batches=0,
        inner_time_s=6.0,
        round_timeout_s=30.0,
        fault_plan=slow,
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert [sorted(r["replica_ids"]) for r in rounds] == [[0, 1]] * 3 and all(r["wasted_steps"] == 0 for r in rounds)
    steps = [r["replica_steps"] for r in rounds]
    assert all(1 <= s["1"] < s["0"] <= 6 for s in steps), steps
    positions = applied_positions(rounds)
    assert len(positions) == len(set(positions))  # never twice
    per_step = cfg.batch_size * cfg.grad_accum
    assert [len(sum((list(range(a, a + c)) for a, c in r["data_ranges"]["1"]), [])) for r in rounds] == [
        s["1"] * per_step for s in steps
    ]
    # What replica 1 left in round 0 is the first thing handed out in round 1 (to slot 0).
    left = rounds[0]["data_ranges"]["1"][-1][0] + rounds[0]["data_ranges"]["1"][-1][1]
    assert left in [ranges[0][0] for ranges in rounds[1]["data_ranges"].values()]


def test_a_hot_spare_takes_a_lost_replicas_place_at_the_next_boundary(ray_local, tmp_path):
    """spare_replicas: 1. Once the spare is ready (set up, never trained), a replica's ranks
    are killed at round 0's end; round 1 goes on without it, and at the boundary after it
    the spare becomes active at once: two replicas again in round 2."""

    killer = KillOnceTheSpareIsReady()
    cfg = tiny_config(tmp_path / "run", diloco_loops=3, spare_replicas=1, eval_batches=0)
    rounds = DilocoFSDPTrainer(cfg, callbacks=[killer]).train().rounds
    assert rounds[1]["replicas"] == 1 and rounds[1]["dropped"] == [killer.victim]
    assert sorted(rounds[2]["replica_ids"]) == sorted(set(killer.active) - {killer.victim} | {killer.spare})
    events = read_events(cfg.output_dir, "membership")
    promoted = next(e for e in events if e["action"] == "join" and e["replica_id"] == killer.spare)
    assert promoted["reason"] == "spare" and promoted["round"] == 2
    ready = next(e for e in events if e["action"] == "spare" and e["replica_id"] == killer.spare)
    assert ready["time"] <= promoted["time"]
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(len(positions)))  # the lost round's data went back, once


class SlowPlanServer(ParameterServer):
    """A server whose data plan takes ten minutes: a sync in progress, as far as a ping goes."""

    def data_plan(self, replica_ids):
        import time

        time.sleep(600)
        return super().data_plan(replica_ids)


def test_a_ping_finds_a_dead_server_at_once_and_a_busy_one_alive(ray_local, tmp_path):
    """What a failed period is checked against (control.calls.check_servers): a server busy
    with a long call answers beside it, and a dead one raises at once. No bound on this
    machine's speed: the answer is checked while the busy call is still running, and the
    dead server's error comes before a timeout that a live one would have answered in."""
    servers = ServerGroup(tiny_config(tmp_path / "run"), SlowPlanServer)
    assert servers.ping(timeout_s=120.0)  # started
    busy = servers.actors[0].data_plan.remote([0])
    assert servers.ping(timeout_s=120.0)  # answered, not taken as alive on the timeout
    assert ray.wait([busy], timeout=0)[1] == [busy]  # and the long call is still running
    servers.kill()
    # ray.kill is asynchronous: a ping sent at once can still be answered before the kill
    # lands (it did on a loaded CI machine). The busy call failing is the death seen.
    with pytest.raises(RayActorError):
        ray.get(busy)
    with pytest.raises(RayActorError):
        servers.ping(timeout_s=600.0)  # raises: a timeout would have returned False
