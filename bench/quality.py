"""The embedded default's quality over seeds: ``python bench/quality.py``.

This module owns the quality acceptance of ``configs/tiny.yaml``: it runs the default
once per seed for every (mode, codec) asked for, in one local Ray instance, and prints
each run's final eval loss (the last round record's ``eval_loss``, as in
``metrics.jsonl``) with the median and the max per (mode, codec), then the ratios the
acceptance bounds, on the median:

* ``sync``, codec ``none``: median <= 0.78 and max <= 0.82 over seeds 1-5;
* ``decoupled`` / ``sync`` (codec ``none``): <= 1.03;
* ``int8`` / ``none`` (mode ``sync``): <= 1.02. A codec other than ``none`` runs with
  ``pseudo_grad_compression: <codec>`` and ``error_feedback: true``, as the bandwidth
  acceptance does.

One seed's final loss says little here: the default ends near the task's floor for most
initial draws, but for some (one seed in four or five) it is still on a plateau at the
end, whatever the code (see docs/results.md), so bounds are on the median over seeds
and a comparison is always seed for seed. A synchronous run is deterministic for its
seed (the same loss to the last digit twice), so each pair is measured once.

Usage: ``python bench/quality.py [--seeds 1,2,3,4,5] [--modes sync,decoupled]
[--codecs none,int8] [--set KEY=VALUE ...] [--out FILE.json]``. Exit status 1 when a
bound that the chosen runs can check is not met. Reuses ``bench/run.py``'s config and
train helpers; about 30-45 s a run on 2 cores, so the default 20 runs take 10-15 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import yaml  # noqa: E402
from run import config, train  # noqa: E402

# The acceptance (see the module docstring).
SYNC_MEDIAN_BOUND = 0.78
SYNC_MAX_BOUND = 0.82
DECOUPLED_RATIO_BOUND = 1.03
CODEC_RATIO_BOUND = 1.02


def codec_fields(codec: str) -> dict:
    """The config fields of a pseudo-gradient codec (``none``: fp32, no fields)."""
    return {} if codec == "none" else {"pseudo_grad_compression": codec, "error_feedback": True}


def final_eval_loss(rounds: list[dict]) -> float:
    """The last round record's eval loss (the run's final evaluation)."""
    return next(r["eval_loss"] for r in reversed(rounds) if r.get("eval_loss") is not None)


def measure(seeds: list[int], modes: list[str], codecs: list[str], overrides: dict, log=print) -> dict:
    """``{(mode, codec): [final eval loss per seed]}``, one run each, in a Ray that is
    already started."""
    losses: dict[tuple[str, str], list[float]] = {}
    for mode in modes:
        for codec in codecs:
            runs = losses.setdefault((mode, codec), [])
            for seed in seeds:
                fields = {"seed": seed, "sync_mode": mode, **codec_fields(codec), **overrides}
                start = time.perf_counter()
                runs.append(final_eval_loss(train(config(**fields))))
                log(f"# {mode} {codec} seed {seed}: {runs[-1]:.4f} ({time.perf_counter() - start:.0f} s)")
    return losses


def summary(losses: dict) -> dict:
    """Median and max per (mode, codec), the ratios on the median, and each bound the
    runs can check: ``name -> (value, bound, met)``."""
    stats = {key: {"median": statistics.median(v), "max": max(v)} for key, v in losses.items()}
    ratios: dict[str, float] = {}
    for mode, codec in losses:
        if mode != "sync" and ("sync", codec) in stats:
            ratios[f"{mode}/sync ({codec})"] = stats[(mode, codec)]["median"] / stats[("sync", codec)]["median"]
        if codec != "none" and (mode, "none") in stats:
            ratios[f"{codec}/none ({mode})"] = stats[(mode, codec)]["median"] / stats[(mode, "none")]["median"]
    checks: dict[str, tuple[float, float, bool]] = {}
    if ("sync", "none") in stats:
        sync = stats[("sync", "none")]
        checks["sync median"] = (sync["median"], SYNC_MEDIAN_BOUND, sync["median"] <= SYNC_MEDIAN_BOUND)
        checks["sync max"] = (sync["max"], SYNC_MAX_BOUND, sync["max"] <= SYNC_MAX_BOUND)
    if "decoupled/sync (none)" in ratios:
        value = ratios["decoupled/sync (none)"]
        checks["decoupled/sync (none)"] = (value, DECOUPLED_RATIO_BOUND, value <= DECOUPLED_RATIO_BOUND)
    for name, value in ratios.items():
        if name.endswith("/none (sync)"):
            checks[name] = (value, CODEC_RATIO_BOUND, value <= CODEC_RATIO_BOUND)
    return {"stats": stats, "ratios": ratios, "checks": checks}


def table(seeds: list[int], losses: dict, result: dict) -> str:
    """The per-seed table, ratios and checks as text (docs/results.md quotes it)."""
    head = f"| mode | codec | {' | '.join(f'seed {s}' for s in seeds)} | median | max |"
    lines = [head, "|" + "---|" * (len(seeds) + 4)]
    for (mode, codec), values in losses.items():
        s = result["stats"][(mode, codec)]
        cells = " | ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {mode} | {codec} | {cells} | {s['median']:.4f} | {s['max']:.4f} |")
    lines.append("")
    for name, value in result["ratios"].items():
        lines.append(f"ratio {name} on the median: {value:.4f}")
    for name, (value, bound, met) in result["checks"].items():
        lines.append(f"check {name}: {value:.4f} <= {bound} {'ok' if met else 'NOT MET'}")
    return "\n".join(lines)


def parse_sets(items: list[str]) -> dict:
    """``KEY=VALUE`` pairs, each value read as YAML (as ``bench/chaos.py --set`` does)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    return overrides


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds (default 1,2,3,4,5)")
    parser.add_argument("--modes", default="sync,decoupled", help="sync_mode values (default sync,decoupled)")
    parser.add_argument("--codecs", default="none,int8", help="pseudo-gradient codecs, none = fp32 (default none,int8)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config field (YAML)")
    parser.add_argument("--out", default=None, help="also write the losses, stats and checks to this JSON file")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    codecs = [c for c in args.codecs.split(",") if c]
    overrides = parse_sets(args.set)
    start = time.perf_counter()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        losses = measure(seeds, modes, codecs, overrides)
    finally:
        ray.shutdown()
    result = summary(losses)
    print(table(seeds, losses, result))
    minutes = (time.perf_counter() - start) / 60
    print(f"# {len(seeds) * len(modes) * len(codecs)} runs in {minutes:.1f} min, load {os.getloadavg()[0]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "seeds": seeds,
                    "overrides": overrides,
                    "runs": [{"mode": m, "codec": c, "final_eval_loss": v} for (m, c), v in losses.items()],
                    "stats": [{"mode": m, "codec": c, **s} for (m, c), s in result["stats"].items()],
                    "ratios": result["ratios"],
                    "checks": {n: {"value": v, "bound": b, "met": ok} for n, (v, b, ok) in result["checks"].items()},
                    "minutes": minutes,
                },
                f,
                indent=1,
            )
    return 0 if all(met for _, _, met in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
