"""The math of decoupled mode, as plain functions: merge weights, staleness and delayed
Nesterov momentum.

In decoupled mode (``sync_mode: decoupled``) replicas run on their own clocks and the
server merges whatever has arrived (see :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`).
Two rules make that converge like synchronous DiLoCo:

* **Token weights, staleness discount, a fixed divisor** (:func:`merge_weighting`). A
  contribution's weight is the loss tokens it trained on times ``(1 + s) ** -staleness_power``,
  where ``s`` is its staleness (below; staleness-aware async SGD, Zhang et al. 2016, divides
  the step by the staleness). A merge divides by one *round's worth* of tokens: the tokens
  the merged replicas trained on plus, for every active rank not in the merge, the tokens a
  rank has trained on per period so far. So a merge of one replica moves the weights by about
  a 1/replicas share of a synchronous round, a discount really shrinks a stale step instead
  of being normalised away, and a merge of every replica is the synchronous round's
  token-weighted mean, also when ``inner_time_s`` cut the periods short.
* **Outer momentum** (``decoupled_momentum``) and what staleness counts. With ``every_step``
  each merge is one step of the outer optimizer, as each synchronous round is, and a
  contribution's staleness is the merges applied since it started. With
  **delayed Nesterov** (the default) (Liu et al., "Asynchronous Local-SGD", 2024) each merge applies its
  gradient part at once, ``theta -= lr * g``, and adds ``g`` to the momentum; once a round's
  worth of tokens has been merged (a *cycle*) the momentum part is applied,
  ``m = beta * m + sum(g)``, ``theta -= lr * beta * m``; staleness counts the cycles ended
  since the contribution started (:func:`momentum_steps`). So a cycle is exactly one
  synchronous Nesterov step whose gradient is the sum of the cycle's merge gradients, and
  when the cycle's contributions all started from the cycle's weights (none stale, whatever
  ``staleness_power``) that sum is the synchronous round's mean: the cycle *is* the
  synchronous round (unit-tested at the defaults against ``torch.optim.SGD(nesterov=True)``).
  One buffer per parameter holds ``beta * m`` plus the cycle's gradients so far, so it costs
  what plain Nesterov costs.
When to merge and how long each period runs is :mod:`diloco_ray.algo.merge_timing`'s.

``work``, the rounds' worth of tokens merged (a merged contribution's tokens over its
merge's divisor, summed), drives the run's end, both lr schedules and the delayed cycles;
a stale contribution counts its tokens in full there (its data is trained) while its
weight is discounted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

CYCLE_EPS = 1e-9  # round-off allowance when fractions of a round add up to a whole one


def staleness_weight(tokens: float, staleness: int, power: float) -> float:
    """A contribution's merge weight: its tokens, discounted by ``(1 + staleness) ** -power``."""
    if staleness < 0:
        raise ValueError(f"staleness {staleness} < 0: a contribution cannot start from a future version")
    return float(tokens) * (1.0 + staleness) ** -power


@dataclass(frozen=True)
class Weighting:
    """How one merge weighs its contributions.

    Args:
        weights: replica id -> its weight in the merge's sum (tokens x staleness discount).
        divisor: what the weighted sum is divided by: one round's worth of tokens.
        shares: replica id -> its tokens over the divisor: the rounds' worth of work it adds.
    """

    weights: dict[int, float]
    divisor: float
    shares: dict[int, float]

    @property
    def applied(self) -> float:
        """The share of a round's weight the merge applies (its weights over the divisor):
        the sum of ``shares`` when nothing is stale, less when something is."""
        return sum(self.weights.values()) / self.divisor


def merge_weighting(
    tokens: Mapping[int, float],
    staleness: Mapping[int, int],
    absent_ranks: int,
    per_rank_tokens: float,
    power: float,
) -> Weighting:
    """Weights, divisor and shares of one merge.

    Args:
        tokens: merged replica id -> the loss tokens its period trained on (all its ranks).
        staleness: merged replica id -> its staleness (see :func:`momentum_steps`).
        absent_ranks: ranks of the active replicas not in this merge (replicas may have
            different ``ranks_per_replica``; each trains in proportion to its ranks).
        per_rank_tokens: the tokens one rank has trained on per period so far, which
            stands in for each absent rank.
        power: ``staleness_power``.
    """
    divisor = sum(tokens.values()) + absent_ranks * per_rank_tokens
    if divisor <= 0 or absent_ranks < 0:
        raise ValueError(f"a merge needs tokens > 0 and absent ranks >= 0, got {divisor}, {absent_ranks}")
    weights = {rid: staleness_weight(t, staleness[rid], power) for rid, t in tokens.items()}
    return Weighting(weights, float(divisor), {rid: t / divisor for rid, t in tokens.items()})


def momentum_steps(version: int, work: float, rule: str) -> int:
    """The outer momentum steps taken so far, what staleness is counted in: one per merge
    (``every_step``, whose ``version`` counts merges), or one per whole round's worth of
    merged work (``delayed``, whose momentum is applied once per cycle)."""
    return version if rule == "every_step" else math.floor(work + CYCLE_EPS)


def cycle_ends(work_before: float, work_after: float) -> bool:
    """Whether merging moved the work done (in rounds' worth) past a whole round: the
    moment delayed Nesterov applies its momentum."""
    return math.floor(work_after + CYCLE_EPS) > math.floor(work_before + CYCLE_EPS)


@torch.no_grad()
def delayed_nesterov_(
    param: torch.Tensor, grad: torch.Tensor, buffer: torch.Tensor, lr: float, beta: float, cycle_end: bool
) -> None:
    """One merge's delayed-Nesterov update of one parameter, in place.

    Args:
        param: the global weights.
        grad: the merge's outer gradient (already weighted, divided and clipped).
        buffer: ``beta * m`` plus the gradients merged since the last cycle end.
        lr: the outer learning rate.
        beta: the outer momentum.
        cycle_end: a round's worth has now been merged: apply the momentum part.
    """
    param.sub_(grad, alpha=lr)
    buffer.add_(grad)
    if cycle_end:
        param.sub_(buffer, alpha=lr * beta)
        buffer.mul_(beta)


@torch.no_grad()
def correct_stale_(delta: torch.Tensor, momentum: torch.Tensor) -> float:
    """Correct a stale pseudo-gradient against the outer momentum, in place; returns the
    cosine between them before the correction.

    A contribution that started ``s`` outer steps ago was computed from weights the
    trajectory has since left. The outer momentum says where the trajectory goes (HeLoCo,
    Al Asif et al. 2026, uses it as the reference): a tensor whose pseudo-gradient agrees
    with it (cosine >= 0) is kept; one that points against it has the component along the
    momentum removed (its projection onto the momentum's orthogonal complement), so a stale
    contribution cannot pull the weights back along the path already taken, while what it
    says about other directions is kept. HeLoCo scales the removal by agreement and
    confidence; this is its simplest form, with no parameters. ``momentum`` all zero (no
    step taken yet) leaves ``delta`` as it is.
    """
    m_sq = float(momentum.double().pow(2).sum())
    d_sq = float(delta.double().pow(2).sum())
    if m_sq == 0.0 or d_sq == 0.0:
        return 0.0
    dot = float((delta.double() * momentum.double()).sum())
    cosine = dot / math.sqrt(m_sq * d_sq)
    if cosine < 0.0:
        delta.sub_(momentum.to(delta.dtype), alpha=dot / m_sq)
    return cosine
