"""How a rank takes in the global weights (no Ray, no model): the period's messages applied
once, a gap closed by a full load from the servers first, an overlapped merge's messages
waiting for the end of the steps, and a rank that forgot its versions reloading everything."""

from __future__ import annotations

import numpy as np
import torch

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.runtime.messages import PeriodId, SyncPeriod
from diloco_ray.runtime.rank_weights import receive_weights

SHAPES = {"w": (6, 4), "b": (6,)}


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def message(tensors: dict, version: int, fragment=None) -> np.ndarray:
    """A server's message of ``tensors``: every row, or fragment ``fragment``'s of two."""
    rows = partition.whole(SHAPES) if fragment is None else partition.fragments(SHAPES, 2)[fragment]
    meta = {"version": version, **({} if fragment is None else {"fragment": fragment})}
    pieces = {n: partition.take(tensors[n], iv) for n, iv in rows.items()}
    return compression.pack_pieces(pieces, {n: iv[0] for n, iv in rows.items()}, list(SHAPES), Codec("none"), meta)[0]


class Server:
    """A stand-in server actor: ``full_weights.remote()`` hands over its full message."""

    def __init__(self, full: np.ndarray):
        self.full, self.asked = full, 0
        self.full_weights = self

    def remote(self) -> np.ndarray:
        self.asked += 1
        return self.full


def rank() -> tuple[RankSync, list, dict]:
    params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in SHAPES.items()]
    return RankSync(SHAPES, 1, 0, fragments=2), params, dict(params)


def period(version: int, messages: list, server: Server | None = None, full: bool = False) -> SyncPeriod:
    servers = [server] if server is not None else []
    return SyncPeriod(PeriodId(0, 0, 0), [], messages=messages, full=full, version=version, servers=servers)


def test_a_held_version_is_skipped_and_the_next_applied():
    sync, params, local = rank()
    first = message(weights(1), 0)
    assert receive_weights(sync, params, period(0, [first], full=True), merge=False) == len(first)
    assert torch.equal(local["w"].detach(), weights(1)["w"])
    assert receive_weights(sync, params, period(0, [first], full=True), merge=False) == 0
    fragment = message(weights(2), 1, fragment=0)
    assert receive_weights(sync, params, period(1, [fragment]), merge=False) == len(fragment)
    assert sync.versions == [1]


def test_a_gap_loads_the_servers_full_weights_first_then_the_message():
    sync, params, local = rank()
    server = Server(message(weights(1), 1))
    fragment = message(weights(2), 2, fragment=1)
    got = receive_weights(sync, params, period(2, [fragment], server), merge=False)
    assert server.asked == 1 and got == len(server.full) + len(fragment) and sync.versions == [2]
    lo, hi = partition.fragments(SHAPES, 2)[1]["w"]
    assert torch.equal(local["w"].detach()[lo:hi], weights(2)["w"][lo:hi])
    assert torch.equal(local["w"].detach()[:lo], weights(1)["w"][:lo])


def test_full_only_leaves_the_message_for_the_merge_and_forgetting_reloads():
    sync, params, local = rank()
    lo = partition.fragments(SHAPES, 2)[1]["w"][0]
    server = Server(message(weights(1), 1))
    fragment = message(weights(2), 2, fragment=0)
    job = period(2, [fragment], server)
    assert receive_weights(sync, params, job, merge=False, full_only=True) == len(server.full)
    assert sync.versions == [1] and torch.equal(local["b"].detach(), weights(1)["b"])
    assert receive_weights(sync, params, job, merge=True) == len(fragment) and sync.versions == [2]
    sync.forget_versions()  # a restored server, or a rejected pseudo-gradient
    server.full = message(weights(4), 2)  # the servers' weights now
    receive_weights(sync, params, period(3, [message(weights(3), 3, fragment=1)], server), merge=False)
    assert server.asked == 2 and sync.versions == [3]
    assert torch.equal(local["w"].detach()[:lo], weights(4)["w"][:lo])  # every row reloaded
