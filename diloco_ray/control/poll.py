"""Collecting one sync period's results from the replicas, until its deadline.

:class:`PeriodPoll` waits on every rank's stats ref as it arrives and sorts the replicas
into reported, late and failed (:class:`~diloco_ray.runtime.messages.RoundPoll`). A rank
that fails takes its whole replica down at once: its partners would otherwise wait in an
FSDP collective forever. So does a replica whose ranks show no progress for
``stall_timeout_s`` (a frozen process answers nothing, and Ray cannot tell it from a slow
one). Replicas still running at the deadline are told to stop and get ``abort_grace_s`` to
do so; one that does not is dropped as unresponsive. The waiting and the time go through
:class:`~diloco_ray.control.calls.RayCalls` (or a test's fake, with a clock of its own),
never Ray or the wall clock directly.
"""

from __future__ import annotations

from typing import Callable, Optional

from ray.exceptions import RayActorError, RayTaskError

from diloco_ray.control.calls import ServerLost
from diloco_ray.errors import UserInputError, unwrap
from diloco_ray.runtime.messages import Launch, RoundPoll

STEP_POLL_S = 1.0  # how often the driver collects step events while a round runs


class PeriodPoll:
    """One sync period's collection.

    Args:
        launched: replica id -> its :class:`Launch`.
        attempt: the launch counter of this period (an abort names it; beats carry it).
        calls: the driver's calls (``ready``, ``all_ready``, ``get``, ``now``).
        steps: the step feed (``poll()`` passes step events on, ``beats()`` reads heartbeats),
            or None.
        stall_timeout_s: a replica whose running ranks have not beaten for this long is dropped.
        abort_grace_s: how long a replica told to stop at the deadline may take.
        check_servers: called before a failed replica is dropped; raises
            :class:`~diloco_ray.control.calls.ServerLost` when a server died (the period
            failed for that, not for its replica), which ends the collection: the replicas
            still running are told to stop, none is dropped, and the steps every replica
            ran in the period count in ``wasted_steps`` (the period runs again).
    """

    def __init__(
        self,
        launched: dict[int, Launch],
        attempt: int,
        calls,
        steps,
        stall_timeout_s: float,
        abort_grace_s: float,
        check_servers: Optional[Callable[[], None]] = None,
    ):
        self.launched, self.attempt, self.calls, self.steps = launched, attempt, calls, steps
        self.check_servers = check_servers
        self.stall_timeout_s, self.abort_grace_s = stall_timeout_s, abort_grace_s
        self.owner = {ref: (rid, r) for rid, launch in launched.items() for r, ref in enumerate(launch.stats)}
        self.results: dict[int, list] = {rid: [] for rid in launched}
        self.failed: dict[int, tuple] = {}
        self.pending = set(self.owner)
        self.wasted_steps = 0  # inner steps of the replicas whose period reached no sync

    def collect(self, timeout_s: Optional[float]) -> RoundPoll:
        """Wait for the ranks until ``timeout_s`` (None: no deadline); then stop the late ones."""
        launched_at = self.calls.now()
        deadline = None if timeout_s is None else launched_at + timeout_s
        try:
            self._wait(launched_at, deadline)
        except ServerLost:
            for rid in sorted({self.owner[r][0] for r in self.pending}):
                self.launched[rid].replica.abort(self.attempt)
            # The period runs again on restored servers: none of its steps reach an update.
            if self.steps is not None:
                self.steps.beats()  # the ranks' latest steps, for those that report nothing now
            self.wasted_steps += sum(self._steps_run(rid) for rid in self.launched)
            raise
        self._stop_late()
        return self._sorted()

    def _wait(self, launched_at: float, deadline: Optional[float]) -> None:
        while self.pending:
            remaining = None if deadline is None else max(0.0, deadline - self.calls.now())
            # Wake at least every STEP_POLL_S to pass the ranks' step events on.
            wait = STEP_POLL_S if remaining is None else min(remaining, STEP_POLL_S)
            ready = self.calls.ready(list(self.pending), wait)
            if self.steps is not None:
                self.steps.poll()
            for ref in ready:
                if ref in self.pending:
                    self.pending.discard(ref)
                    self._take(ref, strict=True)
            for rid in self._stalled(launched_at):
                self._drop(rid, "unresponsive")
            if not ready and remaining is not None and remaining <= STEP_POLL_S:
                break  # the deadline passed

    def _take(self, ref, strict: bool) -> None:
        rid = self.owner[ref][0]
        try:
            self.results[rid].append(self.calls.get(ref))
        except (RayActorError, RayTaskError) as e:
            if isinstance(e, RayTaskError) and isinstance(unwrap(e), UserInputError):
                raise  # bad data or config: the user's to fix, not a fault to ride out
            if strict:
                if self.check_servers is not None:
                    self.check_servers()
                self._drop(rid, "failed")

    def _drop(self, rid: int, why: str) -> None:
        replica = self.launched[rid].replica
        self.failed[rid] = (replica, why)
        replica.stop()  # frees ranks blocked in a collective with the lost one
        self.pending = {r for r in self.pending if self.owner[r][0] != rid}

    def _stalled(self, launched_at: float) -> set[int]:
        """Replica ids with a rank still running that has shown no progress (a step beat)
        for ``stall_timeout_s`` since the launch."""
        if self.steps is None or not self.pending:
            return set()
        beats = self.steps.beats()
        if beats is None:
            return set()  # no word from the board this time: nobody is judged on it
        now, stalled = self.calls.now(), set()
        for ref in self.pending:
            rid, rank = self.owner[ref]
            if not self.launched[rid].replica.judged_by_steps:
                continue  # a region: its channel says whether it is alive
            attempt, _, at = beats.get((rid, rank), (None, 0, 0.0))
            last = at if attempt == self.attempt else launched_at
            if now - max(last, launched_at) > self.stall_timeout_s:
                stalled.add(rid)
        return stalled

    def _stop_late(self) -> None:
        """A late replica stops at its next step; one that cannot (frozen) is dropped, so it
        neither holds up the next round nor is launched again and again."""
        late = sorted({self.owner[r][0] for r in self.pending})
        for rid in late:
            self.launched[rid].replica.abort(self.attempt)
        acks = [r for r in self.pending if self.owner[r][0] in late]
        for ref in self.calls.all_ready(acks, self.abort_grace_s):
            self._take(ref, strict=False)  # one that fails now counts below as not having answered
        for rid in late:
            if len(self.results[rid]) < len(self.launched[rid].stats) and rid not in self.failed:
                self._drop(rid, "unresponsive")
        self.late = set(late)

    def _steps_run(self, rid: int) -> int:
        """The inner steps replica ``rid`` ran in this period: what its ranks reported, or
        their last beat of this attempt where they reported nothing (failed, frozen)."""
        beats = self.steps.last_beats if self.steps is not None else {}
        beat = max((b[1] for (r, _), b in beats.items() if r == rid and b[0] == self.attempt), default=0)
        return max([s.inner_steps for s in self.results[rid]] + [beat])

    def _sorted(self) -> RoundPoll:
        reported = {}
        for rid in self.launched:
            stats = self.results[rid]
            if rid in self.failed or rid in self.late or any(s.aborted for s in stats):
                self.wasted_steps += self._steps_run(rid)
                continue
            reported[rid] = sorted(stats, key=lambda s: s.rank)
        late = [rid for rid in self.launched if rid not in self.failed and rid not in reported]
        return RoundPoll(reported, late, list(self.failed.values()))
