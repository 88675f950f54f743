"""Decoupled merges at real period lengths, on a fake clock: the real
:class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop` and a real parameter server,
replicas whose periods take the seconds their pace says (10 s here), and a clock that
jumps to the next report instead of sleeping. No Ray.

The rule under test (issue 29): replicas of one speed merge together, and after any
perturbation (a one-off delay, a kill and its replacement, a replica joining, a slower
replica) they merge together again within two merges.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
from ray.exceptions import RayActorError

from diloco_ray.config import fault_plan
from diloco_ray.driver.loop import loop_for
from tests.unit.driver.test_decoupled_loop import Calls, Host, Members, Replica, Servers, make_config

STEPS = 20
STEP_S = 0.5  # 10 s of inner steps a period
OVERHEAD_S = 0.4  # receiving weights and sending the pseudo-gradient


class FakeClock(Calls):
    """The loop's calls over fake refs whose reports arrive at a time (``at``); waiting
    moves the clock to the first report due or to the end of the wait."""

    def __init__(self):
        super().__init__()  # (its poll count is unused here: refs carry a time instead)
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def ready(self, refs, timeout_s):
        due = [r.at for r in refs if r.at > self.t]
        if not any(r.at <= self.t for r in refs):
            self.t = min([self.t + (timeout_s or 0.0)] + due)
        return [r for r in refs if r.at <= self.t]


class PacedReplica(Replica):
    """A replica whose period takes ``OVERHEAD_S`` + steps x ``step_s`` on the fake clock,
    honouring the period's time budget as a rank does (whole steps that fit, at least one);
    ``delays`` adds seconds to given periods (by launch count), ``dies`` makes one fail."""

    def __init__(self, rid, cfg, clock: FakeClock, step_s=STEP_S, delays=None, dies: Optional[int] = None):
        super().__init__(rid, cfg, clock)
        self.clock, self.step_s, self.extra, self.dies = clock, step_s, dict(delays or {}), dies

    def run_period(self, job):
        steps = STEPS
        if job.time_budget_s is not None:
            steps = max(1, min(STEPS, math.floor(job.time_budget_s / self.step_s + 1e-9)))
        self.steps = steps
        period = len(self.jobs)
        buffers, [ref] = super().run_period(job)
        ref.value.compute_seconds = steps * self.step_s
        ref.at = self.clock.now() + OVERHEAD_S + steps * self.step_s + self.extra.get(period, 0.0)
        if period == self.dies:
            ref.error = RayActorError()
        return buffers, [ref]


class ElasticHost(Host):
    """A host whose reconcile brings the membership back to its target with new replicas."""

    make_replica = None
    target = 0
    next_id = 0

    def reconcile(self):
        super().reconcile()
        while len(self.members.active) < self.target:
            self.members.active.append(self.make_replica(self.next_id))
            self.next_id += 1


def harness(tmp_path, replicas=4, slow=None, delays=None, dies=None, **overrides):
    cfg = make_config(sync_mode="decoupled", num_replicas=replicas, max_steps=STEPS, diloco_loops=40, **overrides)
    clock = FakeClock()

    def replica(rid):
        step_s = STEP_S * (slow or {}).get(rid, 1.0)
        return PacedReplica(rid, cfg, clock, step_s, (delays or {}).get(rid), (dies or {}).get(rid))

    reps = [replica(i) for i in range(replicas)]
    host = ElasticHost(Servers(cfg), Members(reps), folder=str(tmp_path), faults=fault_plan.parse(None))
    host.make_replica, host.target, host.next_id = replica, replicas, replicas
    host.loop = loop_for(cfg.sections(), "", calls=clock)
    host.loop.restore(host.server, reset=False)
    return host, clock


def merged_sets(host, merges: int) -> list[set[int]]:
    return [set(map(int, host.merge()["staleness"])) for _ in range(merges)]


def test_equal_replicas_merge_together_from_the_first_merge(tmp_path):
    host, _ = harness(tmp_path)
    merges = merged_sets(host, 6)
    assert merges == [{0, 1, 2, 3}] * 6


@pytest.mark.parametrize("extra_s", [1.5, 4.0, 8.0])
def test_a_one_off_delay_is_absorbed_within_two_merges(tmp_path, extra_s):
    # Replica 2's third period (launch 2) runs extra_s late: 15%, 40%, 80% of a period.
    host, _ = harness(tmp_path, delays={2: {2: extra_s}})
    merges = merged_sets(host, 8)
    assert merges[:2] == [{0, 1, 2, 3}] * 2
    assert all(m == {0, 1, 2, 3} for m in merges[4:]), merges


def test_a_killed_replica_is_replaced_and_its_replacement_lands_with_the_others(tmp_path):
    host, _ = harness(tmp_path, dies={1: 2})  # replica 1's third period fails
    merges = merged_sets(host, 8)
    assert ("reconcile" in host.calls) and host.members.removed == [(1, "failed")]
    full = {0, 2, 3, 4}  # replica 4 replaced 1
    assert all(m == full for m in merges[4:]), merges


def test_a_replica_joining_mid_period_lands_with_the_others(tmp_path):
    host, clock = harness(tmp_path)
    merges = merged_sets(host, 2)
    clock.t += 4.0  # the join comes 4 s into the third period
    host.target = 5
    host.reconcile()
    host.loop._launch_idle(host)
    merges += merged_sets(host, 6)
    assert all(m == {0, 1, 2, 3, 4} for m in merges[3:]), merges


def test_a_slower_replica_runs_a_shorter_period_and_is_merged_fresh(tmp_path):
    host, _ = harness(tmp_path, slow={3: 2.0})
    records = [host.merge() for _ in range(8)]
    merges = [set(map(int, r["staleness"])) for r in records]
    # Its first period runs whole (nothing is known of it yet) and is merged alone; the next
    # is cut to land with the others' second period after that (merged one step stale, as
    # it started before their merge); from then on all merge together, none stale, the slow
    # replica on a budget of half its full period's steps.
    assert all(m == {0, 1, 2, 3} for m in merges[3:]), merges
    assert all(s == 0 for r in records[4:] for s in r["staleness"].values()), [r["staleness"] for r in records]
    budgets = [job.time_budget_s for job in host.members.active[3].jobs[2:]]
    assert budgets == [pytest.approx(STEPS * STEP_S)] * len(budgets)  # the fast ones' 10 s of steps
