"""A region that sends a hundred times an honest update is screened out, end to end, in
both modes: the home (this process's Ray, two replicas) and region ``eu`` (a Ray cluster of
its own, one replica) whose replica's pseudo-gradient leaves x100 in rounds 1-3 (the
home's ``fault_plan``, ``scale``; decoupled: its first periods at or after merges 1-3).
Sync: each of those rounds is applied without eu, its rejection and why in the round's
record, and eu is applied again in round 4. Decoupled: every merge that met a scaled
period of eu's rejects it as screened out, and eu is applied in the others. No agent exits
on it.

And a region that is no agent at all, speaking the channel with its own token: every round
it answers a 1e30 pseudo-gradient claiming 1e12 tokens. Each reply is refused for its claim
(the reason in the round's record), nothing of it is counted, and the home's replicas end
where they end without it."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import tiny_config

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.algo import compression
from diloco_ray.algo.codecs import Codec
from diloco_ray.channel.client import ChannelClient
from diloco_ray.channel.credentials import Token
from diloco_ray.config.fields import REGION_ID_BASE
from diloco_ray.driver import holdout
from diloco_ray.regions import wire
from diloco_ray.runtime.messages import RegionFacts, RoundStats
from tests.integration.test_regions import free_port, home_config, region_token, train_beside_region
from tests.unit.channel.tls_files import make_tls

pytestmark = pytest.mark.clusters  # regions: each its own Ray cluster (started first: conftest)

ATTACKED = (1, 2, 3)


def attacked_run(tmp_path, factor: float, **fields):
    """The home's two replicas beside eu's one, eu's update ``factor`` times what it is in
    the rounds :data:`ATTACKED`, five rounds of 3 steps: the home's result."""
    tls = make_tls(str(tmp_path))
    port = free_port()
    faults = [{"kind": "scale", "region": "eu", "replica": 0, "round": r, "factor": factor} for r in ATTACKED]
    regions = [{"name": "eu", "replicas": 1}]
    shape = dict(num_replicas=2, diloco_loops=5, max_steps=3, fault_plan=faults)
    cfg = home_config(tmp_path / "home", port, tls, regions, **shape, **fields)
    result, _ = train_beside_region(cfg, port, tls, tmp_path)
    return result


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_region_sending_a_hundred_times_its_update_is_screened_out_and_the_run_goes_on(ray_local, tmp_path, mode):
    # decoupled: every merge waits for eu too, so its scaled periods are merged before the run ends
    deadlines = {"round_timeout_s": 180} if mode == "sync" else {"sync_mode": "decoupled", "min_quorum": 3}
    result = attacked_run(tmp_path, 100, **deadlines)
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


def test_a_sign_flipped_region_passes_the_norm_screen_and_is_refused_by_the_held_out_check(
    ray_local, tmp_path, monkeypatch
):
    """The same region, its update sign-flipped (``scale`` -1) in rounds 1-3, with
    ``region_holdout_margin`` on: its norm is honest, so screening passes it; the home's
    replica scores the round's weights minus it worse than the round's own, and refuses it.
    Every other round it is scored better and applied."""
    scored = []
    real = holdout.worse_than_margin
    monkeypatch.setattr(holdout, "worse_than_margin", lambda t, b, m: scored.append((t, b)) or real(t, b, m))
    result = attacked_run(tmp_path, -1, round_timeout_s=180, region_holdout_margin=0.0)
    eu = str(REGION_ID_BASE)
    assert len(scored) == 5, scored
    for r, (trial, base) in zip(result.rounds, scored):
        if r["round"] in ATTACKED:
            assert r["rejected"][eu].startswith("held-out check: the round's weights minus its update"), r
            assert trial > base and sorted(r["replica_ids"]) == [0, 1]
        else:
            assert eu not in r["rejected"] and r["regions"]["eu"]["applied"] and trial < base, r


class GreedyRegion(threading.Thread):
    """A region that speaks the channel but trains nothing: to every job it answers a
    pseudo-gradient of 1e30 everywhere and claims 1e12 tokens, until the home says stop."""

    def __init__(self, port: int, tls: dict, token: str, servers: int = 1):
        super().__init__(daemon=True)
        self.client = ChannelClient(
            f"127.0.0.1:{port}", "eu", Token(token, "$TEST"), open(tls["ca.pem"], "rb").read(), server_name="localhost"
        )
        self.client.ready, self.servers, self.answered = True, servers, 0

    def run(self) -> None:
        self.client.join(give_up_after_s=120)
        seq = 0
        while True:
            seq, notice = self.client.wait(seq, wait_s=1.0)
            self.client.beat(timeout_s=5)
            if notice is None or "job" not in notice:
                if notice is not None and notice.get("stop"):
                    return
                continue
            job = notice["job"]
            huge = compression.pack({"x": torch.full((64,), 1e30)}, Codec("none"))
            greedy = RoundStats(
                0, 3, 10**12, 1.0, 1.0, 0.0, 0, loss_tokens=10**12, region=RegionFacts(replica_ids=(0,))
            )
            self.client.upload(job["reply"], wire.reply_payload([huge] * self.servers, greedy))
            self.answered += 1


def test_a_region_claiming_1e12_tokens_for_1e30_every_round_is_refused_and_the_others_train_on(ray_local, tmp_path):
    tls = make_tls(str(tmp_path))
    port = free_port()
    shape = dict(num_replicas=2, diloco_loops=4, max_steps=3, seed=5)
    alone = DilocoFSDPTrainer(tiny_config(tmp_path / "alone", **shape)).train()
    cfg = home_config(tmp_path / "home", port, tls, [{"name": "eu", "replicas": 1}], round_timeout_s=180, **shape)
    greedy = GreedyRegion(port, tls, region_token("eu"))
    greedy.start()
    result = DilocoFSDPTrainer(cfg).train()
    greedy.join(timeout=60)
    eu = str(REGION_ID_BASE)
    assert greedy.answered == 4 and all(eu in r["rejected"] for r in result.rounds)
    assert all("1000000000000 tokens claimed" in r["rejected"][eu] for r in result.rounds)
    assert [r["tokens"] for r in result.rounds] == [r["tokens"] for r in alone.rounds]  # nothing of eu's counted
    assert result.rounds[-1]["eval_loss"] <= 1.02 * alone.rounds[-1]["eval_loss"]
