"""The held-out check without Ray: its rule, whom it tries and what it refuses (a fake home
whose replica scores weights by name), and the servers' trial weights, exactly the global
weights minus one contribution's pseudo-gradient on every server."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from diloco_ray.algo.aggregate import Rejection
from diloco_ray.config.fields import REGION_ID_BASE
from diloco_ray.control.calls import ServerLost
from diloco_ray.driver.holdout import HoldoutCheck, carries_update, refused, worse_than_margin
from diloco_ray.runtime.messages import Contribution, RegionFacts, RoundStats
from diloco_ray.runtime.server_aggregator import refusal_message
from diloco_ray.runtime.server_group import assemble_weights
from tests.unit.runtime.test_server_screening import REGION, plans_of, with_region
from tests.unit.runtime.test_server_shards import max_diff

EU, US = REGION_ID_BASE, REGION_ID_BASE + 1


@pytest.mark.parametrize(
    "trial, base, refused_",
    [(2.0, 2.5, False), (2.51, 2.5, False), (2.53, 2.5, True), (float("nan"), 2.5, True), (None, 2.5, True)],
)
def test_an_update_is_refused_when_its_weights_score_more_than_the_margin_above_the_rounds(trial, base, refused_):
    why = worse_than_margin(trial, base, 0.02)
    assert (why is not None) == refused_
    if refused_:
        assert why.startswith("held-out check: the round's weights minus its update score eval loss")
        assert why.endswith("against their 2.5000 (region_holdout_margin 0.02)")


class Members:
    """A home whose first replica scores weights by their name (None: no replica left)."""

    def __init__(self, scores):
        self.scores, self.asked = scores, []

    def first_answer(self, call, among=None, check=None):
        if self.scores is None:
            return None
        return call(self)

    def evaluate(self, refs):
        self.asked.append(refs)
        loss = self.scores[refs[0]]
        return [(loss * 10, 10, 64), (loss * 30, 30, 64)]  # two ranks' sums: the mean is loss


class Servers:
    def global_weights(self):
        return ["round", "round"]

    def trial_weights(self, parts):
        assert len({c.replica_id for c in parts}) == 1 and len(parts) == 2  # one replica's part per server
        return [f"minus {parts[0].replica_id}"] * 2


class Home:
    def __init__(self, scores):
        self.members, self.server = Members(scores), Servers()


def contributions(ids):
    return [[Contribution(rid, [f"buffer {rid} {s}"], 10.0) for rid in ids] for s in range(2)]


def test_each_region_tried_is_scored_against_the_rounds_weights_and_only_a_worse_one_refused():
    home = Home({"round": 3.0, f"minus {EU}": 2.9, f"minus {US}": 3.4})
    why = HoldoutCheck(0.05).refusals(home, contributions([0, EU, US]), tried=[EU, US])
    assert list(why) == [US] and "eval loss 3.4000 against their 3.0000" in why[US]
    assert home.members.asked == [["round", "round"], [f"minus {EU}"] * 2, [f"minus {US}"] * 2]
    assert HoldoutCheck(0.05).refusals(home, contributions([0, 1]), tried=[]) == {}


def test_with_no_home_replica_to_score_on_no_region_is_applied():
    why = HoldoutCheck(0.05).refusals(Home(None), contributions([0, EU]), tried=[EU])
    assert why == {EU: "held-out check: no home replica could score the round's weights"}


def test_a_server_lost_while_it_scores_says_it_died_during_the_held_out_check():
    class DeadServers(Servers):
        def ping(self):
            raise RayActorError()

    home = Home({"round": 3.0})
    home.server = DeadServers()
    home.members.first_answer = lambda call, among=None, check=None: check()  # every call failed: ask the servers
    with pytest.raises(ServerLost, match="a server died during the held-out check"):
        HoldoutCheck(0.05).refusals(home, contributions([0, EU]), tried=[EU])


def test_only_a_regions_reply_that_carries_an_update_is_tried():
    stats = RoundStats(0, 3, 24, 1.0, 1.0, 0.0, 0, region=RegionFacts(replica_ids=(0,)))
    assert carries_update(EU, stats) and not carries_update(3, stats)
    assert not carries_update(EU, RoundStats.empty(aborted=True, region=RegionFacts()))
    assert not carries_update(EU, RoundStats.empty(region=RegionFacts(refused="its reply was refused")))


def test_a_refused_contribution_stands_for_a_refusal_every_server_rejects_with_its_reason():
    sim, clean = with_region(2, 1), with_region(2, 1)
    real = sim.outgoing
    plans = plans_of(sim)
    for rid in sim.replicas:
        sim.receive(rid)
        sim.train(rid, 0, 0)
    sent = {rid: real(rid, 0) for rid in sim.replicas}
    given = [[Contribution(rid, sent[rid][s], 1.0 + (rid % 7)) for rid in sim.replicas] for s in range(2)]
    parts = refused(given, {REGION: "held-out check: worse"})
    assert all(p[:2] == g[:2] and p[2] is not g[2] for p, g in zip(parts, given))  # the others as they were
    prepared = [srv.prepare(0, parts[s]) for s, srv in enumerate(sim.servers)]
    reduced = [srv.reduce(*prepared) for srv in sim.servers]
    applied = [srv.commit(plans, *reduced) for srv in sim.servers]
    clean.sync(0, 0, plans_of(clean), skip={REGION})
    for a in applied:
        assert a.accepted == [0, 1] and a.rejected[REGION].reason is Rejection.REFUSED
        assert str(a.rejected[REGION]) == "held-out check: worse"
    assert max_diff(sim.global_weights(), clean.global_weights()) == 0.0


@pytest.mark.parametrize("num_servers", [1, 2])
def test_the_trial_weights_are_the_global_weights_minus_the_contribution_on_every_server(num_servers):
    sim = with_region(num_servers, 1)
    sim.sync(0, 0, plans_of(sim))  # the weights have moved once
    sim.receive(REGION)
    sim.train(REGION, 1, 0)
    bufs = sim.outgoing(REGION, 0)
    trial = assemble_weights(
        [srv.trial_weights(Contribution(REGION, bufs[s], 1.0)) for s, srv in enumerate(sim.servers)], sim.shapes
    )
    delta = assemble_weights([b for per_server in bufs for b in per_server], sim.shapes)
    expected = {n: w - delta[n] for n, w in sim.global_weights().items()}
    assert max_diff(trial, expected) < 1e-6 and max_diff(trial, sim.global_weights()) > 1e-4
    broken = [srv.trial_weights(Contribution(REGION, [refusal_message("no")], 1.0)) for srv in sim.servers]
    assert max_diff(assemble_weights(broken, sim.shapes), sim.global_weights()) == 0.0
