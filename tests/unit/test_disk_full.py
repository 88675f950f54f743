"""A full disk (ENOSPC, EDQUOT) without Ray: recognised however it is wrapped, named by
the file that failed, left behind as no half-written file, and printed by the CLI as one
line with exit status 1 (an environment failure, not bad input)."""

import errno
import os

import pytest
from conftest import ROOT

from diloco_ray import cli
from diloco_ray.errors import disk_full
from diloco_ray.persist.disk_full import disk_full_line

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FULL = os.strerror(errno.ENOSPC)


def test_a_full_disk_is_found_inside_ray_errors_and_chained_ones():
    from ray.exceptions import RayTaskError

    original = OSError(errno.ENOSPC, FULL, "/run/checkpoints/x.part")
    wrapped = RayTaskError("ParameterServer.save", "Traceback: remote", original).as_instanceof_cause()
    assert disk_full(wrapped) is original
    try:
        try:
            raise original
        finally:
            raise OSError(errno.ENOSPC, FULL)  # the close that failed after the write did
    except OSError as later:
        assert disk_full(later) is original  # the one that names its file
    quota = disk_full(RuntimeError(f"I/O error: {os.strerror(errno.EDQUOT)} (os error {errno.EDQUOT})"))
    assert quota.errno == errno.EDQUOT
    assert disk_full(OSError(errno.EACCES, "Permission denied", "/x")) is None
    assert disk_full(ValueError("no space here")) is None


def test_safetensors_failing_on_a_full_disk_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from diloco_ray.persist import state_files

    def full(tensors, path):
        open(path, "wb").write(b"half")
        raise SafetensorError(f"Error while serializing: I/O error: {FULL} (os error {errno.ENOSPC})")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as raised:
        state_files.save_tensors(str(tmp_path / "w.safetensors"), {"w": torch.ones(2)})
    assert raised.value.errno == errno.ENOSPC and str(tmp_path) in raised.value.filename
    assert os.listdir(tmp_path) == []  # the half-written temp file is gone


def test_metrics_and_config_writes_on_a_full_disk_name_their_file(tmp_path, monkeypatch):
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.observe.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path))

    class FullFile:
        closed = False

        def write(self, text):
            raise OSError(errno.ENOSPC, FULL)

    real, logger._file = logger._file, FullFile()
    with pytest.raises(OSError) as raised:
        logger.log({"event": "round", "round": 0})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == logger.path
    real.close()

    def no_room(self, redact=True):
        raise OSError(errno.ENOSPC, FULL)

    config = TrainerConfig.from_yaml(TINY)
    monkeypatch.setattr(TrainerConfig, "yaml_text", no_room)
    with pytest.raises(OSError) as raised:
        config.to_yaml(str(tmp_path / "config.yaml"))
    assert raised.value.filename == str(tmp_path / "config.yaml")
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # no config.yaml.tmp left


def write_checkpoint(root, round_index):
    import torch

    from diloco_ray.persist import checkpoint, state_files

    tmp = checkpoint.begin(str(root), round_index)
    state_files.save_state(tmp, "outer", {"w": torch.ones(2)})
    return checkpoint.commit(tmp, str(root), round_index, {})


def test_train_on_a_full_disk_is_one_line_exit_1_and_drops_the_half_checkpoint(tmp_path, capsys, monkeypatch):
    """The trainer is a stand-in that fails as the real one does when an actor's
    checkpoint write hits a full disk (the integration test runs the real one)."""
    from ray.exceptions import RayTaskError

    from diloco_ray.driver import trainer as trainer_module
    from diloco_ray.persist.run_folder import RunFolder

    out = tmp_path / "run"
    good = write_checkpoint(out / "checkpoints", 1)
    half = out / "checkpoints" / ".tmp-round-00000002-abc"  # the checkpoint being written
    half.mkdir()
    (out / ".final.0123abcd.tmp").mkdir()  # and final/'s temp folder, had the disk filled at the end
    failed = OSError(errno.ENOSPC, FULL, str(half / "global.safetensors"))

    class FullDiskTrainer:
        def __init__(self, config, callbacks, stop_on_sigterm, ray_output_to_file):
            self.run_dir = RunFolder(config.sections().checkpointing, config.log_dir)

        def train(self):
            raise RayTaskError("ParameterServer.save", "Traceback: remote", failed).as_instanceof_cause()

    monkeypatch.setattr(trainer_module, "DilocoFSDPTrainer", FullDiskTrainer)
    code = cli.main(["train", TINY, "--set", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"diloco-ray: error: output_dir: no space left on device writing '{half}/global.safetensors'")
    assert f"last good checkpoint ({good})" in err and f"--set resume_from={out}" in err
    assert sorted(os.listdir(out)) == ["checkpoints"] and os.listdir(out / "checkpoints") == ["round-00000001"]


@pytest.mark.parametrize("inside", [True, False])
def test_the_line_names_output_dir_only_when_the_file_is_in_it(tmp_path, inside):
    where = str(tmp_path / "run" / "metrics.jsonl") if inside else "/var/tmp/ray/session/spill"
    line = disk_full_line(OSError(errno.ENOSPC, FULL, where), str(tmp_path / "run"))
    assert line.startswith("output_dir: " if inside else "no space left on device writing '/var/tmp/ray")
    assert where in line
