"""The outer gradient as the server forms it: weighted sum, mean, norm; pure tensor code.

One outer step is: reject what cannot be applied, add each accepted pseudo-gradient times
its weight into an fp32 sum, divide by the total weight, take the global L2 norm, clip by
it, and step the outer optimizer. The parameter server does this a slice at a time
(several servers each hold some rows: each sums and squares its own, and the norm is
taken over every server's squares, in one global order); :meth:`OuterOptimizer.step
<diloco_ray.algo.outer.OuterOptimizer.step>` does it on whole tensors in one process. Both
call the functions here, so the tests of one check the other.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch
from torch import Tensor


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


def mean_in_place(acc: dict[str, Tensor], total_weight: float) -> dict[str, Tensor]:
    """The weighted sum ``acc`` divided by ``total_weight``, in place (no second copy)."""
    return {n: t.div_(total_weight) for n, t in acc.items()} if total_weight > 0 else {}


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
