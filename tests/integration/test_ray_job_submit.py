"""``ray job submit`` against a local head, as the README and docs/clusters.md walk through it:
a head with token authentication (Ray 2.60's default), the job refused without the token, and
the embedded default run to completion with it."""

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from conftest import free_port

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def wait_for(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError as e:
            if getattr(e, "code", None) is not None:  # an HTTP answer (even 401): it is up
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not come up in {timeout_s:g}s") from e
            time.sleep(1)


@pytest.fixture(scope="module")
def local_head():
    """A head node of its own (ports, temp dir, token), shared by this module's tests and
    stopped by killing its process group: ``ray stop`` would stop every Ray on the machine."""
    # Short: Ray's unix sockets live under it and their paths are limited to 107 bytes.
    temp = tempfile.mkdtemp(prefix="rjs", dir="/tmp")
    # RAY_TMPDIR/ray is where `ray start` notes the head's address, for a driver on this
    # machine to find (ray_current_cluster).
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_TMPDIR": temp,
    }
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    cmd = [
        os.path.join(BIN, "ray"),
        "start",
        "--head",
        "--port",
        str(free_port()),
        "--block",
        "--include-dashboard",
        "true",
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard),
        "--dashboard-agent-listen-port",
        str(free_port()),
        "--num-cpus",
        "4",
        "--disable-usage-stats",
        "--temp-dir",
        os.path.join(temp, "ray"),
    ]
    with open(os.path.join(temp, "head.log"), "w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for(f"{address}/api/version", 120)
        yield address, env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=3)  # `ray start --block` can take 15 s to go: its group is killed below
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        # Whatever is left of this cluster (its processes all name its temp dir).
        subprocess.run(["pkill", "-9", "-f", temp], check=False)


def test_ray_job_submit_runs_the_default_on_a_local_head(local_head, tmp_path):
    address, env = local_head
    ray = os.path.join(BIN, "ray")

    # Token authentication is on: a CLI that does not send the token is turned away.
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    refused = subprocess.run(
        [ray, "job", "list", "--address", address],
        capture_output=True,
        text=True,
        env={**no_token, "RAY_AUTH_MODE": "disabled", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert refused.returncode != 0 and "Authentication" in refused.stdout + refused.stderr

    out = tmp_path / "run"
    t0 = time.monotonic()
    job = subprocess.run(
        [
            ray,
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--",
            "diloco-ray",
            "train",
            "configs/tiny.yaml",
            "--set",
            f"output_dir={out}",
            "--set",
            "diloco_loops=2",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=420,
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-3000:]
    assert "succeeded" in log and "round 2/2" in log
    with open(out / "metrics.jsonl") as f:
        rounds = [r for r in map(json.loads, f) if r["event"] == "round"]
    assert [r["round"] for r in rounds] == [0, 1] and all(r["replicas"] == 2 for r in rounds)
    assert (out / "final" / "model.safetensors").exists()
    print(f"ray job submit: 2 rounds of tiny.yaml in {time.monotonic() - t0:.1f}s")


def test_train_joins_a_running_local_head_and_says_so(local_head, tmp_path):
    """`ray start --head` runs on this machine and RAY_ADDRESS is not set: `diloco-ray
    train` joins that cluster (one line on stderr) instead of failing on num_cpus. Asked for
    GPUs, it then reads the joined cluster's resources and stops with one line: the head has
    none (a run to the end on a joined cluster is the job above)."""
    _, env = local_head
    run = subprocess.run(
        [
            os.path.join(BIN, "diloco-ray"),
            "train",
            os.path.join(ROOT, "configs", "tiny.yaml"),
            "--set",
            f"output_dir={tmp_path / 'run'}",
            "--set",
            "device=cuda",
        ],
        env={**env, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "joining the running local Ray cluster at" in run.stderr
    assert "device: 'cuda' but the Ray cluster has no GPUs" in run.stderr
