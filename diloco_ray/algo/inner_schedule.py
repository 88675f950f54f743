"""The inner loop's clock, as plain arithmetic: the learning rate at a step, and which steps
end with which fragment's sync."""

from __future__ import annotations

import math

from diloco_ray.config.sections import InnerOptimSection


def inner_lr_at(step: int, inner: InnerOptimSection) -> float:
    """Inner learning rate at global inner step ``step`` (0-based, counted over the run).

    Linear warmup over ``warmup_steps``, then ``lr_schedule`` decays from ``lr`` towards
    ``lr * min_lr_ratio``, reached at step ``max_steps * diloco_loops`` (one past the last
    step, as in transformers' schedules).
    """
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    if inner.lr_schedule == "constant":
        return inner.lr
    total = max(1, inner.max_steps * inner.diloco_loops - inner.warmup_steps)
    frac = min(1.0, (step - inner.warmup_steps) / total)
    floor = inner.lr * inner.min_lr_ratio
    if inner.lr_schedule == "cosine":
        return floor + (inner.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return floor + (inner.lr - floor) * (1.0 - frac)


def sync_period(fragment: int, steps: int, fragments: int) -> tuple[int, int]:
    """The inner steps ``[first, last)`` of a round that end with ``fragment``'s sync:
    syncs fall at ``floor((k + 1) * steps / fragments)``, so periods differ by at most one."""
    return fragment * steps // fragments, (fragment + 1) * steps // fragments
