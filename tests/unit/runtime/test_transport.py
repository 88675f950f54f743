"""transport.receive: buffers come back as sent, held until a simulated link delivers them."""

import time

import pytest
import torch

from diloco_ray.algo import compression, links
from diloco_ray.runtime import transport


@pytest.fixture
def slept(monkeypatch):
    """The seconds transport.receive asked to sleep (nothing sleeps for real)."""
    calls = []
    real = links.wait_for
    monkeypatch.setattr(links, "wait_for", lambda arrivals: real(arrivals, sleep=calls.append))
    return calls


def message(meta):
    return compression.pack({"w": torch.ones(1000)}, "none", meta)


def test_unstamped_buffers_come_back_at_once(slept):
    bufs = [message({"version": 1}), message({}), message({"sent_at": time.time() + 60})]
    got = transport.receive(bufs)
    # a bare sent_at (the servers stamp every weights message) is not a link stamp
    assert [b is a for a, b in zip(bufs, got)] == [True] * 3 and slept == []


def test_a_stamped_uplink_holds_until_its_latest_arrival(slept):
    link = links.Link(mbps=8.0, latency_ms=100.0)  # 1 MB/s
    now = time.time()
    early = message(links.stamp(link, 100_000, clock=lambda: now - 10))  # arrived long ago
    late = message(links.stamp(link, 1_000_000, clock=lambda: now))  # 0.1 s + 1 s from now
    transport.receive([early, late])
    assert len(slept) == 1 and 1.0 < slept[0] <= 1.1


def test_the_readers_own_downlink_counts_every_byte_it_reads(slept):
    link = links.Link(mbps=8.0)
    bufs = [message({"sent_at": time.time()}) for _ in range(2)]  # the servers' stamp
    transport.receive(bufs, link)
    expected = sum(len(b) for b in bufs) / 1e6  # bytes at 1 MB/s
    assert len(slept) == 1 and expected * 0.95 < slept[0] <= expected


def test_prefetch_starts_the_download_of_refs_without_waiting(monkeypatch):
    """An overlapped merge reads its message after the next inner steps; prefetch asks Ray to
    bring the objects here at once (fetch_local, no wait), so the download runs beside the
    steps over a real link. Buffers already in hand are left alone."""
    import ray

    asked = []
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: asked.append((refs, kw)) or (refs, []))
    refs = [ray.ObjectRef(b"\x01" * 28), ray.ObjectRef(b"\x02" * 28)]
    transport.prefetch([refs[0], b"buffer", refs[1]])
    assert asked == [(refs, {"num_returns": 2, "timeout": 0, "fetch_local": True})]
    transport.prefetch([b"buffer"])  # nothing to fetch: Ray is not asked
    assert len(asked) == 1
