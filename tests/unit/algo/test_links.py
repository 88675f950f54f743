"""Unit tests for diloco_ray.algo.links: simulated link timing with a fake clock."""

from __future__ import annotations

import pytest

from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.links import Link, arrival, link_for_slot, stamp, wait_for


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


# ---------------------------------------------------------------------------------- Link


def test_seconds_is_latency_plus_serialisation():
    link = Link(mbps=8.0, latency_ms=20.0)
    # 1 MB at 8 Mbit/s = 1 s, plus 20 ms.
    assert link.seconds(1_000_000) == pytest.approx(1.02, abs=1e-12)
    assert link.seconds(0) == pytest.approx(0.02, abs=1e-12)
    assert Link(mbps=100.0).seconds(125_000) == pytest.approx(0.01, abs=1e-12)


def test_unlimited_rate_is_latency_only():
    assert Link(mbps=None, latency_ms=35.0).seconds(10**12) == pytest.approx(0.035, abs=1e-12)
    assert Link().seconds(10**9) == 0.0


# ------------------------------------------------------------------------- link_for_slot


def test_no_link_when_not_simulated():
    assert link_for_slot(None, 0.0, 0) is None
    assert link_for_slot(None, 0, 5) is None


def test_one_rate_for_every_slot():
    for slot in (0, 1, 7):
        assert link_for_slot(50, 10.0, slot) == Link(mbps=50.0, latency_ms=10.0)


def test_latency_alone():
    assert link_for_slot(None, 12.5, 3) == Link(mbps=None, latency_ms=12.5)


def test_rate_per_slot_and_last_for_the_rest():
    rates = [10.0, 20.0, 30.0]
    assert [link_for_slot(rates, 1.0, s).mbps for s in range(5)] == [10.0, 20.0, 30.0, 30.0, 30.0]
    assert link_for_slot((5, 6), 0.0, 1) == Link(mbps=6.0, latency_ms=0.0)
    assert isinstance(link_for_slot([7], 0.0, 0).mbps, float)


# ----------------------------------------------------------------------- stamp / arrival


def test_stamp_and_arrival_round_trip():
    clock = FakeClock(500.0)
    link = Link(mbps=16.0, latency_ms=50.0)
    meta = stamp(link, 2_000_000, clock=clock)
    assert meta == {"sent_at": 500.0, "link_bytes": 2_000_000, "mbps": 16.0, "latency_ms": 50.0}
    # 2 MB at 16 Mbit/s = 1 s; + 50 ms.
    assert arrival(meta) == pytest.approx(501.05, abs=1e-9)
    assert arrival(stamp(Link(latency_ms=30.0), 10**9, clock=clock)) == pytest.approx(500.03, abs=1e-9)


def test_stamp_without_link_is_empty():
    assert stamp(None, 123, clock=FakeClock()) == {}
    assert arrival({}) is None
    assert arrival({"rows": {}, "version": 3}) is None


def test_stamp_survives_the_wire_format():
    from diloco_ray.algo import compression, wire_layout

    clock = FakeClock(42.0)
    meta = stamp(Link(mbps=1.0, latency_ms=2.0), 1000, clock=clock)
    buf = compression.pack({}, Codec("none"), meta)
    assert arrival(wire_layout.packed_meta(buf)) == pytest.approx(42.0 + 0.002 + 0.008, abs=1e-12)


# ------------------------------------------------------------------------------ wait_for


def test_wait_for_sleeps_until_the_latest_arrival():
    clock = FakeClock(100.0)
    slept = wait_for([100.5, None, 102.0, 101.0], clock=clock, sleep=clock.sleep)
    assert slept == pytest.approx(2.0)
    assert clock.slept == [pytest.approx(2.0)]
    assert clock.now == pytest.approx(102.0)


def test_wait_for_does_not_sleep_when_already_arrived():
    clock = FakeClock(100.0)
    assert wait_for([99.0, 100.0], clock=clock, sleep=clock.sleep) == 0.0
    assert clock.slept == []


def test_wait_for_ignores_nones():
    clock = FakeClock(100.0)
    assert wait_for([], clock=clock, sleep=clock.sleep) == 0.0
    assert wait_for([None, None], clock=clock, sleep=clock.sleep) == 0.0
    assert clock.slept == []


def test_wait_for_a_stamped_message():
    clock = FakeClock(10.0)
    meta = stamp(Link(mbps=8.0, latency_ms=100.0), 500_000, clock=clock)  # 0.5 s + 0.1 s
    clock.now += 0.2  # the receiver gets to it 0.2 s later
    slept = wait_for([arrival(meta)], clock=clock, sleep=clock.sleep)
    assert slept == pytest.approx(0.4)
    assert clock.now == pytest.approx(10.6)
