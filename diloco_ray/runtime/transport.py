"""How a message reaches its reader: Ray's object store, with a simulated link in front.

Ranks and servers hand each other packed buffers (:mod:`diloco_ray.algo.compression`) as
object refs; :func:`receive` is where a reader takes them. On a real cluster that is all it
does. For single-machine rehearsals (``link_mbps`` / ``link_latency_ms``) it also holds the
buffers back until they would have crossed the reader's simulated link
(:mod:`diloco_ray.algo.links`: uplink messages carry their sender's stamp, the downlink is
the reading replica's own), so the servers' and ranks' code never sees a link. Real
rate-limited links between real nodes are ``bench/wan.py``'s.
"""

from __future__ import annotations

from typing import Optional

from diloco_ray.algo import compression, links


def resolve(items: list) -> list:
    """Buffers from object refs (fetched in one call) or buffers (tests drive the server
    in-process)."""
    import ray

    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    got = iter(ray.get(refs)) if refs else iter(())
    return [next(got) if isinstance(i, ray.ObjectRef) else i for i in items]


def prefetch(items: list) -> None:
    """Start bringing ``items``' objects to this node without waiting for them, so a
    :func:`receive` later (an overlapped merge, at the end of the next inner steps) finds
    them here: a ref nested in a task's argument is otherwise fetched only when read, and
    over a real link that download would sit between the steps and the next send."""
    import ray

    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)


def receive(items: list, link: Optional[links.Link] = None) -> list:
    """:func:`resolve`, then wait until the buffers would have arrived over a simulated link:
    the reader's own ``link`` (the weights a replica reads: sent at the servers' ``sent_at``
    stamp, all of them over that one link), or else each sender's stamp (pseudo-gradients).
    Unstamped buffers on no link are returned at once."""
    buffers = resolve(items)
    metas = [compression.packed_meta(b) for b in buffers]
    if link is not None:
        sent = max((m.get("sent_at", 0.0) for m in metas), default=0.0)
        links.wait_for([sent + link.seconds(sum(len(b) for b in buffers))])
    else:
        links.wait_for([links.arrival(m) for m in metas])
    return buffers
