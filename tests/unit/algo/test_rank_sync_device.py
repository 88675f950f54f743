"""RankSync's device path (on_device=True, run here with CPU kernels) against its host path:
over several syncs of two servers and two fragments, with overlap's merge, compressed weights
messages, decayed error feedback and a send the servers did not apply, both send the same
bytes and hold the same anchor, residual and local rows. tests/gpu runs the same on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import CODECS
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.algo.sharding import shard_rows

SHAPES = {
    "embed": (37, 12),
    "layers.0.w": (19, 12),
    "layers.0.norm": (12,),
    "layers.1.w": (19, 12),
    "scale": (),
    "head": (37, 12),
}
NAMES = list(SHAPES)


def full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def mine(tensors: dict, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's rows of each tensor (every rank holds a 0-d one)."""
    return {n: (t[shard_rows(t.shape[0], world_size, rank)] if t.dim() else t).clone() for n, t in tensors.items()}


def weights_message(tensors: dict, version: int, fragment=None, codec="none", delta=False) -> np.ndarray:
    """A server's message of every row of ``tensors`` (of one fragment's rows when given)."""
    shapes = {n: t.shape for n, t in tensors.items()}
    target = partition.whole(shapes) if fragment is None else partition.fragments(shapes, 2)[fragment]
    meta = {"version": version, **({"fragment": fragment} if fragment is not None else {})}
    if delta:
        meta["delta"] = True
    pieces = {n: partition.take(tensors[n], iv) for n, iv in target.items()}
    buf, _ = compression.pack_pieces(pieces, {n: iv[0] for n, iv in target.items()}, NAMES, codec, meta, block=16)
    return buf


def pair(codec: str, **options) -> tuple[RankSync, RankSync]:
    """(host path, device path) syncs of rank 1 of 2, otherwise alike."""
    args = dict(servers=2, fragments=2, codec=codec, block=16, fraction=0.25, **options)
    host, dev = RankSync(SHAPES, 2, 1, **args), RankSync(SHAPES, 2, 1, **args)
    host.on_device, dev.on_device = False, True
    return host, dev


def assert_same_state(host: RankSync, dev: RankSync, local_host: dict, local_dev: dict) -> None:
    for name in NAMES:
        assert torch.equal(host.anchor[name], dev.anchor[name]), name
        assert torch.equal(local_host[name], local_dev[name]), name
    assert host.ledger.residual.keys() == dev.ledger.residual.keys()
    for name, r in host.ledger.residual.items():
        assert torch.equal(r, dev.ledger.residual[name]), name
    assert host.versions == dev.versions


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("weights", ["none", "int8"])
def test_the_device_path_sends_and_holds_what_the_host_path_does(codec, weights):
    host, dev = pair(codec, error_feedback=True, overlap=True, decay=0.5)
    start = full(1)
    local = {"host": mine(start, 2, 1), "dev": mine(start, 2, 1)}
    for sync, rows in ((host, local["host"]), (dev, local["dev"])):
        sync.apply([weights_message(start, 0)] * 2, rows)
    assert_same_state(host, dev, local["host"], local["dev"])
    for version in range(1, 5):
        fragment = version % 2
        step = mine(full(10 + version), 2, 1)
        sent = {}
        for key, sync in (("host", host), ("dev", dev)):
            for n in NAMES:
                local[key][n].sub_(0.05 * step[n])
            sent[key] = sync.outgoing(fragment, local[key], attempt=version)
        assert all(isinstance(b, np.ndarray) for b in sent["dev"])
        for a, b in zip(sent["host"], sent["dev"]):
            assert np.array_equal(a, b)
        # The servers applied sync 2's messages but not sync 3's: those go back to the residual.
        if version >= 2:
            verdict = {version - 1: version - 1 != 3}
            host.settle(verdict)
            dev.settle(verdict)
        new = full(20 + version)
        delta = weights != "none"
        message = weights_message(new, version, fragment, codec=weights, delta=delta)
        host.apply([message] * 2, local["host"], merge=True)
        dev.apply([message] * 2, local["dev"], merge=True)
        assert_same_state(host, dev, local["host"], local["dev"])


def test_a_checkpoints_residual_is_used_where_the_device_path_works():
    host, dev = pair("int8", error_feedback=True)
    start = full(2)
    local = mine(start, 2, 1)
    dev.apply([weights_message(start, 0)] * 2, local)
    saved = {n: torch.full(t.shape, 0.25) for n, t in local.items()}
    dev.load_state_dict({"residual": saved})
    dev.outgoing(0, local)
    assert set(dev.ledger.residual) == set(NAMES)
    assert all(dev.ledger.residual[n] is not saved[n] for n in NAMES)  # cloned on load, never aliased


def test_the_device_path_and_a_host_anchor_exclude_each_other():
    sync = RankSync(SHAPES, 1, 0, anchor_on_host=True)
    sync.on_device = True
    with pytest.raises(ValueError, match="anchor_on_host"):
        sync.outgoing(0, mine(full(0), 1, 0))


def test_on_the_host_the_default_is_the_host_path():
    """A CPU rank's sync takes the host path unless told otherwise (its bytes are the same,
    and the host path is the one tuned for the host)."""
    sync = RankSync(SHAPES, 1, 0)
    assert not sync._works_on_device(torch.device("cpu"))
    assert sync._works_on_device(torch.device("cuda", 0))
    assert not RankSync(SHAPES, 1, 0, anchor_on_host=True)._works_on_device(torch.device("cuda", 0))
