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

And the home's driver killed mid-round, then resumed from its checkpoint while the region's
agent stays up: the region takes up its own part of that checkpoint (its replica's inner
state), its replica reloads the checkpoint's weights instead of training on from the rounds
the home undid, and the run ends with the weights of the same job run without the kill.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import ROOT, max_abs_diff, subprocess_env, tiny_config

from diloco_ray import DilocoFSDPTrainer, TrainerConfig
from diloco_ray.observe.metrics import read_events
from tests.integration.test_regions import (
    applied_positions,
    free_port,
    home_config,
    start_region,
    train_beside_region,
    wait_for_line,
)
from tests.unit.channel.tls_files import make_tls

pytestmark = pytest.mark.clusters  # regions: each its own Ray cluster (started first: conftest)

FAULTS = [
    {"kind": "nan", "region": "eu", "replica": 1, "round": 0},
    {"kind": "freeze", "region": "eu", "replica": 0, "round": 2, "step": 1},
]


def test_a_poisoned_replica_and_a_frozen_one_inside_a_region_are_handled_there(ray_local, tmp_path):
    tls = make_tls(str(tmp_path))
    port = free_port()
    cfg = home_config(
        tmp_path / "home",
        port,
        tls,
        [{"name": "eu", "replicas": 2}],
        num_replicas=1,
        pseudo_grad_compression="topk",
        diloco_loops=5,
        max_steps=6,
        round_timeout_s=None,
        stall_timeout_s=8,
        fault_plan=FAULTS,
    )
    result, log = train_beside_region(cfg, port, tls, tmp_path)
    eu = [r["regions"]["eu"] for r in result.rounds]
    assert [r["round"] for r in result.rounds] == [0, 1, 2, 3, 4]
    assert eu[0]["replica_ids"] == [0] and eu[0]["applied"]  # replica 1 left out (NaN) inside the region
    assert eu[1]["replica_ids"] == [0, 1]  # reset, reloaded, applied again
    assert eu[2]["replica_ids"] == [1]  # replica 0 frozen: dropped by its silence, the round went on
    assert "replica 0 dropped (unresponsive)" in log
    assert any(2 in e["replica_ids"] for e in eu[3:])  # a new replica in its slot
    positions = applied_positions(result.rounds)
    assert len(positions) == len(set(positions))  # none applied twice


def test_a_home_resumed_while_its_region_stays_up_ends_with_the_weights_of_the_run_without_the_kill(
    ray_local, tmp_path
):
    tls = make_tls(str(tmp_path))
    port = free_port()
    shape = dict(diloco_loops=5, max_steps=4, checkpoint_steps=4, eval_batches=1, seed=3)
    flat = DilocoFSDPTrainer(tiny_config(tmp_path / "flat", num_replicas=2, **shape)).train()
    cfg = home_config(
        tmp_path / "home",
        port,
        tls,
        [{"name": "eu", "replicas": 1}],
        num_replicas=1,
        min_regions=2,  # every round with the region: the flat run's rounds
        round_timeout_s=180,
        fault_plan=[{"kind": "kill", "target": "driver", "round": 3}],
        **shape,
    )
    agent = start_region("eu", port, tls, tmp_path)
    try:
        wait_for_line(tmp_path / "eu.log", "Ray is up", agent)
        cfg.to_yaml(str(tmp_path / "home.yaml"))
        command = [sys.executable, "-m", "diloco_ray", "train", str(tmp_path / "home.yaml")]
        killed = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert [r["round"] for r in read_events(cfg.output_dir, "round")] == [0, 1, 2]
        again = TrainerConfig.from_yaml(
            str(tmp_path / "home" / "config.yaml"), overrides={"resume_from": cfg.output_dir, "fault_plan": None}
        )
        resumed = DilocoFSDPTrainer(again).train()
        agent.wait(timeout=120)
    finally:
        agent.kill()
    log = open(tmp_path / "eu.log").read()
    assert agent.returncode == 0 and log.count("Ray is up") == 1, log[-3000:]
    assert "took up its part of the home's checkpoint of round 3" in log
    assert [r["round"] for r in resumed.rounds] == [3, 4]
    assert all(1_000_000 in r["replica_ids"] for r in resumed.rounds)
    assert max_abs_diff(cfg.output_dir, flat.output_dir) <= 1e-5
