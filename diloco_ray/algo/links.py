"""Simulated slow links between replicas and the parameter server.

On one machine every transfer is a memory copy, so a run cannot show what a cross-region
job would spend in sync. With ``link_mbps`` / ``link_latency_ms`` set, each replica gets
a simulated link to the servers, modelled at the *receiving* end of every transfer:

* the sender stamps each message with the wall-clock time it was sent (``sent_at``) and
  the bytes its replica sends in that sync altogether (``link_bytes``: all its ranks and
  all server shards share the one link);
* the receiver may use the message only at ``sent_at + latency + link_bytes * 8 / rate``
  and sleeps until then if it needs it earlier.

Because the delay sits where the data is *used*, not where it is sent, a sender keeps
computing while its bytes are "on the wire": with ``overlap_communication`` the inner
steps hide the transfer exactly as they would on a real link, and without it the
replica waits. Uplink and downlink each have the full rate (full duplex); the servers'
own links are assumed fast (a datacenter), and only one sync is in flight per link at a
time, so messages do not queue behind each other. Clocks are those of one machine: the
model is meant for single-machine rehearsals, not for multi-node runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union


@dataclass(frozen=True)
class Link:
    """One replica's simulated link.

    Args:
        mbps: bandwidth in Mbit/s (None: unlimited, only latency applies).
        latency_ms: one-way latency in milliseconds.
    """

    mbps: Optional[float] = None
    latency_ms: float = 0.0

    def seconds(self, nbytes: int) -> float:
        """Time for ``nbytes`` to cross the link: latency plus serialisation."""
        wire = 0.0 if self.mbps is None else nbytes * 8.0 / (self.mbps * 1e6)
        return self.latency_ms / 1000.0 + wire


def link_for_slot(link_mbps: Union[float, Sequence[float], None], latency_ms: float, slot: int) -> Optional[Link]:
    """The link of the replica in ``slot``, or None when links are not simulated.

    Args:
        link_mbps: ``config.link_mbps``: one rate for every replica or one per slot.
        latency_ms: ``config.link_latency_ms``.
        slot: the replica's slot (0-based position among the active replicas).
    """
    if link_mbps is None and not latency_ms:
        return None
    rate = link_mbps[min(slot, len(link_mbps) - 1)] if isinstance(link_mbps, (list, tuple)) else link_mbps
    return Link(mbps=None if rate is None else float(rate), latency_ms=float(latency_ms))


def stamp(link: Optional[Link], link_bytes: int, clock: Callable[[], float] = time.time) -> dict:
    """The header fields a sender adds to a message (empty when links are not simulated)."""
    if link is None:
        return {}
    return {"sent_at": clock(), "link_bytes": int(link_bytes), "mbps": link.mbps, "latency_ms": link.latency_ms}


def arrival(meta: dict) -> Optional[float]:
    """When a message stamped by :func:`stamp` is fully received (None: not simulated; a
    bare ``sent_at``, which the servers put on every weights message, is not a link stamp)."""
    if "link_bytes" not in meta:
        return None
    link = Link(meta.get("mbps"), meta.get("latency_ms", 0.0))
    return meta["sent_at"] + link.seconds(meta["link_bytes"])


def wait_for(
    arrivals: Sequence[Optional[float]],
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Sleep until the latest of ``arrivals`` (Nones ignored); returns the seconds slept."""
    due = [a for a in arrivals if a is not None]
    if not due:
        return 0.0
    delay = max(due) - clock()
    if delay > 0:
        sleep(delay)
        return delay
    return 0.0
