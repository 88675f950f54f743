"""Faults inside a region, named by the home's ``fault_plan``, handled there as the home
handles its own: the home (this process's Ray, one replica) and region ``eu`` (a Ray cluster
of its own in a ``diloco-ray region`` process, two replicas), topk with error feedback, no
round deadline (``round_timeout_s: null``).

* Round 0: eu's replica 1 turns NaN. The region's merge leaves it out (eu applies replica 0
  alone) and resets it: it is applied again in round 1, with every weight reloaded.
* Round 2: eu's replica 0 freezes mid-period. The region is not judged by the home's
  stall check (its channel says it is alive), so the region's agent judges its replicas the
  home's way: silent for ``stall_timeout_s``, the replica is dropped, the region applies the
  other, and the round goes on instead of waiting forever; a new replica takes the slot.

No agent exits on any of it, and every stream position is applied once.
"""

from __future__ import annotations

from conftest import tiny_config

from diloco_ray import DilocoFSDPTrainer
from tests.integration.test_regions import TOKEN, applied_positions, free_port, start_region, wait_for_line
from tests.unit.channel.tls_files import make_tls

FAULTS = [
    {"kind": "nan", "region": "eu", "replica": 1, "round": 0},
    {"kind": "freeze", "region": "eu", "replica": 0, "round": 2, "step": 1},
]


def test_a_poisoned_replica_and_a_frozen_one_inside_a_region_are_handled_there(ray_local, tmp_path, monkeypatch):
    tls = make_tls(str(tmp_path))
    port = free_port()
    monkeypatch.setenv("DILOCO_CHANNEL_TOKEN", TOKEN)
    cfg = tiny_config(
        tmp_path / "home",
        num_replicas=1,
        regions=[{"name": "eu", "replicas": 2}],
        channel_host="127.0.0.1",
        channel_port=port,
        channel_tls_cert=tls["home.pem"],
        channel_tls_key=tls["home.key"],
        pseudo_grad_compression="topk",
        diloco_loops=5,
        max_steps=6,
        round_timeout_s=None,
        stall_timeout_s=8,
        fault_plan=FAULTS,
    )
    agent = start_region("eu", port, tls, tmp_path)
    try:
        wait_for_line(tmp_path / "eu.log", "Ray is up", agent)
        result = DilocoFSDPTrainer(cfg).train()
        agent.wait(timeout=120)
    finally:
        agent.kill()
    log = open(tmp_path / "eu.log").read()
    assert agent.returncode == 0, log[-3000:]
    assert log.count("joined;") == 1  # never restarted
    eu = [r["regions"]["eu"] for r in result.rounds]
    assert [r["round"] for r in result.rounds] == [0, 1, 2, 3, 4]
    assert eu[0]["replica_ids"] == [0] and eu[0]["applied"]  # replica 1 left out (NaN) inside the region
    assert eu[1]["replica_ids"] == [0, 1]  # reset, reloaded, applied again
    assert eu[2]["replica_ids"] == [1]  # replica 0 frozen: dropped by its silence, the round went on
    assert "replica 0 dropped (unresponsive)" in log
    assert any(2 in e["replica_ids"] for e in eu[3:])  # a new replica in its slot
    positions = applied_positions(result.rounds)
    assert len(positions) == len(set(positions))  # none applied twice
