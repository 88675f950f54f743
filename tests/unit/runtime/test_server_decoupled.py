"""The server in decoupled mode, in-process: merges one contribution at a time, delayed
Nesterov, in-flight plans and what a checkpoint keeps of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import seal

from diloco_ray.algo import decoupled
from diloco_ray.data import plan as data
from diloco_ray.runtime.messages import Contribution
from tests.unit.runtime.test_server_shards import SHAPES, Sim, max_diff, noise


def merge(sim: Sim, rid: int, buffers, weight: float, divisor: float, plan, unused=None):
    srv = sim.servers[0]
    prepared = srv.prepare(0, [Contribution(rid, buffers[0], weight)], divisor)
    reduced = srv.reduce(prepared)
    applied = srv.commit({rid: plan}, reduced, unused=unused or {}, shares={rid: weight / divisor})
    sim.messages, sim.full = [srv.new_weights_message(0)], False
    return applied


def start_both(sim: Sim) -> tuple[dict, dict]:
    """Replicas 0 and 1 reserve a plan, take in the global weights and train one period
    from them: rid -> plan, rid -> [server][rank] buffers."""
    srv = sim.servers[0]
    plans = {rid: srv.reserve_plan(rid) for rid in (0, 1)}
    bufs = {}
    for rid in (0, 1):
        sim.receive(rid)
        sim.train(rid, 0, 0)
        bufs[rid] = sim.outgoing(rid, 0)
    return plans, bufs


@pytest.mark.parametrize("momentum", ["delayed", "every_step"])
def test_two_merges_from_one_start_make_the_synchronous_round(momentum):
    """Two replicas start from the same weights and are merged one at a time (no staleness
    discount). With delayed Nesterov that is exactly the synchronous round: the weights and
    the data trained agree; applying momentum at every merge does not."""
    ref = Sim(1, 1, 1, 2)
    ref.round(0)
    dec = Sim(1, 1, 1, 2, sync_mode="decoupled", staleness_power=0.0, decoupled_momentum=momentum)
    srv = dec.servers[0]
    plans, bufs = start_both(dec)
    weights = {0: 1.0, 1: 2.0}  # Sim's synchronous round weights replica r by 1 + r
    first = merge(dec, 0, bufs[0], weights[0], 3.0, plans[0])
    second = merge(dec, 1, bufs[1], weights[1], 3.0, plans[1])
    assert (first.round, second.round, second.work) == (0, 1, pytest.approx(1.0))
    assert srv.sync_version() == 2
    diff = max_diff(dec.global_weights(), ref.global_weights())
    if momentum == "delayed":
        assert diff < 1e-6
    else:
        assert diff > 1e-3
    assert srv.plans.cursor == ref.servers[0].plans.cursor
    assert {**first.data_ranges, **second.data_ranges} == ref.history[0][0].data_ranges


def test_a_rejected_or_unfinished_plan_goes_back_and_a_checkpoint_gives_back_in_flight_ones():
    dec = Sim(1, 1, 1, 3, sync_mode="decoupled")
    srv = dec.servers[0]
    plans = {rid: srv.reserve_plan(rid) for rid in (0, 1, 2)}
    with pytest.raises(RuntimeError, match="already has a plan"):
        srv.reserve_plan(0)
    dec.receive(0)
    dec.train(0, 0, 0)
    bufs = dec.outgoing(0, 0)
    per = dec.cfg.sequences_per_replica_round
    tail = data.ranges_of(data.plan_positions(plans[0])[per // 2 :])
    applied = merge(dec, 0, bufs, 1.0, 3.0, plans[0], unused={0: tail})
    assert applied.applied and applied.data_ranges[0] == data.trained_part(plans[0], tail)
    srv.release_plan(1)  # replica 1 died
    assert srv.plans.cursor.returned == data._normalise(tail + plans[1])
    # A checkpoint now: replica 2's plan is still in flight, so the saved cursor holds it too.
    assert srv.resume_cursor().returned == data._normalise(tail + plans[1] + plans[2])
    assert list(srv.plans.in_flight) == [2]
    # A NaN contribution is rejected; its plan goes back and nothing moves.
    before = dec.global_weights()
    dec.receive(2)
    dec.train(2, 0, 0)
    bad = dec.outgoing(2, 0)
    from tests.unit.runtime.test_server_shards import with_value

    bad[0][0] = with_value(bad[0][0])
    rejected = merge(dec, 2, bad, 1.0, 3.0, plans[2])
    assert not rejected.applied and 2 in rejected.rejected
    assert srv.plans.in_flight == {}
    assert srv.plans.cursor.returned == data._normalise(tail + plans[1] + plans[2])
    assert max_diff(before, dec.global_weights()) == 0.0
    assert np.isclose(srv.merged_work(), 1.0 / 3.0)


def test_a_checkpoint_keeps_weights_momentum_work_and_the_cursor_with_in_flight_plans_given_back(tmp_path):
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.errors import ConfigError
    from diloco_ray.runtime.server import ParameterServer

    dec = Sim(1, 1, 1, 2, sync_mode="decoupled")
    srv = dec.servers[0]
    plans = {rid: srv.reserve_plan(rid) for rid in (0, 1)}
    dec.receive(0)
    dec.train(0, 0, 0)
    merge(dec, 0, dec.outgoing(0, 0), 1.0, 2.0, plans[0])  # replica 1 is still in flight
    srv.save(str(tmp_path))
    seal(tmp_path)
    restored = ParameterServer(dec.cfg.to_dict())
    restored.load(str(tmp_path))
    assert restored.merged_work() == pytest.approx(0.5) and restored.sync_version() == 1
    assert restored.plans.in_flight == {} and restored.plans.cursor == srv.resume_cursor()
    assert restored.plans.cursor.returned == plans[1]
    for name, p in srv.store.optimizer.params.items():
        assert torch.equal(restored.store.optimizer.params[name], p)
        mine = srv.store.optimizer._optimizer.state[p]["momentum_buffer"]
        theirs = restored.store.optimizer._optimizer.state[restored.store.optimizer.params[name]]["momentum_buffer"]
        assert torch.equal(mine, theirs) and mine.abs().sum() > 0  # the outer momentum
    sync_cfg = TrainerConfig.from_dict({**dec.cfg.to_dict(), "sync_mode": "sync"})
    with pytest.raises(ConfigError, match="sync_mode: sync, but checkpoint .* sync_mode: decoupled"):
        ParameterServer(sync_cfg.to_dict()).load(str(tmp_path))


@pytest.mark.parametrize("correction", ["none", "momentum"])
def test_a_stale_contribution_is_corrected_against_the_outer_momentum(correction):
    """Replicas 0 and 1 start from the same weights; 0 is merged first (a Nesterov step
    that fills the momentum), then 1, one step stale. With ``stale_correction: momentum``
    each of 1's tensors that points against the momentum loses its component along it
    before the merge; the weights equal that computed by hand with torch's SGD, to 1e-6."""
    lr, beta, step = 0.7, 0.9, 0.01
    dec = Sim(
        1,
        1,
        1,
        2,
        step=step,
        sync_mode="decoupled",
        staleness_power=0.0,
        decoupled_momentum="every_step",
        stale_correction=correction,
        outer_lr=lr,
        outer_momentum=beta,
    )
    srv = dec.servers[0]
    start = dec.global_weights()
    plans, bufs = start_both(dec)
    for rid, staleness in ((0, 0), (1, 1)):
        prepared = srv.prepare(0, [Contribution(rid, bufs[rid][0], 1.0, staleness)], 2.0)
        srv.commit({rid: plans[rid]}, srv.reduce(prepared), unused={}, shares={rid: 0.5})
    # By hand: each merge is one Nesterov SGD step on its pseudo-gradient over 2 (the divisor).
    params = {n: torch.tensor(v, requires_grad=True) for n, v in start.items()}
    opt = torch.optim.SGD(params.values(), lr=lr, momentum=beta, nesterov=True)
    corrected = 0
    for rid in (0, 1):
        for n, p in params.items():
            delta = step * noise(SHAPES, 0, 0, rid)[n]
            if rid == 1 and correction == "momentum":
                corrected += decoupled.correct_stale_(delta, opt.state[p]["momentum_buffer"]) < 0
            p.grad = delta / 2.0
        opt.step()
    if correction == "momentum":
        assert corrected > 0  # some tensors pointed against the momentum (else the test shows nothing)
    assert max_diff(dec.global_weights(), {n: p.detach().numpy() for n, p in params.items()}) < 1e-6


def merge_everywhere(sim: Sim, rid: int, buffers, weight: float, divisor: float, plan):
    """:func:`merge` on every server: each prepares its pieces, all reduce, all commit."""
    prepared = [srv.prepare(0, [Contribution(rid, buffers[s], weight)], divisor) for s, srv in enumerate(sim.servers)]
    reduced = [srv.reduce(*prepared) for srv in sim.servers]
    applied = [srv.commit({rid: plan}, *reduced, unused={}, shares={rid: weight / divisor}) for srv in sim.servers]
    sim.messages, sim.full = [srv.new_weights_message(0) for srv in sim.servers], False
    return applied[0]


def reload_servers(sim: Sim, folder, save: bool = True) -> None:
    """Every server saves into ``folder`` (unless it holds their states already), and new
    servers load from it in their place."""
    from diloco_ray.runtime.server import ParameterServer
    from tests.unit.runtime.test_server_shards import ThroughRay

    for srv in sim.servers if save else ():
        srv.save(str(folder))
    seal(folder)
    sim.servers = [ThroughRay(ParameterServer(sim.cfg.to_dict(), index=s)) for s in range(len(sim.servers))]
    for srv in sim.servers:
        srv.load(str(folder))


@pytest.mark.parametrize("servers, checkpoint", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_with_outer_grad_clip_a_delayed_cycle_is_the_synchronous_clipped_round(tmp_path, servers, checkpoint, fraction):
    """Two replicas from one start, merged one at a time, with ``outer_grad_clip`` at a
    ``fraction`` of the round's gradient norm: the first merge applies its gradient clipped by
    its own norm (the cycle's so far; at 0.5 it is under the clip), the second brings the
    cycle to the round's gradient clipped by the round's norm, gathered over every server's
    rows. The weights are the synchronous clipped round's, also when the servers are
    checkpointed between the merges (the cycle's gradient in the outer state, its clip
    coefficient in the position)."""
    ref = Sim(servers, 1, 1, 2)
    ref.round(0)
    clip = fraction * ref.history[0][0].pseudo_grad_norm
    ref = Sim(servers, 1, 1, 2, outer_grad_clip=clip)
    ref.round(0)
    dec = Sim(servers, 1, 1, 2, sync_mode="decoupled", staleness_power=0.0, outer_grad_clip=clip)
    plans, bufs = start_both(dec)
    first = merge_everywhere(dec, 0, bufs[0], 1.0, 3.0, plans[0])
    coef = [srv.store.cycle_clip for srv in dec.servers]
    assert coef == [pytest.approx(min(1.0, clip / first.pseudo_grad_norm), rel=1e-3)] * servers  # (norm + 1e-6)
    assert (coef[0] < 1.0) == (fraction == 0.25)
    if checkpoint:
        reload_servers(dec, tmp_path)
        assert [srv.store.cycle_clip for srv in dec.servers] == coef
    merge_everywhere(dec, 1, bufs[1], 2.0, 3.0, plans[1])
    assert max_diff(dec.global_weights(), ref.global_weights()) < 1e-6
    for srv in dec.servers:  # the cycle ended: its gradient and coefficient start over
        assert srv.store.cycle_clip == 1.0
        assert all(not srv.store.optimizer.cycle_grad(n).any() for n in srv.store.optimizer.params)


def test_a_checkpoint_without_a_cycle_clip_loads_at_a_cycle_clip_of_1(tmp_path):
    """A checkpoint written before the cycle was clipped (no ``cycle_clip`` in its meta, no
    cycle gradient in its outer state) resumes with ``outer_grad_clip`` on: the cycle so far
    counts as unclipped, and the next merge clips the rest of it by its own norm."""
    import json

    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.persist.server_state import file_names

    dec = Sim(1, 1, 1, 2, sync_mode="decoupled", staleness_power=0.0)
    plans, bufs = start_both(dec)
    merge_everywhere(dec, 0, bufs[0], 1.0, 3.0, plans[0])
    dec.servers[0].save(str(tmp_path))
    meta_file = tmp_path / file_names(0, 1)[2]
    meta = json.loads(meta_file.read_text())
    del meta["cycle_clip"]
    meta_file.write_text(json.dumps(meta))
    dec.cfg = TrainerConfig.from_dict({**dec.cfg.to_dict(), "outer_grad_clip": 1e-4})
    reload_servers(dec, tmp_path, save=False)
    store = dec.servers[0].store
    assert store.cycle_clip == 1.0 and all(store.optimizer.cycle_grad(n) is None for n in store.optimizer.params)
    merged = merge_everywhere(dec, 1, bufs[1], 2.0, 3.0, plans[1])
    assert merged.applied and merged.work == pytest.approx(1.0) and store.cycle_clip == 1.0
    assert all(np.isfinite(w).all() for w in dec.global_weights().values())


def test_a_cycle_whose_norm_passes_fp32s_range_is_not_merged():
    """Clipped by the cycle, the cycle's gradient is summed in fp32: a merge that would take
    the cycle's norm past fp32's largest value (the only way an entry of it can overflow) is
    rejected for every replica in it, as a mean past fp32's range is; below it, the agreement
    carries the cycle's norm over every server's parts."""
    from diloco_ray.runtime.messages import Reduced
    from diloco_ray.runtime.server_aggregator import CYCLE_OVERFLOWS, Agreement

    big = float(torch.finfo(torch.float32).max) ** 2

    def agree(cycle_parts):
        return Agreement.of(
            [Reduced([0, 1], [(0, 0, 1.0)], {}, 0.0, [(0, 0, cycle_parts[0])]), Reduced([0, 1], [], {}, 0.0, [])]
        )

    fine = agree([9.0])
    assert fine.accepted == [0, 1] and fine.cycle_norm == 3.0 and fine.norm == 1.0
    over = agree([big])
    assert over.accepted == [] and over.norm is None and over.cycle_norm is None
    assert over.rejected == {0: CYCLE_OVERFLOWS, 1: CYCLE_OVERFLOWS}
    plain = Agreement.of([Reduced([0], [(0, 0, 4.0)], {}, 0.0)])  # no cycle parts: none asked for
    assert plain.cycle_norm is None and plain.norm == 2.0
