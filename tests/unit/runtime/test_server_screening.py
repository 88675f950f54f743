"""Screening across regions, through the servers in-process: a region's contribution far
outside the others is rejected by every server (each sums its own rows' squares, all agree
on the norm), and the weights are those of the sync without it; an honest one passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.aggregate import Rejection
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.screening import NormScreen
from diloco_ray.config.fields import REGION_ID_BASE
from tests.unit.runtime.test_server_shards import Sim, max_diff

REGION = REGION_ID_BASE
ACROSS_REGIONS = dict(
    regions=[{"name": "eu", "replicas": 1}],
    channel_tls_cert="home.pem",
    channel_tls_key="home.key",
    channel_tokens_file="tokens",
)


def scaled(buf: np.ndarray, factor: float) -> np.ndarray:
    tensors, meta = compression.unpack(buf)
    return compression.pack({n: t * factor for n, t in tensors.items()}, Codec("none"), meta)


def with_region(num_servers: int, fragments: int, **cfg) -> Sim:
    """Two home replicas (0, 1) and a region's member (REGION)."""
    sim = Sim(num_servers, fragments, 1, 3, **ACROSS_REGIONS, **cfg)
    sim.replicas = {0: sim.replicas[0], 1: sim.replicas[1], REGION: sim.replicas[2]}
    return sim


def plans_of(sim: Sim) -> dict:
    ids = list(sim.replicas)
    return dict(zip(ids, sim.servers[0].data_plan(ids)))


@pytest.mark.parametrize("num_servers, fragments", [(1, 1), (2, 2)])
def test_a_region_sending_a_hundred_times_an_honest_update_is_screened_out_on_every_server(num_servers, fragments):
    attacked, clean = with_region(num_servers, fragments), with_region(num_servers, fragments)
    real = attacked.outgoing
    attacked.outgoing = lambda rid, f: (
        [[scaled(b, 100.0) for b in bufs] for bufs in real(rid, f)] if rid == REGION else real(rid, f)
    )
    for r in range(2):
        for f in range(fragments):
            applied, reduced = attacked.sync(r, f, plans_of(attacked))
            clean.sync(r, f, plans_of(clean), skip={REGION})
            for a in applied:
                assert a.accepted == [0, 1] and a.rejected[REGION].reason is Rejection.SCREENED
                assert "region_screen_norm 10" in str(a.rejected[REGION])
    assert max_diff(attacked.global_weights(), clean.global_weights()) == 0.0


def test_an_honest_region_passes_and_the_flat_layout_is_not_screened():
    sim = with_region(2, 2)
    for r in range(2):
        for f in range(2):
            applied, _ = sim.sync(r, f, plans_of(sim))
            assert all(a.accepted == [0, 1, REGION] and not a.rejected for a in applied)
    flat = Sim(1, 1, 1, 2)
    assert flat.servers[0].server.screen is None


def test_screening_is_off_when_its_threshold_is_null():
    assert with_region(1, 1, region_screen_norm=None).servers[0].server.screen is None


@pytest.mark.parametrize(
    "norms, history, rejected",
    [
        ({0: 1.0, 1: 1.2, 9: 11.5}, [], {9}),  # 11.5 > 10 x median(1.0, 1.2) = 11
        ({0: 1.0, 1: 1.2, 9: 10.5}, [], set()),
        ({9: 50.0}, [1.0, 2.0, 3.0], {9}),  # alone: against the accepted history (median 2)
        ({9: 15.0}, [1.0, 2.0, 3.0], set()),
        ({9: 50.0}, [], {9}),  # alone, no history: nothing to hold it against, so not applied
        ({0: 1.0, 9: float("inf")}, [], {9}),
        ({0: 0.0, 9: 1.0}, [], set()),  # nothing to scale a bar from
        ({0: 1.0, 8: 100.0, 9: 100.0}, [], set()),  # two regions: the median of the others
    ],
)
def test_the_rule_against_the_others_median_or_its_own_history(norms, history, rejected):
    screen = NormScreen(10.0)
    for n in history:
        screen.judge({0: n}, [])  # the home's, accepted unscreened
    assert set(screen.judge(norms, [r for r in norms if r >= 8])) == rejected


def test_the_history_holds_every_accepted_norm_per_fragment_and_no_rejected_one():
    screen = NormScreen(10.0)
    screen.judge({0: 1.0, 9: 2.0}, [9])
    screen.judge({0: 1.0, 9: 500.0}, [9])
    screen.judge({0: 7.0}, [], fragment=1)
    assert list(screen.history[0]) == [1.0, 2.0, 1.0] and list(screen.history[1]) == [7.0]
    assert screen.judge({9: 25.0}, [9]) and not screen.judge({9: 25.0}, [9], fragment=1)
    assert torch.tensor(1.0)  # (torch imported for Sim's sake)


def test_a_region_alone_whose_first_contribution_is_already_scaled_is_held_against_the_homes():
    """Decoupled merges take whoever arrived: a region's first message, scaled and alone,
    has no honest history of its own; the home's recent norms are its bar."""
    screen = NormScreen(10.0)
    for _ in range(3):
        screen.judge({0: 1.0}, [])
    why = screen.judge({9: 100.0}, [9])[9]
    assert why.reason is Rejection.SCREENED and "100x the median 1 of the last 3 accepted ones" in str(why)


def test_a_reply_the_home_refused_is_rejected_by_every_server_with_its_reason():
    from diloco_ray.runtime.server_aggregator import refusal_message

    refused, clean = with_region(2, 1), with_region(2, 1)
    real = refused.outgoing
    message = refusal_message("its reply was refused: 1000000000000 tokens claimed; its plan holds 48")
    refused.outgoing = lambda rid, f: [[message] for _ in refused.servers] if rid == REGION else real(rid, f)
    applied, _ = refused.sync(0, 0, plans_of(refused))
    clean.sync(0, 0, plans_of(clean), skip={REGION})
    for a in applied:
        assert a.accepted == [0, 1] and str(a.rejected[REGION]).endswith(
            "1000000000000 tokens claimed; its plan holds 48"
        )
    assert max_diff(refused.global_weights(), clean.global_weights()) == 0.0


def test_the_gateway_turns_a_reply_claiming_more_than_its_plan_into_a_refusal_every_server_rejects():
    from diloco_ray.regions import wire
    from diloco_ray.regions.gateway import RegionGateway
    from diloco_ray.runtime.messages import PeriodId, RegionFacts, RoundStats, SyncPeriod
    from diloco_ray.runtime.server_aggregator import refused_in

    gateway = RegionGateway.__new__(RegionGateway)
    gateway.max_bytes, gateway.seq_len, gateway.servers = 1 << 20, 8, 2
    job = SyncPeriod(period=PeriodId(0, 0, 1), full=False, version=0, plan=[(0, 6)], messages=[], servers=[])
    greedy = RoundStats(0, 5, 10**12, 1.0, 1.0, 0.0, 0, loss_tokens=10**12, region=RegionFacts(replica_ids=(0,)))
    buffers, stats = gateway._checked_reply("eu", job, wire.reply_payload([np.zeros(4, np.uint8)] * 2, greedy))
    assert (stats.tokens, stats.loss_tokens, stats.aborted) == (0, 0, False)
    assert refused_in(buffers[:1]) == "its reply was refused: 1000000000000 tokens claimed; its plan holds 48"
    honest = RoundStats(0, 5, 40, 1.0, 1.0, 0.0, 0, loss_tokens=40, region=RegionFacts(replica_ids=(0,)))
    buffers, stats = gateway._checked_reply("eu", job, wire.reply_payload([np.zeros(4, np.uint8)] * 2, honest))
    assert stats == honest and refused_in([compression.pack({}, Codec("none"))]) is None
