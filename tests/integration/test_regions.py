"""A run across three Ray clusters joined only by the channel: the home (this process's Ray,
two replicas) and two regions (each a Ray cluster of its own in a `diloco-ray region`
process, two replicas), against the flat run of six replicas on one cluster with the same
seed.

fp32, sync mode: each region merges its two replicas and sends one message per sync, the
home averages them with its own replicas by tokens, and the run ends with the flat run's
weights to float round-off; every stream position is applied once, and the records name
each region's replicas and its channel bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, applied_positions, free_port, max_abs_diff, tiny_config

from diloco_ray import DilocoFSDPTrainer
from tests.unit.channel.tls_files import make_tls

pytestmark = pytest.mark.clusters  # regions: each its own Ray cluster (started first: conftest)


def region_token(name: str) -> str:
    """Region ``name``'s own channel token in these tests."""
    return f"{name}-region-test-token"


def wait_for_line(path, text: str, process, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert process.poll() is None, path.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} in {path} within {timeout_s:g}s")


def home_config(folder, port: int, tls: dict, regions: list, **fields):
    """A home's config whose channel listens on this machine (``port``, the test CA's
    certificate, a token per region in a tokens file beside ``folder``), with ``regions``
    and the job's ``fields``."""
    tokens = os.path.join(os.path.dirname(str(folder)), "channel_tokens")
    with open(os.open(tokens, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("".join(f"{r['name']} {region_token(r['name'])}\n" for r in regions))
    return tiny_config(
        folder,
        regions=regions,
        channel_tokens_file=tokens,
        channel_host="127.0.0.1",
        channel_port=port,
        channel_tls_cert=tls["home.pem"],
        channel_tls_key=tls["home.key"],
        **fields,
    )


def start_region(name: str, port: int, tls: dict, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "RAY_ADDRESS": "local"}
    env["DILOCO_CHANNEL_TOKEN"] = region_token(name)
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_ray", "region", "--home", f"127.0.0.1:{port}", "--name", name]
        + ["--ca-cert", tls["ca.pem"], "--server-name", "localhost", "--output-dir", str(tmp_path / name)],
        env=env,
        cwd=ROOT,
        stdout=open(tmp_path / f"{name}.log", "w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


def train_beside_region(cfg, port: int, tls: dict, tmp_path, name: str = "eu"):
    """Start region ``name``'s agent, train the home's ``cfg`` once its Ray is up, and wait
    for the agent to leave: (the home's result, the agent's log). The agent exited 0 and
    joined once, or the test fails with its log."""
    agent = start_region(name, port, tls, tmp_path)
    try:
        wait_for_line(tmp_path / f"{name}.log", "Ray is up", agent)
        result = DilocoFSDPTrainer(cfg).train()
        agent.wait(timeout=120)
    finally:
        agent.kill()
    log = open(tmp_path / f"{name}.log").read()
    assert agent.returncode == 0 and log.count("joined;") == 1, log[-3000:]  # never restarted
    return result, log


# Plain rounds, and streaming syncs with overlap (a region's replicas start each period
# before its weights have crossed, and merge them at its end, as the home's do).
SYNCS = {"plain": {}, "overlap": dict(sync_fragments=2, overlap_communication=True, max_steps=4)}


@pytest.mark.parametrize("syncs", sorted(SYNCS))
def test_three_regions_of_two_end_with_the_weights_of_six_flat_replicas(ray_local, tmp_path, syncs):
    tls = make_tls(str(tmp_path))
    port = free_port()
    shape = {**dict(diloco_loops=3, max_steps=3, seed=3), **SYNCS[syncs]}
    flat = DilocoFSDPTrainer(tiny_config(tmp_path / "flat", num_replicas=6, **shape)).train()

    home_cfg = home_config(
        tmp_path / "home",
        port,
        tls,
        [{"name": "eu", "replicas": 2}, {"name": "us", "replicas": 2}],
        num_replicas=2,
        min_regions=1 if syncs == "overlap" else 3,  # (fragments commit with whoever reported)
        round_timeout_s=180,  # a region that failed is dropped, and the test fails fast
        **shape,
    )
    agents = {name: start_region(name, port, tls, tmp_path) for name in ("eu", "us")}
    try:
        for name, agent in agents.items():  # their Rays start while this machine is idle
            wait_for_line(tmp_path / f"{name}.log", "Ray is up", agent)
        regions = DilocoFSDPTrainer(home_cfg).train()
        for agent in agents.values():
            agent.wait(timeout=120)
    finally:
        for agent in agents.values():
            agent.kill()
    logs = {name: open(tmp_path / f"{name}.log").read() for name in agents}
    for name, agent in agents.items():
        assert agent.returncode == 0, logs[name][-3000:]
        syncs_done = 3 * home_cfg.sync_fragments
        assert f"region {name}: done, {syncs_done} syncs" in logs[name]

    assert max_abs_diff(str(tmp_path / "home"), str(tmp_path / "flat")) <= 1e-5
    members = [0, 1, 1_000_000, 1_000_001]  # a region is one member
    assert [sorted(r["replica_ids"]) for r in regions.rounds] == [members] * 3
    assert sorted(applied_positions(regions.rounds)) == sorted(
        applied_positions(flat.rounds)
    )  # the same data, once each
    assert [r["tokens"] for r in regions.rounds] == [r["tokens"] for r in flat.rounds]
    for r in regions.rounds:
        assert sorted(r["regions"]) == ["eu", "home", "us"]
        assert all(r["regions"][n]["replica_ids"] == [0, 1] and r["regions"][n]["applied"] for n in r["regions"])
        eu, us = r["regions"]["eu"], r["regions"]["us"]
        assert eu["bytes_up"] > 0 and eu["bytes_down"] > 0 and us["bytes_up"] > 0
        # one message a region: about one replica's pseudo-gradient, not two
        one_replica = r["regions"]["home"]["bytes_up"] / 2
        assert eu["bytes_up"] < 1.5 * one_replica, (eu, r["regions"]["home"])
    written = open(tmp_path / "home" / "config.yaml").read() + open(tmp_path / "home" / "metrics.jsonl").read()
    tokens = [region_token(name) for name in agents]
    assert not any(t in text for t in tokens for text in [written, *logs.values()])
