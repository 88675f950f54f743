"""Decoupled mode at real period lengths: ``python bench/decoupled.py``.

The tiny default hides what decoupled mode must get right (2 replicas, 2 s periods, a
task learnt to its floor). This bench runs what a user scaling out runs: 4 replicas of a
~2.6M-parameter Llama learning real English text from scratch (:mod:`text_corpus`: the
docstrings of Python's standard library and of ``transformers``, a byte-level BPE of 2048
tokens), seq 128, batch 8 per replica, H = 25 (periods of 8 s or more on 2 shared cores),
16 rounds (inner lr 3e-3: eval loss falls from ~6.8 after the first round and is still
falling at the end; with 1e-3 it rose 0.30 at the second round even in sync mode), with
the project's defaults for everything else (the plain outer step, ``min_quorum`` 1, the
grace window, ``decoupled_momentum``).

For each seed (default 0-2) and each speed (``equal``; ``slow``: replica 1 2x slower, a
``slowdown`` in the fault plan) it runs the synchronous and the decoupled mode and prints
per run:

* ``all_share``: the share of merges after the first that hold every replica (sync: 1);
* ``final``: the final eval loss, and ``vs_sync`` its ratio to the synchronous run's;
* ``max_rise``: the largest rise of eval loss between consecutive evaluations;
* ``reach_s``: training seconds (set-up excluded) until eval loss first reaches 1.01x the
  synchronous run's final loss (inf: never), and ``reach_vs_sync`` that over the
  synchronous run's own time to reach it;
* ``train_s``, ``merges``, ``wasted``: training seconds, outer steps, and the share of
  inner steps not merged (lost, aborted, or in flight at the end).

``--set KEY=VALUE`` applies to every run (e.g. ``decoupled_momentum=every_step``);
``--modes``, ``--speeds``, ``--seeds``, ``--rounds`` pick runs; ``--out FILE`` writes
every run's figures and records as JSON, and ``--sync-from FILE`` reuses such a file's
synchronous runs (compare decoupled variants without running sync again). About 3-4
minutes a run here (a ``slow`` synchronous run more): the default 12 runs take 45-60
minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import text_corpus  # noqa: E402
import yaml  # noqa: E402
from chaos import goodput, seconds_to, training_seconds  # noqa: E402

from diloco_ray import DilocoFSDPTrainer, TrainerConfig  # noqa: E402

REACH = 1.01  # "reaches the synchronous loss": within 1% of it
MODEL = {
    "model_type": "llama",
    "vocab_size": text_corpus.VOCAB,
    "hidden_size": 160,
    "intermediate_size": 448,
    "num_hidden_layers": 6,
    "num_attention_heads": 5,
    "num_key_value_heads": 5,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def config(seed: int, mode: str, speed: str, rounds: int, extra: dict) -> TrainerConfig:
    data, tokenizer = text_corpus.build()
    fields = {
        "model_config": MODEL,
        "tokenizer_name": tokenizer,
        "json_file_path": data,
        "text_field": "text",
        "seq_len": 128,
        "batch_size": 8,
        "max_steps": 25,
        "diloco_loops": rounds,
        "num_replicas": 4,
        "min_replicas": 1,
        "cpus_per_rank": 0.5,
        "server_cpus": 0.25,
        "lr": 3e-3,
        "warmup_steps": 25,
        "eval_batches": 8,
        "logging_steps": 25,
        "seed": seed,
        "sync_mode": mode,
        "output_dir": tempfile.mkdtemp(prefix="decoupled-bench-"),
    }
    if speed == "slow":
        fields["fault_plan"] = [{"kind": "slowdown", "replica": 1, "round": 0, "factor": 2.0}]
    return TrainerConfig(**{**fields, **extra})


def evals(rounds: list) -> list[float]:
    return [r["eval_loss"] for r in rounds if r["eval_loss"] is not None]


def figures(rounds: list, replicas: int) -> dict:
    """What one run shows, before it is compared with its synchronous twin."""
    losses, (applied, ran) = evals(rounds), goodput(rounds)
    later = rounds[1:]
    return {
        "all_share": sum(len(r["replica_ids"]) == replicas for r in later) / max(1, len(later)),
        "final": losses[-1],
        "max_rise": max([b - a for a, b in zip(losses, losses[1:])] + [0.0]),
        "train_s": training_seconds(rounds)[-1],
        "merges": len(rounds),
        "wasted": 1.0 - applied / ran if ran else 0.0,
    }


def compare(run: dict, sync: dict) -> None:
    """Adds ``vs_sync``, ``reach_s`` and ``reach_vs_sync`` to ``run`` (in place)."""
    target = REACH * sync["figures"]["final"]
    run["figures"]["vs_sync"] = run["figures"]["final"] / sync["figures"]["final"]
    run["figures"]["reach_s"] = seconds_to(run["rounds"], target)
    sync_reach = seconds_to(sync["rounds"], target)
    run["figures"]["reach_vs_sync"] = run["figures"]["reach_s"] / sync_reach


def run_one(seed: int, mode: str, speed: str, args, extra: dict) -> dict:
    cfg = config(seed, mode, speed, args.rounds, extra)
    start = time.perf_counter()
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    out = {"seed": seed, "mode": mode, "speed": speed, "seconds": time.perf_counter() - start, "rounds": rounds}
    out["figures"] = figures(rounds, cfg.num_replicas)
    return out


def stored_syncs(path: str | None) -> dict:
    """(seed, speed) -> the synchronous run an earlier ``--out`` file holds, so variants of
    decoupled mode can be compared with one set of synchronous runs."""
    if path is None:
        return {}
    with open(path) as f:
        runs = json.load(f)["runs"]
    return {(r["seed"], r["speed"]): r for r in runs if r["mode"] == "sync"}


def table(runs: list[dict]) -> str:
    head = (
        "| seed | speed | mode | final | vs sync | max rise | all-replica merges | reach 1.01x sync (s) | vs sync "
        "| train s | merges | wasted |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in runs:
        f = r["figures"]
        lines.append(
            f"| {r['seed']} | {r['speed']} | {r['mode']} | {f['final']:.4f} | {f.get('vs_sync', 1.0):.4f} | "
            f"{f['max_rise']:.3f} | {f['all_share']:.0%} | {f.get('reach_s', float('nan')):.1f} | "
            f"{f.get('reach_vs_sync', 1.0):.2f} | {f['train_s']:.0f} | {f['merges']} | {f['wasted']:.1%} |"
        )
    return "\n".join(lines)


def summary(runs: list[dict]) -> list[str]:
    out = []
    for speed in sorted({r["speed"] for r in runs}):
        dec = [r["figures"] for r in runs if r["speed"] == speed and r["mode"] == "decoupled"]
        if not dec or "vs_sync" not in dec[0]:
            continue
        ratios, reach = [f["vs_sync"] for f in dec], [f["reach_vs_sync"] for f in dec]
        out.append(
            f"{speed}: decoupled/sync final median {statistics.median(ratios):.4f} max {max(ratios):.4f}; "
            f"all-replica merges min {min(f['all_share'] for f in dec):.0%}; largest eval rise "
            f"{max(f['max_rise'] for f in dec):.3f}; time to 1.01x sync loss vs sync max {max(reach):.2f}"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--speeds", default="equal,slow")
    parser.add_argument("--modes", default="sync,decoupled")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], help="config field=value (YAML) for every run")
    parser.add_argument("--out", default=None, help="write the runs (figures and records) as JSON here")
    parser.add_argument(
        "--sync-from", default=None, help="take the synchronous twins from an earlier --out FILE, not new runs"
    )
    args = parser.parse_args()
    extra = {}
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key] = yaml.safe_load(value)
    text_corpus.build()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    runs, stored = [], stored_syncs(args.sync_from)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for speed in args.speeds.split(","):
            twins = {}
            for mode in args.modes.split(","):
                if mode == "sync" and (seed, speed) in stored:
                    twins[mode] = stored[seed, speed]
                else:
                    twins[mode] = run_one(seed, mode, speed, args, extra)
                if mode != "sync" and "sync" in twins:
                    compare(twins[mode], twins["sync"])
                f = twins[mode]["figures"]
                print(f"# seed {seed} {speed} {mode}: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()), flush=True)
            runs.extend(twins.values())
    ray.shutdown()
    print(table(runs))
    for line in summary(runs):
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"overrides": extra, "runs": runs}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
