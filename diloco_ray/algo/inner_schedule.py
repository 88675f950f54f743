"""The inner loop's clock, as plain arithmetic: the learning rate at a step, and which steps
end with which fragment's sync."""

from __future__ import annotations

import math

from diloco_ray.config.schema import TrainerConfig


def inner_lr_at(step: int, config: TrainerConfig) -> float:
    """Inner learning rate at global inner step ``step`` (0-based, counted over the run).

    Linear warmup over ``warmup_steps``, then ``lr_schedule`` decays from ``lr`` towards
    ``lr * min_lr_ratio``, reached at step ``max_steps * diloco_loops`` (one past the last
    step, as in transformers' schedules).
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    total = max(1, config.max_steps * config.diloco_loops - config.warmup_steps)
    frac = min(1.0, (step - config.warmup_steps) / total)
    floor = config.lr * config.min_lr_ratio
    if config.lr_schedule == "cosine":
        return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return floor + (config.lr - floor) * (1.0 - frac)


def sync_period(fragment: int, steps: int, fragments: int) -> tuple[int, int]:
    """The inner steps ``[first, last)`` of a round that end with ``fragment``'s sync:
    syncs fall at ``floor((k + 1) * steps / fragments)``, so periods differ by at most one."""
    return fragment * steps // fragments, (fragment + 1) * steps // fragments
