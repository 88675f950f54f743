"""diloco-ray: DiLoCo training of Hugging Face causal LMs on a Ray cluster.

from diloco_ray import TrainerConfig, DilocoFSDPTrainer
config = TrainerConfig.from_yaml("configs/tiny.yaml", overrides={"output_dir": "out"})
result = DilocoFSDPTrainer(config).train()
"""

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError, DataError, UserInputError

__all__ = ["TrainerConfig", "DilocoFSDPTrainer", "TrainResult", "ConfigError", "DataError", "UserInputError"]
__version__ = "0.1.0"


def __getattr__(name):
    # The trainer pulls in Ray; import it only when asked for, so config tools stay light.
    if name in ("DilocoFSDPTrainer", "TrainResult"):
        from diloco_ray.driver import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'diloco_ray' has no attribute {name!r}")
