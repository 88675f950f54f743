"""Decoupled mode's math without Ray: delayed Nesterov equals a synchronous Nesterov step
per cycle, staleness weights, the cycle count, and the adaptive grace window."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_ray.algo import decoupled


def torch_nesterov(start: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float) -> torch.Tensor:
    p = start.clone().requires_grad_(True)
    opt = torch.optim.SGD([p], lr=lr, momentum=beta, nesterov=True)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_cycle_of_merges_is_one_synchronous_nesterov_step(parts):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=g)
    rounds = [torch.randn(5, 3, generator=g) for _ in range(3)]
    p, buf = start.clone(), torch.zeros_like(start)
    for full in rounds:
        # Each round's gradient arrives as `parts` merges that add up to it.
        pieces = [full * w for w in torch.linspace(1, 2, parts) / torch.linspace(1, 2, parts).sum()]
        for i, piece in enumerate(pieces):
            decoupled.delayed_nesterov_(p, piece, buf, lr=0.7, beta=0.9, cycle_end=i == parts - 1)
    torch.testing.assert_close(p, torch_nesterov(start, rounds, 0.7, 0.9), rtol=1e-5, atol=1e-6)


def test_between_cycle_ends_a_merge_moves_by_its_gradient_alone():
    p, buf = torch.ones(4), torch.full((4,), 2.0)  # buf: beta * m from an earlier cycle
    decoupled.delayed_nesterov_(p, torch.full((4,), 0.5), buf, lr=0.1, beta=0.9, cycle_end=False)
    torch.testing.assert_close(p, torch.full((4,), 0.95))
    torch.testing.assert_close(buf, torch.full((4,), 2.5))


def test_staleness_discounts_by_the_configured_power():
    assert decoupled.staleness_weight(100, 0, 1.0) == 100
    assert decoupled.staleness_weight(100, 1, 1.0) == 50
    assert decoupled.staleness_weight(100, 3, 0.5) == pytest.approx(50)
    assert decoupled.staleness_weight(100, 5, 0.0) == 100
    with pytest.raises(ValueError, match="staleness"):
        decoupled.staleness_weight(100, -1, 1.0)


def test_cycles_end_when_a_whole_round_has_been_merged():
    work, ends = 0.0, []
    for _ in range(6):
        before, work = work, work + 1 / 3
        ends.append(decoupled.cycle_ends(before, work))
    assert ends == [False, False, True, False, False, True]
    assert decoupled.cycle_ends(0.5, 2.5)  # one big merge past a boundary


def test_a_merge_divides_by_a_round_of_the_tokens_trained():
    # Both replicas merged (inner_time_s cut their periods short): the divisor is the tokens
    # they trained on, so the merge is the synchronous token-weighted mean (bug: it was the
    # tokens of full periods, and the update 0.75x the synchronous one).
    w = decoupled.merge_weighting({0: 300.0, 1: 150.0}, {0: 0, 1: 0}, 0.0, 1.0)
    assert (w.weights, w.divisor, w.shares) == ({0: 300.0, 1: 150.0}, 450.0, {0: 300 / 450, 1: 150 / 450})
    assert w.applied == pytest.approx(1.0) and sum(w.shares.values()) == pytest.approx(1.0)
    # One merged, a replica still training stands in at 580 tokens.
    w = decoupled.merge_weighting({0: 300.0}, {0: 0}, 580.0, 1.0)
    assert w.divisor == 300.0 + 580.0 and w.shares == {0: 300.0 / 880.0}
    # A stale contribution: its weight is discounted, its share of the work is not.
    w = decoupled.merge_weighting({0: 300.0, 1: 300.0}, {0: 0, 1: 1}, 0.0, 1.0)
    assert w.weights == {0: 300.0, 1: 150.0} and w.shares == {0: 0.5, 1: 0.5} and w.applied == 0.75
    with pytest.raises(ValueError):
        decoupled.merge_weighting({}, {}, 0.0, 1.0)


def test_staleness_counts_outer_momentum_steps():
    # every_step: one momentum step per merge (the version); delayed: one per whole round's worth.
    assert decoupled.momentum_steps(7, 2.5, "every_step") == 7
    assert [decoupled.momentum_steps(7, w, "delayed") for w in (0.0, 0.5, 0.999, 1.0, 2.5)] == [0, 0, 0, 1, 2]
    # Shares adding up to a whole round with round-off end the cycle (as cycle_ends does).
    assert decoupled.momentum_steps(0, 0.1 + 0.2 + 0.3 + 0.4 - 1e-12, "delayed") == 1


def test_a_stale_pseudo_gradient_against_the_momentum_loses_its_component_along_it():
    m = torch.tensor([1.0, 0.0, 0.0])
    aligned = torch.tensor([0.5, 2.0, 0.0])
    assert decoupled.correct_stale_(aligned, m) == pytest.approx(0.5 / math.sqrt(4.25))
    assert aligned.tolist() == [0.5, 2.0, 0.0]  # agrees with the trajectory: kept
    against = torch.tensor([-3.0, 1.0, 2.0])
    cosine = decoupled.correct_stale_(against, m)
    assert cosine == pytest.approx(-3.0 / math.sqrt(14.0))
    assert against.tolist() == [0.0, 1.0, 2.0]  # the part along the momentum removed, the rest kept
    untouched = torch.tensor([-1.0, 1.0, 0.0])
    assert decoupled.correct_stale_(untouched, torch.zeros(3)) == 0.0 and untouched.tolist() == [-1.0, 1.0, 0.0]
