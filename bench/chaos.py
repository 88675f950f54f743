"""Goodput under failures, on the embedded default (configs/tiny.yaml).

The same job runs twice: once without faults, once while a chaos thread kills a random
rank of a random active replica every ``--every`` seconds (as a lost node or a spot
preemption would). It reports, in the units torchft and Decoupled DiLoCo use:

* ``goodput``: replica inner steps whose work reached an applied outer update, over all
  replica inner steps run (the work of a killed replica's round, of a late one, or of a
  round run again is lost). Decoupled DiLoCo reports 88% under heavy failures.
* ``time_efficiency``: the fault-free run's wall time over the faulty run's, for the
  same rounds (torchft's "training efficiency": 81% at one failure a minute).
* ``work_efficiency``: applied replica inner steps per second, faulty over fault-free:
  a round applied with fewer replicas did less work. On a machine with fewer cores than
  processes a round with one replica left also runs faster (it has the cores to itself),
  so time efficiency alone can exceed 1 there; this figure cannot hide that.
* ``eval_loss_ratio``: the faulty run's final eval loss over the fault-free run's.

Steps run by a replica that died are counted from its last step beat (every few
seconds), so goodput is, if anything, slightly overstated. Run: ``python bench/chaos.py``
(prints "NAME VALUE" lines; ``--every 20 --rounds 30`` are the defaults).
"""

import argparse
import os
import random
import sys
import tempfile
import threading
import time

import ray

from diloco_ray import DilocoFSDPTrainer, TrainerConfig

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")


class Chaos:
    """A callback whose thread kills one rank of a random active replica every
    ``every`` seconds while training runs (a seeded choice, for repeatable runs)."""

    def __init__(self, every: float, seed: int = 0):
        self.every, self.rng, self.kills = every, random.Random(seed), []
        self._stop = threading.Event()

    def on_train_begin(self, trainer):
        self.trainer = trainer
        threading.Thread(target=self._loop, daemon=True).start()

    def on_train_end(self, trainer):
        self._stop.set()

    def _loop(self):
        while not self._stop.wait(self.every):
            live = [rep for rep in list(self.trainer.replicas) if rep.ranks]
            if not live:
                continue
            rep = self.rng.choice(live)
            ray.kill(self.rng.choice(rep.ranks), no_restart=True)
            self.kills.append((time.time(), rep.id))


def run(rounds: int, callbacks=()) -> tuple[list, float]:
    out = tempfile.mkdtemp()
    # min_replicas 1: a round goes on with the survivors; the replacement joins when ready.
    cfg = TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "diloco_loops": rounds, "min_replicas": 1})
    start = time.perf_counter()
    result = DilocoFSDPTrainer(cfg, callbacks=list(callbacks)).train()
    return result.rounds, time.perf_counter() - start


def goodput(rounds: list) -> tuple[int, int]:
    """(replica inner steps applied, replica inner steps run) over a run's records."""
    applied = sum(sum(r["replica_steps"].values()) for r in rounds)  # fewer than max_steps with inner_time_s
    return applied, applied + sum(r.get("wasted_steps", 0) for r in rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=20.0, help="seconds between failures")
    parser.add_argument("--rounds", type=int, default=30, help="outer rounds of each run")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    clean, clean_s = run(args.rounds)
    chaos = Chaos(args.every)
    faulty, faulty_s = run(args.rounds, [chaos])
    applied, ran = goodput(faulty)
    clean_applied, clean_ran = goodput(clean)
    figures = {
        "failures": len(chaos.kills),
        "failures_per_minute": len(chaos.kills) / (faulty_s / 60),
        "goodput": applied / ran,
        "goodput_fault_free": clean_applied / clean_ran,
        "time_efficiency": clean_s / faulty_s,
        "work_efficiency": (applied / faulty_s) / (clean_applied / clean_s),
        "eval_loss_fault_free": clean[-1]["eval_loss"],
        "eval_loss_faulty": faulty[-1]["eval_loss"],
        "eval_loss_ratio": faulty[-1]["eval_loss"] / clean[-1]["eval_loss"],
        "rounds_with_a_dropped_replica": sum(1 for r in faulty if r["dropped"]),
        "seconds_fault_free": clean_s,
        "seconds_faulty": faulty_s,
    }
    for name, value in figures.items():
        print(f"{name} {value:.4g}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
