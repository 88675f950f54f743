"""What a job is: the config schema and its validation, the checks run before Ray starts, the fault plan,
and the generated field docs.

``from diloco_ray.config import TrainerConfig`` is the public path (CONTRACT.md).
"""

from diloco_ray.config.schema import TrainerConfig

__all__ = ["TrainerConfig"]
