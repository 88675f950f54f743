"""The pure membership policies: how to move towards a target, and whether a cluster can
hold the job at all; and who is blamed when a call to the first replica that answers fails."""

import pytest
import ray
from conftest import tiny_config
from ray.exceptions import RayActorError

from diloco_ray.control.calls import ServerLost, check_servers
from diloco_ray.driver.membership import Decision, Membership, capacity_shortfall, decide


def test_decide_starts_the_shortfall_counting_starting_replicas():
    assert decide(3, active=[0], starting=[]) == Decision(start=2)
    assert decide(3, active=[0], starting=[1]) == Decision(start=1)
    assert decide(2, active=[0], starting=[1, 2]) == Decision(cancel=[2])


def test_decide_stops_the_newest_extras_and_cancels_starts():
    assert decide(1, active=[0, 3, 1], starting=[4]) == Decision(stop=[3, 1], cancel=[4])
    assert decide(2, active=[0, 1], starting=[]) == Decision()


def test_capacity_adds_ranks_servers_gpus_and_custom_resources(tmp_path):
    def shortfall(cfg, device, available):
        return capacity_shortfall(cfg.sections().placement, cfg.num_replicas, device, available)

    cfg = tiny_config(tmp_path, num_replicas=2, ranks_per_replica=2, cpus_per_rank=1.0, server_cpus=0.5)
    assert shortfall(cfg, "cpu", {"CPU": 4.5}) is None
    short = shortfall(cfg, "cpu", {"CPU": 4.0})
    assert "CPU 4.5 (the cluster has 4)" in short and "num_replicas" in short
    assert "GPU 4 (the cluster has 2)" in shortfall(cfg, "cuda", {"CPU": 8, "GPU": 2})
    regions = tiny_config(
        tmp_path, num_replicas=3, replica_resources=[{"us": 1}, {"eu": 1}], server_resources={"us": 0.5}
    )
    # Replicas 0 and 2 in us (one rank each), replica 1 in eu, the server in us.
    assert shortfall(regions, "cpu", {"CPU": 8, "us": 2.5, "eu": 1}) is None
    assert "us 2.5 (the cluster has 2)" in shortfall(regions, "cpu", {"CPU": 8, "us": 2, "eu": 1})


def test_a_lost_replica_is_replaced_from_the_spares_at_once():
    # Replica 0 died: spare 5 takes its place now, and one new replica starts as the next spare.
    assert decide(2, [1], [], spares=[5], spares_wanted=1) == Decision(start=1, promote=[5])
    # The oldest spare goes first; the other stays a spare.
    assert decide(2, [1], [], spares=[7, 5], spares_wanted=2) == Decision(start=1, promote=[5])
    # A spare already starting counts: nothing more is requested.
    assert decide(2, [1], [9], spares=[5], spares_wanted=1) == Decision(promote=[5])


def test_spares_are_kept_at_their_count_and_stopped_first_when_fewer_are_wanted():
    assert decide(2, [0, 1], [], spares=[], spares_wanted=2) == Decision(start=2)
    assert decide(2, [0, 1], [], spares=[3, 4], spares_wanted=1) == Decision(stop=[4])
    # Scaling down to one: the newest active replica stops; the spare stays a spare.
    assert decide(1, [0, 1], [], spares=[3], spares_wanted=1) == Decision(stop=[1])
    # Without spares wanted, decide is what it always was.
    assert decide(3, [0, 1], [2]) == Decision()
    assert decide(1, [0, 1], [2]) == Decision(stop=[1], cancel=[2])


class Rep:
    def __init__(self, rid):
        self.id, self.stopped = rid, False

    def stop(self, keep=False):
        self.stopped = True


class DeadServers:
    def ping(self):
        raise RayActorError()


def test_a_call_failed_by_a_dead_server_blames_no_replica(tmp_path, monkeypatch):
    """An eval reads the servers' weights: when a server died every replica's call fails,
    and none of them is removed for it (bug: each was removed as failed in turn)."""
    s = tiny_config(tmp_path, num_replicas=2).sections()
    events = []
    members = Membership(s.membership, s.placement, "cpu", None, events.append, lambda: 3)
    members.home = [Rep(0), Rep(1)]

    def failing(refs, timeout=None):
        raise RayActorError()

    monkeypatch.setattr(ray, "get", failing)
    check = lambda: check_servers(DeadServers(), "during the eval")  # noqa: E731
    with pytest.raises(ServerLost, match="during the eval"):
        members.first_answer(lambda rep: rep.id, check=check)
    assert [r.id for r in members.home] == [0, 1] and not events
    # Servers alive: the call failed for the replica, which is removed; the next one answers.
    answers = iter([RayActorError(), "answered"])

    def once_failing(refs, timeout=None):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(ray, "get", once_failing)
    assert members.first_answer(lambda rep: rep.id, check=lambda: None) == "answered"
    assert [r.id for r in members.home] == [1] and [(e.replica_id, e.reason) for e in events] == [(0, "failed")]
