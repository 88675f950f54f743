"""metrics.jsonl and the trackers: every event lands, round records can be rewound."""

import glob
import json
import os

from diloco_ray.metrics import MetricsLogger, read_events


def round_record(r):
    return {"event": "round", "round": r, "train_loss": 1.0 / (r + 1), "eval_loss": None, "replica_ids": [0]}


def test_jsonl_tensorboard_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(str(tmp_path), ["tensorboard", "wandb"], None, {"seed": 1})
    logger.log({"event": "membership", "action": "join", "replica_id": 0})
    for r in range(3):
        logger.log(round_record(r))
    logger.close()
    events = read_events(str(tmp_path))
    assert [e["event"] for e in events] == ["membership", "round", "round", "round"]
    assert all("time" in e for e in events)
    assert glob.glob(str(tmp_path / "logs" / "events.out.tfevents.*"))
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*"))


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
