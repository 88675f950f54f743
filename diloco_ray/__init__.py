"""diloco-ray: DiLoCo training of Hugging Face causal LMs on a Ray cluster.

from diloco_ray import TrainerConfig, DilocoFSDPTrainer
config = TrainerConfig.from_yaml("configs/tiny.yaml", overrides={"output_dir": "out"})
result = DilocoFSDPTrainer(config).train()

from diloco_ray import run_sweep
swept = run_sweep(config, {"outer_lr": [0.5, 1.0], "outer_momentum": [0.0, 0.5]})
print(swept.best)
"""

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError, DataError, UserInputError

__all__ = [
    "TrainerConfig",
    "DilocoFSDPTrainer",
    "TrainResult",
    "run_sweep",
    "ConfigError",
    "DataError",
    "UserInputError",
]
__version__ = "0.1.0"


def __getattr__(name):
    # The trainer pulls in Ray; import it only when asked for, so config tools stay light.
    if name in ("DilocoFSDPTrainer", "TrainResult"):
        from diloco_ray.driver import trainer

        return getattr(trainer, name)
    if name == "run_sweep":
        from diloco_ray.sweep.runner import sweep

        return sweep
    raise AttributeError(f"module 'diloco_ray' has no attribute {name!r}")
