"""The diloco-ray command as a user runs it: exit codes, one-line errors, outputs."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# Small enough for a test: the same job as the embedded default, fewer and shorter rounds.
QUICK = ["--set", "diloco_loops=2", "--set", "max_steps=4", "--set", "eval_batches=2"]


def run_cli(*args, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "diloco_ray", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("override, words", [
    ("outer_lrr=0.5", ["outer_lrr", "outer_lr"]),
    ("batch_size=zero", ["batch_size", "'zero'", "integer"]),
    ("outer_momentum=1.5", ["outer_momentum", "1.5", "< 1.0"]),
    ("pseudo_grad_compression=zip", ["pseudo_grad_compression", "'zip'", "'int8'"]),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, override, words):
    r = run_cli("train", TINY, "--set", f"output_dir={tmp_path}/out", "--set", override)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0]
    assert not os.path.exists(tmp_path / "out")


def test_missing_config_file(tmp_path):
    r = run_cli("train", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr


def test_help_lists_every_field():
    from diloco_ray.config import FIELD_NAMES

    r = run_cli("train", "--help")
    assert r.returncode == 0
    for name in FIELD_NAMES:
        assert f"  {name} (default" in r.stdout


def test_tiny_default_end_to_end_then_refuses_to_overwrite(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", TINY, "--set", f"output_dir={out}", *QUICK)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "round 2/2" in r.stdout
    for name in ("config.yaml", "metrics.jsonl", "final/config.json", "final/model.safetensors",
                 "final/tokenizer.json"):
        assert (out / name).exists(), name
    before = (out / "metrics.jsonl").read_text()

    again = run_cli("train", TINY, "--set", f"output_dir={out}", *QUICK)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched

    rep = run_cli("report", str(out))
    assert rep.returncode == 0, rep.stderr
    assert (out / "report.png").stat().st_size > 10_000
    assert "2 rounds" in rep.stdout


def test_missing_text_field_in_data_is_exit_2(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n' * 50)
    r = run_cli("train", TINY, "--set", f"output_dir={tmp_path}/out", "--set", "dataset_name=null",
                "--set", f"json_file_path={data}", "--set", "text_field=nope", *QUICK)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "nope" in r.stderr and "question" in r.stderr


def test_report_on_a_folder_without_a_run(tmp_path):
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 2 and "metrics.jsonl" in r.stderr
