"""What a real ``diloco-ray train`` does when its output_dir is contested or its disk fills.

Two trainers started on one output_dir: the second is refused in one line (exit 2) and
the first finishes as if it were alone. A disk that fills part-way (a small tmpfs as
output_dir): one line naming output_dir and the file (exit 1, no traceback), the half
checkpoint gone, and the last good checkpoint intact and resumable once there is room.
Each driver is a subprocess that joins this module's Ray (as a ``ray job submit`` driver
joins its cluster), which saves starting a Ray per run.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, tiny_config

pytestmark = pytest.mark.integration
ERROR = "diloco-ray: error: "


@pytest.fixture(scope="module")
def ray_address(ray_local):
    return ray_local.get_runtime_context().gcs_address


def start_cli(ray_address, *args, **popen):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, "RAY_ADDRESS": ray_address}
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_ray", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def write_config(path, cfg) -> str:
    path.write_text(cfg.yaml_text())
    return str(path)


def wait_for(check, proc, timeout_s=180.0, what="it"):
    """Poll ``check()`` until true; fail if ``proc`` ends or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{err[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def round_records(output_dir) -> list:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if r.get("event") == "round"]


def error_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith(ERROR)]


def test_a_second_trainer_on_a_running_output_dir_is_refused_and_the_first_finishes(ray_address, tmp_path):
    out = tmp_path / "run"
    # The second starts as soon as the first holds the folder (its config.yaml written, then
    # metrics.jsonl opened), so its own start-up (seconds: Python, torch) runs beside the
    # first's set-up and round 0; round 1 is slowed (1 s a step) so that the first is still
    # training while the second is refused.
    slow = [{"kind": "slow", "replica": 0, "round": 1, "step": 0, "seconds": 1}]
    cfg = tiny_config(out, diloco_loops=2, max_steps=4, eval_batches=1, fault_plan=slow)
    first = start_cli(ray_address, "train", write_config(tmp_path / "job.yaml", cfg))
    wait_for((out / "metrics.jsonl").exists, first, what="the run's metrics.jsonl")
    config_yaml = (out / "config.yaml").read_bytes(), (out / "config.yaml").stat().st_mtime_ns

    # The most dangerous second run: one that would clear the folder first.
    second = start_cli(ray_address, "train", str(tmp_path / "job.yaml"), "--set", "overwrite_output_dir=true")
    started = time.monotonic()
    _, err = second.communicate(timeout=120)
    refused_in = time.monotonic() - started
    assert first.poll() is None, f"the first run ended before the second was refused ({refused_in:.1f} s)"
    assert second.returncode == 2, err
    assert err.strip().splitlines() == error_lines(err), err  # that line and nothing else
    assert len(error_lines(err)) == 1, err
    assert f"output_dir: '{out}' is in use by another diloco-ray run (pid {first.pid} on" in err

    _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err[-3000:]
    assert [(r["round"], r["replicas"]) for r in round_records(out)] == [(0, 2), (1, 2)]
    assert (out / "final" / "model.safetensors").stat().st_size > 0
    assert ((out / "config.yaml").read_bytes(), (out / "config.yaml").stat().st_mtime_ns) == config_yaml


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs mounted for the test (root only), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_leaving(folder, free_bytes: int) -> str:
    """Fill ``folder``'s filesystem with one file until only ``free_bytes`` are left."""
    st = os.statvfs(folder)
    path = os.path.join(folder, "filler")
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - free_bytes))
    return path


def folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(folder) for f in names)


def test_a_full_disk_is_one_line_and_the_last_checkpoint_survives(ray_address, tmp_path, small_disk):
    from diloco_ray.persist import checkpoint, run_folder, state_files

    out = small_disk
    # A checkpoint at set-up and after every round; round 0 is slowed (0.5 s a step: 2 s,
    # against milliseconds to fill a tmpfs once the poll sees the first checkpoint) so the
    # disk is filled after the first checkpoint and before the second.
    slow = [{"kind": "slow", "replica": 0, "round": 0, "step": 0, "seconds": 0.5}]
    cfg = tiny_config(out, diloco_loops=2, max_steps=4, checkpoint_steps=4, eval_batches=1, fault_plan=slow)
    job = write_config(tmp_path / "job.yaml", cfg)
    run = start_cli(ray_address, "train", job)
    first = out / "checkpoints" / "round-00000000"
    wait_for(first.is_dir, run, what="the first checkpoint")
    # Room for metrics lines, not for another checkpoint: it fails part-way inside the actors.
    filler = fill_leaving(out, folder_bytes(first) // 2)
    _, err = run.communicate(timeout=300)

    assert run.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    [line] = error_lines(err)
    assert line.startswith(f"{ERROR}output_dir: no space left on device writing '{out}/checkpoints/"), line
    assert f"last good checkpoint ({first})" in line and f"--set resume_from={out}" in line, line
    assert [p for p in os.listdir(out / "checkpoints") if p.startswith(".tmp-")] == []  # the half one is gone

    # The last good checkpoint verifies and loads with the project's own code...
    assert checkpoint.latest_valid(str(out / "checkpoints")) == (str(first), [])
    s = cfg.sections()
    assert run_folder.resolve_resume(str(out), s.checkpointing, s.model, s.peft) == (str(first), [])
    assert state_files.load_state(str(first), "outer")["round"] == 0
    shapes = json.loads((first / "server.json").read_text())["shapes"]
    weights = state_files.load_tensors(str(first / "global.safetensors"))
    assert {n: list(t.shape) for n, t in weights.items()} == shapes
    # ... and once there is room, the run resumes from it, as the line says, and finishes.
    os.remove(filler)
    resumed = start_cli(
        ray_address, "train", str(out / "config.yaml"), "--set", f"resume_from={out}", "--set", "fault_plan=null"
    )
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [r["round"] for r in round_records(out)] == [0, 1]
    assert (out / "final" / "model.safetensors").stat().st_size > 0
