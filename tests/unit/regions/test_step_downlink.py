"""The home's side of ``region_downlink: step`` (regions.downlink), with the home's servers
in-process and a region's copy of them (regions.mirror) taking what the channel holds: a
region that joins gets the whole state once, then only the records of the syncs since its
copy's version; the whole state goes down again, and is counted by its reason, when the home
restored its servers, when the copy's digest differed, when the region says it holds
nothing, and when the syncs it needs are no longer kept. No Ray."""

from __future__ import annotations

import time
from types import SimpleNamespace

from diloco_ray.regions import downlink
from diloco_ray.regions.mirror import ServerMirror, local_call
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server_group import chain_sync
from tests.unit.regions.test_server_mirror import CODECS
from tests.unit.runtime.test_server_shards import Sim


class Channel:
    def __init__(self):
        self.published, self.voided = {}, set()

    def publish(self, key, payload):
        self.published[key] = payload

    def unpublish(self, key):
        self.published.pop(key, None)

    def void(self, key, void=True):
        self.voided.add(key)

    def wait(self, keys, timeout_s: float = 30.0) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        while not all(k in self.published for k in keys):
            assert time.monotonic() < deadline, keys
            time.sleep(0.01)
        return [self.published[k] for k in keys]


class Home:
    """The home's servers, a channel, and the downlink; syncs chained as the driver chains them."""

    def __init__(self):
        self.sim = Sim(num_servers=2, fragments=1, world_size=1, replicas=2, **CODECS)
        self.channel = Channel()
        self.downlink = downlink.StepDownlink(self.channel, "home1")
        self.servers = [SimpleNamespace(state=SimpleNamespace(remote=s.state)) for s in self.sim.servers]
        self.serial = 0

    def sync(self, round_index: int) -> None:
        sim = self.sim
        ids = list(sim.replicas)
        plans = dict(zip(ids, sim.servers[0].data_plan(ids)))
        contributions = [[] for _ in sim.servers]
        for rid in ids:
            sim.receive(rid)
            sim.train(rid, round_index, 0)
            for s, bufs in enumerate(sim.outgoing(rid, 0)):
                contributions[s].append(Contribution(rid, bufs, 1.0 + rid))
        done = chain_sync(sim.servers, local_call, 0, contributions, plans, digest=True)
        sim.messages, sim.full = done.weights, False
        self.serial += 1
        self.downlink.note(self.serial, done)

    def period(self, copy: ServerMirror) -> tuple[list, list]:
        """One period of region ``eu``: the keys it is sent; its copy takes them and its reply is heard."""
        version = self.sim.servers[0].sync_version()
        recs, states = self.downlink.inputs("eu", version, self.serial, self.servers)
        copy.catch_up(self.channel.wait(states), self.channel.wait(recs), version)
        assert copy.version == version and copy.digests() == [s.weights_digest() for s in self.sim.servers]
        self.downlink.heard("eu", copy.version, False)
        return recs, states


def resends(home: Home) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # counted by the publication's thread once it is made
        counts = dict(home.downlink.resends.get("eu", {}))
        if sum(counts.values()) == home.expected:
            return counts
        time.sleep(0.01)
    return dict(home.downlink.resends.get("eu", {}))


def test_the_whole_state_goes_down_only_when_the_records_cannot_bring_a_region_up():
    home = Home()
    copy = ServerMirror(home.sim.cfg.to_dict())
    home.expected = 1
    recs, states = home.period(copy)  # joins
    assert states and not recs and resends(home) == {"joined": 1}
    for r in range(3):
        home.sync(r)
    recs, states = home.period(copy)
    assert len(recs) == 3 and not states  # the three syncs since, as records
    home.sync(3)
    recs, states = home.period(copy)
    assert len(recs) == 1 and not states

    home.downlink.servers_restored()  # the home's servers started again from a checkpoint
    home.expected = 2
    recs, states = home.period(copy)
    assert states and resends(home) == {"joined": 1, "restored": 1}

    home.sync(4)
    home.downlink.heard("eu", copy.version, True)  # its copy's digest differed
    home.expected = 3
    assert home.period(copy)[1] and resends(home)["differed"] == 1

    home.downlink.heard("eu", -1, False)  # an agent started again: holds nothing
    home.expected = 4
    assert home.period(copy)[1] and resends(home)["holds nothing"] == 1

    for r in range(5, 5 + downlink.SYNCS_KEPT + 2):  # more syncs than are kept, without the region
        home.sync(r)
    home.expected = 5
    recs, states = home.period(copy)
    assert states and resends(home) == {"joined": 1, "restored": 1, "differed": 1, "holds nothing": 1, "fell behind": 1}
    assert len(home.channel.published) < downlink.SYNCS_KEPT + 8  # old records and states are let go


def test_a_region_that_keeps_asking_for_the_whole_state_gets_the_weights_messages_instead():
    """A region's own word (its copy differed, or holds nothing) makes the home gather and
    send its servers' state: at most CLAIMED_RESENDS times a run, then it gets no state and
    its period takes the weights messages, as with ``region_downlink: weights``."""
    home = Home()
    copy = ServerMirror(home.sim.cfg.to_dict())
    home.expected = 1
    home.period(copy)
    for n in range(downlink.CLAIMED_RESENDS):
        home.sync(n)
        home.downlink.heard("eu", -1, False)
        home.expected = 2 + n
        assert home.period(copy)[1] and resends(home)["holds nothing"] == n + 1
    home.sync(99)
    home.downlink.heard("eu", -1, False)
    recs, states = home.downlink.inputs("eu", home.sim.servers[0].sync_version(), home.serial, home.servers)
    assert states == [] and resends(home)["holds nothing"] == downlink.CLAIMED_RESENDS
