"""A parameter server's side of one sync's agreement: the replicas' weighted sum, the
verdicts every server shares, the mean and its squared norms.

:class:`Aggregator` holds what a sync keeps between ``prepare`` and ``commit``
(:class:`PendingSync`) and the memory its sum is built in (:class:`SumSpace`);
:class:`Agreement` is what every server's ``reduce`` says together. The tensor math is
:mod:`diloco_ray.algo.aggregate`'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import partition
from diloco_ray.algo.aggregate import (
    NonFiniteError,
    add_corrected,
    add_pieces,
    mean_in_place,
    norm_of_parts,
    squares_by_part,
)
from diloco_ray.algo.outer import Rejected, Rejection
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import Contribution, Prepared, Reduced
from diloco_ray.runtime.server_codec import SliceCodec


@dataclass
class PendingSync:
    """What one sync keeps between ``prepare``, ``reduce`` and ``commit``. The sum becomes
    the mean in place and the step consumes it, so each stage hands the big tensors on and
    leaves None behind: one reference to them at a time.

    Args:
        fragment: the fragment being synced.
        contributions: the replicas' contributions to this server.
        valid: ids of the replicas whose pieces this server summed.
        started: wall-clock time the first piece arrived.
        acc: name -> weighted sum of the valid pieces, until ``reduce``.
        mean: name -> the accepted mean, from ``reduce`` until ``commit``.
        divisor: decoupled mode: what the weighted sum is divided by (one round's worth
            of tokens) instead of the accepted weights.
    """

    fragment: int
    contributions: list
    valid: list[int]
    started: float
    acc: Optional[dict] = None
    mean: Optional[dict] = None
    divisor: Optional[float] = None


@dataclass(frozen=True)
class Agreement:
    """What every server's :meth:`Aggregator.reduce` says of one sync, together.

    Args:
        accepted: the replicas whose contributions every server accepted.
        norm: the global L2 norm of the accepted mean over every server's rows (None when
            nothing was accepted).
        rejected: replica id -> why it was rejected (by any server).
        started: when server 0's first piece arrived.
    """

    accepted: list[int]
    norm: Optional[float]
    rejected: dict
    started: float

    @classmethod
    def of(cls, reduced: Sequence[Reduced]) -> "Agreement":
        """From every server's ``reduce`` result, in server order."""
        accepted = reduced[0].accepted
        # In one global order, so every server (and any server count) gets the same norm.
        norm = norm_of_parts(t for r in reduced for t in r.sumsq) if accepted else None
        return cls(accepted, norm, reduced[0].reasons, reduced[0].started)


class SumSpace:
    """One fp32 buffer kept from sync to sync, where a sync's sum is built and, once the sum
    is consumed, an uncompressed weights message. A fresh sum each sync cost more than the
    adds into it: every page of it faulted in again (0.13 s of a 0.45 s sync at 27M
    parameters on this VM). 4 bytes per parameter of the slice: the server's peak holds a
    sum anyway. What it hands out is valid until it hands out the next."""

    def __init__(self):
        self._buffer = torch.empty(0)

    def _at_least(self, floats: int) -> torch.Tensor:
        if self._buffer.numel() < floats:
            self._buffer = torch.empty(0)  # the old one goes before the new one comes
            self._buffer = torch.empty(floats)
        return self._buffer

    def zeroed(self, shapes: Mapping[str, tuple]) -> dict[str, torch.Tensor]:
        """Zeroed tensors of ``shapes`` (name -> shape), views of the buffer."""
        buffer = self._at_least(sum(math.prod(shape) for shape in shapes.values()))
        out, offset = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out[name] = buffer[offset : offset + size].view(shape).zero_()
            offset += size
        return out

    def as_bytes(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the buffer's memory."""
        return self._at_least(-(-nbytes // 4)).numpy().view(np.uint8)[:nbytes]


class Aggregator:
    """One server's weighted sum of the replicas' pieces, and the mean it becomes.

    Args:
        layout: the rows this server holds.
        codec: decodes and checks the replicas' buffers.
        momentum_of: name -> the outer momentum of this server's rows of it (or None), which a
            stale contribution is corrected against (``stale_correction: momentum``);
            None: no correction.
    """

    def __init__(
        self,
        layout: SliceLayout,
        codec: SliceCodec,
        momentum_of: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
    ):
        self.layout, self.codec, self.momentum_of = layout, codec, momentum_of
        self.pending: Optional[PendingSync] = None
        self.space = SumSpace()

    def prepare(self, fragment: int, contributions: list[Contribution], divisor: Optional[float] = None) -> Prepared:
        """Fetch, decode and check every contribution; add the valid ones' weighted sum in
        fp32, one replica at a time (never more than one decoded copy held), and keep it
        until :meth:`reduce`. ``divisor`` (decoupled mode) replaces the accepted weights as
        the sum's divisor."""
        started = time.time()
        target = self.layout.target(fragment)
        acc = self._zeroed(target)
        reasons, valid = {}, []
        for c in contributions:
            why = self._add(acc, c, target)
            if why is None:
                valid.append(c.replica_id)
                continue
            reasons[c.replica_id] = why
            if why.reason is Rejection.NON_FINITE:  # added part-way: sum the valid ones again
                acc = self._sum(contributions, set(valid), target)
        self.pending = PendingSync(fragment, contributions, valid, started, acc=acc, divisor=divisor)
        return Prepared(
            order=[c.replica_id for c in contributions],
            weights={c.replica_id: float(c.weight) for c in contributions},
            reasons=reasons,
            arrived=time.time(),
        )

    def _add(self, acc: dict, c: Contribution, target: partition.Rows) -> Optional[Rejected]:
        """Add ``c``'s pieces into ``acc``; why not, where they cannot be."""
        import ray

        try:
            self._accumulate(acc, transport.receive(c.refs), target, c)
        except NonFiniteError as e:
            return Rejected(Rejection.NON_FINITE, str(e))
        except ValueError as e:
            return Rejected(Rejection.MALFORMED, str(e))
        except ray.exceptions.RayError as e:  # its node went down after it reported
            return Rejected(Rejection.LOST_IN_TRANSIT, f"pseudo-gradient lost in transit: {type(e).__name__}")
        return None

    def _accumulate(self, acc: dict, buffers: list, target: partition.Rows, c: Contribution) -> None:
        """Add one replica's checked pieces, times its weight, into ``acc``, corrected first
        when it is stale and a correction is configured."""
        found = self.codec.decode(buffers, target)
        first_row = {n: iv[0] for n, iv in target.items()}
        if c.staleness > 0 and self.momentum_of is not None:
            add_corrected(acc, found, first_row, float(c.weight), self.momentum_of)
        else:
            add_pieces(acc, found, first_row, float(c.weight))

    def _sum(self, contributions: list[Contribution], ids: set[int], target: partition.Rows) -> dict:
        """The weighted sum of the contributions of replicas ``ids`` (checked before), in a
        new sum that replaces the last one."""
        acc = self._zeroed(target)
        for c in contributions:
            if c.replica_id in ids:
                self._accumulate(acc, transport.resolve(c.refs), target, c)
        return acc

    def _zeroed(self, target: partition.Rows) -> dict[str, torch.Tensor]:
        return self.space.zeroed({n: self.layout.piece_shape(n, iv) for n, iv in target.items()})

    def reduce(self, *prepared: Prepared) -> Reduced:
        """Agree on the accepted replicas (rejected anywhere means rejected everywhere),
        turn the sum into this slice's mean in place, and return its squared norms."""
        pending = self.pending
        reasons = {rid: why for p in prepared for rid, why in p.reasons.items()}
        accepted = [rid for rid in prepared[0].order if rid not in reasons]
        total = sum(prepared[0].weights[rid] for rid in accepted)
        if pending.divisor is not None and total > 0:
            total = pending.divisor
        target = self.layout.target(pending.fragment)
        if accepted != pending.valid:  # another server rejected one this server summed
            pending.acc = self._sum(pending.contributions, set(accepted), target)  # in the same space
        acc, pending.acc = pending.acc, None  # becomes the mean, in place: one reference, which commit consumes
        pending.mean = mean_in_place(acc, total)
        del acc
        mean = pending.mean
        sumsq = squares_by_part(mean, self.layout.position, {n: target[n][0] for n in mean})
        return Reduced(accepted=accepted if total > 0 else [], sumsq=sumsq, reasons=reasons, started=pending.started)

    def take_mean(self) -> dict:
        """The accepted mean (name -> this sync's rows), handed over once: the sync ends here,
        whether its step is taken or not, and no sum is held from now on."""
        pending, self.pending = self.pending, None
        mean, pending.mean = pending.mean, None
        return mean

    def message_space(self, nbytes: int) -> np.ndarray:
        """``nbytes`` for an uncompressed message: the sum space's memory when no sync holds a
        sum in it. A sync's weights message is built after its sum was consumed, so the two
        share one buffer and the server's peak stays weights + momentum + one buffer. Such a
        message is valid until the next :meth:`prepare`: through Ray it was copied into the
        object store when the call returned."""
        if self.pending is not None:
            return np.empty(nbytes, dtype=np.uint8)
        return self.space.as_bytes(nbytes)
