"""Bad input to the CLI, in-process and before Ray: exit 2, one line naming the field,
nothing written, and no secret ever echoed."""

import os

import pytest
from conftest import ROOT

from diloco_ray import cli
from diloco_ray.persist import storage

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("target", ["-5", "0"])
def test_scale_to_fewer_than_one_replica_is_refused(tmp_path, capsys, target):
    (tmp_path / "metrics.jsonl").write_text("")
    code, out, err = run_cli(capsys, "scale", str(tmp_path), target)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"diloco-ray: error: replicas: {target}")
    assert not (tmp_path / "scale_request.json").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TINY, "--set", f"output_dir=s3://AKIAEXAMPLE:{SECRET}@bucket/run"],
        ["train", TINY, "--set", f"resume_from=s3://AKIAEXAMPLE:{SECRET}@bucket/run/checkpoints"],
        ["scale", f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", "3"],
        ["report", f"gs://user:{SECRET}@bucket/run"],
    ],
)
def test_credentials_in_a_uri_are_refused_and_never_echoed(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "credentials" in err
    assert SECRET not in out + err and "***@bucket" in err


def test_redact_hides_only_the_userinfo():
    assert storage.redact(f"s3://key:{SECRET}@bucket/a/b?x=1") == "s3://***@bucket/a/b?x=1"
    assert storage.redact("s3://bucket/a@b") == "s3://bucket/a@b"
    assert storage.redact("outputs/run") == "outputs/run"


@pytest.mark.parametrize(
    "output_dir, says",
    [
        ("/proc/self/diloco", "pseudo-filesystem"),
        ("/sys/diloco-run", "pseudo-filesystem"),
        ("{tmp}/" + "x" * 300, "at most 255"),
        ("{tmp}/" + "/".join(["y" * 200] * 25), "shorter than"),
        ("{tmp}/file/run", "not a writable folder"),
    ],
)
def test_output_dir_that_cannot_be_made_is_bad_input(tmp_path, capsys, output_dir, says):
    (tmp_path / "file").write_text("not a folder")
    before = sorted(os.listdir(tmp_path))
    code, out, err = run_cli(capsys, "train", TINY, "--set", f"output_dir={output_dir.format(tmp=tmp_path)}")
    assert code == 2 and err.count("\n") == 1 and err.startswith("diloco-ray: error: output_dir:") and says in err
    assert sorted(os.listdir(tmp_path)) == before  # nothing created


def test_a_second_run_on_a_locked_output_dir_is_refused_and_a_dead_holder_frees_it(tmp_path, capsys):
    import signal
    import subprocess
    import sys
    import time

    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.persist.run_folder import LOCK_FILE, RunFolder

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from diloco_ray.config import TrainerConfig\n"
                "from diloco_ray.persist.run_folder import RunFolder\n"
                f"config = TrainerConfig.from_yaml({TINY!r}, overrides={{'output_dir': {str(out)!r}}})\n"
                "held = RunFolder(config.sections().checkpointing, config.log_dir); held.lock()\n"
                "print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run_cli(capsys, "train", TINY, "--set", f"output_dir={out}")
        assert code == 2 and err.count("\n") == 1 and "in use by another diloco-ray run" in err
        assert f"pid {holder.pid}" in err
        assert sorted(os.listdir(out)) == [LOCK_FILE]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up
        holder.wait()
    config = TrainerConfig.from_yaml(TINY, overrides={"output_dir": str(out)})
    folder = RunFolder(config.sections().checkpointing, config.log_dir)
    deadline = time.time() + 5
    while True:  # the kernel released the dead holder's lock
        try:
            folder.lock()
            break
        except Exception:
            assert time.time() < deadline
            time.sleep(0.1)
    folder.unlock()


def a_checkpoint(root, round_index=3):
    """A valid (verifying) checkpoint folder under ``root``."""
    import torch

    from diloco_ray.persist import checkpoint, state_files

    tmp = checkpoint.begin(str(root), round_index)
    state_files.save_state(tmp, "global", {"w": torch.ones(2)})
    return checkpoint.commit(tmp, str(root), round_index, {})


# A resume from another run's checkpoint into a finished run: a case of test_bad_inputs.py.


def test_overwrite_output_dir_leaves_no_old_checkpoint_behind(tmp_path):
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.persist import checkpoint
    from diloco_ray.persist.run_folder import RunFolder

    out = tmp_path / "run"
    a_checkpoint(out / "checkpoints")
    (out / "final").mkdir()
    (out / "metrics.jsonl").write_text('{"event": "round", "round": 3}\n')
    (out / "notes.txt").write_text("the user's own file")
    assert checkpoint.latest_valid(str(out / "checkpoints"))[0] is not None
    cfg = TrainerConfig.from_yaml(TINY, overrides={"output_dir": str(out), "overwrite_output_dir": True})
    RunFolder(cfg.sections().checkpointing, cfg.log_dir).prepare(resuming=False)
    assert checkpoint.latest_valid(str(out / "checkpoints"))[0] is None
    assert sorted(os.listdir(out)) == ["notes.txt"]
    # Resuming the run itself with overwrite_output_dir set keeps what it resumes from.
    a_checkpoint(out / "checkpoints")
    cfg = TrainerConfig.from_yaml(
        TINY, overrides={"output_dir": str(out), "overwrite_output_dir": True, "resume_from": str(out)}
    )
    RunFolder(cfg.sections().checkpointing, cfg.log_dir).prepare(resuming=True)
    assert checkpoint.latest_valid(str(out / "checkpoints"))[0] is not None


def test_unwrap_finds_the_original_inside_nested_ray_errors():
    # A rank's set-up failing on the tokenising task's DataError: Ray wraps it twice, and
    # the inner wrapper is also a DataError whose str() carries a remote traceback.
    from ray.exceptions import RayTaskError

    from diloco_ray.errors import DataError, unwrap

    original = DataError("prompt_template: names column 'x'")
    inner = RayTaskError("prepare_token_data", "Traceback: task", original).as_instanceof_cause()
    outer = RayTaskError("RankWorker.setup", "Traceback: rank", inner).as_instanceof_cause()
    assert isinstance(inner, DataError) and "Traceback" in str(inner)
    assert unwrap(outer) is original
    plain = RuntimeError("boom")
    assert unwrap(RayTaskError("f", "tb", plain).as_instanceof_cause()) is plain
