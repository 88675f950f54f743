"""Decoupled mode end to end: replicas on their own clocks, merged by quorum and grace
window, a slow replica merged stale and discounted, a lost replica's plan given back,
a hot spare stepping in without waiting for a merge, and a resumed run. In every case each
stream position is trained on at most once, and exactly once when nothing is in flight."""

import json
import sys
import threading

import pytest
import ray
from conftest import EXACT_JOB, KillOnceTheSpareIsReady, applied_positions, max_abs_diff, tiny_config, wait_for_a_spare

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.algo import merge_timing
from diloco_ray.algo.inner_schedule import inner_lr_at
from diloco_ray.observe.metrics import read_events

pytestmark = pytest.mark.integration
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DECOUPLED = dict(sync_mode="decoupled", diloco_loops=3, max_steps=4, eval_batches=1, min_quorum=1)
SLOW_1 = [{"kind": "slowdown", "replica": 1, "round": 0, "factor": 4}]
# Replica 1 8x replica 0's pace, both by a fixed time a step (``slowdown`` by seconds): the
# paces stay apart by that much on a busy machine, where a multiple of a computed step (a
# ``factor``) follows the machine's jitter and a loaded replica 0 could fall to 2x.
PACED_8X = [{"kind": "slowdown", "replica": r, "round": 0, "seconds": s} for r, s in ((0, 0.1), (1, 0.8))]


def no_position_twice(rounds) -> bool:
    positions = applied_positions(rounds)
    return len(positions) == len(set(positions))


def merged(rounds, rid: int) -> list:
    return [r for r in rounds if rid in r["replica_ids"]]


def test_a_poll_collects_every_report_that_is_ready(ray_local):
    """Once one report is ready, every report ready by then comes back in the same poll (bug:
    one per poll, so a replica that finished with another missed the merge and was merged
    one outer step stale, at half weight)."""
    from diloco_ray.control.calls import RayCalls

    ready = [ray.put(i) for i in range(3)]
    never = ray.remote(num_cpus=0)(lambda: __import__("time").sleep(600)).remote()
    try:
        assert set(RayCalls().ready(ready + [never], 5.0)) == set(ready)
        assert RayCalls().ready([never], 0.01) == []
    finally:
        ray.cancel(never, force=True)


# conftest's EXACT_JOB, in both modes (decoupled with a quorum of all): the
# fault-free runs it compares with, made once a session by ``uninterrupted`` (test_fault_kinds.py
# shares the synchronous one), so the test below adds no run when they already exist.
LOCKSTEP_RUN = EXACT_JOB


def test_quorum_of_all_merges_every_replica_each_step_and_trains_the_rounds_tokens(ray_local, tmp_path, uninterrupted):
    """min_quorum = replicas: each merge holds both replicas, none stale, and the run
    merges exactly diloco_loops rounds' worth of tokens, each position once, to the same
    weights as the synchronous mode."""
    cfg = tiny_config(tmp_path / "run", **LOCKSTEP_RUN, sync_mode="decoupled", min_quorum=2)
    decoupled = uninterrupted(**LOCKSTEP_RUN, sync_mode="decoupled", min_quorum=2)
    rounds = decoupled.rounds
    assert len(rounds) == 5 and all(sorted(r["replica_ids"]) == [0, 1] for r in rounds)
    assert all(r["staleness"] == {"0": 0, "1": 0} for r in rounds)
    assert rounds[-1]["work"] == pytest.approx(5.0)
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(5 * 2 * cfg.sequences_per_replica_round))
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"]
    # Replicas in lockstep: every merge is the synchronous round, so the weights are the same.
    sync = uninterrupted(**LOCKSTEP_RUN)
    assert max_abs_diff(decoupled.output_dir, sync.output_dir) <= 1e-6


def test_a_slow_replica_is_merged_stale_and_the_fast_one_does_not_wait(ray_local, tmp_path):
    """Replica 1 is 8x slower, its periods are not cut to land with replica 0's
    (``align_periods: false``) and the grace window is too short to wait for it: replica 0
    is merged alone several times while 1 trains, and 1's work arrives stale, counted
    with its staleness (and replica 0's, when 1 was merged while 0 trained); nothing is
    trained twice. The inner lr schedule follows the tokens merged, not the merges: no
    period starts past the run's schedule although there are more merges than rounds."""
    cfg = tiny_config(
        tmp_path / "run",
        **{**DECOUPLED, "diloco_loops": 4, "grace_window_s": 0.05, "fault_plan": PACED_8X, "logging_steps": 1},
        align_periods=False,
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    fast, slow = merged(rounds, 0), merged(rounds, 1)
    assert len(fast) >= 2 * len(slow) >= 2
    # Whether the first merge also holds replica 1 (replica 0's pace stands in for its own, so
    # it is waited for a quarter of a period) turns on how long a step takes on this machine:
    # tests/unit/algo/test_merge_timing.py checks that rule. Every later merge of replica 1's
    # work is stale: replica 0 was merged while it trained.
    assert 0 in rounds[0]["replica_ids"]
    assert all(r["staleness"]["1"] >= 1 for r in slow if r is not rounds[0])
    assert rounds[-1]["work"] >= 4.0 - 1e-9
    assert no_position_twice(rounds)
    steps = read_events(str(tmp_path / "run"), "step")
    assert len(rounds) > cfg.diloco_loops and steps
    for e in steps:  # an event comes after its step: global_step counts it
        assert e["lr"] == pytest.approx(inner_lr_at(e["global_step"] - 1, cfg.sections().inner_optim))
    # A period starts at the tokens merged so far: below the run's end, whatever the merge count.
    assert max(e["global_step"] - e["step"] for e in steps) < cfg.diloco_loops * cfg.max_steps


# Replica 1 4x replica 0's pace, both by a fixed time a step (``slowdown`` by seconds): the
# paces the grace window is computed from stay what they are on a busy machine (a multiple of
# a computed step does not: its jitter alone can move an arrival out of the window).
PACED_4X = [{"kind": "slowdown", "replica": r, "round": 0, "seconds": s} for r, s in ((0, 0.1), (1, 0.4))]


def test_the_grace_window_waits_for_a_replica_predicted_soon(ray_local, tmp_path, monkeypatch):
    """A replica 4x slower, its periods whole (``align_periods: false``), with a grace
    window of a whole period (``grace_fraction: 1``): once its pace is known, a merge
    waits for it, so it is merged fresh (staleness 0) with replica 0.

    What is checked here is the wiring: the driver learns the pace and its merge waits for
    the arrival it predicts. How late an arrival may be and still be waited for (a quarter
    of a period) is the rule's own, checked on a clock the test controls
    (tests/unit/algo/test_merge_timing.py); here the driver tolerates a whole period, so
    that a busy machine's jitter in a period's seconds cannot move an arrival out."""
    monkeypatch.setattr(merge_timing, "TOLERANCE_SHARE", 1.0)
    cfg = tiny_config(
        tmp_path / "run",
        **{**DECOUPLED, "diloco_loops": 4, "grace_fraction": 1.0, "fault_plan": PACED_4X},
        align_periods=False,
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    together = [r for r in rounds if sorted(r["replica_ids"]) == [0, 1]]
    assert len(together) >= 2  # after both periods are known, every merge waits for replica 1
    assert all(r["staleness"] == {"0": 0, "1": 0} for r in together[1:])
    assert no_position_twice(rounds)


def test_a_lost_replica_gives_its_plan_back_and_a_spare_takes_its_place_at_once(ray_local, tmp_path):
    """spare_replicas: 1, min_quorum 2. Once the spare is ready, a replica's ranks are killed
    after merge 0; its next period fails, its plan goes back, and the spare is promoted and
    launched at once, within the same merge's wait (not at the next merge): merge 1 holds the
    survivor and the spare. Nothing is trained twice."""

    killer = KillOnceTheSpareIsReady()
    cfg = tiny_config(tmp_path / "run", **{**DECOUPLED, "diloco_loops": 3, "spare_replicas": 1, "min_quorum": 2})
    rounds = DilocoFSDPTrainer(cfg, callbacks=[killer]).train().rounds
    survivor = set(killer.active) - {killer.victim}
    assert rounds[1]["dropped"] == [killer.victim]
    assert set(rounds[1]["replica_ids"]) == survivor | {killer.spare}
    events = read_events(cfg.output_dir, "membership")
    promoted = next(e for e in events if e["action"] == "join" and e["replica_id"] == killer.spare)
    assert promoted["reason"] == "spare" and promoted["round"] == 1
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(len(positions)))  # quorum 2: nothing left in flight


def test_a_resumed_run_trains_the_in_flight_data_again_and_keeps_the_weights(ray_local, tmp_path):
    """A checkpoint keeps the global weights, the outer momentum, the work merged and the
    cursor with in-flight plans given back. Resuming it trains those plans, and every
    position of both runs together is trained exactly once up to the resumed frontier."""
    first_cfg = tiny_config(
        tmp_path / "a",
        **{**DECOUPLED, "diloco_loops": 2, "checkpoint_steps": 4, "grace_window_s": 0.0, "fault_plan": SLOW_1},
    )
    first = DilocoFSDPTrainer(first_cfg).train().rounds
    # Checkpoints fall due by the work merged (checkpoint_steps = one round's worth), not by
    # the merge count (bug: one per merge): the one at the start, then one per round's worth.
    saved = [e["round"] for e in read_events(str(tmp_path / "a"), "checkpoint") if e["action"] == "saved"]
    works = [0.0] + [r["work"] for r in first]
    crossed = [r["round"] + 1 for r, before in zip(first, works) if int(r["work"] + 1e-9) > int(before + 1e-9)]
    assert len(crossed) < len(first) and saved == [0] + crossed
    # The newest checkpoint taken while replica 1 (slow, never waited for) was in flight.
    last = max((c for c in (tmp_path / "a" / "checkpoints").glob("round-*") if given_back(c)), key=lambda c: c.name)
    saved_round = int(last.name.split("-")[1])
    kept = [r for r in first if r["round"] < saved_round]
    second_cfg = tiny_config(tmp_path / "b", **{**DECOUPLED, "diloco_loops": 4, "resume_from": str(last)})
    second = DilocoFSDPTrainer(second_cfg).train().rounds
    assert second[0]["round"] == saved_round
    assert set(second[0]["staleness"].values()) == {0}  # started from the restored weights: none stale
    assert second[0]["work"] > kept[-1]["work"] >= 2.0 - 1e-9
    positions = applied_positions(kept) + applied_positions(second)
    assert len(positions) == len(set(positions))
    # What was in flight at the checkpoint went back into its cursor, and is trained after the resume.
    assert given_back(last) <= set(applied_positions(second))


def given_back(checkpoint) -> set:
    """The positions a checkpoint's cursor hands out again first (in-flight plans given back)."""
    cursor = json.loads((checkpoint / "server.json").read_text())["cursor"]
    return {p for s, c in cursor["returned"] for p in range(s, s + c)}


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_replicas_of_different_sizes_with_a_time_budget_contribute_every_step(ray_local, tmp_path, mode):
    """ranks_per_replica: [2, 1] (replica 0 is FSDP over 2 ranks) and inner_time_s, with
    replica 1 4x slower: in both modes every outer step holds both replicas (the slow one
    runs the steps that fit its budget instead of being dropped or merged stale), each
    trained data in proportion to its ranks and the steps it ran, and nothing twice."""
    cfg = tiny_config(
        tmp_path / "run",
        **{**DECOUPLED, "sync_mode": mode, "diloco_loops": 2, "max_steps": 6, "min_quorum": 2},
        ranks_per_replica=[2, 1],
        inner_time_s=0.6,
        fault_plan=SLOW_1,
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert all(sorted(r["replica_ids"]) == [0, 1] for r in rounds)
    # A merge of every replica is a round's worth, whatever steps fitted the budget (bug:
    # decoupled counted full periods, so shortened ones made a merge less than a round).
    assert len(rounds) == 2
    if mode == "decoupled":
        assert [r["work"] for r in rounds] == pytest.approx([1.0, 2.0])
    for r in rounds:
        for rid in (0, 1):
            trained = sum(count for _, count in r["data_ranges"][str(rid)])
            steps = r["replica_steps"][str(rid)]
            assert 1 <= steps <= cfg.max_steps
            assert trained == cfg.ranks_of(rid) * steps * cfg.batch_size * cfg.grad_accum
    assert no_position_twice(rounds)


def test_a_spare_takes_over_the_rest_of_a_lost_replicas_period(ray_local, tmp_path):
    """spare_replicas: 1, min_quorum 2, 8 steps a period. A replica's ranks are killed part
    way through its period after merge 0; the spare starts at once, cut to land with the
    survivor (when a whole period would end past the grace window; its untrained plan goes
    back to the cursor), and is merged with the survivor at merge 1, neither stale. Nothing
    is trained twice, and with nothing in flight at the end, every position once."""

    class KillPartWayThroughAPeriod:
        def on_round_end(self, trainer, record):
            if record["round"] != 0:
                return
            self.spare, victim = wait_for_a_spare(trainer), trainer.replicas[-1]
            self.victim = victim.id
            # The victim starts its next period when this returns; kill it about a third in.
            threading.Timer(0.3, lambda: [ray.kill(r, no_restart=True) for r in victim.ranks]).start()

    killer = KillPartWayThroughAPeriod()
    # Steps 0.1 s longer (a period of 8 is then at least 0.8 s, whatever this machine's step
    # time: a factor on a 4 ms step left periods of 0.28 s, over before the kill), so that a
    # period is long against its fixed costs and the time left of it matters. Which id ends
    # up the spare depends on set-up order, so every id is slowed in its periods launched
    # at merges 0 and 1 (the spare's first launch is at merge 1).
    slow = [{"kind": "slow", "replica": r, "round": n, "seconds": 0.1} for r in (0, 1, 2) for n in (0, 1)]
    cfg = tiny_config(
        tmp_path / "run",
        **{**DECOUPLED, "diloco_loops": 3, "max_steps": 8, "spare_replicas": 1, "min_quorum": 2},
        fault_plan=slow,
    )
    rounds = DilocoFSDPTrainer(cfg, callbacks=[killer]).train().rounds
    survivor = ({0, 1, 2} - {killer.spare, killer.victim}).pop()
    assert rounds[1]["dropped"] == [killer.victim]
    assert sorted(rounds[1]["replica_ids"]) == sorted([survivor, killer.spare])
    assert rounds[1]["staleness"] == {str(survivor): 0, str(killer.spare): 0}
    assert 1 <= rounds[1]["replica_steps"][str(killer.spare)] <= cfg.max_steps
    positions = applied_positions(rounds)
    assert sorted(positions) == list(range(len(positions)))
