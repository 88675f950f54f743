"""Where RankSync's work runs (on_device, anchor_on_host), on the host: a checkpoint's
residual is used where the work runs, the device path and a host anchor exclude each other,
and a CPU rank works on the host by default. The codec is one path on every device
(tests/unit/algo/test_message_paths.py); tests/gpu holds a GPU rank's sync to the host's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import Codec
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
    buf, _ = compression.pack_pieces(pieces, {n: iv[0] for n, iv in target.items()}, NAMES, Codec(codec, 16), meta)
    return buf


def pair(codec: str, **options) -> tuple[RankSync, RankSync]:
    """(host path, device path) syncs of rank 1 of 2, otherwise alike."""
    args = dict(servers=2, fragments=2, codec=Codec(codec, 16, 0.25), **options)
    host, dev = RankSync(SHAPES, 2, 1, **args), RankSync(SHAPES, 2, 1, **args)
    host.on_device, dev.on_device = False, True
    return host, dev


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
