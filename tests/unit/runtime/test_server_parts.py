"""The parameter server's parts on their own (no Ray, no actor): the sum space, the
aggregator's agreement, the store's position through a round, the plan ledger."""

from __future__ import annotations

import numpy as np
import pytest

from diloco_ray.algo.outer import OuterOptimizer
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.data import plan as data
from diloco_ray.runtime.messages import Reduced
from diloco_ray.runtime.server_aggregator import Aggregator, Agreement, PendingSync, SumSpace
from diloco_ray.runtime.server_codec import SliceCodec
from diloco_ray.runtime.server_store import PlanLedger, SliceStore
from tests.unit.runtime.test_server_shards import SHAPES, initial_weights, make_config


def test_the_sum_space_is_reused_zeroed_and_grows_only_when_it_must():
    space = SumSpace()
    first = space.zeroed({"a": (2, 3), "b": ()})
    first["a"].fill_(7.0)
    again = space.zeroed({"a": (2, 3)})
    assert again["a"].data_ptr() == first["a"].data_ptr() and again["a"].abs().sum() == 0
    assert space.as_bytes(28).ctypes.data == first["a"].data_ptr()  # 7 floats fit: the same memory
    bigger = space.zeroed({"a": (4, 4)})
    assert bigger["a"].shape == (4, 4) and bigger["a"].abs().sum() == 0


def test_a_message_takes_the_sum_space_only_while_no_sum_is_pending():
    layout = SliceLayout(SHAPES, 0, 1, 1)
    aggregator = Aggregator(layout, SliceCodec(layout))
    space = aggregator.space.as_bytes(8).ctypes.data
    assert aggregator.message_space(8).ctypes.data == space
    aggregator.pending = PendingSync(0, [], [], 0.0)
    assert aggregator.message_space(8).ctypes.data != space


def test_the_agreement_norm_does_not_depend_on_the_server_order():
    parts = [[(0, 0, 4.0), (2, 0, 1.0)], [(1, 0, 4.0)]]
    reduced = [Reduced(accepted=[0, 1], sumsq=p, reasons={}, started=1.0) for p in parts]
    one, other = Agreement.of(reduced), Agreement.of(reduced[::-1])
    assert one.norm == other.norm == 3.0 and one.accepted == [0, 1]
    nobody = Agreement.of([Reduced(accepted=[], sumsq=[(0, 0, 4.0)], reasons={1: "x"}, started=1.0)])
    assert nobody.norm is None and nobody.rejected == {1: "x"}


def store(fragments: int) -> SliceStore:
    layout = SliceLayout(SHAPES, 0, 1, fragments)
    cfg = make_config(sync_fragments=fragments)
    return SliceStore(layout, OuterOptimizer(layout.split(initial_weights()), cfg), fragments)


def test_a_round_of_fragments_advances_version_fragment_and_round_together():
    s = store(2)
    assert s.advance([0, 1]) is None and (s.fragment, s.version, s.round) == (1, 1, 0)
    assert s.advance([1, 2]) == {0, 1, 2}  # data counts as trained once any fragment was applied
    assert (s.fragment, s.version, s.round, s.round_accepted) == (0, 2, 1, None)
    position = s.position()
    other = store(2)
    other.restore_position(position)
    assert other.position() == position


def test_plain_diloco_with_nothing_accepted_keeps_the_version():
    s = store(1)
    assert s.advance([]) == set() and (s.version, s.round) == (0, 1)


def test_the_ledger_settles_a_merge_and_gives_back_what_was_not_trained():
    ledger = PlanLedger(lambda rid: 8, owner="server 0")
    plans = {rid: ledger.reserve(rid) for rid in (0, 1)}
    with pytest.raises(RuntimeError, match="server 0: replica 0 already has a plan in flight"):
        ledger.reserve(0)
    unused = {0: data.ranges_of(data.plan_positions(plans[0])[6:])}
    consumed = ledger.settle_merge({0: plans[0]}, [0], unused)
    assert consumed == {0: data.trained_part(plans[0], unused[0])}
    assert ledger.cursor.returned == unused[0] and list(ledger.in_flight) == [1]
    assert ledger.resume_cursor().returned == data._normalise(unused[0] + plans[1])
    ledger.release(1)
    assert ledger.in_flight == {} and ledger.cursor == ledger.resume_cursor()


def test_a_rounds_commit_consumes_the_trained_plans_only():
    ledger = PlanLedger(lambda rid: 4, owner="server 0")
    plans = dict(zip((0, 1), ledger.plan_round([0, 1])))
    consumed = ledger.commit_round(plans, {0}, {})
    assert consumed == {0: plans[0]} and ledger.cursor.returned == plans[1]
    assert np.array_equal(np.asarray(ledger.plan_round([1])[0]), np.asarray(plans[1]))
