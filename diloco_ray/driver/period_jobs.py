"""What both loops launch a sync period from: the part they share, composed (not inherited).

:class:`PeriodJobs` keeps what the next period a replica runs starts from -- the weights
message it loads (:class:`Handout`), the launch counter, the replicas whose inner state must
start fresh -- and builds the :class:`~diloco_ray.runtime.messages.SyncPeriod` job every
rank of the replica gets. :class:`~diloco_ray.driver.sync_loop.SyncLoop` launches every
replica's period of a round together; :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`
launches each replica on its own clock. Neither knows the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from diloco_ray.algo import links
from diloco_ray.algo.aggregate import poisoned
from diloco_ray.config.sections import SyncCodecSection
from diloco_ray.driver.host import Host
from diloco_ray.runtime.messages import AppliedRound, PeriodId, SyncPeriod


@dataclass
class Handout:
    """What replicas load at the start of their next sync period.

    Args:
        messages: one packed weights message (or its ref) per server.
        full: whether they hold every parameter (a full load) or one fragment.
        version: the sync they bring a replica to. It follows the servers' count by the
            one rule both use (:func:`~diloco_ray.algo.outer.sync_advances`): the driver
            numbers a streaming period's messages before that sync's commit returns.
    """

    messages: list = field(default_factory=list)
    full: bool = True
    version: int = 0


class PeriodJobs:
    """The state a loop launches periods from, and the jobs it launches.

    Args:
        sync_codec: the job's sync section (its simulated links, ``link_mbps`` and ``link_latency_ms``).
    """

    def __init__(self, sync_codec: SyncCodecSection):
        self.sync_codec = sync_codec
        self.handout = Handout()
        self.attempt = 0  # launches so far: keys aborts, so a re-run is not stopped by an old abort
        self.reset_inner: set[int] = set()  # replica ids whose inner state is poisoned (NaN/Inf rejected)
        # Replica id -> {launch attempt: whether the servers applied what it sent then},
        # learnt since its last period and handed to it with the next (error feedback).
        self.verdicts: dict[int, dict[int, bool]] = {}

    def restore(self, server) -> int:
        """Point replicas at the servers' state: the latest sync's message (a resumed
        replica merges it; one without the weights loads everything first). Returns the
        servers' round index (the next update's)."""
        version = server.version()
        messages = server.last_weights() if version else server.full_weights()
        self.handout = Handout(messages, full=version == 0, version=version)
        return server.round_index()

    def next_attempt(self) -> int:
        """Count a launch (one sync period of every replica launched together, or one replica's)."""
        self.attempt += 1
        return self.attempt

    def job(self, host: Host, rep, slot: int, index: int, fragment: int, plan: list, **fields) -> SyncPeriod:
        """What every rank of ``rep`` (in ``slot``) gets for the sync period of ``fragment`` of
        the round (decoupled: the merge) ``index``, launched now (see RankWorker.run_period).
        What the period starts from (the handout, the launch, the replica's fresh start and
        verdicts, its slot's link) is filled in here; ``fields`` are the :class:`SyncPeriod`
        fields the loop decides (step board, reload and re-run flags, snapshots, schedule
        position, time budget)."""
        return SyncPeriod(
            period=PeriodId(index, fragment, self.attempt),
            plan=plan,
            messages=self.handout.messages,
            full=self.handout.full,
            version=self.handout.version,
            servers=host.server.actors,
            reset_inner=rep.id in self.reset_inner,
            sent_verdicts=self.verdicts_for(rep.id),
            link=links.link_for_slot(self.sync_codec.link_mbps, self.sync_codec.link_latency_ms, slot),
            **fields,
        )

    def launched(self, replica_ids) -> None:
        """Those replicas' periods have started: a fresh inner state applied to them once,
        and the verdicts on their earlier sends delivered."""
        self.reset_inner -= set(replica_ids)
        for rid in replica_ids:
            self.verdicts.pop(rid, None)

    def verdicts_for(self, replica_id: int) -> tuple[tuple[int, bool], ...]:
        """``(attempt, applied)`` of the replica's sends learnt since its last period."""
        return tuple(sorted(self.verdicts.get(replica_id, {}).items()))

    def note_sync(self, attempt: int, applied: AppliedRound, sent: Iterable[int]) -> None:
        """A sync of the period launched as ``attempt`` committed: each replica in ``sent``
        (it sent a pseudo-gradient then) learns whether it was applied with its next
        period, and one rejected for NaN/Inf starts that period with a fresh inner state."""
        accepted = set(applied.accepted)
        for rid in sent:
            self.verdicts.setdefault(rid, {})[attempt] = rid in accepted
        self.reset_inner |= poisoned(applied.rejected)

    def note_dropped(self, attempt: int, replica_ids: Iterable[int]) -> None:
        """What these replicas sent in ``attempt`` (if they sent anything: one told to stop
        may not have) reached no sync: late past the deadline, or lost (a region whose link
        was cut learns it when it is back; a lost replica of this cluster never comes back)."""
        for rid in replica_ids:
            self.verdicts.setdefault(rid, {})[attempt] = False
