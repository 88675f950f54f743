"""The public path of the outer optimizer: ``from diloco_ray.outer import OuterOptimizer`` (CONTRACT.md).

The math lives in :mod:`diloco_ray.algo.outer`; this module only keeps the documented import working.
"""

from diloco_ray.algo.outer import OuterOptimizer, clip_coefficient, outer_lr_at

__all__ = ["OuterOptimizer", "clip_coefficient", "outer_lr_at"]
