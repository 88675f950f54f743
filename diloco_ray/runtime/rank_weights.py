"""One rank's side of the weights traffic: the global weights in, its pseudo-gradient out.

Around the rank's :class:`~diloco_ray.algo.rank_sync.RankSync` (anchor, versions, codec) and
its local rows: before a sync period :class:`RankWeights` brings the rows up to the sync
version the driver names (skipping a message it already holds, loading everything from the
servers after a gap, or applying the message, blended in for an overlapped merge); after
it, it packs the pseudo-gradient ``global - local``, one buffer per server. The transport
waits out a simulated link both ways.
"""

from __future__ import annotations

import numpy as np
import torch

from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.runtime import transport
from diloco_ray.runtime.messages import SyncPeriod
from diloco_ray.runtime.rank_state import local_rows


class RankWeights:
    """One rank's weights messages, in and out.

    Args:
        sync: the rank's :class:`~diloco_ray.algo.rank_sync.RankSync`.
        params: the rank's trained parameters, ``(name, parameter)`` in model order.
    """

    def __init__(self, sync: RankSync, params: list):
        self.sync, self.params = sync, params

    def local_rows(self) -> dict[str, torch.Tensor]:
        """name -> the rows of each trained parameter this rank holds."""
        return local_rows(self.params)

    def seed(self) -> list[np.ndarray]:
        """This rank's rows of its freshly built weights, one fp32 buffer per server."""
        return self.sync.seed(self.local_rows())

    def adopt(self, expected: list | None) -> tuple[list[str], bool]:
        """:meth:`~diloco_ray.algo.rank_sync.RankSync.adopt` of this rank's freshly built rows."""
        return self.sync.adopt(self.local_rows(), expected)

    def forget_versions(self) -> None:
        """The servers were restored from a checkpoint: the next message loads everything."""
        self.sync.versions = [-1] * len(self.sync.versions)

    def receive(self, job: SyncPeriod, merge: bool, full_only: bool = False, fetched=None) -> int:
        """Bring this rank up to the weights of the job's sync version: skip messages it
        already holds, load everything after a gap, else apply them (blending them in
        with ``merge``; ``fetched``: the messages' prefetch, if one was started;
        ``full_only``: a full load only, the message itself waits). Returns the bytes
        received."""
        version = job.version
        decision = self.sync.decide_load(version, fragment_message=not job.full)
        received = 0
        if decision == "full":
            full = transport.receive([s.full_weights.remote() for s in job.servers], job.link)
            received += self._apply(full, merge=False)
            decision = self.sync.decide_load(version, fragment_message=not job.full)
        if decision == "apply" and not full_only:
            received += self._apply(transport.receive(fetched or job.messages, job.link), merge=merge)
        return received

    def outgoing(self, fragment: int, link, attempt: int) -> list[np.ndarray]:
        """This rank's packed pseudo-gradient of ``fragment``, one buffer per server, kept
        under launch ``attempt`` until the driver's verdict on it (see
        :meth:`~diloco_ray.algo.rank_sync.RankSync.settle`)."""
        return self.sync.outgoing(fragment, self.local_rows(), link, attempt)

    @torch.no_grad()
    def _apply(self, buffers: list, merge: bool) -> int:
        self.sync.apply(buffers, self.local_rows(), merge=merge)
        return sum(len(b) for b in buffers)
