"""The runs of one ``bench/wan.py --regions N`` rehearsal, one job at a time: across the
regions (:meth:`Rehearsal.regions_run`: the home's ``diloco-ray train`` and every other
region's ``diloco-ray region``, each in its namespace, the links counted while they run,
an outage of one region's link when asked) and on the flat layout of the same replicas
(:meth:`Rehearsal.flat_run`, :func:`wanlab.runs.one_run`). Each returns its row
(:mod:`wanlab.layouts` says what a row holds and gathers them).
"""

from __future__ import annotations

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

from . import runs
from .outage import cut_link, last_eval, nan_facts, outage_facts, read_records
from .router import CHANNEL_PORT, RELAY_PORT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sets(fields: dict) -> list[str]:
    return [a for key, value in fields.items() for a in ("--set", f"{key}={json.dumps(value)}")]


def codec_fields(codec: str, overlap: bool) -> dict:
    down, fragments = runs.DOWN[codec], 3 if overlap else 1
    return dict(
        pseudo_grad_compression=codec, weights_compression=down, sync_fragments=fragments, overlap_communication=overlap
    )


def wait_for(path: str, text: str, proc, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in open(path).read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in {path}:\n{open(path).read()[-3000:]}")
        time.sleep(0.5)


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
        args: ``bench/wan.py``'s parsed arguments (``regions``, ``replicas_per_region``, ``set``, ``config``).
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
        with runs.CounterLog(net, ports={RELAY_PORT: "channel"}) as log:
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
            cmd = [sys.executable, "-m", "diloco_ray", "region", "--home", f"{site.gateway}:{RELAY_PORT}"]
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
            "channel_port": CHANNEL_PORT,
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
        # What each region applies per sync: every applied member's message (the home's
        # replicas' and every region's, its own among them); with region_downlink: step that
        # is what comes down, as records.
        applied = sum(
            e.get("bytes_up", 0) for r in rounds for e in (r.get("regions") or {}).values() if e.get("applied")
        )
        row["applied_bytes_per_region"] = applied
        row["wire_down_net_per_applied"] = (row["wan_wire_bytes_down"] - row["wire_down_ack_bytes"]) / (
            len(others) * applied or float("nan")
        )
        row["records_with_regions"] = sum("regions" in r for r in every)
        row["rounds"] = [
            {**{k: r.get(k) for k in runs.ROUND_KEYS}, "time": r["time"], "regions": r.get("regions")} for r in every
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
        full = runs.one_run(cluster, shared, rate, codec, overlap, extra, pins=pins, keep=keep)
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
