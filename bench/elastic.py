"""How fast membership heals, on the embedded default (configs/tiny.yaml).

Two measurements, each from metrics.jsonl timestamps of one run:

* ``recovery_seconds``: a replica's process dies mid-round (os._exit at a given round);
  from the moment it dies to the round boundary at which a replacement is active again
  (full membership).
* ``scale_to_first_update_seconds``: ``trainer.scale(3)`` from ``on_round_end``; from
  that call to the first applied round that includes the new replica's pseudo-gradient.

Run: ``python bench/elastic.py`` (prints "NAME VALUE" lines).
"""

import json
import os
import sys
import tempfile
import time

from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.observe.metrics import read_events
from diloco_ray.runtime.rank import RankWorker

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
DEATH_FILE = os.path.join(tempfile.mkdtemp(), "death.json")


class DiesInRoundTwo(RankWorker):
    """Replica 1 dies at the start of round 2, after noting the time."""

    def run_period(self, job):
        if self.replica_id == 1 and job.round == 2:
            with open(DEATH_FILE, "w") as f:
                json.dump({"time": time.time()}, f)
            os._exit(1)
        return super().run_period(job)


class ScaleAtRoundOne:
    def __init__(self):
        self.called_at = None

    def on_round_end(self, trainer, record):
        if record["round"] == 1:
            self.called_at = time.time()
            trainer.scale(3)


def run(overrides, **kwargs):
    out = tempfile.mkdtemp()
    cfg = TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "diloco_loops": 8, **overrides})
    DilocoFSDPTrainer(cfg, **kwargs).train()
    return out


def recovery(**overrides) -> dict:
    """Kill replica 1's process at the start of round 2; seconds from its death to full
    membership again, and how long the replacement took to start."""
    out = run(overrides, worker_cls=DiesInRoundTwo)
    with open(DEATH_FILE) as f:
        died = json.load(f)["time"]
    join = next(e for e in read_events(out, "membership") if e["action"] == "join" and e["replica_id"] == 2)
    return {"recovery_seconds": join["time"] - died, "replacement_start_seconds": join["start_seconds"]}


def main() -> int:
    for name, value in recovery().items():
        print(f"{name} {value:.2f}")

    scaler = ScaleAtRoundOne()
    out = run({"max_replicas": 3}, callbacks=[scaler])
    first = next(r for r in read_events(out, "round") if 2 in r["replica_ids"])
    print(f"scale_to_first_update_seconds {first['time'] - scaler.called_at:.2f}")
    print(f"round_seconds_median {sorted(r['round_seconds'] for r in read_events(out, 'round'))[4]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
