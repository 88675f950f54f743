"""Regions over real rate-limited links: ``sudo python bench/wan.py [--quick] [--out FILE]``.

Builds one network namespace per region on this machine (the servers' region, which also
runs the Ray head and the driver, and one per replica), joins them through a bridge by
veth pairs shaped with ``tc tbf`` in both directions (:mod:`wan_links`), starts a raylet
in each, and runs a config the way a user would: the CLI in the head's region with
``RAY_ADDRESS`` set, servers and replicas pinned to their regions
with ``server_resources`` / ``replica_resources``. ``netem`` is not available here, so a
link has a rate and no added delay (latency rehearsals use the simulated link of
:mod:`diloco_ray.algo.links`, ``link_latency_ms``). The default config is
``configs/wan.yaml``, the default task on a 1.4M-parameter model with an eval every 5
rounds: on the 354k-parameter tiny default, topk's 38 kB a replica-round is smaller than
Ray's calls and TCP's acknowledgements around it.

For every run it reports what crossed each replica's link, from the interface counters,
beside what the round records report:

* ``wire_bytes_up`` / ``wire_bytes_down``: bytes the replica regions sent / received in the
  steady state (counters sampled every 0.1 s; from the second round's start to the last
  round's record: round 0 also loads the initial weights, and one replica seeds the
  servers just before it), summed over replicas; ``job_wire_bytes_*`` the same over the
  whole job (worker start-up and the final save included);
* ``reported_bytes_up`` / ``reported_bytes_down``: the sum of the same rounds' records'
  ``bytes_up`` / ``bytes_down`` + ``eval_bytes_down`` (the messages' lengths; eval reads
  the global weights on one replica, which crosses its link unless the next round's
  weights message is those weights exactly);
* ``control_bytes_up`` / ``control_bytes_down``: frames of Ray's control plane in the same
  window (connections to the GCS, the raylets and their agents, told apart by port:
  ``wan_links.SERVICES``; no message crosses there): what would have crossed anyway;
  ``wire_{up,down}_{gcs,raylet,agent,objects,worker}_bytes`` (and ``_ack_bytes``) each
  service's share;
* ``wire_packets_up`` / ``wire_packets_down``: packets, same window (most packets up while
  the weights come down are TCP's acknowledgements of them: 66 bytes each);
* ``wire_up_tcp_payload``, ``wire_up_acks``, ``wire_up_ack_bytes`` (and ``wire_down_*``):
  what the frames were, same window (:mod:`wan_capture`): TCP payload (the messages and
  Ray's calls around them) and pure acknowledgements; the rest is frame headers;
* ``wire_ratio_up`` / ``wire_ratio_down``: (wire - control) / reported; ``*_net``: the
  same less that direction's pure acknowledgements (TCP's answer to the other direction:
  with int8 weights down and topk up, about 2% of the down bytes crossing up, a quarter
  of topk's payload);
* ``exposed_sync_fraction``: summed ``sync_seconds`` over summed ``round_seconds``;
* ``round_seconds`` (median), ``final_eval_loss``, ``wall_seconds``, ``start_seconds``
  (before the first round) and ``end_seconds`` (after the last record); ``rounds``: each
  round's seconds (round, sync, compute, eval) and reported bytes.

It runs 100, 20 and 5 Mbit/s with codecs ``none``, ``int8`` and ``topk`` (weights down:
``none``, ``int8``, ``int8``),
overlap off (one fragment) and on (3 fragments, ``overlap_communication``); ``--quick``
runs 20 Mbit/s with ``none`` and with ``topk`` + overlap. Ray's idle traffic is measured
once per rate for the record (``--idle-seconds``, 0 skips it). Everything is torn down on
exit, Ctrl-C included. Needs root.

``--regions N`` rehearses regions as separate Ray clusters instead (:mod:`wan_layouts`):
the home and N-1 regions, each a private Ray in its own namespace running
``diloco-ray region``, joined only by a delaying relay on the channel's port
(:mod:`wan_regions`, :mod:`wan_relay`: the delay this layout adds in userspace), beside
the flat layout of the same replicas on one cluster; rows for both, the fp32 runs' final
weights compared, and an outage of one region's link (``--no-outage`` skips it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wan_capture  # noqa: E402
import wan_links  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAN = os.path.join(ROOT, "configs", "wan.yaml")
RATES = (100.0, 20.0, 5.0)
CODECS = ("none", "int8", "topk")
# The weights' codec beside each pseudo-gradient codec: a sparse weights delta leaves replicas
# training from stale weights (bench/low_bandwidth.py --frontier), so topk's down is int8.
DOWN = {"none": "none", "int8": "int8", "topk": "int8"}
IDLE_SECONDS = 20.0
SERVICE_KEYS = wan_capture.label_keys(wan_links.SERVICES)
CONTROL = ("gcs", "raylet", "agent")  # wan_links.SERVICES that carry no message
FRAME_KEYS = tuple(f"{way}_{key}" for way in ("up", "down") for key in wan_capture.KEYS + SERVICE_KEYS)
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


def idle_rate(cluster: wan_links.Regions, seconds: float) -> float:
    """Bytes per second Ray's control traffic puts on the replica links, both ways, idle."""
    before = cluster.counters()
    time.sleep(seconds)
    up, down = replica_traffic(before, cluster.counters())
    return (up + down) / seconds


def overrides(cluster: wan_links.Regions, replicas: int, codec: str, overlap: bool, out: str, pins=None) -> list[str]:
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
    """The links' counters, and what the frames on them were (:mod:`wan_capture`), read every
    ``period`` seconds in a thread, wall-clock stamped, so the bytes of any time window (the
    training rounds) can be read off afterwards."""

    def __init__(self, cluster, period: float = 0.1, ports: dict | None = None):
        self.cluster, self.period = cluster, period
        ports = wan_links.SERVICES if ports is None else ports
        self.capture = wan_capture.Capture({r.name: r.host_end for r in cluster.regions[1:]}, ports)
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "CounterLog":
        # The links' ends may live in another namespace (wan_regions' router): capture there.
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


def check_quick_flags(parser: argparse.ArgumentParser, args) -> None:
    """The fp32 run's own flags mean something with --quick only, and only when positive."""
    for flag, value in (("--quick-none-rate", args.quick_none_rate), ("--quick-none-steps", args.quick_none_steps)):
        if value is None:
            continue
        if not args.quick:
            parser.error(f"{flag} sets the fp32 run of --quick; without --quick it would be ignored")
        if value <= 0:
            parser.error(f"{flag}: {value:g} is not allowed; give a number above 0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=WAN)
    parser.add_argument("--quick", action="store_true", help="20 Mbit/s: none, and topk with overlap")
    parser.add_argument(
        "--quick-none-rate",
        type=float,
        default=None,
        help="with --quick, the fp32 run's link rate in Mbit/s (default 20; test_wan: 100, for that run's bytes)",
    )
    parser.add_argument(
        "--quick-none-steps",
        type=int,
        default=None,
        help="with --quick, the fp32 run's max_steps (test_wan: 10; its sync is exposed at any length)",
    )
    parser.add_argument("--out", default=None, help="write {'runs': [...], ...} as JSON here")
    parser.add_argument("--replicas", type=int, default=2, help="replica regions (the config's num_replicas)")
    parser.add_argument("--set", action="append", default=[], help="config FIELD=VALUE for every run")
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS, help="how long idle traffic is measured")
    regions = parser.add_argument_group("--regions N: regions as separate Ray clusters (bench/wan_layouts.py)")
    regions.add_argument("--regions", type=int, default=0, metavar="N", help="N regions (the home and N-1 others)")
    regions.add_argument("--replicas-per-region", type=int, default=2, help="every region's replicas, the home's too")
    regions.add_argument("--codec", action="append", default=[], help="only these codecs' rows (none, int8, topk)")
    regions.add_argument("--no-outage", dest="outage", action="store_false", help="skip the outage run")
    regions.add_argument(
        "--no-equivalence-pair",
        dest="equivalence_pair",
        action="store_false",
        help="read equivalence off the fp32 rows instead of a short pair of runs of their own (rows already short)",
    )
    regions.add_argument("--outage-loops", type=int, default=16, help="diloco_loops of topk rows and the outage run")
    regions.add_argument("--outage-channel-timeout", type=float, default=8.0, help="the outage run's channel_timeout_s")
    regions.add_argument("--outage-round-timeout", type=float, default=180.0, help="the outage run's round_timeout_s")
    regions.add_argument("--run-timeout", type=float, default=1200.0, help="seconds a regions run may take")
    args = parser.parse_args()
    check_quick_flags(parser, args)
    if args.regions == 1 or args.regions < 0:
        parser.error("--regions N needs N >= 2 (the home and at least one other region)")
    reason = wan_links.why_not_available()
    if reason:
        print(f"bench/wan.py: {reason}", file=sys.stderr)
        return 2
    if args.regions:
        import wan_layouts

        return wan_layouts.main(args)
    print("links: tc tbf, rate only (tc netem is not available here: no added delay)", flush=True)
    runs, idle = [], None
    with wan_links.Regions(args.replicas, cpus=1, head_cpus=1) as cluster:
        none_rate = 20.0 if args.quick_none_rate is None else args.quick_none_rate
        for rate, codec, overlap in variants(args.quick, none_rate):
            if cluster.rate_mbit != rate:
                cluster.shape(rate)
                if args.idle_seconds > 0:  # for the record only: the runs count theirs by port
                    idle = idle_rate(cluster, args.idle_seconds)
                    print(f"# {rate:g} Mbit/s: Ray's idle traffic {idle:.0f} B/s over the replica links", flush=True)
            shorter = args.quick and codec == "none" and args.quick_none_steps
            extra = (f"max_steps={args.quick_none_steps}",) if shorter else ()
            runs.append(one_run(cluster, args, rate, codec, overlap, extra))
            print("# " + json.dumps(runs[-1]), flush=True)
    print(table(runs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"idle_bytes_per_second": idle, "delay_emulated": False, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
