"""Unit tests for the inner learning-rate schedule and inner optimizer factory (no process group).

Both take the inner-optimiser section of a validated config, as the ranks do."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_ray.algo.inner_schedule import inner_lr_at
from diloco_ray.algo.optimizers import build_inner_optimizer
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import InnerOptimSection
from diloco_ray.errors import ConfigError


def make(**kw) -> InnerOptimSection:
    base = dict(
        model_config={"model_type": "llama"},
        tokenizer_name="builtin:char",
        dataset_name="builtin:arithmetic",
        lr=1.0,
        max_steps=10,
        diloco_loops=2,
        warmup_steps=4,
        min_lr_ratio=0.1,
    )
    return TrainerConfig(**{**base, **kw}).sections().inner_optim


# Run of max_steps * diloco_loops = 20 inner steps, 4 of warmup; decay spans 16 steps and
# reaches lr * min_lr_ratio at step 20 (= max_steps * diloco_loops).


def test_warmup_is_linear():
    cfg = make(lr_schedule="cosine")
    assert [inner_lr_at(s, cfg) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_same_for_every_schedule(schedule):
    cfg = make(lr_schedule=schedule, lr=2e-3, warmup_steps=5)
    assert inner_lr_at(0, cfg) == pytest.approx(2e-3 / 5)
    assert inner_lr_at(2, cfg) == pytest.approx(2e-3 * 3 / 5)
    assert inner_lr_at(4, cfg) == pytest.approx(2e-3)
    assert inner_lr_at(5, cfg) == pytest.approx(2e-3)  # peak right after warmup


def test_cosine_hand_values():
    cfg = make(lr_schedule="cosine")
    assert inner_lr_at(4, cfg) == pytest.approx(1.0)
    # quarter: frac = 4/16 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/4))
    assert inner_lr_at(8, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(0.5)))
    assert inner_lr_at(12, cfg) == pytest.approx(0.55)  # half way: mean of lr and floor
    assert inner_lr_at(20, cfg) == pytest.approx(0.1)  # lr * min_lr_ratio
    assert inner_lr_at(100, cfg) == pytest.approx(0.1)  # clamped after the run


def test_cosine_monotone_and_bounded():
    cfg = make(lr_schedule="cosine")
    lrs = [inner_lr_at(s, cfg) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert min(lrs) == pytest.approx(0.1) and max(lrs) == pytest.approx(1.0)


def test_cosine_without_warmup():
    cfg = make(lr_schedule="cosine", warmup_steps=0, min_lr_ratio=0.0, lr=0.5)
    assert inner_lr_at(0, cfg) == pytest.approx(0.5)
    assert inner_lr_at(10, cfg) == pytest.approx(0.25)
    assert inner_lr_at(20, cfg) == pytest.approx(0.0, abs=1e-12)


def test_linear_hand_values():
    cfg = make(lr_schedule="linear")
    assert inner_lr_at(4, cfg) == pytest.approx(1.0)
    assert inner_lr_at(8, cfg) == pytest.approx(1.0 - 0.9 * 0.25)
    assert inner_lr_at(12, cfg) == pytest.approx(0.55)
    assert inner_lr_at(16, cfg) == pytest.approx(1.0 - 0.9 * 0.75)
    assert inner_lr_at(20, cfg) == pytest.approx(0.1)
    assert inner_lr_at(50, cfg) == pytest.approx(0.1)


def test_constant():
    cfg = make(lr_schedule="constant", lr=3e-4, warmup_steps=0)
    assert {inner_lr_at(s, cfg) for s in (0, 1, 10, 19, 20, 1000)} == {3e-4}
    cfg = make(lr_schedule="constant", lr=3e-4, warmup_steps=2, min_lr_ratio=0.0)
    assert [inner_lr_at(s, cfg) for s in range(5)] == pytest.approx([1.5e-4, 3e-4, 3e-4, 3e-4, 3e-4])


def test_min_lr_ratio_one_is_flat_after_warmup():
    cfg = make(lr_schedule="cosine", min_lr_ratio=1.0)
    assert [inner_lr_at(s, cfg) for s in (4, 9, 15, 20)] == pytest.approx([1.0] * 4)


def test_warmup_longer_than_run():
    cfg = make(lr_schedule="cosine", warmup_steps=30, max_steps=10, diloco_loops=2)
    assert inner_lr_at(14, cfg) == pytest.approx(0.5)
    assert inner_lr_at(29, cfg) == pytest.approx(1.0)


# --- the inner optimizer ------------------------------------------------------------------


def params():
    return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2, 2))]


def test_build_adamw_with_kwargs():
    cfg = make(lr=2e-3, inner_opt_kwargs={"weight_decay": 0.05, "betas": [0.8, 0.95]})
    opt = build_inner_optimizer(params(), cfg)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["lr"] == 2e-3
    assert group["weight_decay"] == 0.05
    assert tuple(group["betas"]) == (0.8, 0.95)
    assert len(group["params"]) == 2


def test_build_adamw_defaults():
    opt = build_inner_optimizer(params(), make(lr=1e-3))
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["lr"] == 1e-3
    assert opt.param_groups[0]["weight_decay"] == torch.optim.AdamW(params()).defaults["weight_decay"]


def test_build_other_optimizer():
    opt = build_inner_optimizer(params(), make(inner_opt="SGD", lr=0.1, inner_opt_kwargs={"momentum": 0.5}))
    assert type(opt) is torch.optim.SGD
    assert opt.param_groups[0]["momentum"] == 0.5 and opt.param_groups[0]["lr"] == 0.1


def test_built_optimizer_steps():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = build_inner_optimizer([p], make(inner_opt="SGD", lr=0.5))
    p.grad = torch.tensor([1.0, 1.0])
    opt.step()
    assert torch.equal(p.detach(), torch.tensor([0.5, -2.5]))


@pytest.mark.parametrize("name", ["AdamQ", "adamw", "Optimizer", "lr_scheduler", "swa_utils"])
def test_unknown_optimizer(name):
    with pytest.raises(ConfigError) as ei:
        build_inner_optimizer(params(), make(inner_opt=name))
    msg = str(ei.value)
    assert msg.startswith("inner_opt:") and f"'{name}'" in msg and "AdamW" in msg


@pytest.mark.parametrize(
    "kwargs, detail", [({"foo": 1}, "foo"), ({"betas": [2.0, 0.9]}, "beta"), ({"weight_decay": -1.0}, "weight_decay")]
)
def test_bad_optimizer_kwargs(kwargs, detail):
    with pytest.raises(ConfigError) as ei:
        build_inner_optimizer(params(), make(inner_opt_kwargs=kwargs))
    msg = str(ei.value)
    assert msg.startswith("inner_opt_kwargs:") and "AdamW" in msg and detail in msg
