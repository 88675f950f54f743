"""One region's link down in the middle of a run, then up (``bench/wan.py --regions``' outage run).

:func:`cut_link` runs beside the home: once the home has written ``after_rounds`` records it
takes the link of a region down (:meth:`wanlab.router.RegionNet.link`: frames dropped both
ways) for ``seconds``, brings it back, and notes the region's lasting processes (its agent,
its Ray's GCS and raylet, its rank actors) before the cut and once a record lists the
region again. :func:`outage_facts` reads the run's records: how many processes were
replaced, how many records after the link came back passed before the region was applied
again, and which stream positions were lost (below the furthest applied, never applied)
or repeated (applied twice), from every record's ``data_ranges``.

The same run poisons a replica of another region in round 0 (:func:`nan_fault`, through the
home's ``fault_plan``): :func:`nan_facts` says whether that region's merge left it out then
and from which round it was applied again (the region resets it for its next round).
"""

from __future__ import annotations

import json
import os
import time

CUT_AFTER_ROUNDS = 3  # rounds the outage run completes before the link goes down
NAN_REPLICA = 1  # the replica of a region that turns NaN in round 0


def nan_fault(region: str) -> dict:
    """The fault plan's entry that poisons ``region``'s replica NAN_REPLICA in round 0."""
    return {"kind": "nan", "region": region, "replica": NAN_REPLICA, "round": 0}


def nan_facts(every: list[dict], region: str) -> dict:
    """Whether ``region``'s merge left its poisoned replica out in round 0, and the first
    round after that applied it again (None: never)."""
    merged = [(r["round"], (r.get("regions") or {}).get(region, {}).get("replica_ids", [])) for r in every]
    again = next((i for i, ids in merged if i >= 1 and NAN_REPLICA in ids), None)
    left_out = bool(merged) and merged[0][0] == 0 and NAN_REPLICA not in merged[0][1]
    return {"region": region, "replica": NAN_REPLICA, "left_out_in_round_0": left_out, "applied_again_at": again}


def read_records(path: str) -> list[dict]:
    """Every round record written so far (each with its ``time``)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if r.get("event") == "round"]


def ranges_of(positions: list[int]) -> list[list[int]]:
    """Sorted positions as [start, count] runs."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and p == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([p, 1])
    return out


def lost_and_repeated(records: list[dict]) -> tuple[list, list]:
    """(lost, repeated) stream ranges over every record's ``data_ranges``: a position
    applied twice; a position below the furthest applied that was never applied."""
    seen: dict[int, int] = {}
    for r in records:
        for ranges in r.get("data_ranges", {}).values():
            for start, count in ranges:
                for p in range(start, start + count):
                    seen[p] = seen.get(p, 0) + 1
    top = max(seen, default=-1)
    return ranges_of([p for p in range(top + 1) if p not in seen]), ranges_of([p for p, n in seen.items() if n > 1])


def last_eval(every: list[dict]):
    return next((r["eval_loss"] for r in reversed(every) if r.get("eval_loss") is not None), None)


def region_processes(net, site) -> dict[int, str]:
    """The region's agent and its Ray's lasting processes (not Ray's idle pool workers)."""
    keep = ("diloco_ray region", "ray::RankWorker", "ray::HeldWeights", "gcs_server", "raylet")
    return {pid: cmd for pid, cmd in net.processes(site).items() if any(k in cmd for k in keep)}


def cut_link(net, site, metrics, home, after_rounds: int, seconds: float, facts: dict) -> None:
    """After ``after_rounds`` records, ``site``'s link down for ``seconds``, then up; then
    note its processes once a record lists it again (or the run ends)."""
    while len(read_records(metrics)) < after_rounds:
        if home.poll() is not None:
            return
        time.sleep(0.2)
    facts["before"] = region_processes(net, site)
    net.link(site, up=False)
    facts["down"] = time.time()
    time.sleep(seconds)
    net.link(site, up=True)
    facts["up"] = time.time()
    while home.poll() is None:
        later = [r for r in read_records(metrics) if r["time"] >= facts["up"]]
        if any(listed(r, site.name) for r in later):  # while the run goes on: its processes still run
            facts["after"] = region_processes(net, site)
            return
        time.sleep(0.5)


def listed(record: dict, name: str) -> bool:
    """Whether ``record`` applied region ``name``."""
    entry = (record.get("regions") or {}).get(name)
    return entry is not None and entry.get("applied", True)


def outage_facts(every: list[dict], name: str, facts: dict, region_log: str) -> dict:
    if "up" not in facts:
        return {"error": "the link was never cut (the run ended first)"}
    before, after = facts["before"], facts.get("after")
    replaced = sorted(set(before) - set(after or {}))
    with_region = [listed(r, name) for r in every]
    back = next((i for i, r in enumerate(every) if r["time"] >= facts["up"]), None)
    again = next((i for i in range(back, len(every)) if with_region[i]), None) if back is not None else None
    lost, repeated = lost_and_repeated(every)
    return {
        "seconds": facts["up"] - facts["down"],
        "region": name,
        # None: the region was never applied again while the run went on (nothing to compare).
        "restarted_processes": None if after is None else len(replaced) + len(set(after) - set(before)),
        "replaced": [before[p] for p in replaced] if after is not None else None,
        "rounds_before_cut": sum(r["time"] < facts["down"] for r in every),
        "rounds_after_up": sum(r["time"] >= facts["up"] for r in every),
        "agent_joins": region_log.count("joined;"),
        "rounds_without_region": sum(not w for w in with_region),
        "reapplied_within_syncs": None if again is None else again - back,
        "lost_ranges": len(lost),
        "repeated_ranges": len(repeated),
        "lost": lost[:20],
        "repeated": repeated[:20],
        "final_eval_loss": last_eval(every),
    }


def outage_seconds(round_seconds: float) -> float:
    """How long the link stays down: 20 s, or 3 rounds of the fault-free run when longer."""
    return max(20.0, 3 * round_seconds)
