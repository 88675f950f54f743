"""What an actor reads of a checkpoint is checked against its manifest as it loads, and what
the driver downloads of a bucket checkpoint to verify it is bounded (persist/manifest.py,
cloud_checkpoint.fetch, staging.read_checked). Buckets are a local moto S3; no Ray."""

import json
import os
import uuid

import pytest
import s3_server
import torch

from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError, DataError
from diloco_ray.persist import checkpoint, cloud_checkpoint, server_state, staging, state_files, storage
from diloco_ray.persist.run_folder import resolve_resume
from diloco_ray.runtime.rank_state import RankState

s3_bucket = s3_server.s3_bucket  # module-scoped fixture: one moto server for this file

CONFIG = TrainerConfig(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", seq_len=8)
SERVER_FILES = ["server.json", "global.safetensors", "outer.safetensors", "outer.json"]


@pytest.fixture(autouse=True)
def stage(tmp_path, monkeypatch):
    """Every bucket folder stages under tmp_path/stage (what an actor's node would hold)."""
    monkeypatch.setenv("DILOCO_RAY_STAGING", str(tmp_path / "stage"))
    monkeypatch.delenv("DILOCO_RAY_MAX_CHECKPOINT_BYTES", raising=False)


def write_server(where: str) -> dict:
    """Server 0's files in checkpoint ``where`` (a folder or a URI), in ServerCheckpoint's
    format; the manifest hashes :func:`staging.publish` reports for a URI."""
    folder = staging.scratch(where)
    meta = {"round": 1, "fragment": 0, "version": 1, "cursor": {}, "shapes": {"w": [2, 3]}}
    with open(os.path.join(folder, "server.json"), "w") as f:
        json.dump(meta, f)
    state_files.save_tensors(os.path.join(folder, "global.safetensors"), {"w": torch.ones(2, 3)})
    state_files.save_state(folder, "outer", {"optimizer": {}, "round": 1})
    return staging.publish(where, SERVER_FILES)


def local_checkpoint(root) -> str:
    """A committed local checkpoint of round 1 holding server 0's files."""
    tmp = checkpoint.begin(str(root), 1)
    write_server(tmp)
    return checkpoint.commit(tmp, str(root), 1, {})


def bucket_checkpoint(s3_bucket) -> str:
    """A committed bucket checkpoint of round 1 holding server 0's files."""
    root = s3_bucket.uri(f"runs/{uuid.uuid4().hex[:8]}/checkpoints")
    uri = cloud_checkpoint.begin(root, 1)
    return cloud_checkpoint.commit(uri, 1, {}, write_server(uri))


def other_weights() -> bytes:
    """A valid weights file with other values: what a tamperer would put in place."""
    path = os.path.join(os.environ["DILOCO_RAY_STAGING"], "forged.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state_files.save_tensors(path, {"w": torch.full((2, 3), 7.0)})
    with open(path, "rb") as f:
        return f.read()


def load_server(where: str):
    return server_state.ServerCheckpoint(0, CONFIG.sections().checkpointing).load(where)


def staged(uri: str) -> set:
    """Files in the staging copy of ``uri``."""
    local = storage.Mirror(uri).local
    return {os.path.relpath(os.path.join(d, n), local) for d, _, names in os.walk(local) for n in names}


# ----------------------------------------------------------------- item 7a: actors re-check


def test_a_server_file_changed_after_the_drivers_check_is_refused_naming_it(tmp_path):
    final = local_checkpoint(tmp_path / "checkpoints")
    assert checkpoint.verify(final) is None  # the driver's check
    assert torch.equal(load_server(final).weights["w"], torch.ones(2, 3))
    with open(os.path.join(final, "global.safetensors"), "wb") as f:
        f.write(other_weights())  # the shared folder changes before the server loads
    with pytest.raises(DataError) as caught:
        load_server(final)
    line = str(caught.value)
    assert "\n" not in line and final in line and "checksum mismatch for 'global.safetensors'" in line


def test_a_file_the_manifest_does_not_list_is_refused_as_it_loads(tmp_path):
    final = local_checkpoint(tmp_path / "checkpoints")
    manifest = checkpoint.read_manifest(final)
    del manifest["files"]["outer.json"]  # rewritten after the check, vouching for less
    with open(os.path.join(final, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(DataError, match=r"'outer.json' is not listed in its manifest.json"):
        load_server(final)


def test_a_rank_file_changed_after_the_drivers_check_is_refused_naming_it(tmp_path):
    def rank_state():
        param = torch.nn.Parameter(torch.arange(4.0))
        sync = RankSync({"p": (4,)}, 1, 0)
        return RankState([("p", param)], sync, CONFIG.sections().inner_optim, "no", 0, 1, torch.device("cpu"), False)

    root = str(tmp_path / "checkpoints")
    tmp = checkpoint.begin(root, 1)
    rank_state().save_inner_state(tmp, 0)
    final = checkpoint.commit(tmp, root, 1, {})
    assert checkpoint.verify(final) is None and rank_state().load_inner_state(final, 0) is True
    assert rank_state().load_inner_state(final, 1) is False  # no state for that slot: still fine
    torch.manual_seed(1234)  # another valid state (its RNG): what old code would load silently
    rank_state().save_inner_state(str(tmp_path / "other"), 0)
    with open(tmp_path / "other" / "replicas" / "slot-0-rank-0.safetensors", "rb") as src:
        forged = src.read()
    with open(os.path.join(final, "replicas", "slot-0-rank-0.safetensors"), "wb") as dst:
        dst.write(forged)
    with pytest.raises(DataError, match=r"checksum mismatch for 'replicas/slot-0-rank-0.safetensors'"):
        rank_state().load_inner_state(final, 0)


def test_a_bucket_file_changed_after_the_drivers_check_is_refused_naming_it(s3_bucket):
    uri = bucket_checkpoint(s3_bucket)
    assert cloud_checkpoint.verify(uri) is None  # the driver's check
    storage.Mirror(uri).write_bytes("global.safetensors", other_weights())
    with pytest.raises(DataError) as caught:
        load_server(uri)  # the server downloads its own files on its node
    line = str(caught.value)
    assert "\n" not in line and uri in line and "checksum mismatch for 'global.safetensors'" in line


def test_a_bucket_checkpoint_loads_and_a_stale_staged_file_it_does_not_list_is_not_read(s3_bucket):
    uri = bucket_checkpoint(s3_bucket)
    assert torch.equal(load_server(uri).weights["w"], torch.ones(2, 3))
    stale = os.path.join(storage.Mirror(uri).local, "replicas", "slot-0-rank-0.json")
    os.makedirs(os.path.dirname(stale))
    open(stale, "w").close()  # left on this node by an earlier write of the same round
    local = staging.read_checked(uri, ["replicas/slot-0-rank-0.json"])
    assert not os.path.exists(os.path.join(local, "replicas", "slot-0-rank-0.json"))


# ----------------------------------------------------------------- item 6b: bounded download


def forge_manifest(uri: str, rel: str) -> None:
    """The bucket checkpoint's manifest, rewritten to list ``rel`` too."""
    mirror = storage.Mirror(uri)
    doc = json.loads(mirror.read_bytes(checkpoint.MANIFEST))
    doc["files"][rel] = "0" * 64
    mirror.write_bytes(checkpoint.MANIFEST, json.dumps(doc).encode())


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd"])
def test_a_manifest_listing_a_path_outside_the_checkpoint_is_refused_before_downloading(s3_bucket, rel):
    uri = bucket_checkpoint(s3_bucket)
    forge_manifest(uri, rel)
    reason = cloud_checkpoint.verify(uri)
    assert reason == f"manifest.json lists an unsafe path {rel!r} (expected a relative path inside the checkpoint)"
    assert staged(uri) == {"manifest.json"}  # not one listed file fetched
    with pytest.raises(DataError, match="unsafe path"):
        load_server(uri)  # an actor refuses it too


def test_a_local_manifest_listing_a_path_outside_is_refused(tmp_path):
    final = local_checkpoint(tmp_path / "checkpoints")
    manifest = checkpoint.read_manifest(final)
    manifest["files"]["../x"] = "0" * 64
    with open(os.path.join(final, checkpoint.MANIFEST), "w") as f:
        json.dump(manifest, f)
    assert "unsafe path '../x'" in checkpoint.verify(final)


def test_a_checkpoint_over_the_byte_cap_is_refused_before_downloading(s3_bucket, monkeypatch):
    uri = bucket_checkpoint(s3_bucket)
    total = sum(size for rel, size in storage.Mirror(uri).sizes("").items() if rel != checkpoint.MANIFEST)
    monkeypatch.setenv(cloud_checkpoint.MAX_BYTES_ENV, str(total - 1))
    reason = cloud_checkpoint.verify(uri)
    cap = f"{total - 1:,} a checkpoint may (DILOCO_RAY_MAX_CHECKPOINT_BYTES)"
    assert reason == f"its files hold {total:,} bytes, more than the {cap}"
    assert staged(uri) == {"manifest.json"}
    # A resume names the checkpoint and the reason, in one line.
    with pytest.raises(ConfigError) as caught:
        resolve_resume(uri)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("resume_from:") and "round-00000001: its files hold" in line
    monkeypatch.setenv(cloud_checkpoint.MAX_BYTES_ENV, str(total))
    assert cloud_checkpoint.verify(uri) is None


@pytest.mark.parametrize("value", ["lots", "0", "-5"])
def test_a_bad_byte_cap_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv(cloud_checkpoint.MAX_BYTES_ENV, value)
    with pytest.raises(ConfigError, match=f"^DILOCO_RAY_MAX_CHECKPOINT_BYTES: '{value}' is not allowed"):
        cloud_checkpoint.max_bytes()


def test_an_oversized_manifest_is_not_downloaded(s3_bucket, monkeypatch):
    uri = bucket_checkpoint(s3_bucket)
    size = storage.Mirror(uri).sizes("")[checkpoint.MANIFEST]
    monkeypatch.setattr(cloud_checkpoint, "MANIFEST_MAX_BYTES", size - 1)
    assert (
        cloud_checkpoint.verify(uri) == f"manifest.json holds {size:,} bytes, more than a manifest may ({size - 1:,})"
    )
    assert staged(uri) == set()


def test_an_object_the_manifest_does_not_list_is_refused_and_not_downloaded(s3_bucket):
    uri = bucket_checkpoint(s3_bucket)
    storage.Mirror(uri).write_bytes("junk/big.bin", b"x" * 1000)
    assert cloud_checkpoint.verify(uri) == "'junk/big.bin' is in the checkpoint but not listed in its manifest.json"
    assert staged(uri) == {"manifest.json"}


def test_a_listed_file_missing_from_the_bucket_is_named(s3_bucket):
    uri = bucket_checkpoint(s3_bucket)
    storage.Mirror(uri).delete("outer.json")
    assert cloud_checkpoint.verify(uri) == "missing file 'outer.json'"
