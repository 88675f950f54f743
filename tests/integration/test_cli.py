"""The diloco-ray command as a user runs it: exit codes, one-line errors, outputs."""

import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# Small enough for a test: the same job as the embedded default, fewer and shorter rounds.
QUICK = ["--set", "diloco_loops=2", "--set", "max_steps=4", "--set", "eval_batches=2", "--set", "logging_steps=1"]


def run_cli(*args, timeout=300, **env_extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env_extra}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "diloco_ray", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_ten_bad_inputs_each_exit_2_with_one_line_naming_the_field_before_ray(tmp_path, capsys):
    """Each bad input: exit 2, one stderr line naming the field (or file) and what is
    allowed, no traceback, no Ray started and nothing written."""
    import ray

    from diloco_ray import cli

    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: [1, 2\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [  # (config, override or None, words the message must hold)
        (TINY, "outer_lrr=0.5", ["outer_lrr", "did you mean 'outer_lr'"]),
        (TINY, "batch_size=zero", ["batch_size", "'zero'", "integer"]),
        (TINY, "seq_len=-8", ["seq_len", "-8", ">= 8"]),
        (TINY, "outer_momentum=1.0", ["outer_momentum", "< 1.0"]),
        (TINY, "inner_opt=Adamm", ["inner_opt", "'Adamm'", "did you mean 'Adam'"]),
        (TINY, "outer_lr_schedule=cos", ["outer_lr_schedule", "'cosine'"]),
        (TINY, "pseudo_grad_compression=zip", ["pseudo_grad_compression", "'zip'", "'int8'"]),
        (TINY, "min_replicas=3", ["num_replicas", "min_replicas=3"]),
        (TINY, f"json_file_path={tmp_path}/missing.jsonl", ["json_file_path", "missing.jsonl", "does not exist"]),
        (TINY, f"resume_from={empty}", ["resume_from", "no checkpoints"]),
        (TINY, "output_dir=ftp://host/run", ["output_dir", "s3://"]),
        (TINY, "outer_opt_kwargs={nesterovv: true}", ["outer_opt_kwargs", "nesterovv"]),
        (TINY, "log_dir=tb", ["log_dir", "tensorboard"]),
        (str(tmp_path / "nope.yaml"), None, ["nope.yaml", "does not exist"]),
        (str(bad_yaml), None, ["bad.yaml", "not valid YAML"]),
    ]
    for i, (config, override, words) in enumerate(cases):
        out = tmp_path / f"out{i}"
        args = ["train", config, "--set", f"output_dir={out}"] + (["--set", override] if override else [])
        if override and override.startswith("output_dir="):
            args = ["train", config, "--set", override]
        code = cli.main(args)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (override, err)
        assert len(lines) == 1 and "Traceback" not in err, (override, err)
        for w in words:
            assert w in lines[0], (override, lines[0])
        assert not out.exists(), override
        assert not ray.is_initialized(), override


def test_print_config_shows_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    import yaml

    from diloco_ray import cli
    from diloco_ray.config.schema import FIELD_NAMES, TrainerConfig

    out = tmp_path / "out"
    assert cli.main(["train", TINY, "--set", f"output_dir={out}", "--set", "lr=1e-4", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert set(printed) == set(FIELD_NAMES)
    assert printed["lr"] == 1e-4 and printed["outer_momentum"] == 0.5 and printed["outer_opt"] == "SGD"
    assert TrainerConfig(**printed) == TrainerConfig.from_yaml(TINY, {"output_dir": str(out), "lr": 1e-4})
    assert not out.exists()


def test_missing_config_file(tmp_path):
    r = run_cli("train", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_every_field():
    from diloco_ray.config.schema import FIELD_NAMES

    r = run_cli("train", "--help")
    assert r.returncode == 0
    for name in FIELD_NAMES:
        assert f"  {name} (default" in r.stdout


def _snapshot(folder):
    """Every file under ``folder`` with its bytes and modification time."""
    found = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = (f.read(), os.stat(path).st_mtime_ns)
    return found


def stale_ray_tmpdir() -> str:
    """A Ray temp root where a `ray start` head that was killed left ray_current_cluster
    behind (nothing listens at its address): ray.init() would take it for a live cluster
    and refuse num_cpus."""
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:1\n")
    return ray_tmp


def ray_sessions(ray_tmpdir) -> set[str]:
    root = os.path.join(ray_tmpdir, "ray")
    return {d for d in os.listdir(root) if d.startswith("session_2")}


def processes_naming(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a Ray session's name)."""
    import psutil

    lines = (" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    return [line[:160] for line in lines if marker in line]


def test_tiny_default_end_to_end_then_refuses_to_overwrite(tmp_path):
    """The default, shortened, from the command line, on a machine where a killed head left
    its cluster file behind: the run starts a Ray of its own (it does not try to join), and
    every process of that Ray is gone within 2 s of the run's end."""
    out = tmp_path / "run"
    ray_tmpdir = stale_ray_tmpdir()
    r = run_cli("train", TINY, "--set", f"output_dir={out}", *QUICK, RAY_TMPDIR=ray_tmpdir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "joining" not in r.stderr
    assert "round 2/2" in r.stdout
    # What a new user sees: no Ray notices, data bars or worker output (they are in
    # logs/ray.log), every replica count says 2 of 2 (the first step line comes when one
    # replica has reported), numbers rounded, plain lines (the output is not a terminal).
    shown = r.stdout + r.stderr
    for noise in ("Token authentication", "tokenise+pack", "pid=", "Started a local Ray"):
        assert noise not in shown, noise
    assert not re.search(r"[\r\x1b]", shown)
    counts = [line for line in r.stdout.splitlines() if line.lstrip().startswith("round ")]
    assert len(counts) >= 3 and all("replicas 2/2" in line for line in counts), counts
    assert any(line.startswith("  round 1/2  step ") for line in counts)  # a step line, with logging_steps=1
    assert re.search(r"^done: 2 rounds in \d+s, eval_loss \d+\.\d{4}, model in ", r.stdout, re.M), r.stdout
    assert f"Ray's output: {out / 'logs' / 'ray.log'}" in r.stdout
    assert "Started a local Ray instance" in (out / "logs" / "ray.log").read_text()
    [session] = ray_sessions(ray_tmpdir)
    deadline = time.monotonic() + 2
    while processes_naming(session) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_naming(session) == []
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "final/config.json",
        "final/model.safetensors",
        "final/tokenizer.json",
    ):
        assert (out / name).exists(), name
    before = _snapshot(out)

    again = run_cli("train", TINY, "--set", f"output_dir={out}", *QUICK)
    assert again.returncode == 2 and "output_dir" in again.stderr and "already holds a run" in again.stderr
    assert "Traceback" not in again.stderr and "Started a local Ray" not in again.stderr
    assert _snapshot(out) == before  # not a byte or a timestamp changed

    rep = run_cli("report", str(out))
    assert rep.returncode == 0, rep.stderr
    assert (out / "report.png").stat().st_size > 10_000
    assert "2 rounds" in rep.stdout


def test_missing_text_field_in_data_is_exit_2(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 50)
    r = run_cli(
        "train",
        TINY,
        "--set",
        f"output_dir={tmp_path}/out",
        "--set",
        "dataset_name=null",
        "--set",
        f"json_file_path={data}",
        "--set",
        "text_field=nope",
        *QUICK,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "nope" in r.stderr and "question" in r.stderr
    assert "Started a local Ray" not in r.stderr  # the driver read the first record: no Ray for a typo


def test_report_on_a_folder_without_a_run(tmp_path):
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr
