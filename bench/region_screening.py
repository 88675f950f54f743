"""What screening regions' contributions costs and what it catches: ``python bench/region_screening.py``.

Runs the embedded default across regions on this machine (no root): the home (this
process's Ray, one replica) and region ``eu`` (a ``diloco-ray region`` process with a Ray
of its own, one replica), per mode and seed, in four variants:

* ``honest``: screening on (``region_screen_norm`` 10, the default);
* ``unscreened``: screening off (``region_screen_norm: null``): what screening costs an
  honest run (the acceptance: the medians within 1.005x);
* ``x1e30``: eu's pseudo-gradient leaves 1e30 times what it is every round from round 1
  (the fault plan's ``scale``): screened out, the run goes on with the home's replica;
* ``flip``: eu's leaves sign-flipped every round from round 1: of an honest norm, which
  the rule cannot tell from an honest update (what it misses, measured);
* ``alone``: the home's replica without eu: the run of the others, the best a screened-out
  region leaves (the acceptance: ``x1e30`` within 1.02x of it on the median);
* ``held-out``: ``honest`` with the held-out check on (``region_holdout_margin``
  :data:`MARGIN`; sync mode only): what the check costs an honest run (within 1.005x of
  ``honest`` on the median), and how often it refuses an honest update;
* ``held-out-flip``: ``flip`` with the check on: each flipped update refused, the run
  within 1.02x of ``alone``.

Prints each run's final eval loss, the rounds in which eu was left out (and, with the
held-out check, each round's score: the eval loss of the round's weights minus eu's update
less the round's weights' own), and per mode
the median and max over seeds with the ratios on the median. Usage: ``python
bench/region_screening.py [--seeds 1,2,3] [--modes sync,decoupled] [--variants ...]
[--out FILE.json]``; about a minute a run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
from quality import final_eval_loss  # noqa: E402
from run import config, train  # noqa: E402

from diloco_ray.config.fields import REGION_ID_BASE  # noqa: E402
from diloco_ray.driver import holdout  # noqa: E402
from tests.unit.channel.tls_files import make_tls  # noqa: E402

ROUNDS = 10  # the default's
VARIANTS = {
    "honest": {},
    "unscreened": {"region_screen_norm": None},
    "x1e30": {"fault_plan": [{"kind": "scale", "region": "eu", "round": r, "factor": 1e30} for r in range(1, ROUNDS)]},
    "flip": {"fault_plan": [{"kind": "scale", "region": "eu", "round": r, "factor": -1} for r in range(1, ROUNDS)]},
    "alone": None,  # no region at all
}
MARGIN = 0.0  # a positive margin lets a late flip pass (docs/results.md, Screening regions)
FLIPPED = VARIANTS["flip"]["fault_plan"]
VARIANTS["held-out"] = {"region_holdout_margin": MARGIN}
VARIANTS["held-out-flip"] = {"region_holdout_margin": MARGIN, "fault_plan": FLIPPED}
SYNC_ONLY = ("held-out", "held-out-flip")  # the check runs while the home's replicas wait for a round
HONEST_BOUND = 1.005
ATTACKED_BOUND = 1.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_region(folder: str, port: int, tls: dict, token: str) -> subprocess.Popen:
    """Region eu's agent, its Ray up (as an operator's would be before the home starts)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_ADDRESS": "local", "DILOCO_CHANNEL_TOKEN": token}
    log = os.path.join(folder, "eu.log")
    cmd = [sys.executable, "-m", "diloco_ray", "region", "--home", f"127.0.0.1:{port}", "--name", "eu"]
    cmd += ["--ca-cert", tls["ca.pem"], "--server-name", "localhost", "--output-dir", os.path.join(folder, "eu")]
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "Ray is up" not in open(log).read():
        if agent.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"region eu did not start:\n{open(log).read()[-2000:]}")
        time.sleep(0.5)
    return agent


def one_run(mode: str, seed: int, variant: str) -> dict:
    started = time.monotonic()
    scores: list = []  # the held-out check's (eval loss of the weights minus eu's update) - (the round's)
    check = holdout.worse_than_margin
    holdout.worse_than_margin = lambda t, b, m: scores.append(round(t - b, 4)) or check(t, b, m)
    try:
        if VARIANTS[variant] is None:
            rounds = train(config(seed=seed, sync_mode=mode, num_replicas=1))
        else:
            rounds = across_regions(mode, seed, VARIANTS[variant])
    finally:
        holdout.worse_than_margin = check
    screened = [r["round"] for r in rounds if str(REGION_ID_BASE) in r.get("rejected", {})]
    return {
        "mode": mode,
        "seed": seed,
        "variant": variant,
        "final_eval_loss": final_eval_loss(rounds),
        "screened_rounds": screened,
        "held_out_scores": scores,
        "seconds": round(time.monotonic() - started, 1),
    }


def across_regions(mode: str, seed: int, extra: dict) -> list[dict]:
    """One run of the home's replica beside region eu's; its round records."""
    folder = tempfile.mkdtemp(prefix="screening-")
    tls, port, token = make_tls(folder), free_port(), secrets.token_hex(32)
    tokens = os.path.join(folder, "tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(f"eu {token}\n")
    fields = dict(
        seed=seed,
        sync_mode=mode,
        num_replicas=1,
        regions=[{"name": "eu", "replicas": 1}],
        channel_host="127.0.0.1",
        channel_port=port,
        channel_tls_cert=tls["home.pem"],
        channel_tls_key=tls["home.key"],
        channel_tokens_file=tokens,
        **({"round_timeout_s": 300} if mode == "sync" else {}),  # decoupled mode has no round deadline
        **extra,
    )
    agent = start_region(folder, port, tls, token)
    try:
        rounds = train(config(**fields))
        agent.wait(timeout=120)
    finally:
        agent.kill()
    return rounds


def summary(runs: list[dict], modes: list[str], variants: list[str]) -> list[str]:
    lines = []
    for mode in modes:
        medians = {}
        for variant in variants:
            losses = [r["final_eval_loss"] for r in runs if (r["mode"], r["variant"]) == (mode, variant)]
            if losses:
                medians[variant] = statistics.median(losses)
                lines.append(
                    f"| {mode} | {variant} | {' / '.join(f'{x:.4f}' for x in losses)} | "
                    f"{medians[variant]:.4f} | {max(losses):.4f} |"
                )
        # (numerator, denominator, bound): what screening costs, then what an attack costs.
        for top, bottom, bound in (
            ("honest", "unscreened", HONEST_BOUND),
            ("x1e30", "alone", ATTACKED_BOUND),
            ("x1e30", "honest", None),
            ("flip", "honest", None),
            ("held-out", "honest", HONEST_BOUND),
            ("held-out-flip", "alone", ATTACKED_BOUND),
        ):
            if top in medians and bottom in medians:
                ratio = medians[top] / medians[bottom]
                check = "" if bound is None else f" (bound {bound}: {'ok' if ratio <= bound else 'NOT MET'})"
                lines.append(f"{mode}: {top}/{bottom} on the median {ratio:.4f}{check}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--modes", default="sync,decoupled")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--margin", type=float, default=MARGIN, help="the held-out variants' region_holdout_margin")
    args = parser.parse_args(argv)
    for variant in SYNC_ONLY:
        VARIANTS[variant]["region_holdout_margin"] = args.margin
    seeds, modes, variants = [int(s) for s in args.seeds.split(",")], args.modes.split(","), args.variants.split(",")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    runs = []
    for mode in modes:
        for seed in seeds:
            for variant in variants:
                if mode != "sync" and variant in SYNC_ONLY:
                    continue
                runs.append(one_run(mode, seed, variant))
                r = runs[-1]
                print(
                    f"# {mode} seed {seed} {variant}: {r['final_eval_loss']:.4f}, "
                    f"left out in rounds {r['screened_rounds']} ({r['seconds']:.0f} s)"
                    + (f"; held-out scores {r['held_out_scores']}" if r["held_out_scores"] else ""),
                    flush=True,
                )
    lines = ["| mode | variant | per seed | median | max |", "|---|---|---|---|---|", *summary(runs, modes, variants)]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "summary": lines}, f, indent=1)
    return 1 if any("NOT MET" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
