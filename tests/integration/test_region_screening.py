"""A region that sends a hundred times an honest update is screened out, end to end, in
both modes: the home (this process's Ray, two replicas) and region ``eu`` (a Ray cluster of
its own, one replica) whose replica's pseudo-gradient leaves x100 in rounds 1-3 (the
home's ``fault_plan``, ``scale``; decoupled: its first periods at or after merges 1-3).
Sync: each of those rounds is applied without eu, its rejection and why in the round's
record, and eu is applied again in round 4. Decoupled: every merge that met a scaled
period of eu's rejects it as screened out, and eu is applied in the others. No agent exits
on it."""

from __future__ import annotations

import pytest

from diloco_ray.config.fields import REGION_ID_BASE
from tests.integration.test_regions import free_port, home_config, train_beside_region
from tests.unit.channel.tls_files import make_tls

ATTACKED = (1, 2, 3)


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_region_sending_a_hundred_times_its_update_is_screened_out_and_the_run_goes_on(ray_local, tmp_path, mode):
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
        fault_plan=faults,
        **({"round_timeout_s": 180} if mode == "sync" else {"sync_mode": "decoupled"}),
    )
    result, _ = train_beside_region(cfg, port, tls, tmp_path)
    eu = str(REGION_ID_BASE)
    if mode == "decoupled":  # which merges meet a scaled period follows arrival timing
        screened = [r for r in result.rounds if eu in r["rejected"]]
        assert screened and all(r["rejected"][eu].startswith("screened out: its norm") for r in screened)
        assert any(r["regions"].get("eu", {}).get("applied") for r in result.rounds)
        return
    for r in result.rounds:
        if r["round"] in ATTACKED:
            assert sorted(r["replica_ids"]) == [0, 1], r
            assert r["rejected"][eu].startswith("screened out: its norm"), r["rejected"]
        else:
            assert eu not in r["rejected"] and r["regions"]["eu"]["applied"], r
