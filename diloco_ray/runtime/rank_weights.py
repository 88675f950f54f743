"""How a rank takes in the global weights before a sync period: the fetching half of its sync.

The rank's :class:`~diloco_ray.algo.rank_sync.RankSync` is plain tensor code: it decides what
a message of a sync version means for what the rank holds (skip it, apply it, or load
everything first) and applies it to the anchor and the local rows. :func:`receive_weights`
is what brings the messages to it: the period's messages through the transport (which waits
out a simulated link), and, when the rank missed a sync or holds nothing yet, every server's
full weights first, asked of the servers themselves. Nothing here goes up: the rank hands
:meth:`~diloco_ray.algo.rank_sync.RankSync.outgoing` its local rows directly.
"""

from __future__ import annotations

import torch

from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import SyncPeriod
from diloco_ray.runtime.rank_state import local_rows


def receive_weights(
    sync: RankSync, params: list, job: SyncPeriod, merge: bool, full_only: bool = False, fetched=None
) -> int:
    """Bring a rank up to the weights of the job's sync version: skip messages it already
    holds, load everything from the servers after a gap, else apply the messages. Returns the
    bytes received.

    Args:
        sync: the rank's :class:`~diloco_ray.algo.rank_sync.RankSync`.
        params: the rank's trained parameters, ``(name, parameter)`` in model order, whose
            local rows a message writes.
        job: the sync period: its version, messages, servers and link.
        merge: blend the messages into the local rows (an overlapped merge) instead of
            replacing them.
        full_only: a full load only; the messages themselves wait (for the overlapped merge).
        fetched: the messages' :func:`~diloco_ray.runtime.transport.prefetch`, if one was
            started, else None (they are fetched here).
    """
    version = job.version
    decision = sync.decide_load(version, fragment_message=not job.full)
    received = 0
    if decision == "full":
        full = transport.receive([s.full_weights.remote() for s in job.servers], job.link)
        received += _apply(sync, params, full, merge=False)
        decision = sync.decide_load(version, fragment_message=not job.full)
    if decision == "apply" and not full_only:
        received += _apply(sync, params, transport.receive(fetched or job.messages, job.link), merge=merge)
    return received


@torch.no_grad()
def _apply(sync: RankSync, params: list, buffers: list, merge: bool) -> int:
    """:meth:`RankSync.apply` of ``buffers`` to the local rows of ``params``; their bytes."""
    sync.apply(buffers, local_rows(params), merge=merge)
    return sum(len(b) for b in buffers)
