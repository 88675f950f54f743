"""Unit tests for diloco_ray.sharding: torch.chunk-compatible row shards and reassembly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.sharding import assemble, local_rows, shard_rows

COMBOS = [(rows, ws) for rows in (0, 1, 2, 3, 4, 5, 7, 8, 10, 13, 16, 31, 100) for ws in (1, 2, 3, 4, 5, 8)]


@pytest.mark.parametrize("rows, ws", COMBOS)
def test_shard_rows_matches_torch_chunk(rows, ws):
    x = torch.arange(rows * 2).reshape(rows, 2)
    chunks = torch.chunk(x, ws, dim=0) if rows else ()
    for rank in range(ws):
        got = x[shard_rows(rows, ws, rank)]
        want = chunks[rank] if rank < len(chunks) else x[rows:]  # missing chunks are empty
        assert torch.equal(got, want), (rows, ws, rank)


@pytest.mark.parametrize("rows, ws", COMBOS)
def test_shard_rows_partition(rows, ws):
    slices = [shard_rows(rows, ws, r) for r in range(ws)]
    covered = [i for s in slices for i in range(s.start, s.stop)]
    assert covered == list(range(rows))


def test_shard_rows_hand_values():
    assert [shard_rows(5, 4, r) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    assert [shard_rows(2, 4, r) for r in range(4)] == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    assert [shard_rows(1, 3, r) for r in range(3)] == [slice(0, 1), slice(1, 1), slice(1, 1)]
    assert shard_rows(10, 1, 0) == slice(0, 10)


@pytest.mark.parametrize("rank, ws", [(-1, 2), (2, 2), (0, 0)])
def test_shard_rows_bad_rank(rank, ws):
    with pytest.raises(ValueError):
        shard_rows(4, ws, rank)


def test_local_rows_0d_and_single_rank_return_whole_tensor():
    s = torch.tensor(3.5)
    for ws in (1, 2, 4):
        for rank in range(ws):
            assert local_rows(s, ws, rank) is s
    x = torch.randn(5, 3)
    assert local_rows(x, 1, 0) is x


def test_local_rows_is_a_view_of_the_right_rows():
    x = torch.arange(14.0).reshape(7, 2)
    pieces = [local_rows(x, 3, r) for r in range(3)]
    assert [p.shape[0] for p in pieces] == [3, 3, 1]
    assert torch.equal(pieces[2], torch.tensor([[12.0, 13.0]]))
    pieces[1][0, 0] = -1.0  # a view: writes reach the full tensor
    assert x[3, 0] == -1.0


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 6])
def test_assemble_round_trip(ws):
    g = torch.Generator().manual_seed(ws)
    full = {
        "w2d": torch.randn(7, 5, generator=g),
        "b1d": torch.randn(5, generator=g),
        "tiny": torch.randn(2, 3, generator=g),
        "scalar": torch.randn((), generator=g),
    }
    shards = [{n: local_rows(t, ws, r).clone() for n, t in full.items()} for r in range(ws)]
    out = assemble(shards, {n: t.shape for n, t in full.items()})
    assert set(out) == set(full)
    for n, t in full.items():
        assert out[n].dtype == torch.float32
        assert torch.equal(out[n], t), n


def test_assemble_accepts_numpy_and_casts_to_fp32():
    full = np.arange(30, dtype=np.float64).reshape(10, 3)
    shards = [{"w": full[shard_rows(10, 4, r)]} for r in range(4)]
    out = assemble(shards, {"w": (10, 3)})
    assert out["w"].dtype == torch.float32
    assert torch.equal(out["w"], torch.arange(30, dtype=torch.float32).reshape(10, 3))
    out = assemble([{"s": np.float32(2.5)}, {"s": np.float32(2.5)}], {"s": ()})
    assert out["s"].shape == () and out["s"].item() == 2.5


def test_assemble_missing_name():
    with pytest.raises(ValueError, match=r"rank 1 .*'w'"):
        assemble([{"w": torch.zeros(2, 2)}, {}], {"w": (4, 2)})


@pytest.mark.parametrize("shape", [(5, 2), (3, 2), (4, 3), (8,)])
def test_assemble_wrong_total_shape(shape):
    shards = [{"w": torch.zeros(2, 2)}, {"w": torch.zeros(2, 2)}]
    with pytest.raises(ValueError, match="'w'"):
        assemble(shards, {"w": shape})


def test_assemble_only_requested_names():
    shards = [{"a": torch.ones(1), "extra": torch.ones(3)}, {"a": torch.ones(1)}]
    out = assemble(shards, {"a": (2,)})
    assert list(out) == ["a"] and torch.equal(out["a"], torch.ones(2))
