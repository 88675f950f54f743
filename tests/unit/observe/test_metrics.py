"""metrics.jsonl and the trackers: every event lands, round records can be rewound."""

import glob
import json

import pytest

from diloco_ray.observe.metrics import MetricsLogger, read_events


def round_record(r):
    return {"event": "round", "round": r, "train_loss": 1.0 / (r + 1), "eval_loss": None, "replica_ids": [0]}


def test_jsonl_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(
        str(tmp_path),
        ["tensorboard", "wandb"],
        None,
        {"seed": 1},
        wandb_settings={"project": "proj-x", "name": "run-y", "tags": ["a", "b"], "entity": None},
    )
    run = logger._wandb
    assert (run.project, run.name, tuple(run.tags)) == ("proj-x", "run-y", ("a", "b"))
    logger.log({"event": "membership", "action": "join", "replica_id": 0})
    for r in range(3):
        logger.log(
            {
                "event": "step",
                "round": r,
                "replica": 1,
                "step": 4,
                "global_step": 4 * r + 4,
                "loss": 2.0 - r,
                "lr": 1e-3,
                "tokens": 100,
            }
        )
        logger.log(round_record(r))
    logger.close()
    logger.close()  # closing twice is harmless
    events = read_events(str(tmp_path))
    assert [e["event"] for e in events] == ["membership"] + ["step", "round"] * 3
    assert all("time" in e for e in events)
    tb = EventAccumulator(str(tmp_path / "logs"))
    tb.Reload()
    expected = [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [(e.step, e.value) for e in tb.Scalars("round/train_loss")] == expected
    loss = tb.Scalars("inner/replica1/loss")
    assert [(e.step, e.value) for e in loss] == [(4, 2.0), (8, 1.0), (12, 0.0)]
    assert "round/round" not in tb.Tags()["scalars"]
    assert glob.glob(str(tmp_path / "logs" / "wandb" / "offline-run-*" / "run-*.wandb"))


def test_truncate_rounds_keeps_other_events_and_appending_continues(tmp_path):
    logger = MetricsLogger(str(tmp_path))
    for r in range(4):
        logger.log(round_record(r))
    logger.log({"event": "checkpoint", "action": "saved", "round": 4})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"event": "round", "rou')  # a line torn by a crash
    assert logger.truncate_rounds(2) == 3
    logger.log(round_record(2))
    logger.close()
    rounds = [e["round"] for e in read_events(str(tmp_path), "round")]
    assert rounds == [0, 1, 2]
    assert [e["event"] for e in read_events(str(tmp_path))].count("checkpoint") == 1
    with open(tmp_path / "metrics.jsonl") as f:
        assert all(json.loads(line) for line in f)  # no torn line left
