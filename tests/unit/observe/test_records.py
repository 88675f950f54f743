"""Unit tests for diloco_ray.observe.records: the round record from sync reports (no Ray)."""

import pytest

from diloco_ray.algo.outer import Rejected, Rejection
from diloco_ray.observe.records import Evaluation, MergeFacts, RoundRecord, Syncs, Timing
from diloco_ray.runtime.messages import AppliedRound, RoundStats


def stats(rank, up, down, steps=3, compute=1.0):
    return RoundStats(
        rank=rank,
        inner_steps=steps,
        tokens=100,
        loss_sum=2.0 * steps,
        compute_seconds=compute,
        load_seconds=0.0,
        bytes_up=up,
        bytes_down=down,
    )


def build(syncs, max_steps=3, sync_fragments=1, **facts):
    """A record from plain values: the round's shape is all it reads of the config."""
    timing = Timing(round_seconds=3.0, until_applied=2.5)
    return RoundRecord.build(
        syncs, 0, Evaluation(), timing, max_steps=max_steps, sync_fragments=sync_fragments, **facts
    )


def test_streaming_round_record():
    # Replica 1 is rejected in the first sync, so only replica 0 counts for the round.
    applied = [
        AppliedRound(
            applied=True,
            round=4,
            fragment=0,
            outer_lr=0.7,
            pseudo_grad_norm=3.0,
            accepted=[0],
            rejected={1: Rejected(Rejection.NON_FINITE, "non-finite values in 'w'")},
            seconds=0.5,
        ),
        AppliedRound(
            applied=True,
            round=4,
            fragment=1,
            outer_lr=0.7,
            pseudo_grad_norm=4.0,
            accepted=[0, 1],
            data_ranges={0: [[0, 8]]},
            round_done=True,
            seconds=0.25,
        ),
    ]
    reported = [
        {0: [stats(0, 100, 1000), stats(1, 110, 1000)], 1: [stats(0, 90, 1000), stats(1, 80, 1000)]},
        {0: [stats(0, 10, 50, steps=4)], 1: [stats(0, 20, 60, steps=4, compute=2.5)]},
    ]
    record = build(Syncs(applied, reported, late=set(), failed={7}), max_steps=7, sync_fragments=2).to_record()
    assert [f["step"] for f in record["fragments"]] == [3, 7]  # floor((k+1) * 7 / 2)
    assert [f["bytes_up"] for f in record["fragments"]] == [380, 30]
    assert [f["bytes_down"] for f in record["fragments"]] == [2000, 110]  # one rank per replica
    assert record["bytes_up"] == 410 and record["peak_bytes_up"] == 380 and record["peak_bytes_down"] == 2000
    assert record["replicas"] == 1 and record["replica_ids"] == [0]
    assert record["dropped"] == [1, 7] and record["rejected"] == {"1": "non-finite values in 'w'"}
    assert record["pseudo_grad_norm"] == pytest.approx(5.0)
    assert record["tokens"] == 300 and record["train_loss"] == pytest.approx(2.0)
    assert record["compute_seconds"] == pytest.approx(2.0)  # replica 0: 1.0 + 1.0
    assert record["data_ranges"] == {"0": [[0, 8]]}


SYNC_KEYS = [
    "event", "round", "replicas", "replica_ids", "dropped", "late", "rejected", "inner_steps", "replica_steps",
    "tokens", "train_loss", "outer_lr", "pseudo_grad_norm", "data_ranges", "resumed_steps", "bytes_up", "bytes_down",
    "peak_bytes_up", "peak_bytes_down", "fragments", "compute_seconds", "wasted_steps", "eval_loss", "eval_ppl",
    "round_seconds", "sync_seconds", "eval_seconds", "eval_bytes_down",
]  # fmt: skip
MERGE_KEYS = ["sync_mode", "staleness", "applied_weight", "in_flight", "work", "merge_seconds"]


def one_sync(**applied):
    info = AppliedRound(True, 2, 0, 0.7, 3.0, accepted=[0], data_ranges={0: [[0, 4]]}, round_done=True, **applied)
    return Syncs([info], [{0: [stats(0, 10, 20, compute=1.5)]}])


def test_a_round_record_has_its_keys_in_order_with_eval_and_timing():
    evaluation = Evaluation(loss=1.0, seconds=0.25, bytes_down=64)
    timing = Timing(round_seconds=3.0, until_applied=2.5)
    record = RoundRecord.build(one_sync(), 5, evaluation, timing, max_steps=3, sync_fragments=1).to_record()
    assert list(record) == SYNC_KEYS
    assert (
        record["eval_loss"] == 1.0
        and record["eval_ppl"] == pytest.approx(2.718281828)
        and record["eval_seconds"] == 0.25
    )
    assert record["eval_bytes_down"] == 64 and record["wasted_steps"] == 5 and record["round_seconds"] == 3.0
    assert record["sync_seconds"] == pytest.approx(1.0)  # 2.5 s to the update, 1.5 of it inner steps
    assert record["fragments"] == [
        {
            "fragment": 0,
            "step": 3,
            "replicas": 1,
            "bytes_up": 10,
            "bytes_down": 20,
            "pseudo_grad_norm": 3.0,
            "seconds": 0.0,
        }
    ]


def test_a_merge_record_adds_the_merge_facts_and_at_the_end_the_abandoned_steps():
    facts = MergeFacts(staleness={"0": 1}, applied_weight=0.5, in_flight=[1], work=2.5, merge_seconds=0.1)
    record = build(one_sync(), merge=facts).to_record()
    assert list(record) == SYNC_KEYS + MERGE_KEYS
    assert record["sync_mode"] == "decoupled" and record["staleness"] == {"0": 1} and record["work"] == 2.5
    last = build(one_sync(), merge=facts, abandoned_steps=0).to_record()
    assert list(last) == SYNC_KEYS + MERGE_KEYS + ["abandoned_steps"] and last["abandoned_steps"] == 0
