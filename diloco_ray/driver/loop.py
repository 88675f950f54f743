"""The loop interface: what the trainer asks of the loop that runs its outer updates.

Two siblings implement :class:`OuterLoop`, neither built on the other:
:class:`~diloco_ray.driver.sync_loop.SyncLoop` (rounds: every replica trains a period, the
servers average them; ``round_index``) and :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`
(merges: replicas on their own clocks, merged as they arrive; ``merge_index``). The trainer
owns one (:func:`loop_for`), and the loop calls the trainer back only through the
:class:`~diloco_ray.driver.host.Host` protocol.
"""

from __future__ import annotations

from typing import Optional, Protocol

from diloco_ray.config.sections import Sections
from diloco_ray.driver.decoupled_loop import DecoupledLoop
from diloco_ray.driver.host import Host
from diloco_ray.driver.period_jobs import PeriodJobs
from diloco_ray.driver.step_feed import StepFeed
from diloco_ray.driver.sync_loop import SyncLoop
from diloco_ray.observe.records import RoundRecord


class OuterLoop(Protocol):
    """Runs a run's outer updates, one :meth:`run_round` at a time."""

    steps: Optional[StepFeed]  # the ranks' step events and heartbeats (set once the run is set up)
    jobs: PeriodJobs  # what replicas launch from, and what they learn of their earlier sends

    @property
    def update_index(self) -> int:
        """The next outer update's index, as the servers count it: the round
        (``SyncLoop.round_index``) or the merge (``DecoupledLoop.merge_index``)."""
        ...

    @property
    def progress(self) -> float:
        """Rounds' worth of work applied: what checkpoints fall due by."""
        ...

    def finished(self) -> bool:
        """Whether the run has trained what it was asked to (``diloco_loops`` rounds' worth)."""
        ...

    def restore(self, server, reset: bool) -> None:
        """Take up the servers' state (at set-up, and after they were restored from a
        checkpoint; ``reset``: replicas reload everything)."""
        ...

    def resume_in_flight(self, replicas: list) -> None:
        """At a resume: let ``replicas`` continue from the in-flight snapshots there are."""
        ...

    def run_round(self, host: Host) -> RoundRecord:
        """Run and apply one outer update (a round, or a merge); its record."""
        ...

    def unmerged(self, replicas: list) -> dict[int, tuple[int, int]]:
        """Replica id -> (launch attempt, update index) of each period whose work is not in
        the weights yet (what a checkpoint on stop leaves out)."""
        ...


def loop_for(sections: Sections, inflight_root: str, calls=None) -> OuterLoop:
    """The loop of ``sync_mode``, handed the sections it reads (and no others);
    ``inflight_root``: the run's in-flight snapshot folder (synchronous rounds only);
    ``calls``: how refs are waited on (Ray's by default)."""
    s = sections
    shared = dict(run=s.run, sync_codec=s.sync_codec, membership=s.membership, evaluation=s.evaluation, calls=calls)
    if s.run.sync_mode == "decoupled":
        return DecoupledLoop(**shared, decoupled=s.decoupled)
    return SyncLoop(**shared, checkpointing=s.checkpointing, inflight_root=inflight_root)
