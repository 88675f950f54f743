"""Regions over real rate-limited links: ``sudo python bench/wan.py [--quick] [--out FILE]``.

Builds one network namespace per region on this machine (the servers' region, which also
runs the Ray head and the driver, and one per replica), joins them through a bridge by
veth pairs shaped with ``tc tbf`` in both directions (:mod:`wanlab.bridge`), starts a raylet
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
  ``wanlab.bridge.SERVICES``; no message crosses there): what would have crossed anyway;
  ``wire_{up,down}_{gcs,raylet,agent,objects,worker}_bytes`` (and ``_ack_bytes``) each
  service's share;
* ``wire_packets_up`` / ``wire_packets_down``: packets, same window (most packets up while
  the weights come down are TCP's acknowledgements of them: 66 bytes each);
* ``wire_up_tcp_payload``, ``wire_up_acks``, ``wire_up_ack_bytes`` (and ``wire_down_*``):
  what the frames were, same window (:mod:`wanlab.capture`): TCP payload (the messages and
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

``--regions N`` rehearses regions as separate Ray clusters instead (:mod:`wanlab.layouts`):
the home and N-1 regions, each a private Ray in its own namespace running
``diloco-ray region``, joined only by a delaying relay on the channel's port
(:mod:`wanlab.router`, :mod:`wanlab.relay`: the delay this layout adds in userspace), beside
the flat layout of the same replicas on one cluster; rows for both, the fp32 runs' final
weights compared, and an outage of one region's link (``--no-outage`` skips it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wanlab import netns  # noqa: E402
from wanlab.bridge import BridgedCluster  # noqa: E402
from wanlab.runs import IDLE_SECONDS, WAN, idle_rate, one_run, table, variants  # noqa: E402


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
    regions = parser.add_argument_group("--regions N: regions as separate Ray clusters (bench/wanlab/layouts.py)")
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
    reason = netns.why_not_available()
    if reason:
        print(f"bench/wan.py: {reason}", file=sys.stderr)
        return 2
    if args.regions:
        from wanlab import layouts

        return layouts.main(args)
    print("links: tc tbf, rate only (tc netem is not available here: no added delay)", flush=True)
    runs, idle = [], None
    with BridgedCluster(args.replicas, cpus=1, head_cpus=1) as cluster:
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
