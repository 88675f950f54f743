"""Decoupled mode's periods in flight, as the driver watches them: who has reported, who
died, who stalled.

A :class:`Flight` is one replica's sync period from its launch until every rank has
reported. :class:`FlightPoll` waits on the flights' stats refs and sorts them each poll:
the periods now done, and the replicas lost (their process died, or they stalled and did
not answer the stop). A replica that shows no step beat for ``stall_timeout_s`` is told
to stop: one that answers (a message that never left, ``drop_link``) comes back done with
an aborted period; one that does not within ``abort_grace_s`` (frozen) is lost. What to do
with either is :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`'s decision; the
waiting goes through :class:`~diloco_ray.control.calls.RayCalls` (or a test's fake).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ray.exceptions import RayActorError, RayTaskError

from diloco_ray.errors import UserInputError, unwrap
from diloco_ray.runtime.messages import Launch


@dataclass
class Flight:
    """One replica's sync period in flight.

    Args:
        launch: its :class:`Launch` (buffer and stats refs).
        plan: the stream ranges reserved for it.
        version: the global version it started from.
        round_index: the merge it was launched in (its ranks key their period-start state by it).
        mark: the outer momentum steps taken when it started (its staleness is counted
            from it, see :func:`~diloco_ray.algo.decoupled.momentum_steps`).
        launched_at: wall-clock launch time.
        attempt: the launch counter its beats carry (an abort names it).
        due: the arrival its time budget aims at, for a period cut to land with others
            (None: it runs a full period; see :mod:`diloco_ray.algo.merge_timing`).
        abort_by: set once it was told to stop (it stalled): when it is lost as
            unresponsive if it has not answered.
    """

    launch: Launch
    plan: list
    version: int
    round_index: int
    mark: int
    launched_at: float
    attempt: int
    due: Optional[float] = None
    abort_by: Optional[float] = None
    stats: list = field(default_factory=list)
    pending: set = field(default_factory=set)

    @property
    def aborted(self) -> bool:
        """It was told to stop and did: nothing of it can be merged."""
        return any(s.aborted for s in self.stats)


@dataclass
class Lost:
    """A replica whose period will never report: ``why`` is ``"failed"`` or ``"unresponsive"``."""

    replica_id: int
    flight: Flight
    why: str
    error: Optional[BaseException] = None


class FlightPoll:
    """Waits on the flights of a decoupled run.

    Args:
        calls: the driver's calls (``ready``, ``get``, ``now``, ``sleep``).
        steps: the step feed (``poll()``, ``beats()``, ``last_beats``), or None.
        stall_timeout_s: a replica whose period has shown no step beat for this long is told to stop.
        abort_grace_s: how long it then has to answer before it is lost.
    """

    def __init__(self, calls, steps, stall_timeout_s: float, abort_grace_s: float):
        self.calls, self.steps = calls, steps
        self.stall_timeout_s, self.abort_grace_s = stall_timeout_s, abort_grace_s

    def poll(self, flights: dict[int, Flight], wait: float) -> tuple[list[tuple[int, Flight]], list[Lost]]:
        """Wait up to ``wait`` for reports. Returns (the periods whose every rank has now
        reported, the replicas lost); both are taken out of ``flights``."""
        refs = [ref for f in flights.values() for ref in f.pending]
        ready = set(self.calls.ready(refs, wait)) if refs else set()
        if not refs:
            self.calls.sleep(wait)
        if self.steps is not None:
            self.steps.poll()
        done, lost = [], []
        for rid, flight in list(flights.items()):
            try:
                for ref in list(flight.pending & ready):
                    flight.pending.discard(ref)
                    flight.stats.append(self.calls.get(ref))
            except (RayActorError, RayTaskError) as e:
                if isinstance(e, RayTaskError) and isinstance(unwrap(e), UserInputError):
                    raise  # bad data or config: the user's to fix, not a fault to ride out
                lost.append(Lost(rid, flights.pop(rid), "failed", e))
                continue
            if not flight.pending:
                flight.stats.sort(key=lambda s: s.rank)
                done.append((rid, flights.pop(rid)))
        return done, lost + self._stop_stalled(flights)

    def steps_run(self, flight: Flight) -> int:
        """Inner steps a period has run, from its ranks' reports or their step beats."""
        beats = self.steps.last_beats if self.steps is not None else {}
        rid = flight.launch.replica.id
        beat = max((b[1] for (r, _), b in beats.items() if r == rid and b[0] == flight.attempt), default=0)
        return max([s.inner_steps for s in flight.stats] + [beat])

    def _stop_stalled(self, flights: dict[int, Flight]) -> list[Lost]:
        """Tell a replica that has shown no step for ``stall_timeout_s`` to stop; lose one
        that has not answered within ``abort_grace_s`` of being told."""
        now = self.calls.now()
        for rid in self._stalled(flights, now):
            flight = flights[rid]
            flight.launch.replica.abort(flight.attempt)
            flight.abort_by = now + self.abort_grace_s
        expired = [rid for rid, f in flights.items() if f.abort_by is not None and now > f.abort_by]
        return [Lost(rid, flights.pop(rid), "unresponsive") for rid in expired]

    def _stalled(self, flights: dict[int, Flight], now: float) -> list[int]:
        """Replicas whose period has shown no step beat for ``stall_timeout_s``, not yet told
        to stop. A lost board judges nobody (no beats, no verdict)."""
        if self.steps is None or not flights:
            return []
        beats = self.steps.beats()
        if beats is None:
            return []
        out = []
        for rid, f in flights.items():
            if not f.launch.replica.judged_by_steps:
                continue  # a region: its channel says whether it is alive
            last = max(
                [at for (r, _), (attempt, _, at) in beats.items() if r == rid and attempt == f.attempt]
                + [f.launched_at]
            )
            if f.abort_by is None and now - last > self.stall_timeout_s:
                out.append(rid)
        return out
