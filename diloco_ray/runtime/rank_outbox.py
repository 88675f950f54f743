"""A rank's pseudo-gradient between the end of its sync period and Ray.

A rank's period (:meth:`RankWorker.run_period <diloco_ray.runtime.rank.RankWorker.run_period>`)
returns its stats as soon as its messages are on their way down from the device, and the
messages leave by a second call, :meth:`RankWorker.message
<diloco_ray.runtime.rank.RankWorker.message>`, which runs in a concurrency group of its own
and waits for the copy: one protocol with or without ``overlap_communication``. With
overlap the next period's inner steps start while the bytes come down, and the driver,
which waits on the stats only, hands the servers refs that are filled a moment later;
without, the next period waits for the sync as it must. An :class:`Outbox` passes each
period's messages from the one call to the other, by the driver's launch attempt.
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

from diloco_ray.algo.device_copy import DownCopy


class PeriodFailed(RuntimeError):
    """The period whose messages were asked for ended without any (it raised, or never ran)."""


class Outbox:
    """Each period's messages, from the period that made them to the call that sends them.

    A period and its send are asked for together, so each kind runs in launch order: the
    n-th :meth:`take` is for the n-th :meth:`post`, whatever the launch counters are (a
    home restarted from a checkpoint counts again from there). The attempt is checked all
    the same: a period that never ran here (its call failed before it started) posts
    nothing, and its send must fail, not take the next period's messages.
    """

    def __init__(self):
        self._posted: collections.deque = collections.deque()  # (attempt, messages, why)
        self._changed = threading.Condition()

    def post(self, attempt: int, sent: Optional[DownCopy]) -> None:
        """The messages of ``attempt`` (None: the period was stopped and sends nothing)."""
        self._put(attempt, sent, None)

    def fail(self, attempt: int, why: str) -> None:
        """``attempt``'s period raised: its :meth:`take` raises too, with ``why``."""
        self._put(attempt, None, why)

    def _put(self, attempt: int, sent: Optional[DownCopy], why: Optional[str]) -> None:
        with self._changed:
            self._posted.append((attempt, sent, why))
            self._changed.notify_all()

    def empty(self) -> bool:
        """Whether every posted period's messages were taken."""
        with self._changed:
            return not self._posted

    def take(self, attempt: int) -> Optional[DownCopy]:
        """The messages of ``attempt``, once its period has posted them (None: it sends
        nothing).

        Raises:
            PeriodFailed: its period raised, or another period posted in its place: this
                one never ran here, and nothing will come.
        """
        with self._changed:
            self._changed.wait_for(lambda: bool(self._posted))
            posted, sent, why = self._posted[0]
            if posted != attempt:  # left for the send it belongs to
                why = f"the period of launch {posted} ran in its place: this one never ran"
            else:
                self._posted.popleft()
        if why is not None:
            raise PeriodFailed(f"the sync period of launch {attempt} sent nothing: {why}")
        return sent
