"""Where the default job's start-up goes: ``python bench/startup.py [CONFIG]``.

Times, for ``configs/tiny.yaml`` (or CONFIG): ``ray.init``; the driver's ``setup()``
(servers and replicas placed and built, the servers seeded) until round 0 can start; and,
inside one rank driven in this process, its own set-up split into imports, tokenizer,
data (tokenise and pack: in a run, the job's one tokenising task does this while the
ranks build their models; see ``diloco_ray.runtime.replica.start_token_data``), model build and
the rest. Run it against two checkouts with
``PYTHONPATH=<checkout>`` to compare before and after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def import_seconds() -> float:
    """A fresh interpreter importing what a rank imports (what each new actor pays)."""
    code = "import time; t = time.perf_counter(); import diloco_ray.runtime.rank; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def rank_split(config_path: str) -> dict[str, float]:
    """One rank's ``setup()`` in this process, its stages timed by wrapping them."""
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.data import samples, tokenization
    from diloco_ray.model import loading as modeling
    from diloco_ray.runtime import rank as inner

    split: dict[str, float] = {}

    def timed(module, name, label):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                split[label] = split.get(label, 0.0) + time.perf_counter() - t

        setattr(module, name, wrapper)

    timed(tokenization, "load_tokenizer", "tokenizer")
    timed(samples, "load_token_data", "data")
    timed(modeling, "build_model", "model")
    cfg = TrainerConfig.from_yaml(config_path, overrides={"output_dir": tempfile.mkdtemp()})
    t = time.perf_counter()
    inner.RankWorker(cfg.to_dict(), 0, 0, 1).setup()
    split["rank total"] = time.perf_counter() - t
    split["rank other"] = split["rank total"] - sum(v for k, v in split.items() if k != "rank total")
    return split


def driver_split(config_path: str) -> dict[str, float]:
    import ray

    from diloco_ray import DilocoFSDPTrainer, TrainerConfig

    t = time.perf_counter()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    ray_s = time.perf_counter() - t
    cfg = TrainerConfig.from_yaml(
        config_path, overrides={"output_dir": tempfile.mkdtemp(), "overwrite_output_dir": True}
    )
    trainer = DilocoFSDPTrainer(cfg)
    t = time.perf_counter()
    trainer.setup()
    setup_s = time.perf_counter() - t
    trainer.shutdown()
    ray.shutdown()
    return {"ray.init": ray_s, "setup() until round 0": setup_s}


def main() -> None:
    config_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "configs", "tiny.yaml")
    figures = {"imports (fresh process)": import_seconds(), **rank_split(config_path), **driver_split(config_path)}
    for name, seconds in figures.items():
        print(f"startup[{name}] {seconds:.2f} s")
    print(f"startup[ray.init + setup] {figures['ray.init'] + figures['setup() until round 0']:.2f} s")


if __name__ == "__main__":
    main()
