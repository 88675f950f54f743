"""One job of the flat layout on its shaped links, and what crossed them (``bench/wan.py``).

:func:`one_run` runs a config the way a user would (the CLI in the head's namespace with
``RAY_ADDRESS`` set, servers and replicas pinned to their regions) while a
:class:`CounterLog` reads the links' counters and sorts their frames
(:mod:`wanlab.capture`) in a thread, and returns the run's row: the steady state's wire
bytes beside the bytes the records report, Ray's control plane told apart by port, and
the run's seconds and loss (``bench/wan.py``'s docstring lists every key).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from . import capture
from .bridge import SERVICES, BridgedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAN = os.path.join(ROOT, "configs", "wan.yaml")
RATES = (100.0, 20.0, 5.0)
CODECS = ("none", "int8", "topk")
# The weights' codec beside each pseudo-gradient codec: a sparse weights delta leaves replicas
# training from stale weights (bench/low_bandwidth.py --frontier), so topk's down is int8.
DOWN = {"none": "none", "int8": "int8", "topk": "int8"}
IDLE_SECONDS = 20.0
SERVICE_KEYS = capture.label_keys(SERVICES)
CONTROL = ("gcs", "raylet", "agent")  # SERVICES that carry no message
FRAME_KEYS = tuple(f"{way}_{key}" for way in ("up", "down") for key in capture.KEYS + SERVICE_KEYS)
# Each round's figures kept in --out, to see where a run's seconds and bytes went.
ROUND_KEYS = ("round", "round_seconds", "sync_seconds", "compute_seconds", "eval_seconds", "bytes_up", "bytes_down")


def variants(quick: bool, none_rate: float = 20.0) -> list[tuple[float, str, bool]]:
    if quick:
        return [(none_rate, "none", False), (20.0, "topk", True)]
    return [(rate, codec, overlap) for rate in RATES for codec in CODECS for overlap in (False, True)]


def replica_traffic(before: dict, after: dict, what: tuple = ("up", "down")) -> tuple[int, ...]:
    """Counters (default: bytes up, bytes down) summed over the replica regions between
    two reads."""
    regions = [r for r in after if r != "srv"]
    return tuple(sum(after[r][key] - before[r][key] for r in regions) for key in what)


def idle_rate(cluster: BridgedCluster, seconds: float) -> float:
    """Bytes per second Ray's control traffic puts on the replica links, both ways, idle."""
    before = cluster.counters()
    time.sleep(seconds)
    up, down = replica_traffic(before, cluster.counters())
    return (up + down) / seconds


def overrides(cluster: BridgedCluster, replicas: int, codec: str, overlap: bool, out: str, pins=None) -> list[str]:
    """``pins``: each replica's region (default: one replica in each region but the servers')."""
    pins = cluster.regions[1 : replicas + 1] if pins is None else pins
    fields = {
        "output_dir": out,
        "server_resources": {cluster.head.resource: 0.001},
        "replica_resources": [{r.resource: 0.001} for r in pins],
        "pseudo_grad_compression": codec,
        "weights_compression": DOWN[codec],
        "sync_fragments": 3 if overlap else 1,
        "overlap_communication": overlap,
    }
    return [a for key, value in fields.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def read_rounds(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if r.get("event") == "round"]


class CounterLog:
    """The links' counters, and what the frames on them were (:mod:`wanlab.capture`), read every
    ``period`` seconds in a thread, wall-clock stamped, so the bytes of any time window (the
    training rounds) can be read off afterwards."""

    def __init__(self, cluster, period: float = 0.1, ports: dict | None = None):
        self.cluster, self.period = cluster, period
        ports = SERVICES if ports is None else ports
        self.capture = capture.Capture({r.name: r.host_end for r in cluster.regions[1:]}, ports)
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CounterLog":
        # The links' ends may live in another namespace (the regions layout's router): capture there.
        with getattr(self.cluster, "in_router", contextlib.nullcontext)():
            self.capture.start()
        self.samples.append((time.time(), self._read()))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), self._read()))
        self.capture.stop()

    def _read(self) -> dict:
        frames = self.capture.totals()
        return {r: {**c, **frames.get(r, {})} for r, c in self.cluster.counters().items()}

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.time(), self._read()))

    def between(self, start: float, end: float, what: tuple = ("up", "down")) -> tuple[int, ...]:
        """Replica-link (up, down) bytes from the last sample at or before ``start`` to the
        first at or after ``end`` (the window widened by at most one period each side)."""
        first = max((s for s in self.samples if s[0] <= start), key=lambda s: s[0], default=self.samples[0])
        last = min((s for s in self.samples if s[0] >= end), key=lambda s: s[0], default=self.samples[-1])
        return replica_traffic(first[1], last[1], what)


def one_run(cluster, args, rate: float, codec: str, overlap: bool, extra: tuple = (), pins=None, keep=None) -> dict:
    """One job on ``cluster`` at ``rate``; ``extra``: config FIELD=VALUE for it alone (last wins);
    ``pins``: each replica's region (see :func:`overrides`); ``keep``: the run's folder, kept."""
    out = keep or tempfile.mkdtemp(prefix="wan-run-")
    fields = overrides(cluster, len(pins) if pins else args.replicas, codec, overlap, out, pins)
    sets = (f"--set={kv}" for kv in (*args.set, *extra))
    cmd = [sys.executable, "-m", "diloco_ray", "train", args.config, *fields, *sets]
    with CounterLog(cluster) as log:
        done = cluster.run(*cmd)
    if done.returncode:
        raise RuntimeError(f"run {rate} Mbit/s {codec} overlap={overlap} failed:\n{done.stderr[-3000:]}")
    every = read_rounds(out)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)  # the run's folder: only its records were needed
    # The steady-state window: from the second round's start to the last record. Round 0
    # also loads the initial weights, and just before it one replica seeds the servers
    # with them (fp32, up); start-up and the final save lie outside too. The job's totals
    # are kept beside it.
    rounds = every[1:]
    start, end = rounds[0]["time"] - rounds[0]["round_seconds"], rounds[-1]["time"]
    up, down = log.between(start, end)
    up_packets, down_packets = log.between(start, end, ("up_packets", "down_packets"))
    frames = dict(zip(FRAME_KEYS, log.between(start, end, FRAME_KEYS)))
    job_up, job_down = replica_traffic(log.samples[0][1], log.samples[-1][1])
    reported_up = sum(r["bytes_up"] for r in rounds)
    reported_down = sum(r["bytes_down"] + r.get("eval_bytes_down", 0) for r in rounds)
    # Ray's control plane (GCS, raylets, agents) carries no message: its frames in the same
    # window, counted by port, are taken off each direction (acknowledgements among them
    # are in *_ack_bytes already, so the net ratios take off only the rest).
    control = {way: sum(frames[f"{way}_{s}_bytes"] for s in CONTROL) for way in ("up", "down")}
    control_acks = {way: sum(frames[f"{way}_{s}_ack_bytes"] for s in CONTROL) for way in ("up", "down")}
    net = {way: control[way] - control_acks[way] for way in ("up", "down")}
    return {
        "rate_mbit": rate,
        "codec": codec,
        "overlap": overlap,
        "wire_bytes_up": up,
        "wire_bytes_down": down,
        "reported_bytes_up": reported_up,
        "reported_bytes_down": reported_down,
        "control_bytes_up": control["up"],
        "control_bytes_down": control["down"],
        "wire_packets_up": up_packets,
        "wire_packets_down": down_packets,
        **{f"wire_{key}": value for key, value in frames.items()},
        "wire_ratio_up": (up - control["up"]) / reported_up,
        "wire_ratio_down": (down - control["down"]) / reported_down,
        # Less the pure TCP acknowledgements each way (mostly of what flows the other way).
        "wire_ratio_up_net": (up - frames["up_ack_bytes"] - net["up"]) / reported_up,
        "wire_ratio_down_net": (down - frames["down_ack_bytes"] - net["down"]) / reported_down,
        "job_wire_bytes_up": job_up,
        "job_wire_bytes_down": job_down,
        "exposed_sync_fraction": sum(r["sync_seconds"] for r in every) / sum(r["round_seconds"] for r in every),
        "round_seconds": statistics.median(r["round_seconds"] for r in every),
        "final_eval_loss": every[-1]["eval_loss"],
        "wall_seconds": log.samples[-1][0] - log.samples[0][0],
        # Before the first round (the driver's start, workers, data) and after the last record.
        "start_seconds": every[0]["time"] - every[0]["round_seconds"] - log.samples[0][0],
        "end_seconds": log.samples[-1][0] - end,
        "rounds": [{key: r.get(key) for key in ROUND_KEYS} for r in every],
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| Mbit/s | codec | overlap | wire up MB | reported up MB | wire/reported up | of it acks | "
        "wire down MB | reported down MB | wire/reported down | exposed sync | round s | final eval loss |",
        "|" + "---|" * 13,
    ]
    for r in runs:
        ratio_up, ratio_down = r["wire_ratio_up"], r["wire_ratio_down"]
        lines.append(
            f"| {r['rate_mbit']:g} | {r['codec']} | {'on' if r['overlap'] else 'off'} | "
            f"{r['wire_bytes_up'] / 1e6:.3f} | {r['reported_bytes_up'] / 1e6:.3f} | "
            f"{ratio_up:.2f} | {ratio_up - r['wire_ratio_up_net']:.2f} | "
            f"{r['wire_bytes_down'] / 1e6:.3f} | {r['reported_bytes_down'] / 1e6:.3f} | "
            f"{ratio_down:.2f} | {r['exposed_sync_fraction']:.1%} | {r['round_seconds']:.1f} | "
            f"{r['final_eval_loss']:.4f} |"
        )
    return "\n".join(lines)
