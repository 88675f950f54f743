"""Screening across regions, through the servers in-process: a region's contribution far
outside the others is rejected by every server (each sums its own rows' squares, all agree
on the norm), and the weights are those of the sync without it; an honest one passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.aggregate import Rejection
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
    return compression.pack({n: t * factor for n, t in tensors.items()}, "none", meta)


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
        ({9: 50.0}, [1.0, 2.0, 3.0], {9}),  # alone: against its own history (median 2)
        ({9: 50.0}, [], set()),  # alone, no history: nothing to compare with
        ({0: 1.0, 9: float("inf")}, [], {9}),
        ({0: 0.0, 9: 1.0}, [], set()),  # nothing to scale a bar from
        ({0: 1.0, 8: 100.0, 9: 100.0}, [], set()),  # two regions: the median of the others
    ],
)
def test_the_rule_against_the_others_median_or_its_own_history(norms, history, rejected):
    screen = NormScreen(10.0)
    for n in history:
        screen.judge({9: n}, [9])
    assert set(screen.judge(norms, [r for r in norms if r >= 8])) == rejected


def test_a_rejected_norm_does_not_join_the_history():
    screen = NormScreen(10.0)
    screen.judge({9: 1.0}, [9])
    screen.judge({0: 1.0, 9: 500.0}, [9])
    assert list(screen.history[9]) == [1.0] and torch.tensor(1.0)  # (torch imported for Sim's sake)
