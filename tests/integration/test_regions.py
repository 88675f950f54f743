"""A run across two Ray clusters joined only by the channel: the home (this process's Ray,
one replica) and a region (a Ray cluster of its own in a `diloco-ray region` process, two
replicas), against the flat run of three replicas on one cluster with the same seed.

fp32, sync mode: the region merges its two replicas and sends one message per sync, the
home averages it with its own replica by tokens, and the run ends with the flat run's
weights to float round-off; every stream position is applied once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from conftest import ROOT, max_abs_diff, tiny_config

from diloco_ray import DilocoFSDPTrainer
from tests.unit.channel.tls_files import make_tls

TOKEN = "region-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path, text: str, process, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert process.poll() is None, path.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} in {path} within {timeout_s:g}s")


def applied_positions(rounds: list) -> list:
    return sorted(p for r in rounds for ranges in r["data_ranges"].values() for s, c in ranges for p in range(s, s + c))


def test_a_region_of_two_and_a_home_of_one_end_with_the_weights_of_three_flat_replicas(
    ray_local, tmp_path, monkeypatch
):
    tls = make_tls(str(tmp_path))
    port = free_port()
    shape = dict(diloco_loops=3, max_steps=3, seed=3)
    flat = DilocoFSDPTrainer(tiny_config(tmp_path / "flat", num_replicas=3, **shape)).train()

    monkeypatch.setenv("DILOCO_CHANNEL_TOKEN", TOKEN)
    home_cfg = tiny_config(
        tmp_path / "home",
        num_replicas=1,
        regions=[{"name": "eu", "replicas": 2}],
        channel_host="127.0.0.1",
        channel_port=port,
        channel_tls_cert=tls["home.pem"],
        channel_tls_key=tls["home.key"],
        round_timeout_s=180,  # a region that failed is dropped, and the test fails fast
        **shape,
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "RAY_ADDRESS": "local"}
    region = subprocess.Popen(
        [sys.executable, "-m", "diloco_ray", "region", "--home", f"127.0.0.1:{port}", "--name", "eu"]
        + ["--ca-cert", tls["ca.pem"], "--server-name", "localhost", "--output-dir", str(tmp_path / "eu")],
        env=env,
        cwd=ROOT,
        stdout=open(tmp_path / "eu.log", "w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(tmp_path / "eu.log", "Ray is up", region)  # its Ray starts while this machine is idle
        regions = DilocoFSDPTrainer(home_cfg).train()
        region.wait(timeout=120)
    finally:
        region.kill()
    out = open(tmp_path / "eu.log").read()
    assert region.returncode == 0, out[-3000:]
    assert "region eu: done, 3 syncs" in out

    assert max_abs_diff(str(tmp_path / "home"), str(tmp_path / "flat")) <= 1e-5
    assert [r["replica_ids"] for r in regions.rounds] == [[0, 1_000_000]] * 3  # the region: one member
    assert applied_positions(regions.rounds) == applied_positions(flat.rounds)  # the same data, once each
    assert [r["tokens"] for r in regions.rounds] == [r["tokens"] for r in flat.rounds]
    written = open(tmp_path / "home" / "config.yaml").read() + open(tmp_path / "home" / "metrics.jsonl").read()
    assert TOKEN not in written and TOKEN not in out
