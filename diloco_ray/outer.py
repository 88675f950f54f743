"""The public path of the outer optimizer: ``from diloco_ray.outer import OuterOptimizer``
(docs/interface.md, "The outer step without Ray").

The math lives in :mod:`diloco_ray.algo.outer`, whose optimizer takes only the outer-optimiser
section of a config (:class:`~diloco_ray.config.sections.OuterOptimSection`); its ``step`` is
the parameter servers' outer step, made of the same calls. The class here is that optimizer
with the documented constructor: it takes a whole
:class:`~diloco_ray.config.schema.TrainerConfig` too, and cuts the section out of it.
"""

from __future__ import annotations

from typing import Mapping, Union

from torch import Tensor

from diloco_ray.algo import outer as outer_math
from diloco_ray.algo.outer import clip_coefficient, outer_lr_at, outer_momentum_at
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import OuterOptimSection, section_of

__all__ = ["OuterOptimizer", "OuterOptimSection", "clip_coefficient", "outer_lr_at", "outer_momentum_at"]


class OuterOptimizer(outer_math.OuterOptimizer):
    """:class:`diloco_ray.algo.outer.OuterOptimizer`, built from a config or its outer section.

    Args:
        global_params: name -> tensor (fp32 copies are taken; the caller's are never mutated).
        config: a TrainerConfig or its ``sections().outer_optim``; any other object with the
            outer section's attributes (``outer_opt``, ``outer_opt_kwargs``, ``outer_lr``,
            ``outer_momentum``, ``outer_lr_schedule``, ``outer_grad_clip``, ``diloco_loops``)
            works too.
    """

    def __init__(self, global_params: Mapping[str, Tensor], config: Union[TrainerConfig, OuterOptimSection]) -> None:
        super().__init__(global_params, outer_section(config))


def outer_section(config: Union[TrainerConfig, OuterOptimSection]) -> OuterOptimSection:
    """The outer-optimiser section of ``config`` (itself when it is one; read attribute by
    attribute from an object that is neither)."""
    if isinstance(config, OuterOptimSection):
        return config
    if isinstance(config, TrainerConfig):
        return config.sections().outer_optim
    return section_of(OuterOptimSection, config)
