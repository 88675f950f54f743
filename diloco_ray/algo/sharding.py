"""Row sharding of parameters across a replica's FSDP ranks, as plain tensor functions.

FSDP2 (``fully_shard``) shards every parameter along dim 0 the way ``torch.chunk`` does:
chunks of ``ceil(rows / world_size)`` rows, the last ones shorter or empty. Each rank
sends the pseudo-gradient of its own rows (see :mod:`diloco_ray.algo.partition`), so no process
inside a replica ever gathers the whole model.
"""

from __future__ import annotations


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
