"""Unit tests for diloco_ray.observe.records: the round record from sync reports (no Ray)."""

import pytest

from diloco_ray.algo.outer import Rejected, Rejection
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.observe.records import round_record
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


def test_streaming_round_record():
    cfg = TrainerConfig(
        model_config={"model_type": "llama"},
        dataset_name="builtin:arithmetic",
        tokenizer_name="builtin:char",
        max_steps=7,
        sync_fragments=2,
    )
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
    record = round_record(cfg, applied, reported, late=set(), failed={7})
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
