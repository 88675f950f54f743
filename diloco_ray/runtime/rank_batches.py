"""A rank's data: the job's tokens, and the micro-batches of its share of each round's data plan.

The server hands each replica stream ranges for the round (:mod:`diloco_ray.data.plan`);
:class:`RankBatches` turns them into this rank's ``[step][micro]`` sample indices once per
round (its sync periods share them) and yields the batches in order, cut by DataLoader
workers when ``num_workers`` > 0 so batching overlaps the steps. A streamed data set is
read at the plan's positions first. With ``inner_time_s`` a replica reads only as many
steps as fit its time budget, and says which ranges it left for the cursor to hand out again.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from diloco_ray.config.sections import DataSection
from diloco_ray.data import plan as data_plan
from diloco_ray.data import samples


def load_tokens(data: DataSection, tokenizer, shared: list | None) -> samples.TokenData:
    """The job's tokens as this rank reads them: a stream it reads round by round
    (``streaming``), the driver's tokenising task's arrays (``shared``: ``[ref]``), or, with
    neither, tokenised here."""
    if data.streaming:
        reader, evals = samples.open_stream(data, tokenizer)
        empty = samples.Samples(*(np.zeros((0, data.seq_len), dtype=np.int64),) * 2, np.zeros(0, dtype=np.int64))
        return samples.TokenData(empty, evals, reader)
    if shared is None:
        return samples.load_token_data(data, tokenizer)
    import ray

    # Read-only arrays in the node's object store, shared by its ranks. No deadline
    # here: the driver bounds a replica's whole start (placement_timeout_s).
    return ray.get(shared[0])


class RankBatches:
    """One rank's view of the training data, round by round.

    Args:
        data: the job's data section as this replica sees it: the order (``seed``,
            ``group_by_length``), the batch shape (``batch_size``, ``grad_accum``, its
            ``ranks_per_replica``, ``max_steps``), ``dynamic_batch`` and ``num_workers``.
        tokens: the job's tokens (:func:`load_tokens`).
        rank: this rank's index inside the replica.
        world_size: ranks in the replica (their agreement on a time budget is one all-reduce).
        device: where that all-reduce's flag lives.
    """

    def __init__(self, data: DataSection, tokens: samples.TokenData, rank: int, world_size: int, device: torch.device):
        self.data, self.tokens = data, tokens
        self.rank, self.world_size, self.device = rank, world_size, device
        self._cached: tuple | None = None  # (round key, samples, [step][micro], positions)

    def for_round(self, round_index: int, plan: list):
        """(samples, ``[step][micro] -> indices``) for this rank's round, computed once per
        round (a round's sync periods share it)."""
        key = (round_index, tuple(map(tuple, plan)))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, *self._plan_batches(plan))
        return self._cached[1], self._cached[2]

    def unused_after(self, steps_done: int) -> list:
        """The ranges of the current round's plan that its first ``steps_done`` steps did
        not read (every rank of the replica computes the same)."""
        return data_plan.unused_ranges(self._cached[3], steps_done, self.data)

    def another_step_fits(self, started: float, done: int, budget: float | None) -> bool:
        """Whether one more inner step fits in ``budget`` seconds from ``started`` (always,
        with no budget), judged by this rank's mean step time so far. The replica's ranks
        agree (the slowest decides), since they step together."""
        if budget is None:
            return True
        elapsed = time.perf_counter() - started
        fits = elapsed + elapsed / done <= budget
        if self.world_size == 1:
            return fits
        import torch.distributed as dist

        flag = torch.tensor([int(fits)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _plan_batches(self, plan: list):
        """(samples to cut from, ``[step][micro] -> indices``, stream positions in the order
        the replica reads them) for the ranges ``plan``; a streamed data set is read at the
        plan's positions first."""
        stream = self.tokens.stream
        if stream is None:
            train = self.tokens.train
            indices, positions = data_plan.plan_order(plan, self.data, len(train), train.lengths)
            return train, data_plan.split_for_rank(indices, self.data, self.rank), positions
        positions = data_plan.plan_positions(plan)
        train = stream.read(positions)
        order = np.arange(len(train))
        if self.data.group_by_length:
            window = data_plan.GROUP_WINDOW_BATCHES * self.data.batch_size
            order = data_plan.group_by_length(order, train.lengths, window)
        return train, data_plan.split_for_rank(order, self.data, self.rank), positions[order]

    def micro_batches(self, source, steps: list, first: int):
        """``(step, micro, batch)`` in order from step ``first`` on, cut from ``source``;
        by DataLoader workers when ``num_workers`` > 0, so batching overlaps the steps."""
        items = [(t, m, idx) for t in range(first, len(steps)) for m, idx in enumerate(steps[t])]
        dynamic = self.data.dynamic_batch
        if self.data.num_workers == 0:
            for t, m, idx in items:
                yield t, m, source.batch(idx, dynamic)
            return
        loader = torch.utils.data.DataLoader(
            _BatchList(source, [idx for *_, idx in items], dynamic),
            batch_size=None,
            shuffle=False,
            num_workers=self.data.num_workers,
        )
        for (t, m, _), batch in zip(items, loader):
            yield t, m, batch

    def step_batches(self, source, steps: list, first: int):
        """``(step, [micro-batches])`` from step ``first`` on: a step's micro-batches
        together, so its loss can be normalised by all of their loss tokens."""
        pending: list = []
        for t, m, batch in self.micro_batches(source, steps, first):
            pending.append(batch)
            if m == len(steps[t]) - 1:
                yield t, pending
                pending = []


class _BatchList(torch.utils.data.Dataset):
    """Micro-batches by position, for DataLoader workers."""

    def __init__(self, samples, indices: list, dynamic: bool):
        self.samples, self.indices, self.dynamic = samples, indices, dynamic

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.samples.batch(self.indices[i], self.dynamic)
