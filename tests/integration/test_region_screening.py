"""A region that sends a hundred times an honest update is screened out, end to end: the
home (this process's Ray, two replicas) and region ``eu`` (a Ray cluster of its own, one
replica) whose replica's pseudo-gradient leaves x100 in rounds 1-3 (the home's
``fault_plan``, ``scale``). Each of those rounds is applied without eu, its rejection and
why in the round's record; eu is applied again in round 4; no agent exits on it."""

from __future__ import annotations

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.config.fields import REGION_ID_BASE
from tests.integration.test_regions import free_port, home_config, start_region, wait_for_line
from tests.unit.channel.tls_files import make_tls

ATTACKED = (1, 2, 3)


def test_a_region_sending_a_hundred_times_its_update_is_screened_out_and_the_run_goes_on(ray_local, tmp_path):
    tls = make_tls(str(tmp_path))
    port = free_port()
    faults = [{"kind": "scale", "region": "eu", "replica": 0, "round": r, "factor": 100} for r in ATTACKED]
    cfg = home_config(
        tmp_path / "home",
        port,
        tls,
        [{"name": "eu", "replicas": 1}],
        num_replicas=2,
        diloco_loops=5,
        max_steps=3,
        round_timeout_s=180,
        fault_plan=faults,
    )
    agent = start_region("eu", port, tls, tmp_path)
    try:
        wait_for_line(tmp_path / "eu.log", "Ray is up", agent)
        result = DilocoFSDPTrainer(cfg).train()
        agent.wait(timeout=120)
    finally:
        agent.kill()
    log = open(tmp_path / "eu.log").read()
    assert agent.returncode == 0 and log.count("joined;") == 1, log[-3000:]
    eu = str(REGION_ID_BASE)
    for r in result.rounds:
        if r["round"] in ATTACKED:
            assert sorted(r["replica_ids"]) == [0, 1], r
            assert r["rejected"][eu].startswith("screened out: its norm"), r["rejected"]
        else:
            assert eu not in r["rejected"] and r["regions"]["eu"]["applied"], r
