"""Unit tests for diloco_ray.algo.sharding: torch.chunk-compatible row shards and reassembly."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo.sharding import shard_rows

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
