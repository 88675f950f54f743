"""A region's one message per sync: the home's mean over regional means is the mean over
every replica (a sum of sums), a bad replica is left out inside its region, and with a
lossy WAN codec the region's residual keeps what its messages did not carry yet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.regions.books import RegionBooks
from diloco_ray.regions.merge import RegionalMerge
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import assemble_weights
from tests.unit.runtime.test_server_shards import SHAPES, Rank, ThroughRay, initial_weights, make_config, noise

WEIGHTS = {0: 10.0, 1: 20.0, 2: 30.0, 3: 45.0}  # tokens each replica trained on
REGIONS = {"eu": [0, 1], "us": [2, 3]}


def home(cfg):
    """The home's servers, started from the same initial weights as every replica."""
    seed = Rank(cfg, SHAPES, 1, 0, initial_weights()).sync
    servers = [ThroughRay(ParameterServer(cfg.to_dict(), index=s)) for s in range(cfg.num_param_servers)]
    seeds = seed.seed({n: t.clone() for n, t in initial_weights().items()})
    for s, server in enumerate(servers):
        server.initialize([seeds[s]], SHAPES)
    return servers


def replica_sends(cfg, ranks: dict, round_index: int, poisoned=()) -> dict[int, list]:
    """Every replica trains one period (its weights move by its own noise) and packs its
    pseudo-gradient: replica id -> one buffer per home server."""
    sends = {}
    for rid, rank in ranks.items():
        moved = noise(SHAPES, round_index, 0, rid)
        for n, t in rank.local.items():
            t.sub_(0.05 * moved[n])
        if rid in poisoned:
            rank.local["lm_head.weight"][0, 0] = float("nan")
        sends[rid] = rank.sync.outgoing(0, rank.local)
    return sends


def sync(servers, contributions_by_server, ids) -> list:
    """One sync on the home's servers; their new weights messages."""
    plans = dict(zip(ids, servers[0].data_plan(ids)))
    prepared = [srv.prepare(0, contributions_by_server[s]) for s, srv in enumerate(servers)]
    reduced = [srv.reduce(*prepared) for srv in servers]
    for srv in servers:
        srv.commit(plans, *reduced)
    return [srv.new_weights_message(0) for srv in servers]


def weights_of(servers) -> dict[str, np.ndarray]:
    return assemble_weights([s.global_weights() for s in servers], SHAPES)


def run(layout: str, rounds: int = 3, poisoned_at=None, **cfg_fields):
    """``rounds`` syncs of 4 replicas, flat (every replica a contribution) or over the two
    regions (each region's RegionalMerge a contribution); the home's final weights."""
    cfg = make_config(num_param_servers=2, **cfg_fields)
    servers = home(cfg)
    ranks = {rid: Rank(cfg, SHAPES, 1, 0, initial_weights()) for rid in WEIGHTS}
    merges = {name: RegionalMerge(SHAPES, cfg.sections().sync_codec, 2) for name in REGIONS}
    outcomes, messages, full = [], [s.full_weights() for s in servers], True
    for r in range(rounds):
        receive(servers, ranks, messages, full)
        poisoned = poisoned_at.get(r, ()) if poisoned_at else ()
        sends = replica_sends(cfg, ranks, r, poisoned)
        if layout == "flat":
            by_server = [[Contribution(rid, [sends[rid][s]], WEIGHTS[rid]) for rid in sends] for s in range(2)]
            messages = sync(servers, by_server, list(sends))
        else:
            regional = {}
            for i, (name, members) in enumerate(REGIONS.items()):
                by_server = [[Contribution(rid, [sends[rid][s]], WEIGHTS[rid]) for rid in members] for s in range(2)]
                regional[100 + i] = merges[name].merge(0, by_server)
            outcomes.append(regional)
            by_server = [
                [Contribution(rid, [m.buffers[s]], m.weight) for rid, m in regional.items() if m.buffers]
                for s in range(2)
            ]
            messages = sync(servers, by_server, [rid for rid, m in regional.items() if m.buffers])
        full = False
    return weights_of(servers), outcomes


def receive(servers, ranks: dict, messages: list, full: bool) -> None:
    """Every replica takes in the latest global weights (everything, the first time)."""
    version = servers[0].sync_version()
    for rank in ranks.values():
        decision = rank.sync.decide_load(version, fragment_message=not full)
        if decision == "full":
            rank.sync.apply([s.full_weights() for s in servers], rank.local)
            decision = rank.sync.decide_load(version, fragment_message=not full)
        if decision == "apply":
            rank.sync.apply(messages, rank.local)


def max_diff(a, b) -> float:
    return max(float(np.abs(a[n] - b[n]).max()) for n in a)


def test_the_home_mean_of_regional_means_is_the_flat_mean():
    flat, _ = run("flat")
    regions, outcomes = run("regions")
    assert max_diff(flat, regions) <= 1e-6
    assert [m.weight for m in outcomes[0].values()] == [30.0, 75.0]  # each region by its replicas' tokens
    assert all(len(m.buffers) == 2 for m in outcomes[0].values())  # one message per home server


def test_a_nan_replica_is_left_out_inside_its_region_and_the_sum_still_holds():
    flat, _ = run("flat", poisoned_at={1: [3]})
    regions, outcomes = run("regions", poisoned_at={1: [3]})
    us = outcomes[1][101]
    assert us.accepted == [2] and us.weight == 30.0 and "non-finite" in str(us.rejected[3]).lower()
    assert max_diff(flat, regions) <= 1e-6


def test_a_region_whose_every_replica_is_rejected_sends_nothing():
    _, outcomes = run("regions", rounds=1, poisoned_at={0: [0, 1]})
    eu = outcomes[0][100]
    assert eu.buffers == [] and eu.weight == 0.0 and sorted(eu.rejected) == [0, 1]


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_with_a_lossy_wan_codec_the_residual_keeps_what_the_messages_did_not_carry(codec):
    cfg = make_config(num_param_servers=1, pseudo_grad_compression=codec, error_feedback=True)
    merge = RegionalMerge(SHAPES, cfg.sections().sync_codec, 1)
    plain = make_config(num_param_servers=1)
    ranks = {rid: Rank(plain, SHAPES, 1, 0, initial_weights()) for rid in (0, 1)}
    servers = home(plain)
    receive(servers, ranks, [s.full_weights() for s in servers], full=True)
    carried = {n: torch.zeros(s) for n, s in SHAPES.items()}
    meant = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for r in range(4):
        sends = replica_sends(plain, ranks, r)  # each from the same anchor: the pseudo-gradient grows
        message = merge.merge(0, [[Contribution(rid, [sends[rid][0]], WEIGHTS[rid]) for rid in ranks]])
        pieces, _ = compression.unpack_pieces(message.buffers[0], list(SHAPES))
        for n, (start, t) in pieces.items():
            carried[n] += t.float()
        for rid in ranks:
            got, _ = compression.unpack_pieces(sends[rid][0], list(SHAPES))
            for n, (start, t) in got.items():
                meant[n] += t.float() * WEIGHTS[rid] / sum(WEIGHTS[i] for i in ranks)
    for n in SHAPES:
        held = merge.ledger.residual.get(n, torch.zeros(SHAPES[n]))
        assert torch.allclose(carried[n] + held, meant[n], atol=1e-5), n
    assert any(float(t.abs().max()) > 0 for t in merge.ledger.residual.values())  # something was held back


@pytest.mark.parametrize("applied", [True, False])
def test_a_message_the_home_did_not_apply_goes_back_into_the_residual(applied):
    cfg = make_config(num_param_servers=1, pseudo_grad_compression="topk")  # topk: error feedback always on
    merge = RegionalMerge(SHAPES, cfg.sections().sync_codec, 1)
    plain = make_config(num_param_servers=1)
    ranks = {rid: Rank(plain, SHAPES, 1, 0, initial_weights()) for rid in (0, 1)}
    servers = home(plain)
    receive(servers, ranks, [s.full_weights() for s in servers], full=True)
    sends = replica_sends(plain, ranks, 0)
    meant = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for rid in ranks:
        for n, (_, t) in compression.unpack_pieces(sends[rid][0], list(SHAPES))[0].items():
            meant[n] += t.float().view(SHAPES[n]) * WEIGHTS[rid] / (WEIGHTS[0] + WEIGHTS[1])
    message = merge.merge(0, [[Contribution(rid, [sends[rid][0]], WEIGHTS[rid]) for rid in ranks]], attempt=7)
    carried = {
        n: t.float().view(SHAPES[n])
        for n, (_, t) in compression.unpack_pieces(message.buffers[0], list(SHAPES))[0].items()
    }
    merge.ledger.settle({7: applied}, merge.read)
    for n in SHAPES:
        held = merge.ledger.residual.get(n, torch.zeros(SHAPES[n])).view(SHAPES[n])
        # applied: the residual is what the message left out; not applied: everything meant
        want = meant[n] - carried.get(n, 0) if applied else meant[n]
        assert torch.allclose(held, want, atol=1e-5), n
    assert merge.ledger.unsettled == {}
    merge.ledger.settle({7: False}, merge.read)  # a verdict heard twice settles nothing more
    assert all(
        torch.allclose(
            merge.ledger.residual.get(n, torch.zeros(SHAPES[n])).view(SHAPES[n]),
            meant[n] - (carried.get(n, 0) if applied else 0),
            atol=1e-5,
        )
        for n in SHAPES
    )


def test_a_saved_state_taken_up_by_a_new_merge_sends_what_the_old_one_would(tmp_path):
    cfg = make_config(num_param_servers=1, pseudo_grad_compression="topk")
    plain = make_config(num_param_servers=1)
    ranks = {rid: Rank(plain, SHAPES, 1, 0, initial_weights()) for rid in (0, 1)}
    servers = home(plain)
    receive(servers, ranks, [s.full_weights() for s in servers], full=True)
    first, second = replica_sends(plain, ranks, 0), replica_sends(plain, ranks, 1)
    old = RegionBooks(RegionalMerge(SHAPES, cfg.sections().sync_codec, 1), str(tmp_path), "run", True, None)
    old.merge_period(0, [[Contribution(rid, [first[rid][0]], WEIGHTS[rid]) for rid in ranks]], attempt=1)
    old.save()  # safetensors and JSON: nothing is unpickled when it is taken up
    assert not list(tmp_path.glob("*.pt")) and list(tmp_path.glob("region_state*.safetensors"))
    new = RegionBooks(RegionalMerge(SHAPES, cfg.sections().sync_codec, 1), str(tmp_path), "run", True, None)
    assert new.load() is not None
    for books in (old, new):
        books.settle({1: False})
    a, b = (
        books.merge_period(0, [[Contribution(rid, [second[rid][0]], WEIGHTS[rid]) for rid in ranks]], attempt=2)
        for books in (old, new)
    )
    assert bytes(a.buffers[0]) == bytes(b.buffers[0])
