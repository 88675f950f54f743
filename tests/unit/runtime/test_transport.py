"""transport.receive: buffers come back as sent, held until a simulated link delivers them."""

import pytest
import torch

from diloco_ray.algo import compression, links, wire_layout
from diloco_ray.algo.codecs import Codec
from diloco_ray.runtime import transport

NOW = 1_800_000_000.0  # the wall clock, as the tests' links read it: the same however long a test takes


@pytest.fixture
def slept(monkeypatch):
    """The seconds transport.receive asked to sleep (nothing sleeps for real), on a clock
    that stands at NOW."""
    calls = []
    real = links.wait_for
    monkeypatch.setattr(links, "wait_for", lambda arrivals: real(arrivals, sleep=calls.append, clock=lambda: NOW))
    return calls


def message(meta):
    return compression.pack({"w": torch.ones(1000)}, Codec("none"), meta)


def test_unstamped_buffers_come_back_at_once(slept):
    bufs = [message({"version": 1}), message({}), message({"sent_at": NOW + 60})]
    got = transport.receive(bufs)
    # a bare sent_at (the servers stamp every weights message) is not a link stamp
    assert [b is a for a, b in zip(bufs, got)] == [True] * 3 and slept == []


def test_a_stamped_uplink_holds_until_its_latest_arrival(slept):
    link = links.Link(mbps=8.0, latency_ms=100.0)  # 1 MB/s
    early = message(links.stamp(link, 100_000, clock=lambda: NOW - 10))  # arrived long ago
    late = message(links.stamp(link, 1_000_000, clock=lambda: NOW))  # 0.1 s + 1 s from now
    transport.receive([early, late])
    assert slept == [pytest.approx(1.1, abs=1e-6)]


def test_the_readers_own_downlink_counts_every_byte_it_reads(slept):
    link = links.Link(mbps=8.0)
    bufs = [message({"sent_at": NOW}) for _ in range(2)]  # the servers' stamp
    transport.receive(bufs, link)
    assert slept == [pytest.approx(sum(len(b) for b in bufs) / 1e6, abs=1e-6)]  # bytes at 1 MB/s


def test_prefetch_fetches_in_another_thread_and_receive_takes_its_result(monkeypatch):
    """An overlapped merge reads its message after the next inner steps; prefetch starts the
    fetch at once in a thread of its own (Ray drops a ray.wait's pull of an object not made
    yet), and receive takes the buffers it fetched. Buffers already in hand pass through."""
    import threading

    import ray

    fetched_in = []

    def get(refs):
        fetched_in.append(threading.current_thread().name)
        return [b"from " + bytes(r.binary()[:1]) for r in refs]

    monkeypatch.setattr(ray, "get", get)
    msg = compression.pack({"w": torch.ones(3)}, Codec("none"))[0]
    ref = ray.ObjectRef(b"\x01" * 28)
    future = transport.prefetch([ref, msg])
    monkeypatch.setattr(transport, "resolve", lambda items: pytest.fail("receive fetched again"))
    monkeypatch.setattr(wire_layout, "packed_meta", lambda b: {})
    assert transport.receive(future) == [b"from \x01", msg]
    assert fetched_in == ["diloco-prefetch"]
