"""The math of decoupled mode, as plain functions: merge weights, what stands in for the
replicas not in a merge, staleness and delayed Nesterov momentum.

In decoupled mode (``sync_mode: decoupled``) replicas run on their own clocks and the
server merges whatever has arrived (see :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`).
The rules that make that converge like synchronous DiLoCo, and exactly where they differ:

* **Token weights, staleness discount, a round's divisor** (:func:`merge_weighting`,
  :class:`TokenLedger`). A contribution's weight is the loss tokens it trained on times
  ``(1 + s) ** -staleness_power``, where ``s`` is its staleness (below; staleness-aware async
  SGD, Zhang et al. 2016, divides the step by the staleness). A merge divides by one
  *round's worth* of tokens: the tokens the merged replicas trained on plus, for every active
  replica not in the merge, the tokens per rank of its own latest merged period times its
  ranks (a replica never merged yet: the tokens per rank of all merged periods so far). So a
  merge of every replica is the synchronous round's token-weighted mean, also when
  ``inner_time_s`` cut the periods short; a merge of some moves the weights by their share of
  a round; and a discount really shrinks a stale step instead of being normalised away.
* **Work.** ``work``, the rounds' worth of tokens merged, grows by each merged contribution's
  tokens over its merge's divisor (a stale contribution's in full: its data is trained, while
  its weight is discounted). When a replica's period is merged, the earlier merges that stood
  in for it are counted again with the tokens it did train, and the difference is added to
  ``work`` then, as far as ``work`` does not go down: ``work`` is the rounds' worth of tokens
  in hindsight, and replicas whose token counts are steady, equal or not, land it on whole
  rounds. It drives the run's end, both lr schedules and the delayed cycles.
* **Outer momentum** (``decoupled_momentum``) and what staleness counts. With ``every_step``
  each merge is one step of the outer optimizer, as each synchronous round is, and a
  contribution's staleness is the merges applied since it started. With **delayed
  Nesterov** (the default) (Liu et al., "Asynchronous Local-SGD", 2024) each merge applies its
  gradient part at once, ``theta -= lr * g``, and adds ``g`` to the momentum; once ``work``
  passes a whole round (a *cycle*) the momentum part is applied, ``m = beta * m + sum(g)``,
  ``theta -= lr * beta * m``; staleness counts the cycles ended since the contribution started
  (:func:`momentum_steps`). The lr follows its schedule by whole rounds of ``work``, so it is
  one lr through a cycle, and a cycle is exactly one synchronous Nesterov step whose gradient
  is the sum of what its merges applied. One buffer per parameter holds ``beta * m`` plus the
  cycle's gradients so far, so it costs what plain Nesterov costs.

That sum is the synchronous round's token-weighted mean when every merge of the cycle divided
by the tokens the cycle merged: the cycle holds one period of each active replica, none stale
(or ``staleness_power`` 0), and every stand-in was what its replica trained, which holds once
each replica has been merged and while each trains the tokens its previous period did. It
differs (1) in a cycle with a stand-in that was off: a replica's first period (stood in at the
average), or one whose token count changed; what those merges applied is not revised, only
``work`` is; (2) in a cycle that ends past a whole round by more than round-off (a replica
merged twice in it): it applies its contributions' token-weighted mean times the rounds'
worth it merged, and the next cycle ends that much sooner.

With ``outer_grad_clip`` the cycle is clipped by its own norm, as the synchronous step is
clipped by its round's: each merge brings what the cycle has applied to its unclipped
gradient so far times the clip coefficient of that gradient's norm
(:func:`delayed_nesterov_clipped_`, each server's part of the norm from :func:`cycle_sumsq`;
the server calls it through :meth:`~diloco_ray.algo.outer.OuterOptimizer.apply_delayed`), so
a cycle ends having applied its merges' sum clipped by that sum's norm: where (1) and (2) are
not in play, the synchronous clipped step, up to fp32 round-off. It costs one more fp32
buffer per parameter (checkpointed with the momentum), only in that configuration.
When to merge and how long each period runs is :mod:`diloco_ray.algo.merge_timing`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from diloco_ray.algo.codecs import DEVICE_CHUNK

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
    tokens: Mapping[int, float], staleness: Mapping[int, int], absent_tokens: float, power: float
) -> Weighting:
    """Weights, divisor and shares of one merge.

    Args:
        tokens: merged replica id -> the loss tokens its period trained on (all its ranks).
        staleness: merged replica id -> its staleness (see :func:`momentum_steps`).
        absent_tokens: what stands in for the active replicas not in this merge: the tokens
            a period of theirs trains on (:meth:`TokenLedger.weigh` estimates it).
        power: ``staleness_power``.
    """
    divisor = sum(tokens.values()) + absent_tokens
    if divisor <= 0 or absent_tokens < 0:
        raise ValueError(f"a merge needs tokens > 0 and absent tokens >= 0, got {divisor}, {absent_tokens}")
    weights = {rid: staleness_weight(t, staleness[rid], power) for rid, t in tokens.items()}
    return Weighting(weights, float(divisor), {rid: t / divisor for rid, t in tokens.items()})


@dataclass
class _StoodIn:
    """A merge whose divisor holds stand-ins for replicas that were training: it is settled
    replica by replica as their periods are merged.

    Args:
        index: the merge's index.
        tokens: the tokens its merged replicas trained on.
        divisor: its divisor, with the stand-ins settled so far replaced by what the
            replicas trained.
        stand_ins: replica id -> (its ranks, the tokens per rank it stood in at).
    """

    index: int
    tokens: float
    divisor: float
    stand_ins: dict[int, tuple[int, float]]


class TokenLedger:
    """What a merge's divisor knows of the replicas not in it, and the hindsight count of
    ``work``.

    An active replica not in a merge stands in at the tokens per rank of its own latest
    merged period, times its ranks; one never merged yet at the tokens one rank has trained
    per period so far (all merged tokens over all merged rank-periods). So replicas whose
    periods train steady, if unequal, token counts see the same divisor at every merge:
    the tokens of one period of each, and a cycle of one period of each adds up to one
    round and applies their token-weighted mean.

    When a replica's period is merged, the merges that stood in for it while it trained are
    settled: each one's share of a round is counted again with what the replica did train
    in place of its stand-in, and the difference is added to the replica's share now. So
    ``work`` is the rounds' worth of tokens in hindsight and lands on whole rounds after a
    cold start or a change of pace; what those merges applied to the weights is not
    revised. A settlement that would take ``work`` back is applied only as far as the merge
    keeps ``work`` from going down (a cycle already ended is never undone).
    """

    def __init__(self):
        self.per_rank: dict[int, float] = {}  # replica id -> tokens per rank of its latest merged period
        self.tokens, self.rank_periods = 0.0, 0  # all merged tokens, and the rank-periods they came from
        self.stood_in: list[_StoodIn] = []  # merges not settled yet, oldest first

    def weigh(
        self,
        tokens: Mapping[int, float],
        ranks: Mapping[int, int],
        absent: Mapping[int, int],
        staleness: Mapping[int, int],
        power: float,
        index: int,
    ) -> Weighting:
        """The weighting of merge ``index``, and its place in the ledger.

        Args:
            tokens: merged replica id -> the loss tokens its period trained on.
            ranks: merged replica id -> its ranks (``world_size``).
            absent: replica id -> ranks, for every active replica not in the merge.
            staleness: merged replica id -> its staleness.
            power: ``staleness_power``.
            index: the merge's index (see :meth:`rewind`).
        """
        self.rank_periods += sum(ranks[rid] for rid in tokens)
        self.tokens += sum(tokens.values())
        settled = self._settle(tokens, ranks, set(absent))
        for rid, t in tokens.items():
            self.per_rank[rid] = t / ranks[rid]
        every_rank = self.tokens / self.rank_periods
        stand_ins = {rid: (n, self.per_rank.get(rid, every_rank)) for rid, n in absent.items()}
        by_rate: dict[float, int] = {}  # (one product per rate: equal rates give the one-average divisor)
        for n, rate in stand_ins.values():
            by_rate[rate] = by_rate.get(rate, 0) + n
        weighting = merge_weighting(tokens, staleness, sum(n * rate for rate, n in by_rate.items()), power)
        if stand_ins:
            self.stood_in.append(_StoodIn(index, sum(tokens.values()), weighting.divisor, stand_ins))
        if not settled:
            return weighting
        # Never below the work already counted: scale a net negative settlement back to fit.
        floor = -sum(weighting.shares.values())
        total = sum(settled.values())
        if total < floor:
            settled = {rid: c * floor / total for rid, c in settled.items()}
        shares = {rid: share + settled.get(rid, 0.0) for rid, share in weighting.shares.items()}
        return Weighting(weighting.weights, weighting.divisor, shares)

    def _settle(self, tokens: Mapping[int, float], ranks: Mapping[int, int], absent: set[int]) -> dict[int, float]:
        """Replace the stand-ins for the merged replicas by what they trained, in every
        merge that holds one; forget those of replicas no longer active. Returns merged
        replica id -> the shares of a round its stand-ins were off by."""
        settled: dict[int, float] = {}
        for merge in self.stood_in:
            for rid in [r for r in merge.stand_ins if r not in tokens and r not in absent]:
                del merge.stand_ins[rid]  # it left: its period will never be merged
            for rid in [r for r in merge.stand_ins if r in tokens]:
                n, rate = merge.stand_ins.pop(rid)
                if tokens[rid] / ranks[rid] == rate:
                    continue
                divisor = merge.divisor - n * rate + tokens[rid]
                settled[rid] = settled.get(rid, 0.0) + merge.tokens / divisor - merge.tokens / merge.divisor
                merge.divisor = divisor
        self.stood_in = [m for m in self.stood_in if m.stand_ins]
        return settled

    def rewind(self, index: int) -> None:
        """The servers went back to before merge ``index`` (restored from a checkpoint):
        forget the stand-ins of the merges undone. Settlements those merges made are not
        made again; the latest tokens per replica stay the best estimate there is."""
        self.stood_in = [m for m in self.stood_in if m.index < index]


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
    param: torch.Tensor,
    grad: torch.Tensor,
    buffer: torch.Tensor,
    lr: float,
    beta: float,
    cycle_end: bool,
    beta_next: Optional[float] = None,
) -> None:
    """One merge's delayed-Nesterov update of one parameter, in place.

    Args:
        param: the global weights.
        grad: the merge's outer gradient (already weighted, divided and clipped).
        buffer: ``beta * m`` plus the gradients merged since the last cycle end.
        lr: the outer learning rate.
        beta: the outer momentum.
        cycle_end: a round's worth has now been merged: apply the momentum part.
        beta_next: the momentum of the next update, which the buffer is decayed by at a
            cycle's end (None: ``beta``). torch's Nesterov decays the buffer by the momentum
            of the update that adds to it, so under a momentum warm-up a cycle of one merge
            is its synchronous step only when the decay waits for the next update's value.
    """
    param.sub_(grad, alpha=lr)
    buffer.add_(grad)
    if cycle_end:
        param.sub_(buffer, alpha=lr * beta)
        buffer.mul_(beta if beta_next is None else beta_next)


def cycle_sumsq(cycle: Optional[torch.Tensor], grad: torch.Tensor, chunk: int = 1 << 16) -> float:
    """The sum of squares of ``cycle + grad``, added and squared in float64 a chunk at a time
    (no copy of the whole rows): one server's part, for one parameter's rows, of the squared
    norm of the cycle's gradient once a merge's ``grad`` has joined it (``cycle`` None: the
    cycle's first merge on these rows). The cycle's norm is the square root of every
    server's parts added up, as a merge's norm is."""
    flat = grad.reshape(-1)
    if not flat.numel():
        return 0.0
    if flat.device.type != "cpu":
        return sumsq_there(flat, cycle)
    parts = flat.split(chunk)
    others = cycle.reshape(-1).split(chunk) if cycle is not None else [None] * len(parts)
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.float64)
    total = 0.0
    for part, other in zip(parts, others):
        wide = scratch[: part.numel()].copy_(part)
        if other is not None:
            wide.add_(other)
        total += float(torch.dot(wide, wide))
    return total


def sumsq_there(values: torch.Tensor, other: Optional[torch.Tensor] = None) -> float:
    """The sum of squares of ``values`` (plus ``other``, of its size), in float64 on their
    own device: a large chunk at a time, summed there and read once. A server's GPU's way
    (``server_gpus``): the host's -- a small chunk at a time through one reused scratch,
    each read as it is done -- would wait on the GPU for every chunk."""
    flat = values.reshape(-1)
    parts = flat.split(DEVICE_CHUNK)
    others = other.reshape(-1).split(DEVICE_CHUNK) if other is not None else [None] * len(parts)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for part, add in zip(parts, others):
        wide = part.double()
        if add is not None:
            wide.add_(add)
        total += torch.dot(wide, wide)
    return float(total)


@torch.no_grad()
def delayed_nesterov_clipped_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buffer: torch.Tensor,
    cycle: torch.Tensor,
    lr: float,
    beta: float,
    coef_before: float,
    coef_now: float,
    cycle_end: bool,
    beta_next: Optional[float] = None,
) -> None:
    """One merge's delayed-Nesterov update of one parameter, clipped by its cycle, in place.

    The cycle's merges so far sum to ``G`` (``cycle``, unclipped); with this merge's ``grad``
    it is ``G' = G + grad``. What the cycle has applied so far was ``coef_before * G``; this
    merge brings it to ``coef_now * G'``, so it applies the difference,
    ``coef_now * G' - coef_before * G``, as :func:`delayed_nesterov_` applies a merge's
    gradient. At the cycle's end the cycle has applied ``c * G_cycle``, ``c`` the clip
    coefficient of the cycle's own norm, and the momentum step takes that: the cycle is one
    synchronous Nesterov step on the clipped gradient of the cycle. Between cycle ends the
    weights stand at the cycle's gradient so far, clipped by its norm so far.

    Args:
        param: the global weights.
        grad: the merge's outer gradient (weighted and divided, not clipped); consumed (it
            becomes the part applied).
        buffer: ``beta * m`` plus what was applied since the last cycle end.
        cycle: the cycle's unclipped merge gradients so far; ``grad`` is added, and it is
            zeroed at the cycle's end. One more fp32 buffer per parameter.
        lr: the outer learning rate.
        beta: the outer momentum.
        coef_before: the clip coefficient of the cycle's gradient before this merge (1.0 at
            a cycle's first merge).
        coef_now: the clip coefficient of the cycle's gradient with this merge (of the norm
            whose parts :func:`cycle_sumsq` gives).
        cycle_end: a round's worth has now been merged: apply the momentum part.
        beta_next: as :func:`delayed_nesterov_`'s.
    """
    cycle.add_(grad)
    if coef_before != 1.0:
        grad.mul_(coef_before)
    if coef_now != coef_before:
        grad.add_(cycle, alpha=coef_now - coef_before)
    delayed_nesterov_(param, grad, buffer, lr, beta, cycle_end, beta_next)
    if cycle_end:
        cycle.zero_()


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
