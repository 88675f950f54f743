"""Merge timing in decoupled mode, as pure decisions over a replica's pace (no clock, no
Ray): the grace window scales with the period, the first merge waits for the replicas
that run the same job, and a period that would end well after others' arrivals is cut
to land with them."""

from __future__ import annotations

import pytest

from diloco_ray.algo.merge_timing import InFlight, MergeTiming, Pace

STEPS = 20  # inner steps of a full period


def paced(periods: dict[int, tuple[float, float]], steps: int = STEPS) -> Pace:
    """A pace that has seen each replica once: rid -> (seconds per step, overhead)."""
    pace = Pace(steps)
    for rid, (step_s, overhead_s) in periods.items():
        pace.observe(rid, overhead_s + steps * step_s, steps * step_s, steps)
    return pace


def test_pace_is_the_median_of_the_latest_periods_and_stands_in_for_a_new_replica():
    pace = Pace(10, history=3)
    pace.observe(0, elapsed_s=6.0, compute_s=5.0, inner_steps=10)  # 0.5 s a step, 1 s outside
    pace.observe(0, elapsed_s=4.0, compute_s=1.5, inner_steps=5)  # a cut period: 0.3 s a step, 2.5 s outside
    assert pace.of(0).step_s == pytest.approx(0.4) and pace.of(0).overhead_s == pytest.approx(1.75)
    pace.observe(0, elapsed_s=14.0, compute_s=5.0, inner_steps=10)  # a one-off 8 s hiccup
    assert pace.of(0).step_s == pytest.approx(0.5) and pace.of(0).overhead_s == pytest.approx(2.5)
    pace.observe(0, elapsed_s=6.0, compute_s=5.0, inner_steps=10)
    pace.observe(0, elapsed_s=6.0, compute_s=5.0, inner_steps=10)  # the hiccup has left the history
    assert pace.period(0) == pytest.approx(6.0)
    pace.observe(1, elapsed_s=21.0, compute_s=20.0, inner_steps=10)
    assert pace.period(7) == pytest.approx((6.0 + 21.0) / 2)  # a new replica: the others' mean
    assert pace.typical_period() == pytest.approx(21.0)  # the median of two: the upper one
    pace.observe(2, elapsed_s=1.0, compute_s=0.0, inner_steps=0)  # nothing trained: nothing learned
    assert 2 not in pace.replicas
    pace.forget(1)
    assert pace.period(7) == pytest.approx(6.0)
    assert Pace(10).period(0) is None and not Pace(10).known


def test_the_grace_window_scales_with_the_period_up_to_its_cap():
    now = 100.0
    ten = MergeTiming(paced({0: (0.5, 0.0), 1: (0.5, 0.0)}), grace_fraction=0.25, grace_cap_s=300.0)
    assert ten.window() == pytest.approx(2.5)  # a quarter of a 10 s period
    assert MergeTiming(ten.pace, 0.25, grace_cap_s=1.0).window() == 1.0
    assert MergeTiming(Pace(STEPS), 0.25, 300.0).window() == 0.0  # nothing seen: no window
    # Replica 1, launched at 91.5, is expected at 101.5: within the window, it is waited for
    # until its expected arrival plus a quarter of its period (2.5 s).
    training = {1: InFlight(launched_at=91.5)}
    assert ten.merge_deadline(now, quorum_met=False, training=training) is None
    assert ten.merge_deadline(now, True, training) == pytest.approx(104.0)
    # Launched at 93.0, it is expected 3 s from now, past the 2.5 s window: merge now.
    assert ten.merge_deadline(now, True, {1: InFlight(93.0)}) == now
    # A period on a budget is expected when its budget aims.
    assert ten.merge_deadline(now, True, {1: InFlight(99.0, due=101.0)}) == pytest.approx(103.5)
    assert MergeTiming(ten.pace, 0.0, 300.0).merge_deadline(now, True, training) == now  # no window


def test_the_first_merge_waits_for_the_replicas_that_run_the_same_job():
    # Replica 0 reported first (10 s); 1-3 have no history: its pace stands in for theirs.
    timing = MergeTiming(paced({0: (0.5, 0.0)}), 0.25, 300.0)
    training = {rid: InFlight(launched_at=0.0) for rid in (1, 2, 3)}
    assert timing.merge_deadline(10.2, True, training) == pytest.approx(12.5)


def test_a_slower_replica_launched_beside_faster_ones_aims_at_their_arrival():
    pace = paced({0: (0.5, 1.0), 1: (0.5, 1.0), 2: (1.0, 1.0)})  # 2 is 2x slower: 21 s vs 11 s
    timing = MergeTiming(pace, 0.25, 300.0)
    aims = timing.plan_launches(now=50.0, training={}, launching=[2, 1, 0])
    assert aims == {0: None, 1: None, 2: pytest.approx(61.0)}
    # Its inner steps get what is left once its time outside them (1 s) is taken off.
    assert timing.budget_s(2, 50.0, aims[2]) == pytest.approx(10.0)
    assert MergeTiming(pace, 0.25, 300.0, align=False).plan_launches(50.0, {}, [2, 1, 0]) == {0: None, 1: None, 2: None}


def test_a_replica_out_of_phase_is_cut_to_land_with_the_cohort():
    timing = MergeTiming(paced({r: (0.5, 0.0) for r in range(4)}), 0.25, 300.0)
    cohort = {r: InFlight(launched_at=40.0) for r in range(3)}  # expected at 50
    # Replica 3 relaunched at 44 would end at 54: cut to land at 50 with the others.
    assert timing.plan_launches(44.0, cohort, [3]) == {3: pytest.approx(50.0)}
    # Relaunched at 41.5 it lands 1.5 s after them, within the window (2.5 s): the merge waits.
    assert timing.plan_launches(41.5, cohort, [3]) == {3: None}
    # Relaunched at 48.5, a budget to 50 is under a quarter of a period: it runs a full one.
    assert timing.plan_launches(48.5, cohort, [3]) == {3: None}
    # No history at all (the first launch): nothing to aim at.
    assert MergeTiming(Pace(STEPS), 0.25, 300.0).plan_launches(0.0, {}, [0, 1]) == {0: None, 1: None}
