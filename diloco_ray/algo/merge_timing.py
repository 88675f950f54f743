"""When decoupled mode merges, and how long each period may run: pure decisions over each
replica's measured pace, with no Ray and no clock of its own (callers pass ``now``).

Replicas on their own clocks drift out of phase: one delayed once, one killed and
replaced, one slower than the rest. Left alone, a merge then holds one replica at a time
and each is an outer step of its own. Two rules keep the replicas that can arrive together
arriving together:

* **A grace window that scales with the period** (:meth:`MergeTiming.merge_deadline`).
  Once the quorum is in, the merge waits for every replica *expected* (by its pace alone)
  within ``grace_fraction`` of a typical period (at most ``grace_window_s``), each until
  its expected arrival plus a tolerance for jitter (a quarter of its period). On the first
  merge the first arrival's pace stands in for the others (they run the same job), so it
  waits for them too.
* **Periods cut to land with a cohort** (:meth:`MergeTiming.plan_launches`). A replica
  launched while others are in flight whose full period would end outside the grace
  window of all their arrivals (a replica that arrived just after a merge, a spare joining
  mid-period, a replica slower than the rest) gets a time budget that ends at the latest
  arrival it can reach with at least ``min_share`` of a period's steps: one of theirs, or
  the one a period after it (when they will have been merged and relaunched). A
  persistently slower replica so runs a shorter H every period: at 2x slower exactly, half
  of one (merged fresh with the others each time); a little slower than 2x, nearly all of
  one, landing with the others' second period (merged one step stale every second merge).
  The rank stops its inner steps when the next would not fit the budget (``time_budget_s``).

A replica's pace is its seconds per inner step and its seconds outside the inner steps
(receiving weights, sending its pseudo-gradient), each the median of its last few periods
(:class:`Pace`): a period cut short still teaches the pace, and a one-off delay does not
(a running average would take one hiccup for a slower pace for several periods, and cut
the replica's next period too little to land with the others).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Optional

TOLERANCE_SHARE = 0.25  # of a period: arrival jitter waited for past a replica's expected arrival
MIN_TOLERANCE_S = 0.25


@dataclass
class ReplicaPace:
    """One replica's pace: seconds per inner step and seconds outside them."""

    step_s: float
    overhead_s: float


class Pace:
    """Each replica's pace, learned from the periods it finished.

    Args:
        steps: inner steps of a full period (``max_steps``).
        history: how many of a replica's latest periods its pace is the median of.
    """

    def __init__(self, steps: int, history: int = 5):
        self.steps, self.history = steps, history
        self.seen: dict[int, deque[ReplicaPace]] = {}
        self.replicas: dict[int, ReplicaPace] = {}

    def observe(self, replica_id: int, elapsed_s: float, compute_s: float, inner_steps: int) -> None:
        """A period of ``replica_id`` took ``elapsed_s`` from launch to report, ``compute_s``
        of it in ``inner_steps`` inner steps."""
        if inner_steps < 1:
            return  # nothing was trained: it says nothing of the pace
        seen = self.seen.setdefault(replica_id, deque(maxlen=self.history))
        seen.append(ReplicaPace(compute_s / inner_steps, max(0.0, elapsed_s - compute_s)))
        self.replicas[replica_id] = ReplicaPace(
            statistics.median(p.step_s for p in seen), statistics.median(p.overhead_s for p in seen)
        )

    def forget(self, replica_id: int) -> None:
        self.seen.pop(replica_id, None)
        self.replicas.pop(replica_id, None)

    @property
    def known(self) -> bool:
        return bool(self.replicas)

    def of(self, replica_id: int) -> Optional[ReplicaPace]:
        """The replica's pace, or the others' mean for one with no period yet (a new
        replica runs the same job); None before any period was seen."""
        if replica_id in self.replicas:
            return self.replicas[replica_id]
        if not self.replicas:
            return None
        n = len(self.replicas)
        return ReplicaPace(
            sum(p.step_s for p in self.replicas.values()) / n, sum(p.overhead_s for p in self.replicas.values()) / n
        )

    def period(self, replica_id: int) -> Optional[float]:
        """Seconds of a full period of ``replica_id``, launch to report."""
        pace = self.of(replica_id)
        return None if pace is None else pace.overhead_s + self.steps * pace.step_s

    def typical_period(self) -> Optional[float]:
        """The median full period over the replicas seen: what the grace window scales with."""
        periods = sorted(self.period(rid) for rid in self.replicas)
        return periods[len(periods) // 2] if periods else None


@dataclass(frozen=True)
class InFlight:
    """A period in flight as timing sees it: launched at ``launched_at``; ``due`` is the
    arrival its time budget aims at (None: a full period)."""

    launched_at: float
    due: Optional[float] = None


class MergeTiming:
    """When to merge and how long to let each period run.

    Args:
        pace: the replicas' :class:`Pace`.
        grace_fraction: the grace window as a share of a typical period.
        grace_cap_s: the longest grace window (``grace_window_s``).
        align: cut periods to land with a cohort (``align_periods``).
        min_share: the shortest budget given, as a share of a full period's inner steps.
    """

    def __init__(
        self, pace: Pace, grace_fraction: float, grace_cap_s: float, align: bool = True, min_share: float = 0.25
    ):
        self.pace, self.fraction, self.cap_s = pace, grace_fraction, grace_cap_s
        self.align, self.min_share = align, min_share

    def window(self) -> float:
        """Seconds past the quorum that replicas expected within are waited for."""
        typical = self.pace.typical_period()
        return 0.0 if typical is None else min(self.cap_s, self.fraction * typical)

    def expected(self, replica_id: int, flight: InFlight) -> Optional[float]:
        """When the period should report, by the replica's pace (or its budget's aim)."""
        if flight.due is not None:
            return flight.due
        period = self.pace.period(replica_id)
        return None if period is None else flight.launched_at + period

    def tolerance(self, replica_id: int) -> float:
        period = self.pace.period(replica_id) or 0.0
        return max(MIN_TOLERANCE_S, TOLERANCE_SHARE * period)

    def merge_deadline(self, now: float, quorum_met: bool, training: Mapping[int, InFlight]) -> Optional[float]:
        """When to merge: None while the quorum is not met; else the latest tolerated arrival
        of the replicas expected within the window, or ``now`` when none is."""
        if not quorum_met:
            return None
        window = self.window()
        if window <= 0.0:
            return now  # no grace window (or nothing known yet): merge what is in
        horizon = now + window
        waits = []
        for rid, flight in training.items():
            expected = self.expected(rid, flight)
            if expected is not None and expected <= horizon:
                waits.append(expected + self.tolerance(rid))
        return max(waits, default=now)

    def plan_launches(
        self, now: float, training: Mapping[int, InFlight], launching: list[int]
    ) -> dict[int, Optional[float]]:
        """Replica id -> the arrival its budget aims at (None: a full period) for each
        replica launched ``now``, while ``training`` are in flight. The fastest are planned
        first, so a slower one launched beside them aims at their arrival."""
        arrivals = {rid: self.expected(rid, f) for rid, f in training.items()}
        arrivals = {rid: t for rid, t in arrivals.items() if t is not None}
        plans: dict[int, Optional[float]] = {}
        for rid in sorted(launching, key=lambda r: (self.pace.period(r) or 0.0, r)):
            plans[rid] = self._aim(rid, now, arrivals) if self.align else None
            period = self.pace.period(rid)
            if plans[rid] is not None:
                arrivals[rid] = plans[rid]
            elif period is not None:
                arrivals[rid] = now + period
        return plans

    def budget_s(self, replica_id: int, now: float, due: float) -> float:
        """Seconds of inner steps that land a period launched ``now`` at ``due`` (the
        rank's ``time_budget_s``: its time outside the inner steps comes off)."""
        pace = self.pace.of(replica_id)
        return max(0.0, due - now - (pace.overhead_s if pace is not None else 0.0))

    def _aim(self, rid: int, now: float, arrivals: Mapping[int, float]) -> Optional[float]:
        pace, period = self.pace.of(rid), self.pace.period(rid)
        if pace is None or not arrivals:
            return None
        own_end, window = now + period, self.window()
        if any(abs(own_end - t) <= window for t in arrivals.values()):
            return None  # it lands with a cohort already: the merge waits for it (or it for them)
        # The others' next arrivals, and the ones after (they relaunch once merged): a
        # cohort due too soon to reach with a useful period may be reached a period later.
        # An overdue replica's is unknown (it is late by an unknown amount): no aim.
        ahead = {r: t for r, t in arrivals.items() if t >= now}
        landings = [t + k * (self.pace.period(r) or 0.0) for r, t in ahead.items() for k in (0, 1)]
        shortest = now + pace.overhead_s + self.min_share * self.pace.steps * pace.step_s
        reachable = [t for t in landings if shortest <= t < own_end]
        return max(reachable, default=None)
