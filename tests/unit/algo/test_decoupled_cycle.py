"""A delayed-Nesterov cycle against the synchronous round, on plain tensors: what stands in
for the replicas not in a merge (:class:`~diloco_ray.algo.decoupled.TokenLedger`), where
cycles end, and clipping by the cycle (:func:`~diloco_ray.algo.decoupled.delayed_nesterov_clipped_`).

Each replica's k-th period has a fixed pseudo-gradient, merged as the server merges it
(weights over the divisor, ``work`` grown by the shares, the momentum at each whole round),
and the result is checked against ``torch.optim.SGD(nesterov=True)`` stepping once per
round on the round's token-weighted mean.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from diloco_ray.algo import decoupled
from diloco_ray.algo.outer import clip_coefficient

LR, BETA = 0.7, 0.9
SHAPE = (6, 5)


def pseudo_grads(replicas: int, periods: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(SHAPE, generator=g) for _ in range(periods)] for _ in range(replicas)]


def synchronous(rounds: list[torch.Tensor], clip=None) -> torch.Tensor:
    """One torch Nesterov step per round from its gradient, clipped as clip_grad_norm_ does."""
    p = torch.zeros(SHAPE).requires_grad_(True)
    opt = torch.optim.SGD([p], lr=LR, momentum=BETA, nesterov=True)
    for g in rounds:
        p.grad = g.clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
    return p.detach()


def merge(sequence, tokens, grads, ranks=None):
    """Merge ``sequence`` (lists of replica ids) as the driver and server do, with
    staleness_power 0. ``tokens(rid, k)``: the tokens of replica rid's k-th period. Returns
    the weights, the merges that ended a cycle, what each cycle applied, and ``work`` after
    each merge."""
    ranks = ranks or dict.fromkeys(range(len(grads)), 1)
    ledger, period = decoupled.TokenLedger(), dict.fromkeys(ranks, 0)
    p, buf, applied = torch.zeros(SHAPE), torch.zeros(SHAPE), torch.zeros(SHAPE)
    work, works, ends, cycles = 0.0, [], [], []
    for i, group in enumerate(sequence):
        merged = {r: float(tokens(r, period[r])) for r in group}
        absent = {r: n for r, n in ranks.items() if r not in group}
        w = ledger.weigh(merged, {r: ranks[r] for r in group}, absent, dict.fromkeys(group, 0), 0.0, i)
        g = sum(grads[r][period[r]] * w.weights[r] for r in group) / w.divisor
        before, work = work, work + sum(w.shares.values())
        end = decoupled.cycle_ends(before, work)
        decoupled.delayed_nesterov_(p, g, buf, LR, BETA, end)
        applied += g
        if end:
            ends.append(i)
            cycles.append(applied)
            applied = torch.zeros(SHAPE)
        for r in group:
            period[r] += 1
        works.append(work)
    return p, ends, cycles, works


def steady(r, k):
    return (300, 100)[r]


def mean_of(grads, k, tokens=(300, 100)):
    return sum(grads[r][k] * t for r, t in enumerate(tokens)) / sum(tokens)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_unequal_replicas_merged_one_at_a_time_make_one_synchronous_round_per_cycle():
    """300 vs 100 tokens a period: a first merge of both, then each alone, in turn. Every
    merge divides by the round's 400 tokens (each absent replica at its own latest period),
    so a cycle ends at each merge of replica 1, the last one's too, each cycle applies the
    round's token-weighted mean, and the weights are the synchronous rounds'. (Bug: one
    running average per rank stood in for both: cycles ended at merges 0, 3, 5, 7, the
    fifth never, and the weights were 0.26 off the synchronous rounds', relative.)"""
    cycles = 5
    grads = pseudo_grads(2, cycles)
    p, ends, applied, works = merge([[0, 1]] + [[0], [1]] * (cycles - 1), steady, grads)
    assert ends == list(range(0, 2 * cycles - 1, 2))
    assert works == [1.0] + [w for k in range(1, cycles) for w in (k + 0.75, k + 1.0)]
    for k in range(cycles):
        torch.testing.assert_close(applied[k], mean_of(grads, k), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p, synchronous([mean_of(grads, k) for k in range(cycles)]), rtol=1e-5, atol=1e-6)


def test_a_cold_start_shifts_the_first_cycle_only_and_cycles_still_end_on_whole_rounds():
    """Replica 0 merged before replica 1 ever reported: replica 1 stands in at the running
    average per rank (300), so that merge applies 300/600 of replica 0 instead of 300/400.
    Replica 1's merge settles the count (the first merge was 0.75 of a round), so the cycle
    ends there, at work 1.0, and every later cycle is the synchronous round."""
    cycles = 4
    grads = pseudo_grads(2, cycles)
    p, ends, applied, works = merge([[0], [1]] * cycles, steady, grads)
    assert ends == [1, 3, 5, 7]
    assert works == [0.5, 1.0] + [w for k in range(1, cycles) for w in (k + 0.75, k + 1.0)]
    first = grads[0][0] * 0.5 + grads[1][0] * 0.25  # the documented difference: 300/600 and 100/400
    torch.testing.assert_close(applied[0], first, rtol=1e-6, atol=1e-6)
    for k in range(1, cycles):
        torch.testing.assert_close(applied[k], mean_of(grads, k), rtol=1e-6, atol=1e-6)
    rounds = [first] + [mean_of(grads, k) for k in range(1, cycles)]
    torch.testing.assert_close(p, synchronous(rounds), rtol=1e-5, atol=1e-6)
    # Against the synchronous rounds themselves, the first cycle's weights are all that differ.
    assert relative(p, synchronous([mean_of(grads, k) for k in range(cycles)])) < 0.2


def test_work_counts_the_rounds_in_hindsight_when_a_replica_changes_pace():
    """Replica 1's third period trains 60 tokens instead of 100 (cut short) and the later
    ones 100 again; each is merged alone, between replica 0's. The merges that stood in for
    it at 100 are settled when it reports, so work is the tokens merged over the round's
    tokens at every merge that completes one period of each: whole rounds."""

    def tokens(r, k):
        return 60 if (r, k) == (1, 2) else (300, 100)[r]

    grads = pseudo_grads(2, 6)
    _, ends, _, works = merge([[0, 1]] + [[0], [1]] * 5, tokens, grads)
    # Round 3 held 300 + 60 tokens: in hindsight that whole round is one, as every other.
    assert [works[i] for i in range(0, 11, 2)] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], abs=1e-12)
    assert ends == [0, 2, 4, 6, 8, 10]


def test_shares_that_do_not_add_up_to_one_in_floats_still_end_every_cycle_on_its_round():
    """Three replicas of 7, 11 and 13 tokens (a round of 31; no share is a binary fraction),
    merged one at a time for 3000 rounds: each cycle ends at the merge that completes its
    round, and the cycles counted are the rounds (round-off stays inside CYCLE_EPS)."""
    ledger, tokens, work, ends = decoupled.TokenLedger(), (7.0, 11.0, 13.0), 0.0, []
    ledger.weigh(dict(enumerate(tokens)), dict.fromkeys(range(3), 1), {}, dict.fromkeys(range(3), 0), 0.0, 0)
    work = 1.0
    for i in range(3 * 3000):
        r = i % 3
        absent = {a: 1 for a in range(3) if a != r}
        w = ledger.weigh({r: tokens[r]}, {r: 1}, absent, {r: 0}, 0.0, i + 1)
        assert w.divisor == 31.0
        before, work = work, work + w.shares[r]
        if decoupled.cycle_ends(before, work):
            ends.append(i)
    assert ends == list(range(2, 3 * 3000, 3))
    assert decoupled.momentum_steps(0, work, "delayed") == 3001 and abs(work - 3001) < 1e-9


def test_a_settlement_never_takes_work_back():
    """A big replica (900 tokens) never merged yet stands in at the small one's 100 while the
    small one is merged three times: each of those counted 0.5 of a round, 1.5 in all, where
    hindsight says 0.3 (and 0.9 for its own merge). Its merge settles what it can without
    taking work back: the merge adds nothing, and work stays at 1.5 (the cycle that ended is
    not undone)."""
    ledger = decoupled.TokenLedger()
    shares = []
    for i in range(3):
        w = ledger.weigh({0: 100.0}, {0: 1}, {1: 1}, {0: 0}, 0.0, i)
        shares.append(sum(w.shares.values()))
    w = ledger.weigh({1: 900.0}, {1: 1}, {0: 1}, {1: 0}, 0.0, 3)
    assert shares == [0.5, 0.5, 0.5] and sum(w.shares.values()) == pytest.approx(0.0, abs=1e-15)
    assert w.divisor == 1000.0 and w.weights == {1: 900.0}  # what is applied is not revised
    assert [m.index for m in ledger.stood_in] == [3]  # the first three are settled


def test_a_rewind_forgets_the_stand_ins_of_the_merges_undone():
    ledger = decoupled.TokenLedger()
    ledger.weigh({0: 100.0, 1: 100.0}, {0: 1, 1: 1}, {}, {0: 0, 1: 0}, 0.0, 0)
    ledger.weigh({0: 300.0}, {0: 1}, {1: 1}, {0: 0}, 0.0, 1)
    ledger.weigh({0: 300.0}, {0: 1}, {1: 1}, {0: 0}, 0.0, 2)
    ledger.rewind(2)
    assert [m.index for m in ledger.stood_in] == [1]
    # A replica that left is no longer stood in for: nothing to settle.
    ledger.weigh({0: 300.0}, {0: 1}, {}, {0: 0}, 0.0, 2)
    assert not ledger.stood_in


@pytest.mark.parametrize("ranks, per_rank", [({0: 1, 1: 2, 2: 3}, 137.0), ({0: 3, 1: 3, 2: 3}, 400.0 / 3)])
def test_equal_tokens_per_rank_weigh_as_the_running_average_did_to_the_bit(ranks, per_rank):
    """With every rank training the same tokens, the divisor and shares are, bit for bit,
    those of the earlier rule (one running average per rank for every absent rank)."""
    rng = random.Random(0)
    ledger, rank_tokens, rank_periods = decoupled.TokenLedger(), 0.0, 0
    for i in range(40):
        group = sorted(rng.sample(sorted(ranks), rng.randint(1, len(ranks))))
        tokens = {r: per_rank * ranks[r] for r in group}
        absent = {r: n for r, n in ranks.items() if r not in group}
        staleness = {r: rng.randint(0, 2) for r in group}
        rank_periods += sum(ranks[r] for r in group)
        rank_tokens += sum(tokens.values())
        before = decoupled.merge_weighting(tokens, staleness, sum(absent.values()) * (rank_tokens / rank_periods), 1.0)
        now = ledger.weigh(tokens, {r: ranks[r] for r in group}, absent, staleness, 1.0, i)
        assert (now.divisor, now.shares, now.weights) == (before.divisor, before.shares, before.weights)


# ---- clipping by the cycle ---------------------------------------------------------------
def clipped_cycles(parts: list[list[torch.Tensor]], clip: float, rule: str) -> torch.Tensor:
    """Each cycle's merges ``parts`` (they add up to its gradient) through the server's
    delayed-Nesterov step: clipped by the cycle's running norm (``cycle``), or each by its
    own norm (``merge``, what OuterOptimizer.apply_delayed does with a merge's norm)."""
    p, buf, cycle = torch.zeros(SHAPE), torch.zeros(SHAPE), torch.zeros(SHAPE)
    for merges in parts:
        coef_before = 1.0
        for i, g in enumerate(merges):
            end = i == len(merges) - 1
            if rule == "cycle":
                coef = clip_coefficient(math.sqrt(decoupled.cycle_sumsq(cycle, g)), clip)
                decoupled.delayed_nesterov_clipped_(p, g.clone(), buf, cycle, LR, BETA, coef_before, coef, end)
                coef_before = 1.0 if end else coef
            else:
                coef = clip_coefficient(float(g.norm()), clip)
                decoupled.delayed_nesterov_(p, g * coef, buf, LR, BETA, end)
    return p


def cycle_parts(cycles: int, merges: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(SHAPE, generator=g) * (1 + j) / merges for j in range(merges)] for _ in range(cycles)]


@pytest.mark.parametrize("merges", [1, 2, 3])
def test_a_cycle_clipped_by_its_norm_is_one_synchronous_clipped_nesterov_step(merges):
    """outer_grad_clip at half the typical cycle norm: clipping each merge's part so that the
    cycle has applied its gradient clipped by its running norm makes each cycle one
    synchronous Nesterov step on the cycle's gradient clipped as clip_grad_norm_ clips it."""
    parts = cycle_parts(4, merges)
    rounds = [sum(c) for c in parts]
    clip = 0.5 * float(torch.stack([r.norm() for r in rounds]).mean())
    torch.testing.assert_close(clipped_cycles(parts, clip, "cycle"), synchronous(rounds, clip), rtol=1e-5, atol=1e-6)


def test_clipping_each_merge_by_its_own_norm_is_not_the_synchronous_step():
    """What the server does today (each merge clipped by the merge's own norm) differs from
    the synchronous clipped step once clipping bites: 2 merges a cycle, clip at half the
    cycle's norm. The cycle rule closes the gap."""
    parts = cycle_parts(4, 2)
    rounds = [sum(c) for c in parts]
    clip = 0.5 * float(torch.stack([r.norm() for r in rounds]).mean())
    reference = synchronous(rounds, clip)
    assert relative(clipped_cycles(parts, clip, "merge"), reference) > 0.1
    assert relative(clipped_cycles(parts, clip, "cycle"), reference) < 1e-6


def test_nothing_clipped_is_the_unclipped_update_to_the_bit():
    parts = cycle_parts(3, 3)
    p, buf = torch.zeros(SHAPE), torch.zeros(SHAPE)
    for merges in parts:
        for i, g in enumerate(merges):
            decoupled.delayed_nesterov_(p, g.clone(), buf, LR, BETA, i == len(merges) - 1)
    assert torch.equal(clipped_cycles(parts, 1e9, "cycle"), p)


def test_the_cycle_norm_adds_up_over_servers_rows():
    g = torch.Generator().manual_seed(2)
    cycle, grad = torch.randn(8, 3, generator=g), torch.randn(8, 3, generator=g)
    parts = decoupled.cycle_sumsq(cycle[:5], grad[:5]) + decoupled.cycle_sumsq(cycle[5:], grad[5:])
    assert parts == pytest.approx(float((cycle.double() + grad.double()).pow(2).sum()), rel=1e-12)
    assert decoupled.cycle_sumsq(None, grad) == pytest.approx(float(grad.double().pow(2).sum()), rel=1e-12)
    chunked = decoupled.cycle_sumsq(cycle, grad, chunk=5)  # a chunk at a time, the last one short
    assert chunked == pytest.approx(float((cycle.double() + grad.double()).pow(2).sum()), rel=1e-12)
