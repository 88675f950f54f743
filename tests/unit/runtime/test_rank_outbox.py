"""A period's messages leaving by their own call: the outbox between the two calls, and an
in-process rank whose period returns its stats alone while its messages come by
:meth:`RankWorker.message`, with and without ``overlap_communication`` (one protocol)."""

import dataclasses
import threading

import numpy as np
import pytest
import torch
from conftest import tiny_config

from diloco_ray.algo import device_copy
from diloco_ray.runtime.messages import PeriodId, RoundStats, SyncPeriod
from diloco_ray.runtime.rank import RankWorker
from diloco_ray.runtime.rank_outbox import Outbox, PeriodFailed


def copy_of(*values):
    return device_copy.DownCopy([torch.tensor(values, dtype=torch.uint8)])


def test_a_send_waits_for_its_period_and_takes_its_messages():
    box, got = Outbox(), []
    taker = threading.Thread(target=lambda: got.append(box.take(3).wait()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not got  # nothing posted yet: it waits
    box.post(3, copy_of(1, 2))
    taker.join(5)
    assert [a.tolist() for a in got[0]] == [[1, 2]]


def test_sends_pair_with_periods_in_launch_order_whatever_the_counters():
    box = Outbox()
    box.post(9, copy_of(9))
    box.post(2, copy_of(2))  # a home restarted from a checkpoint counts again from there
    box.post(5, None)  # a stopped period sends nothing
    assert box.take(9).wait()[0].tolist() == [9]
    assert box.take(2).wait()[0].tolist() == [2]
    assert box.take(5) is None


def test_a_failed_period_fails_its_send_and_only_its_send():
    box = Outbox()
    box.fail(4, "ValueError: bad batch")
    box.post(5, copy_of(5))
    with pytest.raises(PeriodFailed, match="launch 4 sent nothing: ValueError: bad batch"):
        box.take(4)
    assert box.take(5).wait()[0].tolist() == [5]


def test_a_period_that_never_ran_fails_its_send_and_leaves_the_next_ones_messages():
    box = Outbox()
    box.post(6, copy_of(6))  # the period of launch 5 never started here
    with pytest.raises(PeriodFailed, match="launch 6 ran in its place"):
        box.take(5)
    assert box.take(6).wait()[0].tolist() == [6]


def worker(tmp_path, overlap: bool) -> RankWorker:
    cfg = tiny_config(tmp_path, max_steps=4, diloco_loops=2, sync_fragments=2, overlap_communication=overlap)
    w = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
    w.setup()
    return w


def test_the_period_returns_its_stats_and_the_send_its_bytes_with_or_without_overlap(tmp_path):
    apart, together = worker(tmp_path / "a", overlap=True), worker(tmp_path / "b", overlap=False)
    start = together.seed_pieces()
    job = SyncPeriod(period=PeriodId(0, 0, 3), plan=[(0, 16)], messages=[start], full=True, version=0)
    without = together.run_period(job)
    returned = apart.run_period(job)
    assert isinstance(returned, RoundStats) and isinstance(without, RoundStats)  # the stats alone
    sent = apart.message(3)  # one server: one bare buffer
    # A full load merges at once with overlap too: the same period, the same bytes.
    assert np.array_equal(sent, together.message(3)) and returned.bytes_up == sent.nbytes == without.bytes_up

    apart.abort(4)  # a stopped period: an empty buffer per server (the return count is fixed)
    assert apart.run_period(dataclasses.replace(job, period=PeriodId(0, 0, 4), full=False, messages=[])).aborted
    assert apart.message(4).nbytes == 0

    with pytest.raises(Exception):  # a period that raises fails its send too, not the next one's
        apart.run_period(dataclasses.replace(job, period=PeriodId(0, 0, 5), plan=None))
    with pytest.raises(PeriodFailed, match="launch 5"):
        apart.message(5)
