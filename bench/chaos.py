"""Goodput under failures, synchronous vs decoupled, on the embedded default (configs/tiny.yaml).

For each ``--modes`` (``sync``, ``decoupled``) the same job runs twice: once without
faults, once while a chaos thread kills a random rank of a random active replica every
``--every`` seconds (as a lost node or a spot preemption would). ``--slowdown F`` makes
replica 1 F times slower in every run (a ``slowdown`` in the fault plan: a slower GPU
type), and ``--link-mbps`` simulates cross-region links. Figures are printed as
``MODE_NAME VALUE`` lines, side by side, in the units torchft and Decoupled DiLoCo use:

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
* ``decoupled_eval_loss_vs_sync``: final eval losses, fault-free; ``..._at_equal_tokens``
  takes the decoupled run's loss at exactly ``--rounds`` rounds' worth of tokens
  (interpolated: its last merge may pass the end by part of a round).
* ``tokens_per_s``: tokens merged into the global weights per second of training, the
  whole job's throughput; both modes merge ``--rounds`` rounds' worth of tokens.
* ``seconds_to_sync_loss`` (decoupled, fault-free): training seconds until its eval loss
  first reaches the synchronous run's final eval loss (inf: never); ``speedup_to_sync_loss``
  is the synchronous run's training seconds over that. ``speedup_to_same_loss`` is the
  same ratio for the loss both runs reach (the higher of the two final ones).

In decoupled mode the periods still in flight when the run ends are never merged; their
steps count as wasted (``abandoned_steps``).

Steps run by a replica that died are counted from its last step beat (every few
seconds), so goodput is, if anything, slightly overstated. Run: ``python bench/chaos.py``
(``--every 20 --rounds 30 --modes sync,decoupled`` are the defaults).
"""

import argparse
import os
import random
import sys
import tempfile
import threading
import time

import ray
import yaml

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


def run(rounds: int, overrides: dict, callbacks=()) -> tuple[list, float]:
    out = tempfile.mkdtemp()
    # min_replicas 1: a round goes on with the survivors; the replacement joins when ready.
    fields = {"output_dir": out, "diloco_loops": rounds, "min_replicas": 1, **overrides}
    cfg = TrainerConfig.from_yaml(TINY, overrides=fields)
    start = time.perf_counter()
    result = DilocoFSDPTrainer(cfg, callbacks=list(callbacks)).train()
    return result.rounds, time.perf_counter() - start


def goodput(rounds: list) -> tuple[int, int]:
    """(replica inner steps applied, replica inner steps run) over a run's records."""
    applied = sum(sum(r["replica_steps"].values()) for r in rounds)  # fewer than max_steps with inner_time_s
    lost = sum(r.get("wasted_steps", 0) + r.get("abandoned_steps", 0) for r in rounds)
    return applied, applied + lost


def training_seconds(rounds: list) -> list[float]:
    """Seconds of training (set-up excluded) at the end of each record."""
    total, out = 0.0, []
    for r in rounds:
        total += r["round_seconds"]
        out.append(total)
    return out


def seconds_to(rounds: list, loss: float) -> float:
    """Training seconds until eval loss first reaches ``loss`` (inf: never)."""
    for seconds, r in zip(training_seconds(rounds), rounds):
        if r["eval_loss"] is not None and r["eval_loss"] <= loss:
            return seconds
    return float("inf")


def eval_loss_at(rounds: list, work: float) -> float:
    """Eval loss after ``work`` rounds' worth of tokens, interpolated between the records
    around it (a decoupled run's last merge may pass the run's end by part of a round)."""
    points = [(r.get("work", r["round"] + 1), r["eval_loss"]) for r in rounds if r["eval_loss"] is not None]
    for (w0, l0), (w1, l1) in zip(points, points[1:]):
        if w0 <= work <= w1:
            return l0 + (l1 - l0) * (work - w0) / (w1 - w0) if w1 > w0 else l1
    return points[-1][1]


def measure(mode: str, args, overrides: dict) -> tuple[dict, list]:
    clean, clean_s = run(args.rounds, overrides)
    clean_applied, clean_ran = goodput(clean)
    train_s = training_seconds(clean)[-1]
    figures = {
        "goodput_fault_free": clean_applied / clean_ran,
        "tokens_per_s": sum(r["tokens"] for r in clean) / train_s,
        "eval_loss_fault_free": clean[-1]["eval_loss"],
        "outer_steps": len(clean),
        "training_seconds_fault_free": train_s,
        "seconds_fault_free": clean_s,
    }
    if args.every <= 0:
        return figures, clean
    chaos = Chaos(args.every)
    faulty, faulty_s = run(args.rounds, overrides, [chaos])
    applied, ran = goodput(faulty)
    figures.update(
        {
            "failures": len(chaos.kills),
            "failures_per_minute": len(chaos.kills) / (faulty_s / 60),
            "goodput": applied / ran,
            "time_efficiency": clean_s / faulty_s,
            "work_efficiency": (applied / faulty_s) / (clean_applied / clean_s),
            "tokens_per_s_faulty": sum(r["tokens"] for r in faulty) / training_seconds(faulty)[-1],
            "eval_loss_faulty": faulty[-1]["eval_loss"],
            "eval_loss_ratio": faulty[-1]["eval_loss"] / clean[-1]["eval_loss"],
            "rounds_with_a_dropped_replica": sum(1 for r in faulty if r["dropped"]),
            "seconds_faulty": faulty_s,
        }
    )
    return figures, clean


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=20.0, help="seconds between failures (0: fault-free runs only)")
    parser.add_argument("--rounds", type=int, default=30, help="outer rounds (of tokens) of each run")
    parser.add_argument("--modes", default="sync,decoupled", help="sync_mode values to compare")
    parser.add_argument("--slowdown", type=float, default=None, help="make replica 1 this many times slower")
    parser.add_argument("--link-mbps", type=float, default=None, help="simulated link bandwidth per replica")
    parser.add_argument("--set", action="append", default=[], help="extra config field=value (YAML value)")
    args = parser.parse_args()
    overrides: dict = {}
    if args.slowdown:
        overrides["fault_plan"] = [{"kind": "slowdown", "replica": 1, "round": 0, "factor": args.slowdown}]
    if args.link_mbps:
        overrides["link_mbps"] = args.link_mbps
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    fault_free = {}
    for mode in args.modes.split(","):
        figures, fault_free[mode] = measure(mode, args, {**overrides, "sync_mode": mode})
        for name, value in figures.items():
            print(f"{mode}_{name} {value:.4g}", flush=True)
    if {"sync", "decoupled"} <= set(fault_free):
        sync, dec = fault_free["sync"], fault_free["decoupled"]
        target = sync[-1]["eval_loss"]
        reach = seconds_to(dec, target)
        print(f"decoupled_eval_loss_vs_sync {dec[-1]['eval_loss'] / target:.4g}")
        at_equal = eval_loss_at(dec, args.rounds)
        print(f"decoupled_eval_loss_at_equal_tokens {at_equal:.4g}")
        print(f"decoupled_eval_loss_vs_sync_at_equal_tokens {at_equal / target:.4g}")
        print(f"decoupled_seconds_to_sync_loss {reach:.4g}")
        print(f"decoupled_speedup_to_sync_loss {training_seconds(sync)[-1] / reach:.4g}")
        # The loss both runs reach (the higher final one): robust to which run ends lower.
        common = max(target, dec[-1]["eval_loss"])
        print(f"same_loss {common:.4g}")
        print(f"decoupled_speedup_to_same_loss {seconds_to(sync, common) / seconds_to(dec, common):.4g}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
