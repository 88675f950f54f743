"""``bench/wan.py --regions N``: regions as separate Ray clusters, beside the flat layout.

Layout ``regions`` (:mod:`wanlab.router`): the home (region 0) runs ``diloco-ray train`` on a
private Ray in its namespace, with its own replicas and the channel's port; each other
region runs ``diloco-ray region`` on a private Ray in its own namespace and dials the home
through the router's delaying relay, the only way across. Layout ``flat``
(:mod:`wanlab.bridge`): one Ray cluster over N namespaces with the same replicas in each, the
servers in the first, every replica's message crossing its namespace's link.

Each row's ``wan_wire_bytes_*`` are the steady state's bytes (from the second round's
start to the last record, as :func:`wanlab.runs.one_run`) on the non-home regions' links, from
the interface counters; ``reported_bytes_*`` the same rounds' bytes from the home's
records. Regions: the non-home regions' channel bytes (``record["regions"][name]``).
Flat: the records' total times the share of replicas outside the home's namespace (every
replica sends and receives the same bytes a round). ``wire_up_acks`` / ``wire_up_ack_bytes``
(and ``down``) are the pure TCP acknowledgements among the wire bytes (:mod:`wanlab.capture`),
counted in, not taken off: ``wire_ratio_*_net`` is the ratio without them.

Beside the rows: ``equivalence`` (final weights of a short fp32 regions run against the
same flat run, ``EQUIVALENCE_RUN``; and of the full-length fp32 rows, where the sum of
sums' last-bit rounding has grown through every later step, as any change of summation
order's does) and
``outage`` (one region's link down in the middle of a topk run, then up). The delay is
the relay's (:mod:`wanlab.relay`); the flat layout has none (no netem here).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import sys
import tempfile

from . import runs
from .bridge import BridgedCluster
from .outage import CUT_AFTER_ROUNDS, nan_fault, outage_seconds
from .rehearsal import ROOT, Rehearsal
from .router import RegionNet

DELAYS = (0.0, 50.0, 150.0)
# The equivalence pair (fp32, sync, one fragment): short, so that it shows the hierarchy's
# sum against the flat one before chaotic training has grown their last-bit differences.
EQUIVALENCE_RUN = ("diloco_loops=3", "max_steps=10")
CODECS = (("none", False), ("int8", False), ("topk", True))
DELAY_TEXT = (
    "a userspace TCP relay (bench/wanlab/relay.py) in the router namespace adds delay_ms to every chunk it "
    "forwards, once each way, on the channel's one port; tc tbf shapes the rate on both veth ends. Not "
    "modelled: each TCP leg (region-relay, relay-home) has its own short RTT, so congestion control and "
    "windows never see the long round trip; a chunk is delayed as a whole, not each packet; no loss or "
    "jitter. Flat rows have no delay (tc netem is not available here)."
)


def variants(quick: bool, none_rate: float | None = None) -> list[tuple[float, float, str, bool]]:
    """(rate, delay, codec, overlap) of each regions row; ``none_rate``: with ``quick``, the
    fp32 row's rate (``bench/wan.py --quick-none-rate``)."""
    if quick:
        return [(none_rate or 20.0, 100.0, "none", False), (20.0, 100.0, "topk", True)]
    return [(rate, delay, c, o) for rate in runs.RATES for delay in DELAYS for c, o in CODECS]


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
    with RegionNet(reh.names) as net:
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
    with BridgedCluster(args.regions - 1, cpus=reh.per, head_cpus=reh.per + 1) as cluster:
        for rate, codec, overlap in flat:
            call = functools.partial(reh.flat_run, cluster)
            extra = loops if codec == "topk" else ()
            res.run("flat", rate, 0.0, codec, overlap, call, extra=extra, keep=res.kept("flat", codec))
        if args.equivalence_pair:
            call, keep = functools.partial(reh.flat_run, cluster), res.keep_for_equivalence("flat")
            res.run("flat", chosen[0][0], 0.0, "none", False, call, extra=EQUIVALENCE_RUN, keep=keep, equivalence=True)


def main(args) -> int:
    """The rehearsal of ``bench/wan.py --regions N``: regions rows, flat rows, equivalence, outage."""
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


def table(rows: list[dict]) -> str:
    lines = [
        "| layout | Mbit/s | delay ms | codec | overlap | wire up MB | reported up MB | wire/rep up | acks up MB | "
        "wire down MB | reported down MB | wire/rep down | exposed sync | round s | final eval loss |",
        "|" + "---|" * 15,
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['rate_mbit']:g} | {r['delay_ms']:g} | {r['codec']} | "
            f"{'on' if r['overlap'] else 'off'} | "
            f"{r['wan_wire_bytes_up'] / 1e6:.3f} | {r['reported_bytes_up'] / 1e6:.3f} | {r['wire_ratio_up']:.2f} | "
            f"{r['wire_up_ack_bytes'] / 1e6:.3f} | {r['wan_wire_bytes_down'] / 1e6:.3f} | "
            f"{r['reported_bytes_down'] / 1e6:.3f} | {r['wire_ratio_down']:.2f} | {r['exposed_sync_fraction']:.1%} | "
            f"{r['round_seconds']:.1f} | {r['final_eval_loss']} |"
        )
    return "\n".join(lines)
