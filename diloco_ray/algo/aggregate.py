"""One outer step's rules, as pure tensor code: what is rejected and why, the weighted sum,
the mean, its norm, and whether it may be applied.

One outer step is: reject what cannot be applied, add each accepted pseudo-gradient times
its weight over :func:`weight_scale` into an fp32 sum, divide by the total weight over the
same scale, take the global L2 norm, clip by it, and step the outer optimizer; a mean whose
norm is not finite is applied by no one (:func:`agree_on_norm`). The scaled weights add up
to less than 1, so the sum of finite values stays finite however many tokens weigh them
(raw token weights would carry a large but finite pseudo-gradient past fp32's range).

The parameter servers do this a slice at a time (several servers each hold some rows:
each sums and squares its own, and the norm is taken over every server's squares, in one
global order); :meth:`OuterOptimizer.step <diloco_ray.algo.outer.OuterOptimizer.step>` does
it on whole tensors in one process. Both compose the functions here, with the clipped step
and the round counter of :class:`~diloco_ray.algo.outer.OuterOptimizer`, so the two cannot
drift apart and the tests of one check the other.

A server's sum covers the rows of one sync; a replica's pieces arrive as ``(name, rows,
values)``, still encoded (:class:`~diloco_ray.algo.compression.Encoded`), and
:func:`add_pieces` adds them a bounded chunk at a time, so a whole message is never held
decoded. A stale contribution in decoupled mode may be corrected against the outer
momentum first (:func:`add_corrected`), which needs each tensor whole.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from diloco_ray.algo import decoupled, partition

# ---- rejections ------------------------------------------------------------------------


class Rejection(enum.Enum):
    """Why a pseudo-gradient was not applied (what the driver acts on; the record writes
    the :class:`Rejected` detail). A replica rejected for ``NON_FINITE`` values starts its
    next period with a fresh inner state."""

    NON_FINITE = "non-finite values"
    MALFORMED = "malformed"  # a missing or unexpected key, not a tensor, a wrong shape, an unreadable message
    LOST_IN_TRANSIT = "lost in transit"  # its node went down after it reported
    SCREENED = "screened out"  # a region's contribution far outside the others (algo/screening.py)
    REFUSED = "refused"  # a region's reply the home refused before the sync: its claims, the held-out check


@dataclass(frozen=True)
class Rejected:
    """One pseudo-gradient's rejection.

    Args:
        reason: the kind, for decisions.
        detail: what a reader is told (the round record's ``rejected`` value), e.g.
            ``non-finite values in 'w'``.
    """

    reason: Rejection
    detail: str

    def __str__(self) -> str:
        return self.detail


# Why every replica of a sync is rejected when each pseudo-gradient was finite but their
# weighted mean is not (a decoupled merge divides by a round's worth of tokens, which can be
# less than the weights it merges); see agree_on_norm.
MEAN_OVERFLOWS = Rejected(Rejection.NON_FINITE, "the weighted mean overflows fp32")


def poisoned(rejected: Mapping[int, Rejected]) -> set[int]:
    """The replicas of ``rejected`` (id -> why) whose inner state is poisoned: rejected as
    non-finite, they start their next period with a fresh inner state and reload every
    weight (the home's rule for its replicas, and a region's for its own)."""
    return {rid for rid, why in rejected.items() if why.reason is Rejection.NON_FINITE}


class NonFiniteError(ValueError):
    """A pseudo-gradient holds NaN or Inf (rejected as ``Rejection.NON_FINITE``, and the
    driver resets that replica's inner state)."""


def rejection_of(error: ValueError) -> Rejected:
    """The rejection a check's error stands for: :class:`NonFiniteError` is
    ``NON_FINITE``, any other ``ValueError`` (a key, shape or row the pseudo-gradient
    should not have, or lacks) ``MALFORMED``; its message is the detail."""
    kind = Rejection.NON_FINITE if isinstance(error, NonFiniteError) else Rejection.MALFORMED
    return Rejected(kind, str(error))


def check_finite(values: Tensor, name: str) -> Tensor:
    """``values``, once checked finite.

    Raises:
        NonFiniteError: ``values`` hold NaN or Inf.
    """
    # A vectorised fp32 sum is finite when every value is; only when it is not (NaN/Inf,
    # or finite values large enough to overflow) is each value checked.
    if not math.isfinite(float(values.sum())) and not bool(torch.isfinite(values).all()):
        raise NonFiniteError(f"non-finite values in '{name}'")
    return values


def find_invalid(pseudo_grad: Mapping[str, Any], reference_params: Mapping[str, Tensor]) -> Rejected | None:
    """Why a whole ``pseudo_grad`` cannot be applied to ``reference_params``, or None if it can.

    The server checks a replica's rows as it decodes them (wrong rows or shapes are
    ``MALFORMED``) and their values with :func:`check_finite` as it adds them; this is
    the same verdict for a whole pseudo-gradient, through the same :func:`check_finite`
    and :func:`rejection_of`.

    Args:
        pseudo_grad: name -> tensor, one replica's ``global - local``.
        reference_params: name -> tensor, the global params it must match in keys and shapes.

    Returns:
        The rejection (non-finite values, or malformed: a missing/unexpected key, a
        non-tensor, a shape mismatch, with a human-readable detail), or None when the
        pseudo-gradient is usable.
    """
    missing = [k for k in reference_params if k not in pseudo_grad]
    if missing:
        return Rejected(Rejection.MALFORMED, f"missing key {missing[0]!r}")
    extra = [k for k in pseudo_grad if k not in reference_params]
    if extra:
        return Rejected(Rejection.MALFORMED, f"unexpected key {extra[0]!r}")
    for name, ref in reference_params.items():
        g = pseudo_grad[name]
        if not isinstance(g, Tensor):
            return Rejected(Rejection.MALFORMED, f"{name!r} is a {type(g).__name__}, not a tensor")
        if g.shape != ref.shape:
            detail = f"shape mismatch for {name!r}: got {tuple(g.shape)}, want {tuple(ref.shape)}"
            return Rejected(Rejection.MALFORMED, detail)
        if g.is_floating_point():
            try:
                check_finite(g, name)
            except NonFiniteError as e:
                return rejection_of(e)
    return None


# ---- the weighted sum ------------------------------------------------------------------


def add_weighted(acc: Tensor, values: Tensor, weight: float, name: str) -> None:
    """``acc += weight * values`` (flat views of the same length), after :func:`check_finite`."""
    acc.add_(check_finite(values, name).to(dtype=acc.dtype), alpha=weight)


def add_pieces(
    acc: Mapping[str, Tensor],
    found: Iterable,
    first_row: Mapping[str, int],
    weight: float,
    squares: Optional[list] = None,
) -> None:
    """Add decoded pieces, times ``weight``, into the sum ``acc``, a chunk at a time (and,
    given ``squares``, append each chunk's sum of squares to it: the contribution's norm,
    read as it is added).

    Args:
        acc: name -> the sum's fp32 tensor, covering rows from ``first_row[name]`` on.
        found: ``(name, (start, end), piece)``: rows of ``name`` and their still encoded values.
        first_row: name -> the first row ``acc[name]`` covers.
        weight: the contribution's weight in the sum (over :func:`weight_scale`).

    Raises:
        NonFiniteError: from :func:`check_finite`, part-way: ``acc`` then holds the
            pieces before the bad one (the caller builds the sum again).
    """
    for name, span, piece in found:
        flat = partition.take(acc[name], span, first_row[name]).view(-1)  # rows are contiguous
        for lo, values in piece.chunks():
            add_weighted(flat[lo : lo + values.numel()], values, weight, name)
            if squares is not None:
                squares.append(float(torch.linalg.vector_norm(values)) ** 2)


def add_corrected(
    acc: Mapping[str, Tensor],
    found: Iterable,
    first_row: Mapping[str, int],
    weight: float,
    momentum_of: Callable[[str], Optional[Tensor]],
    squares: Optional[list] = None,
) -> None:
    """:func:`add_pieces` for a stale contribution (``stale_correction: momentum``): each
    tensor is assembled whole (one tensor's copy at a time), corrected against
    ``momentum_of(name)``, its outer momentum (None: left as it is), by
    :func:`~diloco_ray.algo.decoupled.correct_stale_`, and then added (``squares``: as
    :func:`add_pieces`, of the contribution as it came)."""
    by_name: dict[str, list] = {}
    for name, span, piece in found:
        by_name.setdefault(name, []).append((span, piece))
    for name, parts in by_name.items():
        whole = torch.empty(acc[name].shape, device=acc[name].device)
        for span, piece in parts:
            partition.put(whole, span, check_finite(piece.decode(), name), offset=first_row[name])
        if squares is not None:
            squares.append(float(torch.linalg.vector_norm(whole)) ** 2)
        momentum = momentum_of(name)
        if momentum is not None:
            decoupled.correct_stale_(whole, momentum.view(whole.shape))
        add_weighted(acc[name].view(-1), whole.view(-1), weight, name)


def weight_scale(total_weight: float) -> float:
    """What each weight is divided by before its pseudo-gradient is added: the smallest power
    of two above ``total_weight``, the weight of every contribution the sum may hold (any
    subset of them then adds up to less than 1).

    A power of two scales exactly, so the mean is, bit for bit, what raw weights and a
    division by the total give wherever that does not overflow (values below fp32's
    normal range aside)."""
    return math.ldexp(1.0, math.frexp(total_weight)[1]) if total_weight > 0 else 1.0


# ---- the mean, its norm and the verdict on it ------------------------------------------


def accepted_of(
    order: Iterable[Hashable], weights: Mapping[Hashable, float], rejected: Mapping, divisor: Optional[float] = None
) -> tuple[list, float]:
    """The contributions a sync's mean is formed from, and what their sum is divided by.

    Args:
        order: every contribution's id, in the order they were summed.
        weights: id -> its weight.
        rejected: the ids rejected by any check (anywhere: rejected by one server means
            rejected by all).
        divisor: decoupled mode: one round's worth of tokens, which replaces the accepted
            weights as the divisor when they are positive.

    Returns:
        The accepted ids in ``order``, and their total weight (or ``divisor``). A total
        that is not positive leaves no mean to apply (:func:`mean_in_place`).
    """
    accepted = [rid for rid in order if rid not in rejected]
    total = sum(weights[rid] for rid in accepted)
    if divisor is not None and total > 0:
        total = divisor
    return accepted, total


def mean_in_place(acc: dict[str, Tensor], divisor: float, scale: float = 1.0) -> dict[str, Tensor]:
    """The sum ``acc``, whose weights were divided by ``scale``, as the weighted mean over
    ``divisor`` (the total weight), in place (no second copy). Values past fp32's range come
    out infinite; the caller's norm shows it."""
    return {n: t.div_(divisor / scale) for n, t in acc.items()} if divisor > 0 else {}


def sum_of_squares(t: Tensor, chunk: int = 1 << 16) -> float:
    """Sum of squares accumulated in float64, a chunk at a time through one reused
    float64 scratch: float64 precision without a float64 copy of the whole tensor, and
    no allocation per chunk (a fresh scratch would fault its pages in again for every
    chunk, on the server's hottest path)."""
    flat = t.reshape(-1)
    if not flat.numel():
        return 0.0
    if flat.device.type != "cpu":
        return decoupled.sumsq_there(flat)
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.float64)
    total = 0.0
    for part in flat.split(chunk):
        wide = scratch[: part.numel()].copy_(part)
        total += float(torch.dot(wide, wide))
    return total


def norm_of_parts(parts: Iterable[tuple[int, int, float]]) -> float:
    """The global L2 norm from ``(parameter position, first row, sum of squares)`` parts,
    summed in one global order, so any number of servers (or one process) gets the same
    norm bit for bit."""
    return math.sqrt(sum(part[2] for part in sorted(parts)))


def squares_by_part(mean: Mapping[str, Tensor], position: Mapping[str, int], first_row: Mapping[str, int]) -> list:
    """The ``(position, first row, sum of squares)`` parts of ``mean`` for :func:`norm_of_parts`."""
    return [(position[n], first_row[n], sum_of_squares(g)) for n, g in mean.items()]


def agree_on_norm(
    accepted: Sequence, rejected: Mapping, parts: Iterable[tuple[int, int, float]]
) -> tuple[Sequence, Optional[float], Mapping]:
    """Whether the mean of ``accepted`` may be applied, by its global norm over ``parts``
    (see :func:`norm_of_parts`).

    Squares are summed in float64, so only a mean whose values are past fp32's range makes
    the norm infinite; such a mean is applied by no one, and every accepted contribution is
    rejected with :data:`MEAN_OVERFLOWS`.

    Returns:
        ``(accepted, norm, rejected)``: the accepted ids (none when the mean overflows),
        the norm to clip by (None when nothing is accepted), and id -> every rejection.
    """
    norm = norm_of_parts(parts) if accepted else None
    if norm is not None and not math.isfinite(norm):
        return [], None, {**rejected, **dict.fromkeys(accepted, MEAN_OVERFLOWS)}
    return accepted, norm, rejected
