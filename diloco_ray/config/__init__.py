"""What a job is: the config schema and its validation, the fault plan, and the generated field docs.

Nothing here imports another subpackage: a config loads and validates without torch or Ray.

``from diloco_ray.config import TrainerConfig`` is the public path (CONTRACT.md).
"""

from diloco_ray.config.schema import TrainerConfig

__all__ = ["TrainerConfig"]
