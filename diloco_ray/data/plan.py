"""Which replica reads what: the data plan, as pure functions over integers.

Rows come from :mod:`diloco_ray.data.sources` and become token samples in
:mod:`diloco_ray.data.samples`; this module decides their order. The training stream is an
endless sequence of sample indices, one seeded permutation per epoch. The parameter
server owns a :class:`DataCursor` into it: a frontier, plus ranges that were handed out
but never applied (a replica died, was late, or was rejected). Each round, replica slot
``s`` gets the ``s``-th batch of ranges: returned ranges first, then fresh ones from the
frontier. Only the ranges of applied replicas are committed, so with any history of
joins, drops, retries and resumes every stream position is trained on exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from diloco_ray.config.sections import DataSection


def epoch_permutation(num_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the ``num_blocks`` training blocks."""
    return np.random.default_rng([seed, epoch]).permutation(num_blocks)


def stream_indices(start: int, count: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block indices at positions ``[start, start + count)`` of the endless training stream."""
    positions = np.arange(start, start + count)
    epochs = positions // num_blocks
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(num_blocks, seed, int(epoch))[positions[mask] % num_blocks]
    return out


Range = tuple[int, int]  # (start, count) of stream positions
GROUP_WINDOW_BATCHES = 50  # group_by_length sorts windows of this many batches


@dataclass
class DataCursor:
    """Where the training stream stands.

    Args:
        frontier: every position before it has been handed out at least once.
        returned: ranges handed out but not applied, to be handed out again first
            (sorted, non-overlapping).
    """

    frontier: int = 0
    returned: list[Range] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"frontier": self.frontier, "returned": [list(r) for r in self.returned]}

    @classmethod
    def from_dict(cls, d: dict) -> "DataCursor":
        return cls(int(d["frontier"]), [(int(s), int(c)) for s, c in d["returned"]])


def _normalise(ranges: list[Range]) -> list[Range]:
    """Sorted, with adjacent or overlapping ranges merged and empty ones dropped."""
    out: list[list[int]] = []
    for start, count in sorted(r for r in ranges if r[1] > 0):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][0] + out[-1][1], start + count) - out[-1][0]
        else:
            out.append([start, count])
    return [(s, c) for s, c in out]


def plan_round(cursor: DataCursor, sizes: list[int]) -> list[list[Range]]:
    """The ranges each replica trains on this round (``sizes[i]`` positions for slot ``i``):
    returned ranges first, in order, then fresh positions from the frontier."""
    returned = list(cursor.returned)
    frontier = cursor.frontier
    plans = []
    for size in sizes:
        mine, need = take_from(returned, size)
        if need:
            mine.append((frontier, need))
            frontier += need
        plans.append(_normalise(mine))
    return plans


def take_from(ranges: list[Range], need: int) -> tuple[list[Range], int]:
    """Up to ``need`` positions from the front of ``ranges``, which are consumed in place:
    the ranges taken, in order, and how many positions are still needed."""
    mine = []
    while need and ranges:
        start, count = ranges[0]
        take = min(need, count)
        mine.append((start, take))
        need -= take
        ranges[0] = (start + take, count - take)
        if ranges[0][1] == 0:
            ranges.pop(0)
    return mine, need


def commit_round(
    cursor: DataCursor, plans: list[list[Range]], applied: list[bool], unused: Optional[list[list[Range]]] = None
) -> DataCursor:
    """The cursor after a round in which ``plans[i]`` was applied iff ``applied[i]``.

    Everything handed out is taken off the cursor; what was not applied goes back to
    ``returned``, so the next round hands it out again. ``unused[i]`` (with a time budget,
    the part of an applied plan its replica had no time to train on) goes back too.
    """
    handed = [r for plan in plans for r in plan]
    fresh_end = max([s + c for s, c in handed if s + c > cursor.frontier] + [cursor.frontier])
    leftover = _subtract(cursor.returned, handed)
    back = [r for plan, ok in zip(plans, applied) if not ok for r in plan]
    back += [r for rest, ok in zip(unused or [], applied) if ok for r in rest]
    return DataCursor(fresh_end, _normalise(leftover + back))


def reserve(cursor: DataCursor, per_replica: int) -> tuple[list[Range], DataCursor]:
    """Decoupled mode: take one replica's plan off the cursor now (returned ranges first,
    then fresh ones), while others are still training on theirs. The plan is in flight
    until it is merged (its data is then trained) or given back (:func:`give_back`)."""
    plan = plan_round(cursor, [per_replica])[0]
    return plan, commit_round(cursor, [plan], [True])


def give_back(cursor: DataCursor, ranges: list[Range]) -> DataCursor:
    """The cursor with ``ranges`` (reserved, never trained) handed out again first."""
    return DataCursor(cursor.frontier, _normalise(list(cursor.returned) + list(ranges)))


def trained_part(plan: list[Range], unused: list[Range]) -> list[Range]:
    """The ranges of ``plan`` its replica trained on: all but ``unused``."""
    return _subtract(plan, unused)


def ranges_of(positions: np.ndarray) -> list[Range]:
    """Stream positions (any order, no repeats) as sorted, merged ranges."""
    if not len(positions):
        return []
    ordered = np.sort(np.asarray(positions, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    return [(int(run[0]), len(run)) for run in np.split(ordered, breaks)]


def sequences_per_step(data: DataSection) -> int:
    """Sequences one inner step of a replica trains on (every rank, every micro-batch)."""
    return data.batch_size * data.grad_accum * data.ranks_per_replica


def unused_ranges(positions_in_order: np.ndarray, steps_done: int, data: DataSection) -> list[Range]:
    """The positions of a round's plan that a replica which ran ``steps_done`` inner steps
    did not train on: a replica reads its plan step by step (:func:`split_for_rank`), so
    those are the ones after the first ``steps_done`` steps' worth, in its order."""
    return ranges_of(positions_in_order[steps_done * sequences_per_step(data) :])


def _subtract(ranges: list[Range], taken: list[Range]) -> list[Range]:
    """The parts of ``ranges`` not covered by ``taken`` (interval arithmetic)."""
    out = []
    for start, count in ranges:
        pieces = [(start, start + count)]
        for t_start, t_count in taken:
            t_end = t_start + t_count
            pieces = [
                piece
                for a, b in pieces
                for piece in (
                    [(a, b)]
                    if t_end <= a or t_start >= b
                    else [p for p in ((a, min(b, t_start)), (max(a, t_end), b)) if p[1] > p[0]]
                )
            ]
        out.extend((a, b - a) for a, b in pieces)
    return _normalise(out)


def plan_indices(plan: list[Range], num_blocks: int, seed: int) -> np.ndarray:
    """Block indices of a replica's plan, in order."""
    if not plan:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([stream_indices(s, c, num_blocks, seed) for s, c in plan])


def group_by_length(indices: np.ndarray, lengths: np.ndarray, window: int) -> np.ndarray:
    """Reorder ``indices`` so that each run of ``window`` is sorted by length (longest
    first), as transformers' ``group_by_length`` does with "megabatches": batches cut
    from a window then pad little. The set of indices does not change."""
    out = indices.copy()
    for start in range(0, len(out), window):
        chunk = out[start : start + window]
        out[start : start + window] = chunk[np.argsort(-lengths[chunk], kind="stable")]
    return out


def plan_order(
    plan: list[Range], data: DataSection, num_blocks: int, lengths: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(sample indices, their stream positions) of a plan in the order its replica reads
    them: the plan's order, or with ``group_by_length`` (and ``lengths``) each window
    sorted by length (:func:`group_by_length`)."""
    indices = plan_indices(plan, num_blocks, data.seed)
    positions = plan_positions(plan)
    if data.group_by_length and lengths is not None:
        order = group_by_length(np.arange(len(indices)), lengths[indices], GROUP_WINDOW_BATCHES * data.batch_size)
        indices, positions = indices[order], positions[order]
    return indices, positions


def rank_batches(
    plan: list[Range], data: DataSection, rank: int, num_blocks: int, lengths: np.ndarray | None = None
) -> list[list[np.ndarray]]:
    """The micro-batches one rank trains on in one round: ``[step][micro] -> sample indices``
    (the plan in :func:`plan_order`, cut by :func:`split_for_rank`)."""
    return split_for_rank(plan_order(plan, data, num_blocks, lengths)[0], data, rank)


def split_for_rank(indices: np.ndarray, data: DataSection, rank: int) -> list[list[np.ndarray]]:
    """Rank ``rank``'s share of a replica's ordered samples, as ``[step][micro]``.

    A replica's samples are consumed step by step; inside a step, micro-batch ``m`` of
    rank ``j`` is the ``(m * ranks + j)``-th run of ``batch_size`` samples. One replica
    with one rank therefore reads its plan in order, which makes DiLoCo with one replica
    comparable batch for batch with a plain training loop.
    """
    if isinstance(data.ranks_per_replica, list):
        raise TypeError("ranks_per_replica is a list: cut the plan of one replica (TrainerConfig.for_replica)")
    ranks, bs, accum = data.ranks_per_replica, data.batch_size, data.grad_accum
    needed = data.max_steps * sequences_per_step(data)
    if len(indices) != needed:
        raise ValueError(f"plan holds {len(indices)} positions, a round needs {needed}")
    steps = []
    for t in range(data.max_steps):
        micro = []
        for m in range(accum):
            offset = ((t * accum + m) * ranks + rank) * bs
            micro.append(indices[offset : offset + bs])
        steps.append(micro)
    return steps


def plan_positions(plan: list[Range]) -> np.ndarray:
    """The stream positions of a plan, in order (what a streamed data set is read at)."""
    if not plan:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, s + c) for s, c in plan])


def eval_batches_for_rank(
    num_eval_blocks: int, eval_batches: int, batch_size: int, rank: int, ranks: int
) -> list[np.ndarray]:
    """The eval batches rank ``rank`` scores: a fixed prefix of the eval split, so every
    round's eval loss is measured on the same sequences."""
    out = []
    for b in range(rank, eval_batches, ranks):
        idx = np.arange(b * batch_size, min((b + 1) * batch_size, num_eval_blocks))
        if len(idx):
            out.append(idx)
    return out
