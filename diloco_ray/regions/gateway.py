"""The home's side of a run across regions: the channel's actor.

:class:`RegionGateway` is a plain class that the trainer makes a Ray actor in the home
cluster: it owns the :class:`~diloco_ray.channel.server.ChannelServer` and carries one sync
period of a region at a time. Its :meth:`~RegionGateway.run_period` publishes the weights
messages the period starts from (and the full weights, for a region that must load
everything), sends the region its job as a notice (:mod:`~diloco_ray.regions.wire`), waits
for the region's one reply and returns it as a replica's period returns (one buffer per
server, then the stats), so its results are object refs the loops wait on like any other.

The round's loops see each region as a member (:mod:`~diloco_ray.regions.members`), whose
periods this actor carries.

A region's part of a checkpoint is its own (its residual and its replicas' inner state,
written in its own ``output_dir``): when the home checkpoints, the gateway asks each region
between periods to save it (:meth:`RegionGateway.save_region`) and keeps what the region
answers (an id and a digest) as the region's file in the home's checkpoint. Every notice
carries the home's *restore directive* for the region: a new home starts every region fresh
unless it resumed a checkpoint, and a home that restores its servers behind the round the
replicas were at names the checkpoint (:meth:`RegionGateway.restore`); the region carries
each directive out once (:class:`~diloco_ray.regions.books.RegionBooks`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from typing import Callable, Optional

from diloco_ray.channel import frames
from diloco_ray.channel.credentials import RegionTokens
from diloco_ray.channel.server import ChannelServer
from diloco_ray.config.sections import ChannelSection
from diloco_ray.logs import log
from diloco_ray.regions import notices, wire
from diloco_ray.regions.downlink import StepDownlink
from diloco_ray.regions.notices import Abort, SaveRequest, Stop
from diloco_ray.runtime.messages import RegionFacts, RoundStats, SyncPeriod
from diloco_ray.runtime.server_aggregator import refusal_message

POLL_S = 0.5  # how often a waiting period checks whether it was told to stop, or its region went silent


class RegionLost(Exception):
    """A region went silent in the middle of a period (see :meth:`RegionGateway.run_period`)."""


class WeightsLost(Exception):
    """The weights a region's period needs could not be fetched from the servers (a server
    died): the period fails at once rather than leave the region waiting for them. The
    driver then finds the dead server (:func:`~diloco_ray.control.calls.check_servers`)
    and restores it, and the region is not blamed."""


class RegionGateway:
    """The channel's end at the home, as a Ray actor (threaded: one period per region at a time).

    Args:
        regions: the section naming the regions and the channel's address and limits.
        tokens_file: the file of the regions' tokens (read by the actor, at the home).
        cert, key: the home's TLS certificate and key (PEM bytes).
        join_info: region name -> what it is handed when it joins (the job's config).
        servers: ``num_param_servers``: a period returns one buffer per server.
        seq_len: tokens per sequence: what a region's plan can hold.
        fragments: ``sync_fragments``: the sync periods of a round (a notice carries the
            round's next one, :attr:`~diloco_ray.regions.wire.Notice.ahead`).
        steps: ``region_downlink: step``: the regions take the outer step themselves
            (:mod:`~diloco_ray.regions.downlink`).
    """

    def __init__(
        self,
        regions: ChannelSection,
        tokens_file: str,
        cert: bytes,
        key: bytes,
        join_info: dict,
        servers: int,
        seq_len: int,
        save_timeout_s: float = 60.0,
        fragments: int = 1,
        steps: bool = False,
    ):
        self.fragments = fragments
        self.servers, self.max_bytes = servers, int(regions.channel_max_frame_mb * (1 << 20))
        self.save_timeout_s, self.seq_len = save_timeout_s, seq_len
        self.timeout_s = regions.channel_timeout_s
        names = [r["name"] for r in regions.regions]
        self.channel = ChannelServer(
            regions=names,
            tokens=RegionTokens(tokens_file, names, log=log.warning),
            cert=cert,
            key=key,
            host=regions.channel_host,
            port=regions.channel_port,
            max_frame_bytes=self.max_bytes,
            join_info=lambda name: join_info[name],
            session_timeout_s=regions.channel_timeout_s,
            log=log.warning,  # joins and refusals, one line each, to Ray's log at the home
        )
        self.port = self.channel.start()
        self.aborted: dict[str, int] = {}  # region -> the launch attempt it was told to stop
        self.held: dict[str, tuple] = {}  # region -> (its agent's instance, the version of its last period)
        self.published: dict[tuple, object] = {}  # (full, version) published or being published -> its token
        self.lock = threading.Lock()
        self.reset_attempts: set[int] = set()  # launches after a restore, whose versions start over
        self.reload_at_round: set[str] = set()  # regions a replica of which starts its next round fresh
        self.home = uuid.uuid4().hex[:12]  # this start of the home: the channel keys of its run name it
        # Region -> what its state starts from in this home's run: a new home starts every
        # region fresh (its servers start from nothing) until restore() names a checkpoint.
        self.directives = {name: _directive(None) for name in self.channel.regions}
        # region_downlink: step: the records and states of the regions' copies of the servers.
        self.downlink = StepDownlink(self.channel, self.home) if steps else None

    def address(self) -> int:
        """The port the channel listens on."""
        return self.port

    def connected(self) -> list[str]:
        """The regions connected now whose replicas are up."""
        return sorted(self.channel.connected(ready=True))

    def note_sync(self, serial: int, refs) -> None:
        """The driver chained its sync ``serial`` (``region_downlink: step``)."""
        self.downlink.note(serial, refs)

    def run_period(self, region: str, job: SyncPeriod, serial: int = 0) -> tuple:
        """Hand ``region`` one sync period of ``job`` and wait for its reply: one buffer per
        server and its stats, with the channel bytes of the period (an empty buffer per
        server and aborted stats when it was told to stop, or merged no replica).
        ``serial``: the driver's count of the syncs it chained before this period.

        Raises:
            RegionLost: the region was not heard from for ``channel_timeout_s`` (its link
                is down, or its agent died): the round goes on without it.
            WeightsLost: the weights the period needs died with a server.
        """
        import ray

        if job.reset and job.period.attempt not in self.reset_attempts:
            self.reset_attempts.add(job.period.attempt)  # the servers were restored: versions start over
            self._unpublish_all()
        messages = self._publish(job.version, False, lambda: ray.get(list(job.messages)))
        full = []  # the full weights cost the servers a pass over the model: only for a region that may need them
        held = self._held(region)
        if job.period.fragment == 0 and region in self.reload_at_round:  # a replica of it starts this round fresh
            self.reload_at_round.discard(region)
            held = None
        if wire.needs_full(job, held):
            full = self._publish(job.version, True, lambda: ray.get([s.full_weights.remote() for s in job.servers]))
        reply = wire.reply_key(self.home, region, job.period)
        before = self.channel.traffic(region)
        directive = self.directives[region]
        notice = wire.notice_of(job, messages, full, reply, directive, self.home, self.fragments, region)
        steps = []
        if self.downlink is not None:
            records, states = self.downlink.inputs(region, job.version, serial, list(job.servers))
            notice = dataclasses.replace(notice, records=tuple(records), states=tuple(states))
            steps = [*records, *states]
        self.channel.expect(region, reply)
        self.channel.notify(region, notices.to_wire(notice))
        return self._await_reply(region, job, reply, [*messages, *full, *steps], before)

    def _await_reply(self, region: str, job: SyncPeriod, reply: str, keys: list, before: tuple) -> tuple:
        """``run_period``'s wait for ``region``'s ``reply``, until it comes, the period is
        aborted, the weights it needs (their channel ``keys``) turn out lost, or the region
        goes silent."""
        while True:
            payload = self.channel.take(reply, timeout_s=POLL_S)
            if payload is not None:
                buffers, stats = self._checked_reply(region, job, payload)
                if not stats.aborted and stats.region.refused is None:  # its replicas hold job.version
                    self.held[region] = (self.channel.instance_of(region), job.version)
                if self.downlink is not None:
                    if stats.region.refused is None:
                        self.downlink.heard(region, stats.region.copy_version, stats.region.copy_differed)
                    resends = tuple(sorted(self.downlink.resends.get(region, {}).items()))
                    stats = dataclasses.replace(stats, region=dataclasses.replace(stats.region, resends=resends))
                self._note_reloads(region, stats.region)
                return (*buffers, self._with_traffic(region, stats, before))
            if self.aborted.get(region, -1) >= job.period.attempt:
                self.channel.discard(reply)
                aborted = RoundStats.empty(aborted=True, region=RegionFacts())
                return (*[b"" for _ in range(self.servers)], self._with_traffic(region, aborted, before))
            lost = any(self.channel.is_void(key) for key in keys)
            if lost or region not in self.channel.connected():
                self.channel.discard(reply)
                self.channel.notify(region, notices.to_wire(Abort(job.period.attempt)))  # what it finds when it is back
                if lost:
                    raise WeightsLost(
                        f"the weights of version {job.version} died with a server before they were published"
                    )
                raise RegionLost(f"region {region!r} not heard from for {self.timeout_s:g}s (channel_timeout_s)")

    def abort(self, region: str, attempt: int) -> None:
        """Stop waiting for ``region``'s period of launch ``attempt`` (the round goes on
        without it); the region is told, and its reply, if it comes, is dropped."""
        self.aborted[region] = max(attempt, self.aborted.get(region, -1))  # its run_period returns, and drops the reply
        self.channel.notify(region, notices.to_wire(Abort(attempt)))

    def save_region(self, region: str, folder: str, round_index: int, verdicts: tuple) -> dict:
        """Ask ``region`` (between its periods) to save its part of the home's checkpoint of
        ``round_index``, first settling ``verdicts`` (its sends' verdicts not yet delivered),
        and write what it answers as ``regions/<region>.json`` in checkpoint ``folder``.
        Returns that file's hashes (as a replica's save does, :func:`staging.publish`); ``{}``
        and no file when the region did not answer within ``save_timeout_s`` or went silent
        (its link down: ``channel_timeout_s``): a restore from this checkpoint then starts it
        fresh, as a replica the checkpoint holds no state for."""
        from diloco_ray.persist import staging

        reply = f"s/{region}/{uuid.uuid4().hex}"
        request = SaveRequest(int(round_index), tuple((int(a), bool(ok)) for a, ok in verdicts), reply)
        self.channel.expect(region, reply)
        self.channel.notify(region, notices.to_wire(request))
        payload, deadline = None, time.monotonic() + self.save_timeout_s
        while payload is None and time.monotonic() < deadline and region in self.channel.connected():
            payload = self.channel.take(reply, timeout_s=POLL_S)
        if payload is None:  # silent past channel_timeout_s, or too slow
            self.channel.discard(reply)
            log.warning("channel: region %r did not save its part of checkpoint %d", region, round_index)
            return {}
        try:
            saved = wire.saved_of(payload, self.max_bytes, round_index)
        except frames.BadFrame as bad:
            log.warning("channel: region %r's save of checkpoint %d was refused (%s)", region, round_index, bad.why)
            return {}
        name = f"regions/{region}.json"
        scratch = staging.scratch(folder)
        os.makedirs(os.path.join(scratch, "regions"), exist_ok=True)
        with open(os.path.join(scratch, name), "w", encoding="utf-8") as f:
            json.dump(saved, f)
        return staging.publish(folder, [name])

    def restore(self, folder: Optional[str]) -> None:
        """The home's servers start from checkpoint ``folder`` (None: from nothing): every
        region's next notice says so, with its part of that checkpoint when it holds one."""
        from diloco_ray.persist import staging

        for region in self.directives:
            saved = None
            if folder is not None:
                name = f"regions/{region}.json"
                local = staging.read_checked(folder, [name])
                if os.path.isfile(os.path.join(local, name)):
                    with open(os.path.join(local, name), encoding="utf-8") as f:
                        saved = json.load(f)
            self.directives[region] = _directive(saved)
        if self.downlink is not None:
            self.downlink.servers_restored()

    def stop(self) -> None:
        """Tell every region the run is over, give them a moment to hear it, and close."""
        for region in self.channel.regions:
            self.channel.notify(region, notices.to_wire(Stop()))
        deadline = time.monotonic() + 5.0
        while self.channel.connected() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.channel.stop(grace_s=1.0)

    def _held(self, region: str) -> Optional[int]:
        """The weights version ``region``'s replicas hold, as far as the home knows (None:
        none yet, or its agent is not the one that completed a period)."""
        instance, version = self.held.get(region, (None, None))
        return version if instance is not None and instance == self.channel.instance_of(region) else None

    def _checked_reply(self, region: str, job: SyncPeriod, payload: bytes) -> tuple[list, RoundStats]:
        """A region's reply to ``job``, its claims checked against what the home planned
        for it (:func:`wire.refused_claim`). A reply that is not well formed, claims more
        than its plan or brings other than one buffer per server is refused: it stands in
        the sync as a message every server rejects with the reason (in the round record's
        ``rejected``), claiming nothing (its plan goes back to the cursor, its send gets a
        False verdict)."""
        try:
            buffers, stats = wire.reply_of(payload, self.max_bytes)
            why = wire.refused_claim(stats, job.plan, self.seq_len)
        except frames.BadFrame as bad:
            buffers, stats, why = [], None, bad.why
        if why is None and not stats.aborted and len(buffers) != self.servers:
            why = f"{len(buffers)} buffers where the home has {self.servers} servers"
        if why is None:
            return (buffers if not stats.aborted else [b""] * self.servers), stats
        why = f"its reply was refused: {why}"
        log.warning("channel: region %r's reply to launch %d: %s", region, job.period.attempt, why)
        refused = RoundStats.empty(region=RegionFacts(refused=why))
        return [refusal_message(why)] * self.servers, refused

    def _note_reloads(self, region: str, facts: RegionFacts) -> None:
        """What a region's reply says its replicas will load: everything at its next period
        (a replica replaced), or at its next round's start (a replica reset). Asking costs
        the region its own link's bytes, nothing more."""
        if facts.reload:
            self.held.pop(region, None)
        if facts.reload_at_round:
            self.reload_at_round.add(region)

    def _with_traffic(self, region: str, stats: RoundStats, before: tuple[int, int]) -> RoundStats:
        """``stats`` named for ``region``, with the channel bytes since ``before`` as its
        bytes both ways."""
        up, down = (now - then for now, then in zip(self.channel.traffic(region), before))
        facts = dataclasses.replace(stats.region or RegionFacts(), name=region)
        return dataclasses.replace(stats, bytes_up=up, bytes_down=down, region=facts)

    def _publish(self, version: int, full: bool, fetch: Callable[[], list]) -> list[str]:
        """The channel keys of weights ``version``'s messages (``full``: its full weights), one
        per server (:func:`~diloco_ray.regions.wire.message_keys`), at once: the
        messages are fetched and published by a thread of their own the first time, so a
        notice goes out while the servers still make its weights (with overlap a
        region's replicas start their steps and merge those weights at the period's end; the
        region's download waits for them). A version's messages stay until one two newer is
        published."""
        keys = wire.message_keys(self.home, version, self.servers, full)
        publication = (full, version)
        with self.lock:
            if publication in self.published:
                return keys
            self.published[publication] = token = object()  # this publication (a restore starts new ones)
            for key in keys:
                self.channel.void(key, False)  # made again (after a restore, the same version's keys)

        def publish() -> None:
            try:
                buffers = fetch()
            except Exception as e:  # a server lost: the periods waiting for these weights fail (WeightsLost)
                log.warning("channel: could not fetch %s (%s)", keys[0], type(e).__name__)
                with self.lock:
                    if self.published.get(publication) is token:
                        del self.published[publication]
                        for key in keys:
                            self.channel.void(key)  # a region waiting for them goes on to its next notice
                return
            with self.lock:
                if self.published.get(publication) is not token:
                    return  # the servers were restored meanwhile: these weights are void
                for key, buffer in zip(keys, buffers):
                    self.channel.publish(key, bytes(memoryview(buffer)))
                stale = {p for p in self.published if p[0] == full and p[1] < version - 1}
                for p in stale:
                    del self.published[p]
            for old_full, old_version in stale:
                for key in wire.message_keys(self.home, old_version, self.servers, old_full):
                    self.channel.unpublish(key)

        threading.Thread(target=publish, name=f"publish-{keys[0]}", daemon=True).start()
        return keys

    def _unpublish_all(self) -> None:
        with self.lock:
            gone, self.published = self.published, {}
        for full, version in gone:
            for key in wire.message_keys(self.home, version, self.servers, full):
                self.channel.unpublish(key)


def _directive(saved: Optional[dict]) -> dict:
    """A restore directive: a new id (carried out once), and the region's saved part of the
    checkpoint the home's servers start from (None: start fresh)."""
    return {"id": uuid.uuid4().hex, "save": saved}
