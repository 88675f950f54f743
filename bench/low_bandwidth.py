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
"""

import argparse
import json
import os
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (4 instead of 10)")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
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
