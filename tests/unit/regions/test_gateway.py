"""The home's gateway, without a channel or Ray: what a region's period does when the
weights it needs cannot be had."""

from __future__ import annotations

import threading

import pytest
import ray
from ray.exceptions import RayActorError

from diloco_ray.regions import gateway as gateway_module
from diloco_ray.regions.gateway import RegionGateway, WeightsLost
from diloco_ray.runtime.messages import PeriodId, SyncPeriod


class Channel:
    """The channel's calls the gateway makes during a period; the region never replies."""

    regions = ("eu",)

    def __init__(self):
        self.notified, self.discarded, self.published, self.voided, self.takes = [], [], [], [], 0

    def connected(self, ready: bool = False):
        return {"eu"}

    def instance_of(self, region):
        return "agent-1"

    def traffic(self, region):
        return (0, 0)

    def expect(self, region, key):
        pass

    def notify(self, region, notice):
        self.notified.append((region, notice))

    def publish(self, key, payload):
        self.published.append(key)

    def take(self, key, timeout_s):
        self.takes += 1
        assert self.takes < 2000, "the period waited on for weights that will never come"
        threading.Event().wait(0.005)
        return None

    def discard(self, key):
        self.discarded.append(key)

    def void(self, key, void=True):
        if void:
            self.voided.append(key)
        elif key in self.voided:
            self.voided.remove(key)

    def is_void(self, key):
        return key in self.voided


def bare_gateway(channel) -> RegionGateway:
    gateway = RegionGateway.__new__(RegionGateway)
    gateway.channel, gateway.servers, gateway.fragments, gateway.timeout_s = channel, 2, 1, 3.0
    gateway.home, gateway.lock = "home1", threading.Lock()
    gateway.published, gateway.held, gateway.aborted = {}, {}, {}
    gateway.reset_attempts, gateway.reload_at_round = set(), set()
    gateway.directives = {"eu": gateway_module._directive(None)}
    gateway.downlink = None  # region_downlink: weights
    return gateway


def test_a_period_whose_weights_died_with_a_server_fails_at_once(monkeypatch):
    """The servers died before the weights of version 3 left them: the region's period
    fails at once (the driver then finds the dead server and restores it) instead of
    leaving the region waiting out a download that never comes; the region is told to
    stop that period, its download of those weights ends (their keys are void), and
    nothing is published."""

    def lost_with_its_server(refs, timeout=None):
        raise RayActorError()

    monkeypatch.setattr(ray, "get", lost_with_its_server)
    channel = Channel()
    gateway = bare_gateway(channel)
    job = SyncPeriod(period=PeriodId(1, 0, 7), full=False, version=3, plan=[(0, 6)], messages=["m"], servers=[])
    with pytest.raises(WeightsLost, match="version 3 died with a server"):
        gateway.run_period("eu", job)
    assert channel.notified[-1] == ("eu", {"abort": 7}) and channel.published == []
    assert channel.discarded == ["r/home1/eu/7/0"]
    assert {"w/home1/3/0", "w/home1/3/1"} <= set(channel.voided)
    # The restored servers publish those weights again: a download waits for them once more.
    gateway._publish(3, False, lambda: [b"w0", b"w1"])
    for _ in range(400):
        if channel.published == ["w/home1/3/0", "w/home1/3/1"]:
            break
        threading.Event().wait(0.005)
    assert channel.published == ["w/home1/3/0", "w/home1/3/1"]
    assert not any(key.startswith("w/") for key in channel.voided)
