"""How fast membership heals, on the embedded default (configs/tiny.yaml).

Two measurements, each from metrics.jsonl timestamps of one run:

* ``recovery_seconds``: a replica's process dies mid-round (os._exit at a given round);
  from the moment it dies to the round boundary at which a replacement is active again
  (full membership).
* ``scale_to_first_update_seconds``: ``trainer.scale(3)`` from ``on_round_end``; from
  that call to the first applied round that includes the new replica's pseudo-gradient.
* ``kill_to_contribution_seconds`` with ``spare_replicas`` 0 and 1, in the synchronous and
  the decoupled mode: a replica's rank actors are killed after round 1 (merge 1), or half
  a round later (``mid_period``: part way through a period, as a failure at a random
  moment); from the kill to the first applied outer step that includes the replica taking
  its place (a cold start, or a hot spare: promoted at the next boundary in the
  synchronous mode; at once in the decoupled mode, where it trains what remained of the
  lost replica's period). Beside it, the median round (merge).

Run: ``python bench/elastic.py`` (prints "NAME VALUE" lines).
"""

import json
import os
import sys
import tempfile
import threading
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


class KillAfterRoundOne:
    """Kills the last active replica's ranks when round 1 ends, or, with ``mid_period``,
    half a round later, part way through its next period, as a failure at a random moment
    would (with spares: first advancing the starting spare until it is ready, since on a
    busy machine set-up can outlast the run); notes when, and who was active."""

    def __init__(self, mid_period: bool = False):
        self.killed_at, self.active, self.mid_period = None, None, mid_period

    def on_round_end(self, trainer, record):
        if self.active is not None or record["round"] < 1:
            return
        deadline = time.monotonic() + 180
        while trainer.config.spare_replicas and not trainer.members.spares and time.monotonic() < deadline:
            trainer.members.admit_ready(0.0)
            time.sleep(0.2)
        self.active = [r.id for r in trainer.replicas]
        victim = trainer.replicas[-1]
        delay = record["round_seconds"] / 2 if self.mid_period else 0.0
        threading.Timer(delay, self._kill, args=(victim,)).start()

    def _kill(self, victim):
        import ray

        for rank in victim.ranks:
            ray.kill(rank, no_restart=True)
        self.killed_at = time.time()


def kill_to_contribution(spares: int, mode: str = "sync", mid_period: bool = False) -> dict:
    """Seconds from a replica's death to the first applied outer step holding its replacement."""
    killer = KillAfterRoundOne(mid_period)
    out = run({"spare_replicas": spares, "diloco_loops": 12, "sync_mode": mode}, callbacks=[killer])
    first = next(r for r in read_events(out, "round") if set(r["replica_ids"]) - set(killer.active))
    rounds = sorted(r["round_seconds"] for r in read_events(out, "round"))
    tag = f"spares={spares}" + ("" if mode == "sync" else f",{mode}") + (",mid_period" if mid_period else "")
    return {
        f"kill_to_contribution_seconds[{tag}]": first["time"] - killer.killed_at,
        f"round_seconds_median[{tag}]": rounds[len(rounds) // 2],
    }


class DroppingTrainer(DilocoFSDPTrainer):
    """A trainer whose replica 1 dies at the start of round 2 (:class:`DiesInRoundTwo`)."""

    worker_cls = DiesInRoundTwo


def run(overrides, trainer_cls: type = DilocoFSDPTrainer, **kwargs):
    out = tempfile.mkdtemp()
    cfg = TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "diloco_loops": 8, **overrides})
    trainer_cls(cfg, **kwargs).train()
    return out


def recovery(**overrides) -> dict:
    """Kill replica 1's process at the start of round 2; seconds from its death to full
    membership again, and how long the replacement took to start."""
    out = run(overrides, trainer_cls=DroppingTrainer)
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
    for mode in ("sync", "decoupled"):
        for spares, mid_period in ((0, False), (1, False), (1, True)):
            for name, value in kill_to_contribution(spares, mode, mid_period).items():
                print(f"{name} {value:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
