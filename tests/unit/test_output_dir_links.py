"""A shared output_dir with links planted at the names a run writes (no Ray): the lock and
appended files refuse the link in one line naming the file, files replaced in one step
replace the link itself; the file a link points at is never written."""

import json
import os

import pytest
from conftest import ROOT, tiny_config

from diloco_ray import cli
from diloco_ray.errors import ConfigError

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
VICTIM_TEXT = "the victim's own text\n"


@pytest.fixture
def victim(tmp_path):
    """A file outside the run folder that a planted link points at."""
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


@pytest.fixture
def out(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    return folder


def plant(out, name, target):
    link = out / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def one_line_naming(raised, path):
    message = str(raised.value)
    return "\n" not in message and f"'{path}'" in message and "symbolic link" in message


def run_folder(out):
    from diloco_ray.persist.run_folder import RunFolder

    return RunFolder(tiny_config(out).sections().checkpointing, None)


# ----------------------------------------------------------------------------- refused in one line


def test_a_link_at_the_lock_is_refused_and_the_victim_untouched(out, victim):
    link = plant(out, ".diloco-ray.lock", victim)
    with pytest.raises(ConfigError) as raised:
        run_folder(out).lock()
    assert one_line_naming(raised, link)
    assert victim.read_text() == VICTIM_TEXT


def test_train_on_a_folder_with_a_planted_lock_link_is_one_line_exit_2(out, victim, capsys, monkeypatch):
    from diloco_ray.control import ray_connection

    def no_ray(*args, **kwargs):
        raise AssertionError("the run went on past its lock")

    monkeypatch.setattr(ray_connection, "connect", no_ray)
    link = plant(out, ".diloco-ray.lock", victim)
    code = cli.main(["train", TINY, "--set", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"diloco-ray: error: '{link}' is a symbolic link")
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(os.listdir(out)) == [".diloco-ray.lock"]  # nothing else touched


def test_scale_reads_no_lock_through_a_link(out, victim):
    from diloco_ray.persist.run_folder import lock_holder

    link = plant(out, ".diloco-ray.lock", victim)
    with pytest.raises(ConfigError) as raised:
        lock_holder(str(out))
    assert one_line_naming(raised, link)


def test_a_link_at_metrics_jsonl_is_refused_and_the_victim_untouched(out, victim):
    from diloco_ray.observe.metrics import MetricsLogger

    link = plant(out, "metrics.jsonl", victim)
    with pytest.raises(ConfigError) as raised:
        MetricsLogger(str(out))
    assert one_line_naming(raised, link)
    assert victim.read_text() == VICTIM_TEXT


def test_a_link_at_the_ray_log_is_refused_and_the_victim_untouched(out, victim):
    from diloco_ray.observe.ray_output import RAY_LOG, RayOutputFile

    link = plant(out, f"logs/{RAY_LOG}", victim)
    with pytest.raises(ConfigError) as raised:
        RayOutputFile(str(link))
    assert one_line_naming(raised, link)
    assert victim.read_text() == VICTIM_TEXT


# ----------------------------------------------------------------------------- replaced, not followed


def test_config_yaml_never_goes_through_a_link_at_any_name(out, victim, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(VICTIM_TEXT)
    plant(out, "config.yaml.tmp", victim)  # where the write used to go first
    plant(out, "config.yaml", other)
    config = tiny_config(out)
    config.to_yaml(str(out / "config.yaml"))
    assert victim.read_text() == VICTIM_TEXT and other.read_text() == VICTIM_TEXT
    assert not (out / "config.yaml").is_symlink() and "output_dir" in (out / "config.yaml").read_text()


def test_report_png_replaces_a_link_and_the_victim_is_untouched(out, victim):
    from diloco_ray.observe.report import write_report

    (out / "config.yaml").write_text("diloco_loops: 1\n")
    record = {
        "event": "round",
        "round": 0,
        "train_loss": 2.0,
        "eval_loss": 1.5,
        "replicas": 2,
        "dropped": [],
        "tokens": 100,
        "bytes_up": 10,
        "bytes_down": 10,
        "round_seconds": 1.0,
        "sync_seconds": 0.5,
    }
    (out / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    link = plant(out, "report.png", victim)
    write_report(str(out))
    assert victim.read_text() == VICTIM_TEXT
    assert not link.is_symlink() and link.read_bytes().startswith(b"\x89PNG")


def test_a_scale_request_never_goes_through_a_link(out, victim):
    from diloco_ray.persist.run_folder import SCALE_REQUEST_FILE, request_scale

    (out / "metrics.jsonl").write_text("")
    plant(out, f"{SCALE_REQUEST_FILE}.tmp", victim)
    path = request_scale(str(out), 3)
    assert victim.read_text() == VICTIM_TEXT
    assert json.loads(open(path).read())["target"] == 3


def test_rewinding_metrics_never_goes_through_a_link(out, victim):
    from diloco_ray.observe.metrics import truncate_rounds

    (out / "metrics.jsonl").write_text(json.dumps({"event": "round", "round": 0}) + "\n")
    plant(out, "metrics.jsonl.tmp", victim)
    assert truncate_rounds(str(out), 0) == 1
    assert victim.read_text() == VICTIM_TEXT and (out / "metrics.jsonl").read_text() == ""


def test_a_snapshot_marker_never_goes_through_a_link(out, victim):
    import torch

    from diloco_ray.persist import snapshot

    folder = out / "checkpoints" / "inflight" / "round-00000001"
    folder.mkdir(parents=True)
    plant(folder, "slot-0-rank-0-step-2.done.tmp", victim)
    snapshot.save(str(folder), 0, 0, 2, {"w": torch.ones(2)})
    assert victim.read_text() == VICTIM_TEXT and snapshot.intact(str(folder), 0, 0, 2)


def test_clean_up_removes_the_final_folders_temp_copies_and_nothing_else(out, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (".final.0123abcd.tmp", ".final_merged.89abcdef.tmp", "final", "final.tmp"):
        (out / name).mkdir()
    plant(out, ".final.fedcba98.tmp", elsewhere)  # a link is never ours to remove
    removed = run_folder(out).discard_partial_writes()
    assert sorted(os.path.basename(p) for p in removed) == [".final.0123abcd.tmp", ".final_merged.89abcdef.tmp"]
    assert sorted(os.listdir(out)) == [".final.fedcba98.tmp", "final", "final.tmp"]
    assert elsewhere.is_dir()
