"""Row sharding of parameters across a replica's FSDP ranks, as plain tensor functions.

FSDP2 (``fully_shard``) shards every parameter along dim 0 the way ``torch.chunk`` does:
chunks of ``ceil(rows / world_size)`` rows, the last ones shorter or empty. Each rank
sends the pseudo-gradient of its own rows, and the parameter server reassembles full
tensors from the pieces, so no process inside a replica ever gathers the whole model.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch


def shard_rows(rows: int, world_size: int, rank: int) -> slice:
    """The rows of a ``rows``-row parameter that ``rank`` of ``world_size`` holds.

    Args:
        rows: size of dim 0 (0-d tensors are treated as one row held by every rank).
        world_size: ranks in the replica.
        rank: this rank, ``0 <= rank < world_size``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    chunk = -(-rows // world_size)  # ceil
    start = min(rank * chunk, rows)
    return slice(start, min(start + chunk, rows))


def local_rows(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The view of ``full`` that ``rank`` holds (the whole tensor for 0-d or one rank)."""
    if full.dim() == 0 or world_size == 1:
        return full
    return full[shard_rows(full.shape[0], world_size, rank)]


def assemble(shards: Sequence[Mapping[str, np.ndarray]], shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Full fp32 tensors from every rank's row shards, in rank order.

    Args:
        shards: one mapping per rank, name -> that rank's rows (numpy or torch).
        shapes: name -> full shape, to check the pieces cover the tensor exactly.

    Raises:
        ValueError: a rank's shard is missing a name or the rows do not add up.
    """
    out = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        pieces = []
        for r, shard in enumerate(shards):
            if name not in shard:
                raise ValueError(f"rank {r} sent no shard for '{name}'")
            pieces.append(torch.as_tensor(shard[name]))
        if len(shape) == 0 or len(pieces) == 1:
            full = pieces[0]
        else:
            full = torch.cat(pieces, dim=0)
        if tuple(full.shape) != shape:
            raise ValueError(f"shards of '{name}' make shape {tuple(full.shape)}, want {shape}")
        out[name] = full.float()
    return out
