"""The outer gradient as the server forms it: weighted sum, mean, norm; pure tensor code.

One outer step is: reject what cannot be applied, add each accepted pseudo-gradient times
its weight over :func:`weight_scale` into an fp32 sum, divide by the total weight over the
same scale, take the global L2 norm, clip by it, and step the outer optimizer; a mean whose
norm is not finite is applied by no one. The scaled weights add up to less than 1, so the
sum of finite values stays finite however many tokens weigh them (raw token weights put a
pseudo-gradient of 1e34 at 2e5 tokens past fp32's range).

The parameter server does this a slice at a time (several servers each hold some rows:
each sums and squares its own, and the norm is taken over every server's squares, in one
global order); :meth:`OuterOptimizer.step <diloco_ray.algo.outer.OuterOptimizer.step>` does
it on whole tensors in one process. Both call the functions here, so the tests of one check
the other.

A server's sum covers the rows of one sync; a replica's pieces arrive as ``(name, rows,
values)``, still encoded (:class:`~diloco_ray.algo.compression.Encoded`), and
:func:`add_pieces` adds them a bounded chunk at a time, so a whole message is never held
decoded. A stale contribution in decoupled mode may be corrected against the outer
momentum first (:func:`add_corrected`), which needs each tensor whole.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor

from diloco_ray.algo import decoupled, partition


class NonFiniteError(ValueError):
    """A pseudo-gradient holds NaN or Inf (the server rejects it as ``Rejection.NON_FINITE``,
    and the driver resets that replica's inner state)."""


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


def add_weighted(acc: Tensor, values: Tensor, weight: float, name: str) -> None:
    """``acc += weight * values`` (flat views of the same length), after :func:`check_finite`."""
    acc.add_(check_finite(values, name).to(dtype=acc.dtype), alpha=weight)


def add_pieces(acc: Mapping[str, Tensor], found: Iterable, first_row: Mapping[str, int], weight: float) -> None:
    """Add decoded pieces, times ``weight``, into the sum ``acc``, a chunk at a time.

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


def add_corrected(
    acc: Mapping[str, Tensor],
    found: Iterable,
    first_row: Mapping[str, int],
    weight: float,
    momentum_of: Callable[[str], Optional[Tensor]],
) -> None:
    """:func:`add_pieces` for a stale contribution (``stale_correction: momentum``): each
    tensor is assembled whole (one tensor's copy at a time), corrected against
    ``momentum_of(name)``, its outer momentum (None: left as it is), by
    :func:`~diloco_ray.algo.decoupled.correct_stale_`, and then added."""
    by_name: dict[str, list] = {}
    for name, span, piece in found:
        by_name.setdefault(name, []).append((span, piece))
    for name, parts in by_name.items():
        whole = torch.empty(acc[name].shape)
        for span, piece in parts:
            partition.put(whole, span, check_finite(piece.decode(), name), offset=first_row[name])
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


def mean_in_place(acc: dict[str, Tensor], divisor: float, scale: float = 1.0) -> dict[str, Tensor]:
    """The sum ``acc``, whose weights were divided by ``scale``, as the weighted mean over
    ``divisor`` (the total weight), in place (no second copy). Values past fp32's range come
    out infinite; the caller's norm shows it."""
    return {n: t.div_(divisor / scale) for n, t in acc.items()} if divisor > 0 else {}


def sum_of_squares(t: Tensor, chunk: int = 1 << 16) -> float:
    """Sum of squares accumulated in float64, a chunk at a time through one reused
    float64 scratch: float64 precision without a float64 copy of the whole tensor, and
    no allocation per chunk (fresh pages per chunk made this the server's largest cost)."""
    flat = t.reshape(-1)
    if not flat.numel():
        return 0.0
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
