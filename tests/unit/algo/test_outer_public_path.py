"""The documented outer-optimizer path (docs/interface.md): ``diloco_ray.outer.OuterOptimizer`` takes a
TrainerConfig or the outer-optimiser section built from it, while ``diloco_ray.algo.outer``'s
takes the section only; both step bitwise alike (no Ray)."""

from __future__ import annotations

import types

import torch

from diloco_ray.algo import outer as outer_math
from diloco_ray.config import TrainerConfig
from diloco_ray.outer import OuterOptimizer, OuterOptimSection, outer_section


def make(**overrides) -> TrainerConfig:
    base = dict(model_config={"model_type": "llama"}, tokenizer_name="builtin:char", dataset_name="builtin:arithmetic")
    return TrainerConfig(**{**base, **overrides})


def start():
    return {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.25])}


def grads(k):
    g = torch.Generator().manual_seed(k)
    return [{n: torch.randn(p.shape, generator=g) for n, p in start().items()} for _ in range(2)]


def three_rounds(opt):
    for r in range(3):
        out = opt.step(grads(r), [1.0, 3.0])
    return out, opt.state_dict()


def test_a_trainer_config_and_its_section_step_alike():
    cfg = make(outer_lr=0.6, outer_momentum=0.8, outer_lr_schedule="cosine", diloco_loops=4, outer_grad_clip=1.5)
    runs = [
        OuterOptimizer(start(), cfg),
        OuterOptimizer(start(), cfg.sections().outer_optim),
        outer_math.OuterOptimizer(start(), cfg.sections().outer_optim),
    ]
    results = [three_rounds(opt) for opt in runs]
    for params, state in results[1:]:
        for name, value in results[0][0].items():
            assert torch.equal(params[name], value)
        assert state["round"] == results[0][1]["round"] == 3
    assert all(isinstance(opt, outer_math.OuterOptimizer) for opt in runs)


def test_the_public_path_reads_the_config_outer_fields():
    cfg = make(outer_opt="SGD", outer_lr=0.3, outer_momentum=0.5, outer_opt_kwargs={"nesterov": False})
    opt = OuterOptimizer(start(), cfg)
    group = opt._optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.3, 0.5, False)
    assert opt.lr_at(0) == 0.3 and opt.max_norm is None


def test_outer_section_of_each_kind_of_config():
    cfg = make(outer_lr=0.4)
    section = cfg.sections().outer_optim
    assert outer_section(cfg) is section
    assert outer_section(section) is section
    names = {f: getattr(section, f) for f in OuterOptimSection.__dataclass_fields__}
    assert outer_section(types.SimpleNamespace(**names)) == section  # an object with the names, as before
