"""What one sync period of a rank has done so far, and what it reports of it.

A :class:`PeriodTally` is filled in step by step by the rank's inner loop
(:mod:`~diloco_ray.runtime.rank`); at the period's end :meth:`PeriodTally.stats` turns it
into the :class:`~diloco_ray.runtime.messages.RoundStats` the driver reads. While it runs,
:class:`BoardReports` tells the driver's board how it goes: step events and heartbeats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
import torch

from diloco_ray.observe.events import StepEvent
from diloco_ray.runtime.messages import RoundStats, SyncPeriod

BEAT_S = 2.0  # how often a rank tells the driver it is alive (seconds)
FLUSH_S = 5.0  # the most a period's end waits for the board to take its last step event


@dataclass
class PeriodTally:
    """What one sync period's inner steps have done so far.

    Args:
        first: the first step this attempt runs (past the steps an in-flight snapshot restored).
        last: one past the last step it may run (moved up when the time budget runs out).
        loss_sum: the sum of the steps' losses (on the device: read only when reported).
        logged: (step, loss_sum) at the last step event.
        at: the step in progress.
    """

    first: int
    last: int
    loss_sum: torch.Tensor
    logged: tuple
    at: int
    tokens: int = 0  # tokens trained on (attention mask)
    counted: int = 0  # tokens that carried loss
    resumed: int = 0  # steps restored from an in-flight snapshot
    aborted: bool = False  # stopped by abort() (or a dropped link): nothing to send
    out_of_time: bool = False  # the time budget cut the period short

    def stats(
        self, rank: int, bytes_up: int, received: int, restarted: bool, compute: float, load: float, unused: list
    ) -> RoundStats:
        """What the driver learns of the period from rank ``rank``: ``bytes_up``: the bytes it
        sends; ``received``: weight bytes taken in; ``compute`` and ``load``: seconds spent on the inner
        steps and on taking in weights; ``unused``: the plan's ranges it had no time for."""
        return RoundStats(
            rank=rank,
            inner_steps=(self.at - self.first) if self.aborted else self.last - self.first,
            tokens=self.tokens,
            loss_sum=float(self.loss_sum),
            compute_seconds=compute,
            load_seconds=load,
            bytes_up=bytes_up,
            bytes_down=received,
            aborted=self.aborted,
            resumed_step=self.resumed,
            restarted=restarted,
            loss_tokens=self.counted,
            unused=unused,
        )


class BoardReports:
    """What a rank tells the driver's board (``job.board``; None: no one listens) while a
    period runs, without waiting for an answer.

    Args:
        replica_id, rank, world_size: who reports, and how many ranks its replica has.
    """

    def __init__(self, replica_id: int, rank: int, world_size: int):
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        self._last_beat = 0.0
        self._last_step = None  # the ref of the last step event sent, until flushed

    def step(self, job: SyncPeriod, step: int, tally: PeriodTally, lr: float, global_step: int) -> None:
        """Rank 0 sends a step event (mean loss since the last one, lr, tokens) after
        ``step``. Reading the loss syncs the device, which is why it happens every
        ``logging_steps`` and not every step."""
        board = job.board
        if board is None or self.rank != 0:
            return
        total = float(tally.loss_sum)
        since = max(1, step - tally.logged[0])
        self._last_step = board.report.remote(
            StepEvent(
                round=job.period.round,
                replica=self.replica_id,
                step=step,
                global_step=global_step,
                loss=(total - tally.logged[1]) / since,
                lr=lr,
                # rank 0's count for the whole replica: its ranks see equal batches
                tokens=tally.tokens * self.world_size,
                time=time.time(),
            )
        )
        tally.logged = (step, total)

    def flush(self) -> None:
        """Wait (up to FLUSH_S) until the board has taken the last step event sent. Ray
        keeps one caller's calls to an actor in order, not the driver's drain after this
        rank's report: without the wait, a period's last events could reach the driver
        after the period's stats, and so after its round had ended. A lost board answers
        at once (with its error)."""
        if self._last_step is not None:
            ray.wait([self._last_step], timeout=FLUSH_S)
            self._last_step = None

    def beat(self, job: SyncPeriod, step: int) -> None:
        """Tell the driver this rank is alive and at ``step`` (at most every BEAT_S), so a
        frozen rank is told apart from a slow one even without a round deadline."""
        board, now = job.board, time.monotonic()
        if board is not None and now - self._last_beat >= BEAT_S:
            self._last_beat = now
            board.beat.remote(self.replica_id, self.rank, job.period.attempt, step)
