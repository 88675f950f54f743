"""The loop interface: what the trainer asks of the loop that runs its outer updates.

Two siblings implement :class:`OuterLoop`, neither built on the other:
:class:`~diloco_ray.driver.sync_loop.SyncLoop` (rounds: every replica trains a period, the
servers average them) and :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop` (merges:
replicas on their own clocks, merged as they arrive). Both count their outer updates as
``round_index``, as the servers and the records (``round``) do. The trainer owns one
(:func:`loop_for`), and the loop asks the trainer for things only through the
:class:`~diloco_ray.driver.host.Host` protocol.

The loops decide and the trainer acts, as Ray Train v2's policies return decisions that its
controller alone carries out: ``run_round`` returns a
:class:`~diloco_ray.driver.policies.RoundOutcome` and never recovers, reconciles or restores
anything itself. :func:`apply_next_update` is the one place an outcome is carried out, for
both modes, with one give-up rule (:func:`~diloco_ray.driver.policies.give_up_after`).
"""

from __future__ import annotations

from typing import Optional, Protocol

from diloco_ray.config.sections import Sections
from diloco_ray.control.step_feed import StepFeed
from diloco_ray.driver.decoupled_loop import DecoupledLoop
from diloco_ray.driver.holdout import HoldoutCheck
from diloco_ray.driver.host import Host, Recovery
from diloco_ray.driver.period_jobs import PeriodJobs
from diloco_ray.driver.policies import Action, RoundOutcome, give_up_after
from diloco_ray.driver.sync_loop import SyncLoop
from diloco_ray.observe.records import RoundRecord


class OuterLoop(Protocol):
    """Runs a run's outer updates, one :meth:`run_round` at a time."""

    steps: Optional[StepFeed]  # the ranks' step events and heartbeats (set once the run is set up)
    jobs: PeriodJobs  # what replicas launch from, and what they learn of their earlier sends

    round_index: int  # the next outer update (a round, or a merge), as the servers count it

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

    def run_round(self, host: Host) -> RoundOutcome:
        """Run the next outer update (a round, or a merge) as far as the loop can alone;
        how it ended (applied, with its record; or what the trainer must do first)."""
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
    margin = s.channel.region_holdout_margin
    holdout = HoldoutCheck(margin) if margin is not None else None
    return SyncLoop(**shared, checkpointing=s.checkpointing, inflight_root=inflight_root, holdout=holdout)


def apply_next_update(loop: OuterLoop, host: Recovery) -> RoundRecord:
    """Run ``loop``'s next outer update until it is applied, carrying out every other
    outcome on ``host`` (the trainer): its record.

    The one give-up rule of both modes: an update that is not applied in
    ``MAX_ROUND_RETRIES + 1`` calls in a row (a round run again, a merge that lost a
    replica's period or found none training, the servers restored) stops the run."""
    failures = 0
    while True:
        outcome = loop.run_round(host)
        if outcome.action is Action.PROCEED:
            return outcome.record
        failures += 1
        carry_out(give_up_after(outcome, failures, loop.round_index), host)


def carry_out(outcome: RoundOutcome, host: Recovery) -> None:
    """What the trainer does for an outcome that did not apply the update, before the
    loop's next call: stop the run, or restore the servers (the trainer then points the
    loop at them), and in every case bring the replica count back to its target."""
    if outcome.action is Action.STOP:
        raise RuntimeError(outcome.why)
    if outcome.action is Action.RECOVER_SERVER:
        host.recover_server()
    host.reconcile()
