"""output_dir in a bucket: checkpoints and final/ land in (moto's) S3, a run that dies
resumes from there on a machine with no local copy, and ends where an uninterrupted run
ends."""

import os
import shutil

import numpy as np
import pytest
import s3_server
from conftest import EXACT_JOB, TWO_SERVERS, CrashAfter, tiny_config
from safetensors.numpy import load_file

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.persist import storage

pytestmark = pytest.mark.integration
s3_bucket = s3_server.s3_bucket


@pytest.fixture(scope="module")
def staging(tmp_path_factory):
    """The node-local staging root, set before Ray starts so every actor sees it."""
    root = str(tmp_path_factory.mktemp("staging"))
    old = os.environ.get("DILOCO_RAY_STAGING")
    os.environ["DILOCO_RAY_STAGING"] = root
    yield root
    if old is None:
        os.environ.pop("DILOCO_RAY_STAGING", None)
    else:
        os.environ["DILOCO_RAY_STAGING"] = old


def final_weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


# The fault-free run is test_fault_kinds.py's synchronous one (EXACT, made once a session by
# ``uninterrupted``; its checkpoints every other round change no weight). The runs here
# checkpoint every round, pruned to the newest two, from two servers (a sharded checkpoint).
EXACT = EXACT_JOB
COMMON = {**EXACT, **TWO_SERVERS, "checkpoint_steps": 4, "save_total_limit": 2}


def test_checkpoints_land_in_s3_and_a_resume_from_there_matches_an_uninterrupted_run(
    s3_bucket, staging, ray_local, tmp_path, monkeypatch, uninterrupted
):
    reference = uninterrupted(**EXACT)
    # The driver stages elsewhere than the actors (whose processes kept the fixture's
    # root), as on a cluster where they run on other machines: whatever an actor needs
    # from the bucket it must fetch itself.
    driver_staging = str(tmp_path / "driver-staging")
    monkeypatch.setenv("DILOCO_RAY_STAGING", driver_staging)

    uri = s3_bucket.uri("runs", "tiny")
    cfg = tiny_config(uri, **COMMON)
    with pytest.raises(RuntimeError, match="injected"):
        DilocoFSDPTrainer(cfg, callbacks=[CrashAfter(1)]).train()
    keys = s3_bucket.keys("runs/tiny/")
    # Checkpoints after rounds 0 (start), 1 and 2, pruned to the newest two; each complete.
    rounds = sorted({k.split("/")[3] for k in keys if k.startswith("runs/tiny/checkpoints/round-")})
    assert rounds == ["round-00000001", "round-00000002"]
    for r in rounds:
        prefix = f"runs/tiny/checkpoints/{r}/"
        assert {
            prefix + f
            for f in (
                "manifest.json",
                "global-0-of-2.safetensors",
                "global-1-of-2.safetensors",
                "server-0-of-2.json",
                "server-1-of-2.json",
                "replicas/slot-0-rank-0.safetensors",
                "replicas/slot-1-rank-0.json",
            )
        } <= set(keys)
    assert "runs/tiny/metrics.jsonl" in keys and "runs/tiny/config.yaml" in keys
    assert not any(k.startswith("runs/tiny/final/") for k in keys)

    # A new run into the same bucket folder is refused, and nothing there changes.
    before = {k: s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=k)["ETag"] for k in keys}
    with pytest.raises(ConfigError, match="output_dir.*already holds a run"):
        DilocoFSDPTrainer(tiny_config(uri, **COMMON)).train()
    assert {
        k: s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=k)["ETag"] for k in s3_bucket.keys("runs/tiny/")
    } == before

    # Resume on a "fresh machine": no staging area (each process makes its own, 0700).
    for root in (staging, driver_staging):
        shutil.rmtree(root)
    resumed = DilocoFSDPTrainer(tiny_config(uri, resume_from=uri, **COMMON)).train()
    assert [r["round"] for r in resumed.rounds] == [2, 3, 4]
    assert resumed.final_path == f"{uri}/final"

    mirror = storage.Mirror(f"{uri}/final", local=str(tmp_path / "final"))
    assert mirror.download(mirror.local)
    got, want = final_weights(mirror.local), final_weights(os.path.join(reference.output_dir, "final"))
    assert set(got) == set(want)
    worst = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    assert worst <= 1e-5, f"resumed-from-S3 run differs from the uninterrupted one by {worst}"
    assert (tmp_path / "final" / "config.json").exists() and (tmp_path / "final" / "tokenizer.json").exists()

    metrics = storage.Mirror(uri, local=str(tmp_path / "m"))
    assert metrics.download(os.path.join(metrics.local, "metrics.jsonl"))
    text = (tmp_path / "m" / "metrics.jsonl").read_text()
    assert [
        int(line.split('"round": ')[1].split(",")[0]) for line in text.splitlines() if '"event": "round"' in line
    ] == [0, 1, 2, 3, 4]  # round 2 rerun once, contiguous

    from diloco_ray.observe.report import write_report

    assert "5 of 5 rounds" in write_report(uri)
    assert "runs/tiny/report.png" in s3_bucket.keys("runs/tiny/")


def test_a_missing_bucket_is_refused_before_ray(s3_bucket, tmp_path):
    import ray

    running = ray.is_initialized()
    cfg = tiny_config("s3://no-such-bucket/run")
    with pytest.raises(ConfigError, match="output_dir.*no-such-bucket"):
        DilocoFSDPTrainer(cfg).train()
    assert ray.is_initialized() == running


def test_in_flight_snapshots_need_a_local_output_dir(s3_bucket):
    with pytest.raises(ConfigError, match="checkpoint_steps"):
        from diloco_ray.driver import preflight

        preflight.check(TrainerConfig(**{**tiny_config("s3://b/run").to_dict(), "checkpoint_steps": 2}), resuming=False)
