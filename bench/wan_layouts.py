"""``bench/wan.py --regions N``: regions as separate Ray clusters, beside the flat layout.

Layout ``regions`` (:mod:`wan_regions`): the home (region 0) runs ``diloco-ray train`` on a
private Ray in its namespace, with its own replicas and the channel's port; each other
region runs ``diloco-ray region`` on a private Ray in its own namespace and dials the home
through the router's delaying relay, the only way across. Layout ``flat``
(:mod:`wan_links`): one Ray cluster over N namespaces with the same replicas in each, the
servers in the first, every replica's message crossing its namespace's link.

Each row's ``wan_wire_bytes_*`` are the steady state's bytes (from the second round's
start to the last record, as :func:`wan.one_run`) on the non-home regions' links, from
the interface counters; ``reported_bytes_*`` the same rounds' bytes from the home's
records. Regions: the non-home regions' channel bytes (``record["regions"][name]``).
Flat: the records' total times the share of replicas outside the home's namespace (every
replica sends and receives the same bytes a round). ``wire_up_acks`` / ``wire_up_ack_bytes``
(and ``down``) are the pure TCP acknowledgements among the wire bytes (:mod:`wan_capture`),
counted in, not taken off: ``wire_ratio_*_net`` is the ratio without them.

Beside the rows: ``equivalence`` (final weights of a short fp32 regions run against the
same flat run, ``EQUIVALENCE_RUN``; and of the full-length fp32 rows, where the sum of
sums' last-bit rounding has grown through every later step, as any change of summation
order's does) and
``outage`` (one region's link down in the middle of a topk run, then up). The delay is
the relay's (:mod:`wan_relay`); the flat layout has none (no netem here).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import wan
import wan_links
import wan_regions
from wan_outage import (
    CUT_AFTER_ROUNDS,
    cut_link,
    last_eval,
    nan_facts,
    nan_fault,
    outage_facts,
    outage_seconds,
    read_records,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELAYS = (0.0, 50.0, 150.0)
# The equivalence pair (fp32, sync, one fragment): short, so that it shows the hierarchy's
# sum against the flat one before chaotic training has grown their last-bit differences.
EQUIVALENCE_RUN = ("diloco_loops=3", "max_steps=10")
CODECS = (("none", False), ("int8", False), ("topk", True))
DELAY_TEXT = (
    "a userspace TCP relay (bench/wan_relay.py) in the router namespace adds delay_ms to every chunk it "
    "forwards, once each way, on the channel's one port; tc tbf shapes the rate on both veth ends. Not "
    "modelled: each TCP leg (region-relay, relay-home) has its own short RTT, so congestion control and "
    "windows never see the long round trip; a chunk is delayed as a whole, not each packet; no loss or "
    "jitter. Flat rows have no delay (tc netem is not available here)."
)


def variants(quick: bool, none_rate: float | None = None) -> list[tuple[float, float, str, bool]]:
    """(rate, delay, codec, overlap) of each regions row; ``none_rate``: with ``quick``, the
    fp32 row's rate (wan.py's ``--quick-none-rate``)."""
    if quick:
        return [(none_rate or 20.0, 100.0, "none", False), (20.0, 100.0, "topk", True)]
    return [(rate, delay, c, o) for rate in wan.RATES for delay in DELAYS for c, o in CODECS]


def sets(fields: dict) -> list[str]:
    return [a for key, value in fields.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def codec_fields(codec: str, overlap: bool) -> dict:
    down, fragments = wan.DOWN[codec], 3 if overlap else 1
    return dict(
        pseudo_grad_compression=codec, weights_compression=down, sync_fragments=fragments, overlap_communication=overlap
    )


def wait_for(path: str, text: str, proc, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in open(path).read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in {path}:\n{open(path).read()[-3000:]}")
        time.sleep(0.5)


def final_weights(output_dir: str) -> dict:
    from safetensors.torch import load_file

    paths = sorted(glob.glob(os.path.join(output_dir, "final", "*.safetensors")))
    return {name: tensor for path in paths for name, tensor in load_file(path).items()}


def max_abs_diff(a_dir: str, b_dir: str) -> float:
    """The largest difference between two runs' final weights (as tests/conftest.py's)."""
    a, b = final_weights(a_dir), final_weights(b_dir)
    if not a or set(a) != set(b):
        raise RuntimeError(f"final weights missing or unlike in {a_dir} and {b_dir}")
    return max((a[n] - b[n]).abs().max().item() for n in b)


def row_of(log, every: list[dict], layout: str, rate: float, delay: float, codec: str, overlap: bool) -> dict:
    """A row from the counters' log and the home's records (reported_* set by the caller)."""
    rounds = every[1:]
    start, end = rounds[0]["time"] - rounds[0]["round_seconds"], rounds[-1]["time"]
    up, down = log.between(start, end)
    keys = tuple(f"{w}_{k}" for w in ("up", "down") for k in ("tcp_payload", "acks", "ack_bytes"))
    frames = dict(zip(keys, log.between(start, end, keys)))
    packets = log.between(start, end, ("up_packets", "down_packets"))
    return {
        "layout": layout,
        "rate_mbit": rate,
        "delay_ms": delay,
        "codec": codec,
        "overlap": overlap,
        "wan_wire_bytes_up": up,
        "wan_wire_bytes_down": down,
        "wire_packets_up": packets[0],
        "wire_packets_down": packets[1],
        **{f"wire_{k}": v for k, v in frames.items()},
        "exposed_sync_fraction": sum(r["sync_seconds"] for r in every) / sum(r["round_seconds"] for r in every),
        "round_seconds": statistics.median(r["round_seconds"] for r in every),
        "rounds_counted": len(rounds),
        "final_eval_loss": last_eval(every),
        "wall_seconds": log.samples[-1][0] - log.samples[0][0],
        "start_seconds": every[0]["time"] - every[0]["round_seconds"] - log.samples[0][0],
    }


def with_ratios(row: dict) -> dict:
    for way in ("up", "down"):
        reported = row[f"reported_bytes_{way}"] or float("nan")
        row[f"wire_ratio_{way}"] = row[f"wan_wire_bytes_{way}"] / reported
        row[f"wire_ratio_{way}_net"] = (row[f"wan_wire_bytes_{way}"] - row[f"wire_{way}_ack_bytes"]) / reported
    return row


class Rehearsal:
    """The runs of one ``--regions N`` rehearsal.

    Args:
        args: wan.py's parsed arguments (``regions``, ``replicas_per_region``, ``set``, ``config``).
        tls: the channel's files (``ca.pem``, ``home.pem``, ``home.key``), in a folder of
            this rehearsal's own, where the regions' throwaway tokens are written too.
    """

    def __init__(self, args, tls: dict):
        self.args, self.tls = args, tls
        self.names = ["home"] + [f"r{i}" for i in range(1, args.regions)]
        self.per = args.replicas_per_region
        self.tokens = {name: secrets.token_hex(32) for name in self.names[1:]}
        self.tokens_file = os.path.join(os.path.dirname(tls["ca.pem"]), "channel_tokens")
        with open(os.open(self.tokens_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("".join(f"{name} {token}\n" for name, token in self.tokens.items()))

    # ---- layout: regions ------------------------------------------------------------------
    def regions_run(self, net, rate, delay, codec, overlap, extra=(), keep=None, outage=None) -> dict:
        """One job across the regions; ``keep``: its folder, kept; ``outage``: (after this
        many rounds, for this many seconds) one non-home region's link goes down, and the
        row gets ``outage``."""
        if net.rate_mbit != rate:
            net.shape(rate)
        if net.delay_ms != delay:
            net.set_delay(delay)
        out = keep or tempfile.mkdtemp(prefix="wan-regions-")
        os.makedirs(out, exist_ok=True)
        env = net.env(PYTHONPATH=ROOT)
        agents = self._agents(net, out, env)
        cmd = self._home_command(net, out, codec, overlap, extra, outage)
        metrics = os.path.join(out, "home", "metrics.jsonl")
        facts: dict = {}
        with wan.CounterLog(net, ports={wan_regions.RELAY_PORT: "channel"}) as log:
            home = net.start(net.home, cmd, os.path.join(out, "home.log"), env)
            cutter = None
            if outage:
                args = (net, net.sites[-1], metrics, home, *outage, facts)
                cutter = threading.Thread(target=cut_link, args=args, daemon=True)
                cutter.start()
            gone = self._watch(home, agents, outage is not None)
            if cutter is not None:
                cutter.join(timeout=outage[1] + 60)
        for agent in agents.values():
            try:  # told the run is over, they exit; not when the home failed
                agent.wait(timeout=60 if home.returncode == 0 else 1)
            except subprocess.TimeoutExpired:
                agent.kill()
        logs = {n: open(os.path.join(out, f"{n}.log")).read() for n in ["home", *agents]}
        net.stop_processes()
        if home.returncode or gone or not os.path.exists(metrics):
            tails = "".join(f"\n--- {n}.log ---\n{text[-3000:]}" for n, text in logs.items())
            why = f"regions {gone} exited while the home ran" if gone else "failed"
            raise RuntimeError(f"regions run {rate:g} Mbit/s {delay:g} ms {codec} {why}:{tails}")
        every = read_records(metrics)
        row = self._regions_row(log, every, rate, delay, codec, overlap)
        row["region_exits"] = {n: agents[n].returncode for n in agents}
        if outage:
            row["outage"] = outage_facts(every, net.sites[-1].name, facts, logs[net.sites[-1].name])
            row["outage"]["nan"] = nan_facts(every, net.sites[1].name)
            row["outage"]["agent_joins_by_region"] = {n: logs[n].count("joined;") for n in agents}
            row["outage"]["region_exits"] = {n: agents[n].returncode for n in agents}
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return row

    def _agents(self, net, out: str, env: dict) -> dict:
        """Every non-home region's ``diloco-ray region``, started, its Ray up (before the
        home starts, as an operator's would be)."""
        agents = {}
        for site in net.sites[1:]:
            cmd = [sys.executable, "-m", "diloco_ray", "region", "--home", f"{site.gateway}:{wan_regions.RELAY_PORT}"]
            cmd += ["--name", site.name, "--ca-cert", self.tls["ca.pem"], "--server-name", "localhost"]
            cmd += ["--output-dir", os.path.join(out, site.name)]
            own = {**env, "DILOCO_CHANNEL_TOKEN": self.tokens[site.name]}  # each region its own token
            agents[site.name] = net.start(site, cmd, os.path.join(out, f"{site.name}.log"), own)
        for name, agent in agents.items():
            wait_for(os.path.join(out, f"{name}.log"), "Ray is up", agent)
        return agents

    def _home_command(self, net, out: str, codec: str, overlap: bool, extra: tuple, outage) -> list[str]:
        fields = {
            "output_dir": os.path.join(out, "home"),
            "num_replicas": self.per,
            "regions": [{"name": n, "replicas": self.per} for n in self.names[1:]],
            "channel_host": net.home.ip,
            "channel_port": wan_regions.CHANNEL_PORT,
            "channel_tls_cert": self.tls["home.pem"],
            "channel_tls_key": self.tls["home.key"],
            "channel_tokens_file": self.tokens_file,
            **codec_fields(codec, overlap),
        }
        if not outage and not overlap:
            # A round applied only with every region, as the flat run's is with every replica
            # (with fragments each sync commits with whoever reported: the field is refused).
            fields["min_regions"] = len(self.names)
        cmd = [sys.executable, "-m", "diloco_ray", "train", self.args.config, *sets(fields)]
        return cmd + [f"--set={kv}" for kv in (*extra, *self.args.set)]

    def _watch(self, home, agents: dict, outage: bool) -> list[str]:
        """Wait for the home (up to ``--run-timeout``); the regions whose agent failed while
        it ran (not counted in the outage run: the home would wait for them otherwise)."""
        deadline, gone = time.monotonic() + self.args.run_timeout, []
        try:
            while home.poll() is None and time.monotonic() < deadline and not gone:
                gone = [] if outage else [n for n, a in agents.items() if a.poll()]  # (0: told the run is over)
                time.sleep(1.0)
        finally:
            if home.poll() is None:
                home.kill()
                home.wait()
        return gone

    def _regions_row(self, log, every: list[dict], rate, delay, codec, overlap) -> dict:
        row = row_of(log, every, "regions", rate, delay, codec, overlap)
        rounds, others = every[1:], self.names[1:]
        for way in ("up", "down"):
            entries = [(r.get("regions") or {}).get(n, {}) for r in rounds for n in others]
            row[f"reported_bytes_{way}"] = sum(e.get(f"bytes_{way}", 0) for e in entries)
        row["records_with_regions"] = sum("regions" in r for r in every)
        row["rounds"] = [
            {**{k: r.get(k) for k in wan.ROUND_KEYS}, "time": r["time"], "regions": r.get("regions")} for r in every
        ]
        return with_ratios(row)

    # ---- layout: flat ----------------------------------------------------------------------
    def flat_run(self, cluster, rate, codec, overlap, extra=(), keep=None) -> dict:
        """One job on one Ray cluster over the same namespaces and replicas (servers in the first)."""
        if cluster.rate_mbit != rate:
            cluster.shape(rate)
        pins = [r for r in cluster.regions for _ in range(self.per)]
        extra = (f"num_replicas={len(pins)}", *extra, *self.args.set)
        shared = type("Args", (), {"set": [], "config": self.args.config, "replicas": len(pins)})()
        full = wan.one_run(cluster, shared, rate, codec, overlap, extra, pins=pins, keep=keep)
        every = full["rounds"]
        row = {
            "layout": "flat",
            "rate_mbit": rate,
            "delay_ms": 0.0,
            "codec": codec,
            "overlap": overlap,
            "wan_wire_bytes_up": full["wire_bytes_up"],
            "wan_wire_bytes_down": full["wire_bytes_down"],
            **{k: v for k, v in full.items() if k.startswith(("wire_up_", "wire_down_", "wire_packets", "control_"))},
        }
        share = (len(pins) - self.per) / len(pins)  # replicas outside the servers' namespace
        row["reported_bytes_up_all"], row["reported_bytes_down_all"] = (
            full["reported_bytes_up"],
            full["reported_bytes_down"],
        )
        row["reported_bytes_up"] = round(full["reported_bytes_up"] * share)
        row["reported_bytes_down"] = round(full["reported_bytes_down"] * share)
        for key in ("exposed_sync_fraction", "round_seconds", "final_eval_loss", "wall_seconds", "start_seconds"):
            row[key] = full[key]
        row["rounds_counted"] = len(every) - 1
        row["rounds"] = every
        return with_ratios(row)


class Results:
    """What ``--out`` holds, saved after every run; runs that fail are rows with their ``error``."""

    def __init__(self, out: str | None, temp: str):
        self.out, self.temp = out, temp
        self.data = {"runs": [], "equivalence": {"max_abs_diff": None}, "outage": None, "delay": DELAY_TEXT}
        self.keep: dict[str, str] = {}  # layout -> the folder of its first fp32 run (final weights)

    def run(self, layout, rate, delay, codec, overlap, call, equivalence: bool = False, **kw) -> dict:
        """One run's row (appended to ``runs`` unless it is the outage run or an equivalence run)."""
        try:
            row = call(rate, codec=codec, overlap=overlap, **kw)
        except Exception as e:  # one failed run is a row that says why; the rehearsal goes on
            row = {"layout": layout, "rate_mbit": rate, "delay_ms": delay, "codec": codec, "overlap": overlap}
            row["error"] = str(e)[-4000:]
        if "outage" not in kw and not equivalence:
            self.data["runs"].append(row)
        print("# " + json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        save(self.out, self.data)
        return row

    def kept(self, layout: str, codec: str):
        if codec != "none" or layout in self.keep:
            return None
        self.keep[layout] = os.path.join(self.temp, f"{layout}-none")
        return self.keep[layout]

    def compare(self) -> None:
        """equivalence: the short fp32 pair's final weights (EQUIVALENCE_RUN: the hierarchy
        against the flat sum, before fp32 round-off compounds), and beside it the same for
        the fp32 rows' full-length runs, where a sum of sums rounded differently from one
        flat sum has had every step since to grow (as any change of summation order does)."""
        pairs = {"max_abs_diff": ("regions-eq", "flat-eq"), "full_length_max_abs_diff": ("regions", "flat")}
        paired = "regions-eq" in self.keep
        if not paired:  # --no-equivalence-pair: the rows are the pair
            pairs["max_abs_diff"] = pairs["full_length_max_abs_diff"]
        out = {"max_abs_diff": None, "run": " ".join(EQUIVALENCE_RUN) if paired else "the fp32 rows"}
        for key, (reg, flat) in pairs.items():
            if {reg, flat} <= set(self.keep):
                try:
                    out[key] = max_abs_diff(os.path.join(self.keep[reg], "home"), self.keep[flat])
                except Exception as e:
                    out[f"{key}_error"] = str(e)
        self.data["equivalence"] = out

    def keep_for_equivalence(self, layout: str) -> str:
        self.keep[f"{layout}-eq"] = os.path.join(self.temp, f"{layout}-eq")
        return self.keep[f"{layout}-eq"]


def regions_rows(args, reh: Rehearsal, res: Results, chosen: list) -> None:
    """The regions rows, then the outage run beside the first topk + overlap row."""
    loops = (f"diloco_loops={args.outage_loops}",)  # topk rows: as long as the outage run, for its loss
    with wan_regions.RegionNet(reh.names) as net:
        for rate, delay, codec, overlap in chosen:
            call = functools.partial(reh.regions_run, net, delay=delay)
            extra = loops if codec == "topk" else ()
            res.run("regions", rate, delay, codec, overlap, call, extra=extra, keep=res.kept("regions", codec))
        if args.equivalence_pair:
            rate, delay = chosen[0][0], chosen[0][1]
            call = functools.partial(reh.regions_run, net, delay=delay)
            keep = res.keep_for_equivalence("regions")
            res.run("regions", rate, delay, "none", False, call, extra=EQUIVALENCE_RUN, keep=keep, equivalence=True)
        topk = next((r for r in res.data["runs"] if r["codec"] == "topk" and "error" not in r), None)
        if args.outage and topk is not None:
            plan = (CUT_AFTER_ROUNDS, outage_seconds(topk["round_seconds"]))
            # A round deadline too: a region that is connected but never replies is dropped
            # from the round rather than hold the run (a period it skipped, say).
            timeouts = (
                f"channel_timeout_s={args.outage_channel_timeout}",
                f"round_timeout_s={args.outage_round_timeout}",
            )
            # A replica of the first other region turns NaN in round 0: reset there, applied again.
            faults = f"fault_plan={json.dumps([nan_fault(reh.names[1])])}"
            extra = (*loops, *timeouts, faults)
            call = functools.partial(reh.regions_run, net, delay=topk["delay_ms"])
            row = res.run("regions", topk["rate_mbit"], topk["delay_ms"], "topk", True, call, extra=extra, outage=plan)
            base = {"fault_free_eval_loss": topk["final_eval_loss"], "run": row}
            res.data["outage"] = {**row.pop("outage", {"error": row.get("error")}), **base}


def flat_rows(args, reh: Rehearsal, res: Results, chosen: list) -> None:
    """Flat rows beside the regions rows of fp32 and topk + overlap, at their rates (no delay)."""
    loops = (f"diloco_loops={args.outage_loops}",)
    flat = sorted({(v[0], v[2], v[3]) for v in chosen if (v[2], v[3]) in (("none", False), ("topk", True))})
    with wan_links.Regions(args.regions - 1, cpus=reh.per, head_cpus=reh.per + 1) as cluster:
        for rate, codec, overlap in flat:
            call = functools.partial(reh.flat_run, cluster)
            extra = loops if codec == "topk" else ()
            res.run("flat", rate, 0.0, codec, overlap, call, extra=extra, keep=res.kept("flat", codec))
        if args.equivalence_pair:
            call, keep = functools.partial(reh.flat_run, cluster), res.keep_for_equivalence("flat")
            res.run("flat", chosen[0][0], 0.0, "none", False, call, extra=EQUIVALENCE_RUN, keep=keep, equivalence=True)


def main(args) -> int:
    """The rehearsal of ``wan.py --regions N``: regions rows, flat rows, equivalence, outage."""
    sys.path.insert(0, ROOT)
    from tests.unit.channel.tls_files import make_tls

    temp = tempfile.mkdtemp(prefix="wan-layouts-")
    chosen = [v for v in variants(args.quick, args.quick_none_rate) if not args.codec or v[2] in args.codec]
    res = Results(args.out, temp)
    try:
        reh = Rehearsal(args, make_tls(temp))
        regions_rows(args, reh, res, chosen)
        flat_rows(args, reh, res, chosen)
        res.compare()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    save(args.out, res.data)
    print(table([r for r in res.data["runs"] if "error" not in r]))
    print("equivalence: " + json.dumps(res.data["equivalence"]))
    if res.data["outage"]:
        print("outage: " + json.dumps({k: v for k, v in res.data["outage"].items() if k != "run"}))
    return 1 if any("error" in r for r in res.data["runs"]) else 0


def save(path, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def table(runs: list[dict]) -> str:
    lines = [
        "| layout | Mbit/s | delay ms | codec | overlap | wire up MB | reported up MB | wire/rep up | acks up MB | "
        "wire down MB | reported down MB | wire/rep down | exposed sync | round s | final eval loss |",
        "|" + "---|" * 15,
    ]
    for r in runs:
        lines.append(
            f"| {r['layout']} | {r['rate_mbit']:g} | {r['delay_ms']:g} | {r['codec']} | "
            f"{'on' if r['overlap'] else 'off'} | "
            f"{r['wan_wire_bytes_up'] / 1e6:.3f} | {r['reported_bytes_up'] / 1e6:.3f} | {r['wire_ratio_up']:.2f} | "
            f"{r['wire_up_ack_bytes'] / 1e6:.3f} | {r['wan_wire_bytes_down'] / 1e6:.3f} | "
            f"{r['reported_bytes_down'] / 1e6:.3f} | {r['wire_ratio_down']:.2f} | {r['exposed_sync_fraction']:.1%} | "
            f"{r['round_seconds']:.1f} | {r['final_eval_loss']} |"
        )
    return "\n".join(lines)
