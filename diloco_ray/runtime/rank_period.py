"""What one sync period of a rank has done so far, and what it reports of it.

A :class:`PeriodTally` is filled in step by step by the rank's inner loop
(:mod:`~diloco_ray.runtime.rank`); at the period's end :meth:`PeriodTally.stats` turns it
into the :class:`~diloco_ray.runtime.messages.RoundStats` the driver reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco_ray.runtime.messages import RoundStats


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
        self, rank: int, buffers: list, received: int, restarted: bool, compute: float, load: float, unused: list
    ) -> RoundStats:
        """What the driver learns of the period from rank ``rank``: ``buffers``: what it sends;
        ``received``: weight bytes taken in; ``compute`` and ``load``: seconds spent on the inner
        steps and on taking in weights; ``unused``: the plan's ranges it had no time for."""
        return RoundStats(
            rank=rank,
            inner_steps=(self.at - self.first) if self.aborted else self.last - self.first,
            tokens=self.tokens,
            loss_sum=float(self.loss_sum),
            compute_seconds=compute,
            load_seconds=load,
            bytes_up=sum(b.nbytes for b in buffers),
            bytes_down=received,
            aborted=self.aborted,
            resumed_step=self.resumed,
            restarted=restarted,
            loss_tokens=self.counted,
            unused=unused,
        )
