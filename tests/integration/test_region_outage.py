"""A region's link goes down in the middle of a run, and comes back: the home goes on
without the region, the region's agent and replicas never restart, and once the link is
back the region reconnects, loads the current global weights and is applied again within
two syncs. No stream position is applied twice, and none below the furthest applied is
lost. Both modes; in sync mode a server is also killed later, and the region goes on
through its restore. In decoupled mode the region takes the outer step itself
(``region_downlink: step``): its copy of the servers holds the home's weights after every
merge it takes.

The link is a relay on the channel's one port (``bench/wanlab/relay.py``) that the test cuts:
in sync mode every connection through it is reset and new ones are refused until it is
restored; in decoupled mode it goes silent (nothing crosses, nothing is reset).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from conftest import ROOT, applied_positions, paced

from diloco_ray import DilocoFSDPTrainer
from tests.integration.test_regions import free_port, home_config, start_region, wait_for_line
from tests.unit.channel.tls_files import make_tls

sys.path.insert(0, os.path.join(ROOT, "bench"))
from wanlab.relay import Relay  # noqa: E402

pytestmark = pytest.mark.clusters  # regions: each its own Ray cluster (started first: conftest)

REGION = 1_000_000  # the region's member id (REGION_ID_BASE + its index)
ROUNDS_BEFORE_CUT = 2
ROUNDS_CUT = 3  # rounds the home applies without the region while the link is down
ROUNDS = ROUNDS_BEFORE_CUT + ROUNDS_CUT + 5
CUT_S = 8.0  # and for at least this long: past channel_timeout_s, and a few of the client's backoffs
# Rounds of a known length, ~2 s, that cost no CPU: every replica sleeps a fixed time a step
# (conftest.paced), so the link's return is seen within a round or two on any machine.
STEPS, STEP_S = 8, 0.25
PACED = [
    *paced(0, range(ROUNDS), STEP_S),
    *paced(1, range(ROUNDS), STEP_S),  # the home replica that replaces one lost with the server
    *paced(0, range(ROUNDS), STEP_S, region="eu"),
]


# Sync mode streams its syncs with overlap, the path where a region starts a round's next
# period before its notice and must stop it when the home drops the region instead. It also
# loses a server after the link is back: the home restores it from the round's checkpoint,
# and the region, which never noticed, reloads the restored weights. Before all that, the
# region's replica turns NaN in round 0: the region sends nothing then, resets it, and it
# is applied again from the next round.
SERVER_KILLED_AT = ROUNDS_BEFORE_CUT + ROUNDS_CUT + 3
SYNC_EXTRA = dict(
    sync_fragments=2,
    overlap_communication=True,
    round_timeout_s=120,
    checkpoint_steps=STEPS,  # every round
    fault_plan=[
        {"kind": "kill", "target": "server", "round": SERVER_KILLED_AT},
        {"kind": "nan", "region": "eu", "replica": 0, "round": 0},
        *PACED,
    ],
)


def rounds_so_far(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path).read().splitlines()) if r.get("event") == "round"]


def cut_then_restore(relay: Relay, metrics: str, done: threading.Event, times: dict, blackhole: bool) -> None:
    """Cut the link after ROUNDS_BEFORE_CUT rounds; restore it after ROUNDS_CUT more."""
    while len(rounds_so_far(metrics)) < ROUNDS_BEFORE_CUT and not done.is_set():
        time.sleep(0.1)
    relay.cut(blackhole=blackhole)
    times["cut"] = time.time()
    while not done.is_set() and (
        len(rounds_so_far(metrics)) < ROUNDS_BEFORE_CUT + ROUNDS_CUT or time.time() < times["cut"] + CUT_S
    ):
        time.sleep(0.1)
    relay.restore()
    times["restored"] = time.time()


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_region_cut_off_is_left_out_then_applied_again(ray_local, tmp_path, mode):
    tls = make_tls(str(tmp_path))
    port = free_port()
    relay = Relay(listen=("127.0.0.1", 0), to=("127.0.0.1", port))
    relay_port = relay.start()
    cfg = home_config(
        tmp_path / "home",
        port,
        tls,
        [{"name": "eu", "replicas": 1}],
        num_replicas=1,
        channel_timeout_s=3,
        **(SYNC_EXTRA if mode == "sync" else {"fault_plan": PACED}),
        diloco_loops=ROUNDS,
        max_steps=STEPS,
        sync_mode=mode,
        # Error feedback's path: the message the region merged when its link was cut is put
        # back once the home's verdict reaches it (the region's books, tests/unit/regions).
        pseudo_grad_compression="topk",
        **({"min_quorum": 2, "region_downlink": "step"} if mode == "decoupled" else {}),  # both, while both are active
    )
    agent = start_region("eu", relay_port, tls, tmp_path)
    done, times = threading.Event(), {}
    metrics = str(tmp_path / "home" / "metrics.jsonl")
    # Sync: the link is reset and refused. Decoupled: it goes silent (the peers' keepalives find out).
    blackhole = mode == "decoupled"
    cutter = threading.Thread(target=cut_then_restore, args=(relay, metrics, done, times, blackhole), daemon=True)
    try:
        wait_for_line(tmp_path / "eu.log", "Ray is up", agent)
        cutter.start()
        result = DilocoFSDPTrainer(cfg).train()
        done.set()
        agent.wait(timeout=120)
    finally:
        done.set()
        agent.kill()
        relay.close()
    log = open(tmp_path / "eu.log").read()
    assert agent.returncode == 0, log[-3000:]
    assert log.count("Ray is up") == 1 and log.count("joined;") == 1  # never restarted

    rounds = rounds_so_far(metrics)  # with the time each was written
    assert len(rounds) == len(result.rounds)
    with_region = [REGION in r["replica_ids"] for r in rounds]
    cut_at = next(i for i, r in enumerate(rounds) if r["time"] >= times["cut"])
    back_at = next(i for i, r in enumerate(rounds) if r["time"] >= times["restored"])
    assert not all(with_region[cut_at:back_at]), with_region  # the home went on without it
    assert ROUNDS_CUT <= back_at - cut_at + 1, (cut_at, back_at)
    reapplied = next(i for i in range(back_at, len(rounds)) if with_region[i])
    assert reapplied - back_at <= 2, (with_region, back_at)  # applied again within two syncs

    positions = applied_positions(rounds)
    assert len(positions) == len(set(positions))  # none applied twice
    assert set(positions) == set(range(max(positions) + 1))  # none below the furthest lost
    events = [json.loads(x) for x in open(metrics).read().splitlines()]
    left = [e for e in events if e.get("event") == "membership" and e.get("region") == "eu" and e["action"] == "leave"]
    assert left, "the region's leave is recorded"
    if mode == "sync":
        eu = [(r.get("regions") or {}).get("eu", {}) for r in rounds]
        assert not eu[0].get("replica_ids") and eu[1]["replica_ids"] == [0]  # NaN in round 0, reset, back
        assert [e["round"] for e in events if e.get("event") == "server"], "the killed server was restored"
        assert with_region[-1] and rounds[-1]["round"] > SERVER_KILLED_AT  # applied after the restore
    if mode == "decoupled":
        # region_downlink: step: the region's copy of the home's servers took every sync it
        # was sent (the ones it missed while cut off among them) and held the home's weights
        # after each, bit for bit (each sync's digests checked, regions.mirror); it never fell
        # back to downloading the weights messages, and the servers' whole state went down
        # once, when it joined (the syncs it missed came as records).
        assert "differed" not in log and "downloading" not in log, log[-3000:]
        assert rounds[-1]["regions"]["eu"]["state_resends"] == {"joined": 1}
