"""What the low-bandwidth settings buy on the embedded default (configs/tiny.yaml).

Runs the default several times with one seed and compares each variant with the fp32
baseline, all measured from the runs' metrics.jsonl and final/ weights:

* ``int8_bytes_up_ratio`` / ``int4_bytes_up_ratio``: bytes replicas sent, vs fp32;
* ``int8_eval_loss_ratio`` / ``int4_ef_eval_loss_ratio``: final eval loss, vs fp32;
* ``servers2_max_abs_diff``: final weights with ``num_param_servers: 2`` vs 1;
* ``fragments4_peak_bytes_cut``: peak bytes of one sync, F=1 over F=4;
* ``fragments4_eval_loss_ratio`` and ``..._overlap_eval_loss_ratio``: Streaming DiLoCo's loss;
* ``link_sync_seconds_*``: exposed sync time per round over a simulated 20 Mbit/s, 50 ms
  link: plain, int8, and F=4 with overlap (how much the codec and overlap hide).

Run: ``python bench/low_bandwidth.py [--quick]`` (prints "NAME VALUE" lines).

``--frontier`` instead measures each codec's bits per parameter against its loss, over
seeds (:func:`frontier`): up bits per parameter per replica-round (``bytes_up`` over the
rounds: payload, indices, scales and headers), down bits likewise (round 0's full load
left out), and final eval loss over the uncompressed run's of the same seed. ``--setting
tiny`` is the embedded default (seeds 1-3); ``--setting text`` is ``bench/decoupled.py``'s
model still learning English text (2 replicas, synchronous; seeds 0-2), where DiLoCo
itself keeps improving to the end, so a codec's loss shows. Writes
``bench/frontier_<setting>.json`` and ``bench/frontier_<setting>.png``.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from safetensors.torch import load_file

from diloco_ray import DilocoFSDPTrainer, TrainerConfig

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
LINK = {"link_mbps": 20.0, "link_latency_ms": 50.0}


def run(seed: int, loops: int, **overrides) -> tuple[list[dict], dict]:
    out = tempfile.mkdtemp()
    cfg = TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "seed": seed, "diloco_loops": loops, **overrides})
    result = DilocoFSDPTrainer(cfg).train()
    return result.rounds, load_file(os.path.join(result.final_path, "model.safetensors"))


# name -> (pseudo-gradient codec, weights codec, extra fields, outer step); topk's down is int8
# (a sparse weights delta leaves replicas training from stale weights: 1.47 vs 1.04 at seed 1
# on tiny). The outer step: "setting" is the setting's own Nesterov step, stated so that topk
# does not bring its own (tiny.yaml's lr 0.7 and momentum 0.5; on the text model the DiLoCo
# paper's 0.7 and 0.9); "codec" leaves it to the codec, as a user who only names the codec
# (the "none" row: the plain default step).
SPARSELOCO = {"outer_lr": 1.3, "outer_momentum": 0.0, "error_feedback_decay": 0.95}
DILOCO_STEP = {"outer_lr": 0.7, "outer_momentum": 0.9}
FRONTIER = {
    "none": ("none", "none", {}, "codec"),
    "fp16": ("fp16", "fp16", {}, "codec"),
    "int8": ("int8", "int8", {}, "codec"),
    "int4+EF": ("int4", "int4", {"error_feedback": True}, "codec"),
    # What `pseudo_grad_compression: topk` alone gives: SparseLoCo's step and 1/64 where the
    # setting leaves the outer step unset (text), the setting's step and 1/16 where it sets it (tiny).
    "topk": ("topk", "int8", {}, "codec"),
    "topk 1/16 Nesterov": ("topk", "int8", {"topk_fraction": 1 / 16}, "setting"),
    "topk 1/32 Nesterov": ("topk", "int8", {"topk_fraction": 1 / 32}, "setting"),
    "topk 1/64 Nesterov": ("topk", "int8", {"topk_fraction": 1 / 64}, "setting"),
    "topk 1/64 both ways": ("topk", "topk", {"topk_fraction": 1 / 64}, "setting"),
    "topk 1/16 SparseLoCo": ("topk", "int8", {"topk_fraction": 1 / 16, **SPARSELOCO}, "codec"),
    "topk 1/64 SparseLoCo": ("topk", "int8", {"topk_fraction": 1 / 64, **SPARSELOCO}, "codec"),
}


def setting_config(setting: str, seed: int, fields: dict, replicas: int = 2, step: str = "codec"):
    """The setting's config for one frontier run (``step``: see FRONTIER)."""
    if setting == "tiny":  # tiny.yaml sets its outer step itself
        out = tempfile.mkdtemp()
        return TrainerConfig.from_yaml(TINY, overrides={"output_dir": out, "seed": seed, **fields})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decoupled  # the text model and corpus of bench/decoupled.py

    if step == "setting":
        fields = {**DILOCO_STEP, **fields}
    return decoupled.config(seed, "sync", "equal", 16, {"num_replicas": replicas, **fields})


def earlier_rows(log: str | None) -> list[dict]:
    """The ``# {...}`` rows an earlier ``--frontier`` run printed (to finish a cut-short run)."""
    if log is None:
        return []
    with open(log) as f:
        rows = [json.loads(line[2:]) for line in f if line.startswith("# {")]
    return list({(r["codec"], r["seed"]): r for r in rows}.values())  # a codec run twice: once


def frontier(setting: str, seeds: list[int], names: list[str], done: list[dict] = (), replicas: int = 2) -> list[dict]:
    """One row per (codec, seed): bits per parameter up and down, final loss, its ratio
    (to ``none``'s run of the same seed, here or in ``done``)."""
    rows, base = [], {r["seed"]: r["final_eval_loss"] for r in done if r["codec"] == "none"}
    for name in names:
        up_codec, down_codec, extra, step = FRONTIER[name]
        for seed in seeds:
            fields = {"pseudo_grad_compression": up_codec, "weights_compression": down_codec, **extra}
            cfg = setting_config(setting, seed, fields, replicas, step)
            result = DilocoFSDPTrainer(cfg).train()
            params = sum(t.numel() for t in load_file(os.path.join(result.final_path, "model.safetensors")).values())
            rounds, later = result.rounds, result.rounds[1:]
            per = params * cfg.num_replicas
            row = {
                "codec": name,
                "seed": seed,
                "bits_up": 8 * sum(r["bytes_up"] for r in rounds) / (per * len(rounds)),
                "bits_down": 8 * sum(r["bytes_down"] for r in later) / (per * max(1, len(later))),
                "final_eval_loss": rounds[-1]["eval_loss"],
                "eval_losses": [r["eval_loss"] for r in rounds if r["eval_loss"] is not None],
            }
            if name == "none":  # the reference: run first
                base[seed] = row["final_eval_loss"]
            row["loss_ratio"] = row["final_eval_loss"] / base[seed] if seed in base else None
            print("# " + json.dumps(row), flush=True)
            rows.append(row)
    return rows


def late_rise(losses: list[float], last: int = 5) -> float | None:
    """The largest rise of the eval loss from one eval to the next over the last ``last``
    evals (0: it kept falling; None: a row from before the evals were recorded)."""
    if not losses:
        return None
    tail = losses[-last:]
    return max([b - a for a, b in zip(tail, tail[1:])] + [0.0])


def rise(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def frontier_summary(rows: list[dict]) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["codec"] for r in rows):
        mine = [r for r in rows if r["codec"] == name and r["loss_ratio"] is not None]
        ratios = [r["loss_ratio"] for r in mine]
        rises = [x for x in (late_rise(r.get("eval_losses", [])) for r in mine) if x is not None]
        out.append(
            {
                "codec": name,
                "bits_up": statistics.median(r["bits_up"] for r in mine),
                "bits_down": statistics.median(r["bits_down"] for r in mine),
                "loss_ratio_median": statistics.median(ratios),
                "loss_ratio_max": max(ratios),
                "late_rise_max": max(rises) if rises else None,
            }
        )
    return out


def draw(summary: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summary:
        ax.errorbar(
            s["bits_up"],
            s["loss_ratio_median"],
            yerr=[[0], [s["loss_ratio_max"] - s["loss_ratio_median"]]],
            fmt="o",
            capsize=3,
        )
        ax.annotate(f"{s['codec']} (down {s['bits_down']:.2g} b)", (s["bits_up"], s["loss_ratio_median"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bits per parameter per replica-round, up (log)")
    ax.set_ylabel("final eval loss / uncompressed (median; bar: max)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (4 instead of 10)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--frontier", action="store_true", help="bits per parameter vs loss, over seeds")
    parser.add_argument("--setting", choices=("tiny", "text"), default="tiny")
    parser.add_argument("--seeds", default=None, help="comma-separated (default: tiny 1,2,3; text 0,1,2)")
    parser.add_argument("--codecs", default=",".join(FRONTIER), help="frontier codecs, comma-separated")
    parser.add_argument("--rows-from", default=None, help="add the rows an earlier --frontier run printed (its log)")
    parser.add_argument("--replicas", type=int, default=2, help="--setting text: replicas (the JSON/PNG name them)")
    args = parser.parse_args()
    if args.frontier:
        seeds = [int(s) for s in (args.seeds or ("1,2,3" if args.setting == "tiny" else "0,1,2")).split(",")]
        import ray

        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        rows = earlier_rows(args.rows_from)
        done = {r["codec"] for r in rows}
        todo = [c for c in args.codecs.split(",") if c not in done]
        rows += frontier(args.setting, seeds, todo, rows, args.replicas)
        ray.shutdown()
        summary = frontier_summary(rows)
        name = args.setting if args.setting == "tiny" or args.replicas == 2 else f"{args.setting}{args.replicas}"
        stem = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"frontier_{name}")
        with open(stem + ".json", "w") as f:
            json.dump({"setting": args.setting, "seeds": seeds, "rows": rows, "summary": summary}, f, indent=1)
        draw(summary, stem + ".png", f"codec frontier, {name} ({len(seeds)} seeds)")
        print("| codec | bits/param up | bits/param down | loss vs none, median | max | late rise, max |")
        print("|---|---|---|---|---|---|")
        for s in summary:
            print(
                f"| {s['codec']} | {s['bits_up']:.3g} | {s['bits_down']:.3g} | "
                f"{s['loss_ratio_median']:.4f} | {s['loss_ratio_max']:.4f} | {rise(s['late_rise_max'])} |"
            )
        return 0
    loops = 4 if args.quick else 10
    base, w_base = run(args.seed, loops)
    up = sum(r["bytes_up"] for r in base)
    loss = base[-1]["eval_loss"]
    figures = {}
    for name, overrides in {
        "int8": {"pseudo_grad_compression": "int8"},
        "int4": {"pseudo_grad_compression": "int4", "error_feedback": True},
    }.items():
        rounds, _ = run(args.seed, loops, **overrides)
        figures[f"{name}_bytes_up_ratio"] = sum(r["bytes_up"] for r in rounds) / up
        figures[f"{name}{'_ef' if name == 'int4' else ''}_eval_loss_ratio"] = rounds[-1]["eval_loss"] / loss
    _, w_two = run(args.seed, loops, num_param_servers=2)
    figures["servers2_max_abs_diff"] = max(float((w_two[n] - t).abs().max()) for n, t in w_base.items())
    frag, _ = run(args.seed, loops, sync_fragments=4)
    figures["fragments4_peak_bytes_cut"] = base[-1]["peak_bytes_up"] / frag[-1]["peak_bytes_up"]
    figures["fragments4_eval_loss_ratio"] = frag[-1]["eval_loss"] / loss
    over, _ = run(args.seed, loops, sync_fragments=4, overlap_communication=True)
    figures["fragments4_overlap_eval_loss_ratio"] = over[-1]["eval_loss"] / loss
    for name, overrides in {
        "fp32": {},
        "int8": {"pseudo_grad_compression": "int8"},
        "fragments4_overlap": {"sync_fragments": 4, "overlap_communication": True},
        "int8_fragments4_overlap": {
            "pseudo_grad_compression": "int8",
            "sync_fragments": 4,
            "overlap_communication": True,
        },
    }.items():
        rounds, _ = run(args.seed, min(loops, 4), **LINK, **overrides)
        later = rounds[1:]  # round 0 also loads the initial weights
        figures[f"link_sync_seconds_{name}"] = sum(r["sync_seconds"] for r in later) / len(later)
    for name, value in figures.items():
        print(f"{name} {value:.6g}")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "low_bandwidth.json"), "w") as f:
        json.dump({"seed": args.seed, "rounds": loops, "figures": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
