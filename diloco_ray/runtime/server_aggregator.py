"""A parameter server's side of one sync's agreement: the replicas' weighted sum, the
verdicts every server shares, the mean and its squared norms.

The sum is built with each weight over one power of two above the total weight of the
contributions (:func:`~diloco_ray.algo.aggregate.weight_scale`), so it holds a mean's worth
and finite pseudo-gradients never overflow it; a mean that is still past fp32's range (a
decoupled divisor below the weights it divides) shows in the norm, and every server then
rejects the whole sync.

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

from diloco_ray.algo import compression, decoupled, partition, wire_layout
from diloco_ray.algo.aggregate import (
    Rejected,
    Rejection,
    accepted_of,
    add_corrected,
    add_pieces,
    agree_on_norm,
    mean_in_place,
    norm_of_parts,
    rejection_of,
    squares_by_part,
    weight_scale,
)
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.screening import NormScreen
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import Contribution, Prepared, Reduced
from diloco_ray.runtime.server_codec import SliceCodec

# Decoupled, delayed, clipped by the cycle: the cycle's gradient is summed in fp32, so a cycle
# whose norm passes fp32's largest value (which any overflowing entry needs) is not merged.
_FP32_MAX = float(torch.finfo(torch.float32).max)
CYCLE_OVERFLOWS = Rejected(Rejection.NON_FINITE, "the cycle's gradient overflows fp32")


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
        scale: what every weight was divided by before its pieces were added (the
            :func:`~diloco_ray.algo.aggregate.weight_scale` of all the contributions), for
            the sum of any accepted subset too.
    """

    fragment: int
    contributions: list
    valid: list[int]
    started: float
    acc: Optional[dict] = None
    mean: Optional[dict] = None
    divisor: Optional[float] = None
    scale: float = 1.0


@dataclass(frozen=True)
class Agreement:
    """What every server's :meth:`Aggregator.reduce` says of one sync, together.

    Args:
        accepted: the replicas whose contributions every server accepted (none when their
            mean is not finite on some server's rows).
        norm: the global L2 norm of the accepted mean over every server's rows (None when
            nothing was accepted).
        rejected: replica id -> why it was rejected (by any server, or
            :data:`~diloco_ray.algo.aggregate.MEAN_OVERFLOWS` or :data:`CYCLE_OVERFLOWS` for all
            of them).
        started: when server 0's first piece arrived.
        cycle_norm: decoupled, delayed and ``outer_grad_clip``: the global L2 norm of the
            cycle's unclipped gradient with this mean, what the merge is clipped by (None
            otherwise, or when nothing was accepted).
    """

    accepted: list[int]
    norm: Optional[float]
    rejected: dict
    started: float
    cycle_norm: Optional[float] = None

    @classmethod
    def of(cls, reduced: Sequence[Reduced]) -> "Agreement":
        """From every server's ``reduce`` result, in server order."""
        # In one global order, so every server (and any server count) gets the same norm; a
        # mean past fp32's range is applied nowhere.
        parts = (t for r in reduced for t in r.sumsq)
        accepted, norm, rejected = agree_on_norm(reduced[0].accepted, reduced[0].reasons, parts)
        cycle = None
        if accepted and reduced[0].cycle_sumsq is not None:
            cycle = norm_of_parts(t for r in reduced for t in r.cycle_sumsq)
            if not cycle < _FP32_MAX:  # only then can an entry of the cycle's fp32 sum overflow: as above
                rejected = {**rejected, **dict.fromkeys(accepted, CYCLE_OVERFLOWS)}
                accepted, norm, cycle = [], None, None
        return cls(accepted, norm, rejected, reduced[0].started, cycle)


def contribution_scale(contributions: Sequence[Contribution]) -> float:
    """What every weight of one sync's ``contributions`` is divided by before its pieces are
    added. Every weight is known up front: scaled by their total's power of two, the sum of
    any of them holds a mean's worth, whichever turn out accepted."""
    return weight_scale(sum(float(c.weight) for c in contributions))


class SumSpace:
    """One fp32 buffer kept from sync to sync, where a sync's sum is built and, once the sum
    is consumed, an uncompressed weights message (on the host). A fresh sum each sync would
    fault every page of it in again, a cost on the order of the adds into it. 4 bytes per
    parameter of the slice: the server's peak holds a sum anyway. What it hands out is valid
    until it hands out the next.

    Args:
        device: where the buffer lives: the server's GPU (``server_gpus``) or the host.
    """

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self._buffer = torch.empty(0, device=device)

    def _at_least(self, floats: int) -> torch.Tensor:
        if self._buffer.numel() < floats:
            self._buffer = torch.empty(0, device=self.device)  # the old one goes before the new one comes
            self._buffer = torch.empty(floats, device=self.device)
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
        cycle_of: name -> the unclipped gradient of the current delayed-Nesterov cycle on this
            server's rows of it (or None before the first merge): each merge's
            ``cycle_sumsq`` then holds the squared norms of that plus the mean (decoupled,
            delayed, ``outer_grad_clip``: clipped by the cycle); None: no such parts.
        screen: screens the contributions of another party (a region's: ``from_region``)
            by their norm over every server's rows (:mod:`diloco_ray.algo.screening`); None:
            no screening, and no norm is computed.
        from_region: whether a replica id is a region's member (only a region's reply can
            be one the home refused: :func:`refused_in`).
    """

    def __init__(
        self,
        layout: SliceLayout,
        codec: SliceCodec,
        momentum_of: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
        cycle_of: Optional[Callable[[str], Optional[torch.Tensor]]] = None,
        screen: Optional[NormScreen] = None,
        from_region: Callable[[int], bool] = lambda replica_id: False,
    ):
        self.layout, self.codec, self.momentum_of = layout, codec, momentum_of
        self.cycle_of, self.screen, self.from_region = cycle_of, screen, from_region
        self.sumsq: dict[int, float] = {}  # this sync's: replica id -> squared norm of its rows here
        self.pending: Optional[PendingSync] = None
        self.space = SumSpace(codec.device)  # the sum lives where the pieces are decoded

    def prepare(
        self,
        fragment: int,
        contributions: list[Contribution],
        divisor: Optional[float] = None,
        scale: Optional[float] = None,
    ) -> Prepared:
        """Fetch, decode and check every contribution; add the valid ones' weighted sum in
        fp32, one replica at a time (never more than one decoded copy held), and keep it
        until :meth:`reduce`. ``divisor`` (decoupled mode) replaces the accepted weights as
        the sum's divisor. ``scale``: what each weight is divided by, when the sum must be
        the one another set of contributions gave (a region repeating the home's sync from
        the accepted ones alone); None: :func:`contribution_scale` of these."""
        started = time.time()
        target = self.layout.target(fragment)
        scale = contribution_scale(contributions) if scale is None else scale
        acc = self._zeroed(target)
        reasons, valid = {}, []
        self.sumsq = {}
        for c in contributions:
            why = self._add(acc, c, target, scale)
            if why is None:
                valid.append(c.replica_id)
                continue
            reasons[c.replica_id] = why
            if why.reason is Rejection.NON_FINITE:  # added part-way: sum the valid ones again
                acc = self._sum(contributions, set(valid), target, scale)
        self.pending = PendingSync(fragment, contributions, valid, started, acc=acc, divisor=divisor, scale=scale)
        return Prepared(
            order=[c.replica_id for c in contributions],
            weights={c.replica_id: float(c.weight) for c in contributions},
            reasons=reasons,
            arrived=time.time(),
            sumsq=self.sumsq,
        )

    def _add(self, acc: dict, c: Contribution, target: partition.Rows, scale: float) -> Optional[Rejected]:
        """Add ``c``'s pieces into ``acc``; why not, where they cannot be."""
        import ray

        try:
            buffers = transport.receive(c.refs)
            refused = refused_in(buffers) if self.from_region(c.replica_id) else None
            if refused is not None:  # the home refused a region's reply: it stands for nothing
                return Rejected(Rejection.REFUSED, refused)
            self._accumulate(acc, buffers, target, c, scale)
        except ValueError as e:  # non-finite values, or rows and shapes this sync does not take
            return rejection_of(e)
        except ray.exceptions.RayError as e:  # its node went down after it reported
            return Rejected(Rejection.LOST_IN_TRANSIT, f"pseudo-gradient lost in transit: {type(e).__name__}")
        return None

    def _accumulate(self, acc: dict, buffers: list, target: partition.Rows, c: Contribution, scale: float) -> None:
        """Add one replica's checked pieces, times its weight over ``scale``, into ``acc``,
        corrected first when it is stale and a correction is configured."""
        found = self.codec.decode(buffers, target)
        first_row = {n: iv[0] for n, iv in target.items()}
        squares = [] if self.screen is not None else None  # every one's: the screened and their reference
        weight = float(c.weight) / scale
        if c.staleness > 0 and self.momentum_of is not None:
            add_corrected(acc, found, first_row, weight, self.momentum_of, squares)
        else:
            add_pieces(acc, found, first_row, weight, squares)
        if squares is not None:
            self.sumsq[c.replica_id] = math.fsum(squares)

    def _sum(self, contributions: list[Contribution], ids: set[int], target: partition.Rows, scale: float) -> dict:
        """The weighted sum of the contributions of replicas ``ids`` (checked before), in a
        new sum that replaces the last one."""
        acc = self._zeroed(target)
        for c in contributions:
            if c.replica_id in ids:
                self._accumulate(acc, transport.resolve(c.refs), target, c, scale)
        return acc

    def _zeroed(self, target: partition.Rows) -> dict[str, torch.Tensor]:
        return self.space.zeroed({n: self.layout.piece_shape(n, iv) for n, iv in target.items()})

    def reduce(self, *prepared: Prepared) -> Reduced:
        """Agree on the accepted replicas (rejected anywhere means rejected everywhere),
        turn the sum into this slice's mean in place, and return its squared norms (infinite
        where the mean is past fp32's range: :meth:`Agreement.of` then rejects the sync)."""
        pending = self.pending
        reasons = {rid: why for p in prepared for rid, why in p.reasons.items()}
        if self.screen is not None:  # every server the same norms (its rows' squares, in server order)
            norms = {rid: math.sqrt(sum(p.sumsq.get(rid, 0.0) for p in prepared)) for rid in prepared[0].order}
            norms = {rid: n for rid, n in norms.items() if rid not in reasons}
            screened = [rid for rid in norms if self.from_region(rid)]
            reasons.update(self.screen.judge(norms, screened, pending.fragment))
        accepted, total = accepted_of(prepared[0].order, prepared[0].weights, reasons, pending.divisor)
        target = self.layout.target(pending.fragment)
        if accepted != pending.valid:  # another server rejected one this server summed
            # The same scale: it bounds the weights of every subset of the contributions.
            pending.acc = self._sum(pending.contributions, set(accepted), target, pending.scale)  # in the same space
        acc, pending.acc = pending.acc, None  # becomes the mean, in place: one reference, which commit consumes
        pending.mean = mean_in_place(acc, total, pending.scale)
        del acc
        mean = pending.mean
        sumsq = squares_by_part(mean, self.layout.position, {n: target[n][0] for n in mean})
        cycle = None
        if self.cycle_of is not None:
            cycle = [
                (self.layout.position[n], target[n][0], decoupled.cycle_sumsq(self.cycle_of(n), m))
                for n, m in mean.items()
            ]
        accepted = accepted if total > 0 else []
        return Reduced(accepted=accepted, sumsq=sumsq, reasons=reasons, started=pending.started, cycle_sumsq=cycle)

    def take_mean(self) -> dict:
        """The accepted mean (name -> this sync's rows), handed over once: the sync ends here,
        whether its step is taken or not, and no sum is held from now on."""
        pending, self.pending = self.pending, None
        mean, pending.mean = pending.mean, None
        return mean

    def message_space(self, nbytes: int) -> np.ndarray:
        """``nbytes`` for an uncompressed message: the sum space's memory when no sync holds a
        sum in it. A sync's weights message is built after its sum was consumed, so the two
        share one buffer and the server's peak stays weights + momentum + one buffer (+ the
        cycle's gradient when clipped by the cycle). Such a message is valid until the next
        :meth:`prepare`: through Ray it was copied into the object store when the call returned.
        A sum on a GPU lends nothing: a message is built there and comes down on its own."""
        if self.pending is not None or self.space.device.type != "cpu":
            return np.empty(nbytes, dtype=np.uint8)
        return self.space.as_bytes(nbytes)


def refusal_message(why: str) -> np.ndarray:
    """A message that holds nothing and says why the home refused the reply it stands for:
    every server rejects it with that reason (:func:`refused_in`), so the reason reaches the
    round record's ``rejected`` as any rejection's does."""
    return compression.pack({}, Codec("none"), {"refused": str(why)})


def refused_in(buffers: Sequence) -> Optional[str]:
    """Why the home refused the reply ``buffers`` stand for (:func:`refusal_message`);
    None: they are a contribution."""
    for buf in buffers:
        why = wire_layout.packed_meta(buf).get("refused")
        if why is not None:
            return str(why)
    return None
