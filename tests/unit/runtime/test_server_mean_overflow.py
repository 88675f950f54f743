"""Finite pseudo-gradients whose token-weighted sum is past fp32's range: the servers'
aggregator and agreement on their own (no Ray, no actor), then whole servers' commits.

The mean of finite values is finite, so it is applied; a mean that is itself past fp32's
range (decoupled mode divides by one round's worth of tokens, which can be less than the
weights merged) is a rejection of the whole sync that every server agrees on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.outer import Rejection
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server_aggregator import Aggregator, Agreement
from diloco_ray.runtime.server_codec import SliceCodec
from tests.unit.runtime.test_server_decoupled import merge, start_both
from tests.unit.runtime.test_server_shards import Sim, max_diff, with_value

SHAPES = {"w": (4, 2), "b": (3,)}  # two servers: server 0 holds rows 0-2 of w, server 1 the rest


def grads(*scales: float) -> dict[int, dict[str, torch.Tensor]]:
    """Replica r's pseudo-gradient: rows 0-1 of ``w`` at ``scales[r]`` times a fixed pattern
    (near fp32's limit for a scale near 1e38), the rest of ordinary size."""
    out = {}
    for r, scale in enumerate(scales):
        g = torch.Generator().manual_seed(r)
        w = torch.randn(4, 2, generator=g) * 1e-2
        w[:2] = torch.tensor([[3.0, -1.0], [2.5, 3.0]]) * scale
        out[r] = {"w": w, "b": torch.randn(3, generator=g)}
    return out


def contributions(layout: SliceLayout, sent: dict, weights: dict) -> list[Contribution]:
    """One rank per replica: its rows for this server, packed as a rank packs them."""
    target = layout.target(0)
    out = []
    for rid, g in sent.items():
        pieces = {n: g[n][a:b] for n, (a, b) in target.items()}
        buf, _ = compression.pack_pieces(pieces, {n: a for n, (a, _) in target.items()}, layout.names, Codec("none"))
        out.append(Contribution(rid, [buf], weights[rid]))
    return out


def sync(sent: dict, weights: dict, servers: int, divisor=None) -> tuple[list[Agreement], dict]:
    """Every server's prepare and reduce, then each server's agreement and the mean, whole."""
    aggregators = []
    for s in range(servers):
        layout = SliceLayout(SHAPES, s, servers, 1)
        aggregators.append(Aggregator(layout, SliceCodec(layout)))
    prepared = [a.prepare(0, contributions(a.layout, sent, weights), divisor) for a in aggregators]
    reduced = [a.reduce(*prepared) for a in aggregators]
    agreed = [Agreement.of(reduced) for _ in aggregators]  # each server's commit forms its own
    mean = {n: torch.full(s, float("nan")) for n, s in SHAPES.items()}
    for a in aggregators:
        for n, m in a.take_mean().items():
            lo, hi = a.layout.target(0)[n]
            mean[n][lo:hi] = m
    return agreed, mean


def exact_mean(sent: dict, weights: dict, divisor: float) -> dict[str, torch.Tensor]:
    return {n: sum(weights[r] * g[n].double() for r, g in sent.items()) / divisor for n in SHAPES}


@pytest.mark.parametrize("servers", [1, 2])
def test_a_sum_past_fp32_averages_to_the_exact_token_weighted_mean(servers):
    sent, weights = grads(1e38, 1e38), {0: 100.0, 1: 300.0}
    (agreed, *_), mean = sync(sent, weights, servers)
    want = exact_mean(sent, weights, 400.0)
    assert agreed.accepted == [0, 1] and agreed.rejected == {}
    for n in SHAPES:
        torch.testing.assert_close(mean[n].double(), want[n], rtol=1e-6, atol=1e-9)
    norm = float(torch.cat([v.reshape(-1) for v in want.values()]).norm())
    assert agreed.norm == pytest.approx(norm, rel=1e-6)


def test_the_norm_of_a_mean_near_the_fp32_limit_does_not_depend_on_the_server_count():
    sent, weights = grads(1e38, 0.9e38, 1.1e38), {0: 100.0, 1: 300.0, 2: 5.0}
    (one, *_), mean_one = sync(sent, weights, 1)
    (two, *_), mean_two = sync(sent, weights, 2)
    assert one.norm == two.norm and np.isfinite(one.norm)
    for n in SHAPES:
        assert torch.equal(mean_one[n], mean_two[n])


@pytest.mark.parametrize("servers", [1, 2])
def test_a_mean_past_fp32_is_a_rejection_every_server_agrees_on(servers):
    """Decoupled mode divides by a round's worth of tokens: 400 tokens over a round of 100 puts
    a mean of values near 3e38 past fp32's range (on server 0's rows only: the agreement
    still rejects the whole sync on every server)."""
    sent, weights = grads(1e38, 1e38), {0: 100.0, 1: 300.0}
    agreed, _ = sync(sent, weights, servers, divisor=100.0)
    for a in agreed:
        assert a.accepted == [] and a.norm is None
        assert set(a.rejected) == {0, 1}
        for why in a.rejected.values():
            assert why.reason is Rejection.NON_FINITE and "weighted mean overflows" in str(why)
    assert len({repr(a) for a in agreed}) == 1


def test_a_plain_sync_past_fp32_steps_by_its_finite_mean():
    """Through whole servers: both replicas send values of 3e38 (weights 1 and 2), the
    servers step by the clipped mean, and the weights stay finite."""
    sim = Sim(2, 1, 1, 2, outer_grad_clip=1.0)
    ids = list(sim.replicas)
    plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
    contributions = [[] for _ in sim.servers]
    for rid in ids:
        sim.receive(rid)
        sim.train(rid, 0, 0)
        bufs = sim.outgoing(rid, 0)
        bufs[0][0] = with_value(bufs[0][0], 3e38, count=4)
        for s in range(len(sim.servers)):
            contributions[s].append(Contribution(rid, bufs[s], 1.0 + rid))
    prepared = [srv.prepare(0, contributions[s]) for s, srv in enumerate(sim.servers)]
    reduced = [srv.reduce(*prepared) for srv in sim.servers]
    applied = [srv.commit(plans, *reduced) for srv in sim.servers]
    for a in applied:
        assert a.applied and a.accepted == [0, 1] and a.rejected == {}
        assert a.pseudo_grad_norm == pytest.approx(3e38 * 2, rel=1e-6)  # four values of 3e38
    assert all(np.isfinite(w).all() for w in sim.global_weights().values())


def test_a_decoupled_merge_whose_mean_overflows_is_not_applied():
    """One contribution of 2 tokens over a round's worth of 1: twice 3e38 is past fp32's
    range. Nothing moves, its plan goes back to the cursor, and the replica is told why."""
    sim = Sim(1, 1, 1, 2, sync_mode="decoupled", staleness_power=0.0)
    srv = sim.servers[0]
    plans, bufs = start_both(sim)
    bufs[0][0][0] = with_value(bufs[0][0][0], 3e38, count=4)
    before, version = sim.global_weights(), srv.sync_version()
    applied = merge(sim, 0, bufs[0], 2.0, 1.0, plans[0])
    assert not applied.applied and applied.accepted == [] and applied.pseudo_grad_norm is None
    assert applied.rejected[0].reason is Rejection.NON_FINITE
    assert "weighted mean overflows" in str(applied.rejected[0])
    assert srv.sync_version() == version and max_diff(sim.global_weights(), before) == 0.0
    assert srv.plans.cursor.returned == plans[0]
