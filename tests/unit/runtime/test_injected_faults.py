"""The fault room (diloco_ray.runtime.faults): a rank's hook points fire each fault once and
for as long as documented; the driver's faults kill a server or signal the driver (no Ray)."""

import os
import signal
import time

import pytest
import torch

from diloco_ray.config import fault_plan
from diloco_ray.runtime.faults import DriverFaults, RankFaults

PLAN = [
    {"kind": "slow", "replica": 1, "round": 2, "step": 1, "seconds": 0.01},
    {"kind": "nan", "replica": 1, "rank": 1, "round": 2, "step": 3},
    {"kind": "drop_link", "replica": 0, "round": 1},
    {"kind": "kill", "target": "server", "round": 4, "index": 1},
    {"kind": "term", "target": "driver", "round": 5},
]


def poisoned(faults: RankFaults, round_index: int, step: int) -> bool:
    faults.before_step(round_index, step)
    return bool(torch.isnan(faults.poison(torch.tensor(1.0))))


def test_rank_faults_fire_once_and_last_one_period():
    rank1 = RankFaults.for_rank(PLAN, 1, 1)
    assert not poisoned(rank1, 2, 2)
    assert poisoned(rank1, 2, 3)  # the poisoned step
    assert not poisoned(rank1, 2, 4)  # that step only
    rank1.start_period()
    assert not poisoned(rank1, 2, 3)  # a re-run of the round does not fire it again
    slow = RankFaults.for_rank(PLAN, 1, 0)
    slow.before_step(2, 1)
    assert slow.extra_seconds == 0.01
    slow.before_step(2, 2)
    assert slow.extra_seconds == 0.01  # each remaining step of the period is slower
    slow.start_period()
    assert slow.extra_seconds == 0.0


@pytest.mark.parametrize("factor", [100.0, -1.0])
def test_a_scale_fault_sends_that_period_s_pseudo_gradient_times_its_factor(factor):
    faults = RankFaults.for_rank([{"kind": "scale", "replica": 0, "round": 1, "step": 2, "factor": factor}], 0, 0)
    anchor, local = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 2.5])}
    faults.before_step(1, 2)
    sent = faults.scaled(local, anchor)
    assert torch.equal(anchor["w"] - sent["w"], factor * (anchor["w"] - local["w"]))
    assert torch.equal(local["w"], torch.tensor([0.5, 2.5]))  # the replica's own weights untouched
    faults.start_period()
    assert faults.scaled(local, anchor) is local  # that period only


def test_a_dropped_link_holds_the_period_until_the_driver_gives_up():
    quiet = RankFaults.for_rank(PLAN, 0, 0)
    assert quiet.hold_link(lambda: pytest.fail("no fault: nothing to wait for")) is False
    link = RankFaults.for_rank(PLAN, 0, 0)
    link.before_step(1, 0)
    asked = []
    assert link.hold_link(lambda: asked.append(1) or len(asked) == 3) is True
    assert len(asked) == 3
    link.start_period()
    assert link.hold_link(lambda: pytest.fail("the next period's link is up")) is False


def test_a_slowdown_multiplies_every_later_step_and_outlasts_the_period(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    clock = iter([10.0, 10.0, 10.5, 10.5, 11.0, 11.0, 30.0, 30.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    rank = RankFaults(fault_plan.parse([{"kind": "slowdown", "round": 0, "factor": 3}]))
    rank.before_step(0, 0)  # fires; no step measured yet
    rank.before_step(0, 1)  # step 0 took 0.5 s: sleep 2 x 0.5
    rank.before_step(0, 2)
    rank.start_period()  # the gap between periods is not a step
    rank.before_step(1, 0)  # uses the last step's 0.5 s
    assert slept == [0.0, 1.0, 1.0, 1.0]


def test_a_slowdown_by_seconds_adds_them_to_every_later_step_whatever_the_step_took(monkeypatch):
    """A fixed pace: no step time is read, so the machine's load changes nothing."""
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(time, "monotonic", lambda: pytest.fail("a fixed pace reads no clock"))
    rank = RankFaults(fault_plan.parse([{"kind": "slowdown", "round": 1, "step": 1, "seconds": 0.4}]))
    rank.before_step(0, 1)  # not due yet
    rank.before_step(1, 0)
    rank.before_step(1, 1)  # fires
    rank.before_step(1, 2)
    rank.start_period()  # it outlasts the period
    rank.before_step(2, 0)
    assert slept == [0.4, 0.4, 0.4]


def test_in_decoupled_mode_a_replica_fault_fires_in_the_first_period_at_or_after_its_merge():
    """A replica merged every other merge launches periods at merge 0, 2, 4: a fault at merge 1
    fires in its period of merge 2 (an exact match would never come), and only once."""
    plan = [{"kind": "nan", "replica": 0, "round": 1, "step": 2}]
    rank = RankFaults.for_rank(plan, 0, 0, at_or_after=True)
    assert [poisoned(rank, 0, 2), poisoned(rank, 2, 2), poisoned(rank, 4, 2)] == [False, True, False]
    assert not poisoned(RankFaults.for_rank(plan, 0, 0), 2, 2)  # synchronous rounds match exactly


@pytest.mark.parametrize("kind, sig", [("kill", signal.SIGKILL), ("freeze", signal.SIGSTOP)])
def test_kill_and_freeze_signal_the_rank_itself(monkeypatch, kind, sig):
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, s: sent.append((pid, s)))
    rank = RankFaults.for_rank([{"kind": kind, "round": 0, "step": 1}], 0, 0)
    rank.before_step(0, 0)
    rank.before_step(0, 1)
    rank.before_step(0, 1)
    assert sent == [(os.getpid(), sig)]


def test_driver_faults_kill_the_named_server_or_signal_the_driver_once(monkeypatch):
    import ray

    killed, sent, logged = [], [], []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append((actor, no_restart)))
    monkeypatch.setattr(os, "kill", lambda pid, s: sent.append((pid, s)))

    class Servers:
        actors = ["server-0", "server-1"]

        def __len__(self):
            return len(self.actors)

    chaos = DriverFaults(PLAN)
    for round_index in (3, 4, 4, 5, 5):
        chaos.fire(round_index, Servers(), logged.append)
    assert killed == [("server-1", True)]
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert [(e.target, e.kind, e.round) for e in logged] == [("server", "kill", 4), ("driver", "term", 5)]
    DriverFaults(None).fire(0, Servers(), lambda e: pytest.fail("no plan, no fault"))
