"""Typed events write exactly the metrics.jsonl lines they replaced: the same keys (a
field left unset is not written), ``from`` for a keyword, and they travel through Ray."""

import pickle

from diloco_ray.observe.events import (
    CheckpointEvent,
    EarlyStopEvent,
    FaultEvent,
    MembershipEvent,
    ServerEvent,
    StepEvent,
    WarningEvent,
)


def test_each_kind_writes_the_keys_of_its_line():
    assert CheckpointEvent("skipped", path="ck/round-00000002", reason="bad manifest").to_record() == {
        "event": "checkpoint",
        "action": "skipped",
        "path": "ck/round-00000002",
        "reason": "bad manifest",
    }
    assert CheckpointEvent("saved", path="p", round=4, pruned=["q"]).to_record() == {
        "event": "checkpoint",
        "action": "saved",
        "path": "p",
        "round": 4,
        "pruned": ["q"],
    }
    assert MembershipEvent("join", 2, replica_id=5, replicas=3, start_seconds=1.5, nodes=["a1", "b2"]).to_record() == {
        "event": "membership",
        "action": "join",
        "round": 2,
        "replica_id": 5,
        "replicas": 3,
        "start_seconds": 1.5,
        "nodes": ["a1", "b2"],
    }
    assert MembershipEvent("scale", 7, target=4).to_record() == {
        "event": "membership",
        "action": "scale",
        "round": 7,
        "target": 4,
    }
    assert ServerEvent("restart", 3, from_path="ck/round-00000002").to_record() == {
        "event": "server",
        "action": "restart",
        "round": 3,
        "from": "ck/round-00000002",
    }
    assert FaultEvent("driver", "kill", 1).to_record() == {
        "event": "fault",
        "target": "driver",
        "kind": "kill",
        "round": 1,
    }
    assert EarlyStopEvent(6, 0.75, 2).to_record() == {
        "event": "early_stop",
        "round": 6,
        "best_eval_loss": 0.75,
        "patience": 2,
    }
    assert WarningEvent("short", 0).to_record() == {"event": "warning", "message": "short", "round": 0}


def test_a_step_event_travels_as_rank_0_sends_it():
    step = StepEvent(round=1, replica=0, step=10, global_step=40, loss=0.9, lr=1e-3, tokens=640, time=12.5)
    again = pickle.loads(pickle.dumps(step))
    assert again == step and again.to_record() == {
        "event": "step",
        "round": 1,
        "replica": 0,
        "step": 10,
        "global_step": 40,
        "loss": 0.9,
        "lr": 1e-3,
        "tokens": 640,
        "time": 12.5,
    }


def test_an_unset_field_stays_unset_through_pickle():
    leave = pickle.loads(pickle.dumps(MembershipEvent("leave", 3, replica_id=1, reason="failed", replicas=1)))
    assert leave.to_record() == {
        "event": "membership",
        "action": "leave",
        "round": 3,
        "replica_id": 1,
        "reason": "failed",
        "replicas": 1,
    }
