"""A re-run of a round on one in-process rank (no Ray): it must start from the global
weights and the inner state of the round's start, so it sends exactly the first
attempt's pseudo-gradient, however the first attempt ended."""

import dataclasses

import pytest
import torch
from conftest import tiny_config, whole_period

from diloco_ray.algo import compression
from diloco_ray.runtime.messages import PeriodId, SyncPeriod
from diloco_ray.runtime.rank import RankWorker


def rank(tmp_path, **overrides):
    cfg = tiny_config(tmp_path, max_steps=3, diloco_loops=2, **overrides)
    w = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
    w.setup()
    return w


def period(w, job_over=None):
    """Round 1's only sync period, from the weights of version 0."""
    job = SyncPeriod(period=PeriodId(1, 0, 7), plan=[(0, 12)], messages=[w._start], full=True, version=0)
    job = dataclasses.replace(job, **(job_over or {}))
    buffers, stats = whole_period(w, job)
    grads = {}
    for buf in (b for b in buffers if len(b)):  # an aborted period sends empty buffers
        grads.update({n: t.clone() for n, (_, t) in compression.unpack_pieces(buf, w.sync.names)[0].items()})
    return grads, stats


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_rerun_sends_the_first_attempts_pseudo_gradient(tmp_path, codec):
    w = rank(tmp_path, pseudo_grad_compression=codec, error_feedback=codec != "none")
    w._start = w.seed_pieces()  # one server: one bare buffer
    first, stats = period(w)
    assert not stats.restarted and stats.inner_steps == 3
    again, stats = period(w, {"restart": True, "period": PeriodId(1, 0, 8)})  # same version: nothing new to load
    assert stats.restarted and stats.inner_steps == 3  # not stopped by an old abort either
    for name in first:
        assert torch.equal(first[name], again[name]), name


def test_rerun_after_an_abort_is_not_aborted(tmp_path):
    w = rank(tmp_path)
    w._start = w.seed_pieces()  # one server: one bare buffer
    w.abort(7)
    _, stats = period(w)
    assert stats.aborted and stats.inner_steps == 0
    _, stats = period(w, {"restart": True, "period": PeriodId(1, 0, 8)})
    assert not stats.aborted and stats.inner_steps == 3


def test_reset_inner_gives_a_fresh_optimizer(tmp_path):
    w = rank(tmp_path)
    w._start = w.seed_pieces()  # one server: one bare buffer
    period(w)
    assert w.state.optimizer.state  # AdamW moments after a round
    for state in w.state.optimizer.state.values():
        state["exp_avg_sq"].fill_(float("nan"))
    _, stats = period(w, {"restart": True, "reset_inner": True, "period": PeriodId(1, 0, 8)})
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in w.state.optimizer.state.values())
