"""A region's copy of the home's parameter servers: the global weights, their outer state,
and the weights messages the home's replicas get, made in the region from each sync's record.

:class:`ServerMirror` holds one :class:`~diloco_ray.runtime.server.ParameterServer` per home
server, in this process (plain objects, no actors), built from the home's job as the home
builds its own. For every sync it takes the record
(:class:`~diloco_ray.regions.records.SyncRecord`) and runs the servers' own calls on it in
the order the home's take them (:func:`~diloco_ray.runtime.server_group.chain_sync`), so
what it holds afterwards is what the home's servers hold, bit for bit on the same kind of
device, and the weights message it hands the region's replicas is the one the home's
replicas apply. The record's digests are checked after every sync: a copy that differs is
dropped, and the region asks for the whole state again (:class:`Diverged`); one that does
not hold the version the sync starts from cannot take it (:class:`Behind`).

A home that checks its regions' contributions by norm keeps that history to itself: a copy
is handed only the contributions the home accepted, so it screens nothing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.persist.server_state import SavedServer
from diloco_ray.regions import records
from diloco_ray.regions.records import SyncRecord
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import chain_sync


class Behind(Exception):
    """The copy does not hold the version a sync starts from (or holds nothing)."""


class Diverged(Exception):
    """After a sync the copy's rows differ from the home's (their digests disagree)."""


def local_call(server: ParameterServer, method: str, *args, **kwargs):
    """``server.method(*args, **kwargs)``: a call of :func:`chain_sync` on a server held here."""
    return getattr(server, method)(*args, **kwargs)


def mirror_config(home: dict) -> dict:
    """The home's job as its servers read it, less its regions, its faults and its members'
    rules (left at their defaults): the copy screens nothing, has no channel of its own, no
    fault is aimed at it, and it runs no replicas."""
    own = ("fault_plan", "min_quorum", "min_regions", "min_replicas", "max_replicas", "spare_replicas")
    regionless = {k: v for k, v in home.items() if k not in own and not k.startswith(("region", "channel_"))}
    # On the host: the region's agent holds the copy (a home with server_gpus takes the step on
    # a GPU, whose rounding the host's does not repeat: docs/slow-links.md).
    return TrainerConfig.from_dict({**regionless, "regions": None, "server_gpus": 0}).to_dict()


class ServerMirror:
    """The region's copy of the home's servers.

    Args:
        home: the home's job (its config as a dict, as the region took it on joining).
    """

    def __init__(self, home: dict):
        self.config = mirror_config(home)
        self.count = TrainerConfig.from_dict(self.config).sections().placement.num_param_servers
        self.servers: Optional[list[ParameterServer]] = None

    @property
    def version(self) -> Optional[int]:
        """The version the copy holds (None: it holds nothing)."""
        return None if self.servers is None else self.servers[0].sync_version()

    def restore(self, states: Sequence[SavedServer]) -> None:
        """Take up every server's whole state (one per home server, in order)."""
        if len(states) != self.count:
            raise ValueError(f"{len(states)} server states for a home of {self.count} servers")
        servers = [ParameterServer(self.config, index=s) for s in range(self.count)]
        for server, state in zip(servers, states):
            server.restore(state)
        self.servers = servers

    def drop(self) -> None:
        """Hold nothing (until :meth:`restore`)."""
        self.servers = None

    def apply(self, record: SyncRecord) -> list[np.ndarray]:
        """Take the sync ``record`` holds; returns, per server, the weights message the home's
        replicas apply after it.

        Raises:
            Behind: the copy does not hold the version the sync starts from.
            Diverged: after the sync the copy's digests are not the home's (it then holds nothing).
        """
        if self.servers is None or self.version != record.from_version:
            raise Behind(f"holds version {self.version}; the sync starts from {record.from_version}")
        if len(record.pieces) != self.count:
            raise Behind(f"a record of {len(record.pieces)} servers for a home of {self.count}")
        done = chain_sync(
            self.servers,
            local_call,
            record.fragment,
            record.contributions(),
            plans={},
            merge=record.merge,
            scale=record.scale,
            digest=True,
        )
        if tuple(done.digests) != tuple(record.digests) or self.version != record.version:
            self.drop()
            raise Diverged(f"the copy's weights after version {record.version} are not the home's")
        return list(done.weights)

    def catch_up(self, states: Sequence[bytes], syncs: Iterable[bytes], version: int) -> Optional[list[np.ndarray]]:
        """Bring the copy to weights ``version``: from the servers' whole states first (their
        frames, when sent), then each sync's record (frames, oldest first; those the copy is
        already past, or that start past a gap, are passed over). Returns the last sync's
        weights messages (None: the copy took none, it held ``version`` already).

        Raises:
            Behind: the records do not bring it to ``version``.
            Diverged: a sync left it off the home's weights (it then holds nothing).
        """
        if states:
            self.restore([records.state_from(data, len(data)) for data in states])
        made = None
        for data in syncs:
            record = records.record_from(data, len(data))
            if self.servers is not None and record.from_version == self.version:
                made = self.apply(record)
        if self.version != version:
            raise Behind(f"its copy of the servers holds version {self.version}, not {version}")
        return made

    def full_weights(self) -> list[np.ndarray]:
        """Per server, every parameter as replicas hold it (a replica loading everything)."""
        return [s.full_weights() for s in self.servers]

    def last_weights(self) -> list[np.ndarray]:
        """Per server, the latest sync's weights message again."""
        return [s.last_weights() for s in self.servers]

    def digests(self) -> list[str]:
        return [s.weights_digest() for s in self.servers]
