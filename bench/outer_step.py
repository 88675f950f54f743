"""Which outer step to default to: ``python bench/outer_step.py --setting text4 --codecs none``.

Sweeps the outer step (``outer_lr`` x ``outer_momentum``, Nesterov with SGD) with
:func:`diloco_ray.sweep.runner.sweep` (Ray Tune, one trial at a time) for each codec, in
one of these settings:

* ``tiny``: the embedded default (``configs/tiny.yaml``: 2 replicas, 10 rounds of H = 30);
* ``text4``: ``bench/decoupled.py``'s model still learning English text, 4 replicas, 16
  rounds of H = 25, synchronous; ``text4-32`` and ``text4-64``: the same over 32 and 64
  rounds; ``text8``: 8 replicas.

Two passes, as the sweep's cost asks on 2 cores:

* ``--screen`` (seed ``--seeds``' first): every step of the grid, with ASHA stopping a trial
  behind the others after ``--grace-rounds`` rounds;
* ``--confirm lr/momentum,...``: the named steps over every seed, to the last round.

``--outer-lr-schedule`` and ``--momentum-warmup N`` (``outer_momentum_warmup_rounds``) run
either pass under that outer lr schedule or momentum warm-up (its rows' step names end in
it: ``0.7/0.9 cosine``, ``0.7/0.9 warmup 4``).

Each trial's row (setting, codec, step, seed, status, final eval loss, its curve) is
appended to ``--log`` (JSON lines; a step already there for the same setting, codec and
seed is not run again), and the summary per (setting, codec, step) over the finished
seeds (median, max, and the ratios to the best median and the best max) is printed. The
codec's other fields keep what naming the codec gives (``topk``: 1/64 of each block and a
residual decay of 0.95, SparseLoCo's), whatever step the trial takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from diloco_ray import TrainerConfig  # noqa: E402
from diloco_ray.config.fields import CODEC_DEFAULTS  # noqa: E402
from diloco_ray.sweep.runner import sweep  # noqa: E402

TINY = os.path.join(os.path.dirname(HERE), "configs", "tiny.yaml")
LRS = [0.5, 0.7, 1.0, 1.3]
MOMENTA = [0.0, 0.5, 0.9]
UNRECORDED = "unrecorded"  # a row's corpus before rows named theirs
# What the codec brings beside its outer step (kept when a trial sets the step).
CODEC_FIELDS = {
    "none": {"pseudo_grad_compression": "none"},
    "int8": {"pseudo_grad_compression": "int8", "weights_compression": "int8"},
    "topk": {
        "pseudo_grad_compression": "topk",
        "weights_compression": "int8",
        "topk_fraction": CODEC_DEFAULTS["topk"]["topk_fraction"],
        "error_feedback_decay": CODEC_DEFAULTS["topk"]["error_feedback_decay"],
    },
}


def setting_values(setting: str, seed: int) -> dict:
    """The setting's config values for one seed (its output_dir a fresh folder)."""
    out = tempfile.mkdtemp(prefix=f"outer-step-{setting}-")
    if setting == "tiny":
        return TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "seed": seed}).to_dict()
    import decoupled  # the text model and corpus of bench/decoupled.py

    replicas, rounds = {"text4": (4, 16), "text4-32": (4, 32), "text4-64": (4, 64), "text8": (8, 16)}[setting]
    cfg = decoupled.config(seed, "sync", "equal", rounds, {"num_replicas": replicas, "output_dir": out})
    return cfg.to_dict()


def corpus_of(setting: str) -> str:
    """The data a setting trains on: ``builtin`` (tiny's arithmetic), else the text corpus's
    identity (:func:`text_corpus.identity`)."""
    if setting == "tiny":
        return "builtin"
    import text_corpus

    return text_corpus.identity(*text_corpus.build())


def step_name(lr: float, momentum: float, variant: Optional[dict] = None) -> str:
    """``lr/momentum``, then the variant's outer lr schedule and momentum warm-up, if any."""
    variant = variant or {}
    name = f"{lr:g}/{momentum:g}"
    if variant.get("outer_lr_schedule"):
        name += f" {variant['outer_lr_schedule']}"
    if variant.get("outer_momentum_warmup_rounds"):
        name += f" warmup {variant['outer_momentum_warmup_rounds']}"
    return name


def done_rows(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(
    setting: str, codec: str, seed: int, lrs: list, momenta: list, grace: Optional[int], log: str, variant=None
) -> None:
    """Sweep ``lrs`` x ``momenta`` for one setting, codec and seed; append a row a trial.
    ``grace``: rounds before ASHA may stop a trial (None: every trial runs to the end);
    ``variant``: the trials' ``outer_lr_schedule`` and ``outer_momentum_warmup_rounds`` (None:
    constant, none), part of the step's name.

    A step already in the log for this setting, codec and seed is not run again if it
    finished, or if it was stopped early and early stops are allowed now: a confirmation
    runs a step the screen stopped to the end. A screen with part of its grid missing runs
    whole again, since ASHA judges each trial against those before it (a part alone would
    stop other trials); the summary reads the newest row of a step and seed."""
    done = {"finished"} if grace is None else {"finished", "stopped"}
    corpus = corpus_of(setting)
    have = {
        (r["setting"], r["codec"], r["step"], r["seed"])
        for r in done_rows(log)
        if r["status"] in done and r.get("corpus") == corpus
    }
    if all((setting, codec, step_name(lr, m, variant), seed) in have for lr in lrs for m in momenta):
        return
    values = {**setting_values(setting, seed), **CODEC_FIELDS[codec], **(variant or {})}
    swept = sweep(
        values,
        {"outer_lr": lrs, "outer_momentum": momenta},
        grace_rounds=values["diloco_loops"] if grace is None else min(grace, values["diloco_loops"]),
        max_concurrent=1,  # each trial judged against the ones before it: reproducible stops
        ray_output_to_file=True,
    )
    with open(log, "a") as f:
        for t in swept.trials:
            step = step_name(t.overrides["outer_lr"], t.overrides["outer_momentum"], variant)
            row = {
                "setting": setting,
                "corpus": corpus,
                "codec": codec,
                "step": step,
                "seed": seed,
                "status": t.status,
                "rounds": t.rounds,
                "final_eval_loss": t.eval_loss,
                "eval_curve": t.eval_curve,
            }
            f.write(json.dumps(row) + "\n")
            print(f"{setting} {codec} {step} seed {seed}: {t.status} {t.rounds}/{t.planned_rounds} {t.eval_loss}")


def summary(rows: list[dict]) -> list[dict]:
    """Per (setting, corpus, codec, step) over its finished seeds: each seed's loss
    (``per_seed``, in seed order), median, max, and each against the best median and the
    best max of the same setting, corpus and codec on the same seeds (1.0: the best; a
    one-seed screen is held against every step that ran that seed). A row without a corpus
    is from before rows named theirs (``unrecorded``): it is compared with its own kind only."""
    groups: dict = {}
    for r in rows:
        if r["status"] == "finished":
            key = (r["setting"], r.get("corpus", UNRECORDED), r["codec"], r["step"])
            groups.setdefault(key, {})[r["seed"]] = r["final_eval_loss"]
    out = []
    for (setting, corpus, codec, step), by_seed in groups.items():
        seeds = sorted(by_seed)
        peers = [
            g for (s, d, c, _), g in groups.items() if (s, d, c) == (setting, corpus, codec) and set(seeds) <= set(g)
        ]
        losses = [by_seed[seed] for seed in seeds]
        median, worst = statistics.median(losses), max(losses)
        out.append(
            {
                "setting": setting,
                "corpus": corpus,
                "codec": codec,
                "step": step,
                "seeds": len(losses),
                "per_seed": losses,
                "median": median,
                "max": worst,
                "median_vs_best": median / min(statistics.median([g[x] for x in seeds]) for g in peers),
                "max_vs_best": worst / min(max(g[x] for x in seeds) for g in peers),
            }
        )
    return sorted(out, key=lambda o: (o["setting"], o["corpus"], o["codec"], -o["seeds"], o["median"]))


def markdown(rows: list[dict]) -> str:
    """The summary as a Markdown table (docs/results.md, Outer step), seeds listed per step."""
    head = "| setting | corpus | codec | step | per seed | median | max | median / best | max / best |"
    lines = [head, "|---" * 9 + "|"]
    for o in summary(rows):
        each = " / ".join(f"{loss:.4f}" for loss in o["per_seed"])
        lines.append(
            f"| {o['setting']} | {o['corpus']} | {o['codec']} | {o['step']} | {each} | {o['median']:.4f} "
            f"| {o['max']:.4f} | {o['median_vs_best']:.3f} | {o['max_vs_best']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=["tiny", "text4", "text4-32", "text4-64", "text8"], default="text4")
    parser.add_argument("--codecs", default="none,int8,topk")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--screen", action="store_true", help="every step of the grid on the first seed, ASHA on")
    parser.add_argument("--confirm", default="", help="steps LR/MOMENTUM,... over every seed, to the last round")
    parser.add_argument("--grace-rounds", type=int, default=4)
    parser.add_argument("--outer-lr-schedule", choices=["cosine", "linear", "polynomial"], default=None)
    parser.add_argument("--momentum-warmup", type=int, default=0, help="outer_momentum_warmup_rounds of every trial")
    parser.add_argument("--log", default=os.path.join(HERE, "outer_step.jsonl"))
    parser.add_argument(
        "--markdown", action="store_true", help="print the summary of every setting as a table, run nothing"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(done_rows(args.log)))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    variant = {"outer_lr_schedule": args.outer_lr_schedule, "outer_momentum_warmup_rounds": args.momentum_warmup}
    for codec in args.codecs.split(","):
        if args.screen:
            run(args.setting, codec, seeds[0], LRS, MOMENTA, args.grace_rounds, args.log, variant)
        for step in filter(None, args.confirm.split(",")):
            lr, momentum = (float(x) for x in step.split("/"))
            for seed in seeds:
                run(args.setting, codec, seed, [lr], [momentum], None, args.log, variant)
    for row in summary(done_rows(args.log)):
        if row["setting"] == args.setting:
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "per_seed"})
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
