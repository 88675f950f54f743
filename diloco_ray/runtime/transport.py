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

import threading
from concurrent.futures import Future
from typing import Optional

from diloco_ray.algo import links, wire_layout


def resolve(items: list) -> list:
    """Buffers from object refs (fetched in one call) or buffers (tests drive the server
    in-process)."""
    import ray

    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    got = iter(ray.get(refs)) if refs else iter(())
    return [next(got) if isinstance(i, ray.ObjectRef) else i for i in items]


def prefetch(items: list) -> Future:
    """Start bringing ``items``' objects to this node and return a future of their buffers,
    for :func:`receive` to take later (an overlapped merge, at the end of the next inner
    steps). A ref nested in a task's argument is otherwise fetched only when read, and over
    a real link that download would sit between the steps and the next send. A thread
    holds the fetch: Ray drops the pull of an object not yet made when a ``ray.wait`` ends.
    A thread of its own per fetch, so one that never ends (a frozen server) holds up no
    later one."""
    future: Future = Future()

    def fetch(items=list(items)) -> None:
        try:
            future.set_result(resolve(items))
        except BaseException as error:  # handed to whoever reads the future
            future.set_exception(error)

    threading.Thread(target=fetch, daemon=True, name="diloco-prefetch").start()
    return future


def receive(items, link: Optional[links.Link] = None) -> list:
    """:func:`resolve` (or a :func:`prefetch`'s result), then wait until the buffers would
    have arrived over a simulated link:
    the reader's own ``link`` (the weights a replica reads: sent at the servers' ``sent_at``
    stamp, all of them over that one link), or else each sender's stamp (pseudo-gradients).
    Unstamped buffers on no link are returned at once."""
    buffers = items.result() if isinstance(items, Future) else resolve(items)
    metas = [wire_layout.packed_meta(b) for b in buffers]
    if link is not None:
        sent = max((m.get("sent_at", 0.0) for m in metas), default=0.0)
        links.wait_for([sent + link.seconds(sum(len(b) for b in buffers))])
    else:
        links.wait_for([links.arrival(m) for m in metas])
    return buffers
