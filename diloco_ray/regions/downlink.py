"""The home's side of ``region_downlink: step``: what each region needs to take the home's
syncs itself, published on the channel.

The driver tells the gateway of every sync it chains (:meth:`StepDownlink.note`, numbered in
the order it chained them). For a region's period, :meth:`StepDownlink.inputs` names the
records (:mod:`~diloco_ray.regions.records`) of the syncs after the version the region's copy
holds (its last reply says which: :attr:`~diloco_ray.runtime.messages.RegionFacts.copy_version`),
and, where that cannot bring it to the period's weights, every server's whole state first:

* ``joined``: the region holds no copy yet (its first period);
* ``restored``: the home's servers started again from a checkpoint (or from nothing) since
  the region's copy took a whole state: it holds another line of weights;
* ``differed``: its copy's digests were not the home's after a sync;
* ``holds nothing``: its reply says it holds no copy (an agent started again);
* ``fell behind``: the syncs after its copy's version are not all kept here (or one failed).

The gateway counts them by reason (:attr:`StepDownlink.resends`) in the region's facts of
every reply, and from there they reach the round's record (``state_resends``). Records and
states are made on a thread of their own the first time a region needs them, so a notice
goes out while the servers still commit the sync; one that cannot be made (a server died)
is declared void, as lost weights are.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from diloco_ray.logs import log
from diloco_ray.regions import records
from diloco_ray.runtime import transport

# The latest syncs whose records a region behind by a few can still be sent: the gateway holds
# their contributions (until the record is made) or their records, each about the sync's
# messages up; further behind, a region gets the whole state.
SYNCS_KEPT = 16
# Whole states sent on a region's own word (its copy differed, or holds nothing) at most this
# often in a run: past it, the region gets the weights messages, as with region_downlink:
# weights, so a region cannot make the home gather and send its state every sync.
CLAIMED_RESENDS = 8
NOTED_WAIT_S = 30.0  # how long a period waits for the driver's word of the sync its weights come from


class StepDownlink:
    """The records and states the regions' copies of the servers are brought up to date with.

    Args:
        channel: the gateway's :class:`~diloco_ray.channel.server.ChannelServer`.
        home: this start of the home (the channel keys of its run name it).
    """

    def __init__(self, channel, home: str):
        self.channel, self.home = channel, home
        self.noted: dict[int, object] = {}  # serial -> the sync's SyncRefs
        self.versions: dict[int, tuple[int, int]] = {}  # serial -> (from, to) version, once committed
        self.latest = 0  # the last serial noted
        self.copies: dict[str, int] = {}  # region -> the version its copy holds (-1: none), by its last reply
        self.differed: set[str] = set()  # regions whose copy's digest differed at their last sync
        self.capped: set[str] = set()  # regions past CLAIMED_RESENDS: they get the weights messages
        self.taken_on: dict[str, int] = {}  # region -> the servers' line its copy's last whole state was of
        self.made: dict[str, threading.Event] = {}  # channel key -> made (published or void)
        self.published: set[str] = set()  # the keys of those published
        self.resends: dict[str, dict[str, int]] = {}  # region -> reason -> the whole states sent it
        self.line = 0  # the servers' restores so far: states of another line are other states
        self.state_keys: list[list[str]] = []  # the latest publications of the servers' states
        self.cond = threading.Condition()

    # ---- what the home tells it -------------------------------------------------------
    def note(self, serial: int, refs) -> None:
        """The driver chained sync ``serial`` (its :class:`~diloco_ray.runtime.server_group.SyncRefs`)."""
        with self.cond:
            self.noted[serial] = refs
            self.latest = max(self.latest, serial)
            gone = [k for k in self.noted if k <= self.latest - SYNCS_KEPT]
            for k in gone:
                self.noted.pop(k, None)
                self.versions.pop(k, None)
            self.cond.notify_all()
        for k in gone:
            self._drop(record_key(self.home, k))

    def servers_restored(self) -> None:
        """The home's servers start again from a checkpoint: every copy is of another line."""
        with self.cond:
            gone, self.noted, self.versions = list(self.noted), {}, {}
            self.line += 1
        for k in gone:
            self._drop(record_key(self.home, k))

    def heard(self, region: str, copy_version: int, differed: bool) -> None:
        """What ``region``'s reply said of its copy."""
        with self.cond:
            self.copies[region] = copy_version
            if differed:
                self.differed.add(region)

    # ---- a region's period ------------------------------------------------------------
    def inputs(self, region: str, version: int, serial: int, servers: list) -> tuple[list, list]:
        """For ``region``'s period of weights ``version`` (made by sync ``serial``, or by a load
        when no sync made them): the keys of the records and of the states (empty: not sent)
        it needs. A state sent is counted by its reason."""
        with self.cond:
            self.cond.wait_for(lambda: self.latest >= serial, timeout=NOTED_WAIT_S)
            serials = sorted(k for k in self.noted if k <= serial)
        held = self.copies.get(region, -1)
        steps = [(k, self._versions(k)) for k in serials]
        steps = [(k, v) for k, v in steps if v is not None]
        chain = [k for k, (lo, _) in steps if lo >= held]
        reaches = held == version or any(lo == held for _, (lo, _) in steps)
        why = self._why(region, held, reaches)
        states = []
        if why is not None:
            states = self._states(region, why, serial, servers)
            chain = [k for k, _ in steps][-4:]  # the state may be a sync or two before the period's weights
        keys = [self._record(k) for k in chain]
        return keys, states

    def _why(self, region: str, held: int, reaches: bool) -> Optional[str]:
        """Why ``region`` needs the servers' whole state (None: the records will do)."""
        with self.cond:
            differed = region in self.differed
            self.differed.discard(region)
            line = self.taken_on.get(region)
        if line is None:
            return "joined"
        if line != self.line:
            return "restored"
        claimed = "differed" if differed else "holds nothing" if held < 0 else None
        if claimed is not None:
            counts = self.resends.get(region, {})
            if counts.get("differed", 0) + counts.get("holds nothing", 0) >= CLAIMED_RESENDS:
                if region not in self.capped:
                    self.capped.add(region)
                    log.warning("channel: region %r asked for the whole state %d times: it gets the weights "
                                "messages from now on", region, CLAIMED_RESENDS)  # fmt: skip
                return None
            return claimed
        return None if reaches else "fell behind"

    def _versions(self, serial: int) -> Optional[tuple[int, int]]:
        """Sync ``serial``'s versions (before, after), once its commit returned (None: it failed)."""
        if serial not in self.versions:
            refs = self.noted.get(serial)
            if refs is None:
                return None
            try:
                self.versions[serial] = tuple(transport.resolve([refs.commits[0]])[0].versions)
            except Exception as e:  # a server lost with the sync: its weights never came
                log.info("channel: sync %d did not commit (%s)", serial, type(e).__name__)
                return None
        return self.versions[serial]

    # ---- publication ------------------------------------------------------------------
    def _record(self, serial: int) -> str:
        """The key of sync ``serial``'s record, made the first time it is asked for."""
        key = record_key(self.home, serial)
        refs = self.noted.get(serial)

        def make() -> list[bytes]:
            applied, *digests = transport.resolve([refs.commits[0], *refs.digests])
            resolve = transport.resolve
            record = records.record_of(refs.fragment, refs.contributions, applied, digests, resolve, refs.merge)
            refs.contributions = []  # published from here on: the messages' objects may go
            return [records.record_payload(record)]

        self._publish([key], make)
        return key

    def _states(self, region: str, why: str, serial: int, servers: list) -> list[str]:
        """The keys of every server's whole state as it is now, sent ``region`` for reason
        ``why`` (its copy starts from it): counted, and its line noted, once they are made."""
        keys = [f"st/{self.home}/{self.line}/{serial}/{s}" for s in range(len(servers))]
        line = self.line

        def sent() -> None:
            log.info("channel: region %r gets the servers' whole state (%s)", region, why)
            with self.cond:
                counts = self.resends.setdefault(region, {})
                counts[why] = counts.get(why, 0) + 1
                self.taken_on[region] = line

        with self.cond:
            old = [k for k in self.state_keys[:-1] if k != keys]  # a region may still be downloading the last
            self.state_keys = [k for k in self.state_keys if k not in old and k != keys] + [keys]
        for stale in old:
            for key in stale:
                self._drop(key)

        def make() -> list[bytes]:
            return [records.state_payload(state) for state in transport.resolve([s.state.remote() for s in servers])]

        self._publish(keys, make, sent)
        return keys

    def _publish(self, keys: list[str], make: Callable[[], list[bytes]], sent: Optional[Callable] = None) -> None:
        """Publish what ``make`` makes under ``keys`` on a thread of its own, the first time;
        void the keys if it cannot be made. ``sent()`` once they are published."""
        with self.cond:
            made = keys[0] in self.made
            done = self.made.setdefault(keys[0], threading.Event())

        def after() -> None:
            done.wait()
            if sent is not None and keys[0] in self.published:
                sent()

        if made:
            threading.Thread(target=after, daemon=True).start()
            return

        def publish() -> None:
            try:
                for key, payload in zip(keys, make()):
                    self.channel.publish(key, payload)
                self.published.add(keys[0])
                if sent is not None:
                    sent()
            except Exception as e:  # a server lost: a region waiting for these goes on without them
                log.warning("channel: could not make %s (%s)", keys[0], type(e).__name__)
                for key in keys:
                    self.channel.void(key)
            done.set()

        threading.Thread(target=publish, name=f"publish-{keys[0]}", daemon=True).start()

    def _drop(self, key: str) -> None:
        with self.cond:
            self.made.pop(key, None)
            self.published.discard(key)
        self.channel.unpublish(key)


def record_key(home: str, serial: int) -> str:
    """The channel key of sync ``serial``'s record in the home's run ``home``."""
    return f"rec/{home}/{serial}"
