"""One synchronous outer round, as the driver runs it: launch, collect, sync, commit, record.

:class:`SyncLoop` owns the round's state on the driver: the round index, the launch state
it shares in kind with the decoupled loop (:class:`~diloco_ray.driver.period_jobs.PeriodJobs`:
what replicas load next, the launch counter), and the work lost to faults. It asks the
trainer for things only through the :class:`~diloco_ray.driver.host.Host` protocol, and
waits on refs only through ``calls`` (:class:`~diloco_ray.control.calls.RayCalls`). It
decides and the trainer acts: :meth:`SyncLoop.run_round` runs one attempt at a round and
returns how it ended (:class:`~diloco_ray.driver.policies.RoundOutcome`: proceed with the
record, run again, or recover the servers first), and the trainer carries that out
(:func:`~diloco_ray.driver.loop.apply_next_update`). So its decisions -- who reported,
what the attempt's outcome is, which version replicas are handed -- are unit-tested with
fakes and no Ray (``tests/unit/driver/test_sync_loop.py``).

A round is ``sync_fragments`` sync periods, each ending with one fragment's sync (one for
plain DiLoCo). Every period: launch the active replicas, collect what they report by the
deadline, hand the reports to the servers, and move the handout on. Then the commits are
read once, and the round proceeds with its record or says why it must run again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from diloco_ray.algo.outer import sync_advances
from diloco_ray.config.sections import (
    CheckpointSection,
    EvalSection,
    MembershipSection,
    RunShapeSection,
    SyncCodecSection,
)
from diloco_ray.control.calls import RayCalls, ServerLost, check_servers, server_call
from diloco_ray.control.poll import PeriodPoll
from diloco_ray.driver.holdout import HoldoutCheck, carries_update, refused
from diloco_ray.driver.host import Host
from diloco_ray.driver.period_jobs import Handout, PeriodJobs
from diloco_ray.driver.policies import (
    Action,
    RoundOutcome,
    attempt_verdict,
    too_few_reported,
)
from diloco_ray.driver.round_parts import (
    RoundRecorder,
    per_server,
    reported_counts,
    token_weights,
    unused_ranges,
    wasted,
)
from diloco_ray.observe.records import Syncs
from diloco_ray.persist import snapshot
from diloco_ray.runtime.messages import Launch, RoundPoll, SnapshotPlan


@dataclass
class Period:
    """One sync period's results: what the replicas reported, the servers' refs, and the
    launch attempt it ran as."""

    reported: dict
    refs: object
    attempt: int


@dataclass
class Periods:
    """The sync periods of one attempt at a round: those synced, who was late and who
    failed, and the verdict that ended the attempt early (None: every period synced)."""

    periods: list[Period] = field(default_factory=list)
    late: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    verdict: Optional[RoundOutcome] = None


class SyncLoop:
    """Runs synchronous outer rounds for a host.

    Args:
        run: the run's shape (``diloco_loops`` rounds of ``max_steps`` inner steps).
        sync_codec: the syncs (``sync_fragments`` per round; the links the jobs carry).
        membership: who must report and by when (``min_replicas``, ``round_timeout_s``,
            ``stall_timeout_s``, ``abort_grace_s``).
        evaluation: when to evaluate (``eval_every``).
        checkpointing: when ranks snapshot a round in flight (``checkpoint_steps``).
        inflight_root: the run's in-flight snapshot folder (for snapshot plans).
        calls: how refs are waited on (Ray's by default).
        steps: the step feed (``poll``, ``beats``, ``last_beats``), or None.
        holdout: the held-out check of the regions' contributions
            (``region_holdout_margin``), or None.
    """

    def __init__(
        self,
        *,
        run: RunShapeSection,
        sync_codec: SyncCodecSection,
        membership: MembershipSection,
        evaluation: EvalSection,
        checkpointing: CheckpointSection,
        inflight_root: str = "",
        calls=None,
        steps=None,
        holdout: Optional[HoldoutCheck] = None,
    ):
        self.run, self.sync_codec, self.membership = run, sync_codec, membership
        self.checkpointing = checkpointing
        self.inflight_root = inflight_root
        self.calls = calls or RayCalls()
        self.steps, self.holdout = steps, holdout
        self.round_index = 0  # the next round (the servers' round index between rounds)
        self.jobs = PeriodJobs(sync_codec)
        self.recorder = RoundRecorder(run, sync_codec, membership, evaluation)
        self.reset = False  # replicas must reload everything (the servers were restored)
        self.restart = False  # the next launch re-runs a round: replicas restart from the global weights
        self.resume_steps: dict[int, int] = {}  # slot -> in-flight step to continue from
        self.wasted_steps = 0  # replica inner steps this round whose work reached no applied update
        self.attempt_steps = 0  # inner steps this attempt's periods reported, less those counted wasted (rejected)
        self.in_round = False  # a round has started and not yet been applied (see unmerged)

    # ---- what the trainer asks of its loop (driver.loop.OuterLoop) ----------------------
    @property
    def progress(self) -> float:
        """Rounds applied so far: what checkpoints fall due by (``checkpoint_steps``)."""
        return float(self.round_index)

    def finished(self) -> bool:
        """Whether the run has trained what it was asked to (``diloco_loops`` rounds)."""
        return self.round_index >= self.run.diloco_loops

    def restore(self, server, reset: bool) -> None:
        """Take up the servers' state: their round, and their latest message (``reset``:
        every replica reloads everything first)."""
        self.round_index = self.jobs.restore(server)
        self.reset = reset

    def resume_in_flight(self, replicas: list) -> None:
        """Replicas resumed from a checkpoint continue the round from its in-flight
        snapshots, where every rank of theirs has one (``world_size``: a replica's ranks)."""
        folder = snapshot.round_dir(self.inflight_root, self.round_index)
        for slot, rep in enumerate(replicas):
            step = snapshot.common_step(folder, slot, rep.world_size)
            if step is not None:
                self.resume_steps[slot] = step

    def unmerged(self, replicas: list) -> dict[int, tuple[int, int]]:
        """Replica id -> (launch attempt, round) of its period whose work is not in the
        weights yet: between rounds none; inside a round (told to stop in it) every
        replica's, which a stop rewinds to the round's start."""
        return {rep.id: (self.jobs.attempt, self.round_index) for rep in replicas} if self.in_round else {}

    @property
    def streaming(self) -> bool:
        return self.sync_codec.sync_fragments > 1

    # ---- one attempt at the round --------------------------------------------------------
    def run_round(self, host: Host) -> RoundOutcome:
        """One attempt at the round, and how it ended: applied (``PROCEED`` with its
        record), or why it must run again (``RUN_AGAIN``), after the servers are restored
        (``RECOVER_SERVER``). The trainer carries a non-proceeding outcome out and calls
        again; a re-run starts every replica again from the global weights of the round
        (and, with ``restore_on_retry``, from its inner state at the round's start), on the
        same data plan: the cursor only moves when a round is applied."""
        if not self.in_round:  # a new round: its wasted steps count from zero
            self.wasted_steps, self.in_round = 0, True
        self.attempt_steps = 0
        try:
            outcome = self._attempt(host)
        except ServerLost as lost:
            # The round runs again on restored servers: what this attempt's periods
            # reported reaches no update (a period cut short counts in _collect).
            self.wasted_steps += self.attempt_steps
            outcome = RoundOutcome(Action.RECOVER_SERVER, why=str(lost))
        if outcome.action is Action.PROCEED:
            self.in_round = False
        else:
            self.restart = True
        return outcome

    def _attempt(self, host: Host) -> RoundOutcome:
        """The sync periods, the commit, the record."""
        t_start = time.perf_counter()
        members = list(host.members.active)
        host.notify("on_round_begin", self.round_index, len(members))
        ids = [rep.id for rep in members]
        plans = dict(zip(ids, server_call(lambda: host.server.data_plan(ids), "before the round")))
        held = self.jobs.handout
        run = self._run_periods(host, members, plans)
        if run.verdict is not None:
            return run.verdict
        periods = run.periods
        applied = [server_call(lambda p=p: self.calls.get(p.refs.commits)[0], "during the sync") for p in periods]
        self._count_rejected(applied, periods)
        if not self.streaming:
            verdict = attempt_verdict(applied[0].applied, streaming=False)
            if verdict is not None:
                self.jobs.handout = held  # no new version: replicas keep what they hold
                return verdict
            self.jobs.handout.version += sync_advances(applied=True, streaming=False)
        t_applied = time.perf_counter()
        self.round_index = applied[-1].round + 1
        syncs = Syncs(applied, [p.reported for p in periods], run.late, run.failed)
        record = self.recorder.record(
            host,
            syncs,
            self.wasted_steps,
            marks=(t_start, t_applied),
            progress=(self.round_index - 1, self.round_index),
            finished=self.finished(),
        )
        return RoundOutcome(Action.PROCEED, record=record)

    # ---- the steps of an attempt -------------------------------------------------------
    def _run_periods(self, host: Host, members: list, plans: dict) -> Periods:
        """Every sync period of the round, who was late and who failed; or, when too few
        reported, the verdict that ends the attempt."""
        slots = {rep.id: slot for slot, rep in enumerate(members)}
        run, active = Periods(), members
        for fragment in range(self.sync_codec.sync_fragments):
            launched = self._launch(host, active, slots, plans, fragment)
            poll = self._collect(host, launched)
            for rep, why in poll.failed:
                host.members.remove(rep, why)
            run.late |= set(poll.late)
            failed = {rep.id for rep, _ in poll.failed}
            # Neither reached this sync: a member that comes back (a region whose link was cut)
            # puts back what it sent, as a late one does.
            self.jobs.note_dropped(self.jobs.attempt, [*poll.late, *failed])
            run.failed |= failed
            replicas, regions = reported_counts(poll.reported)
            m = self.membership
            run.verdict = too_few_reported(replicas, m.min_replicas, self.streaming, regions, m.min_regions)
            if run.verdict is not None:
                self.wasted_steps += wasted(poll.reported, poll.reported)
                return run
            self.attempt_steps += wasted(poll.reported, poll.reported)
            run.periods.append(self._sync(host, fragment, launched, poll.reported, plans))
            active = [rep for rep in active if rep.id in poll.reported]  # one that missed a sync sits out the round
        return run

    def _launch(self, host: Host, active: list, slots: dict, plans: dict, fragment: int) -> dict[int, Launch]:
        """Start one sync period on every active replica."""
        self.jobs.next_attempt()
        launched = {
            rep.id: Launch(rep, *rep.run_period(self._job(host, rep, slots[rep.id], fragment, plans[rep.id])))
            for rep in active
        }
        # Resume steps, a reload, a re-run's restart and a reset apply to the first period only.
        self.resume_steps, self.reset, self.restart = {}, False, False
        self.jobs.launched(launched)
        if fragment == 0:
            host.inject_faults()  # after the replicas have started, so faults hit a round in flight
        return launched

    def _job(self, host: Host, rep, slot: int, fragment: int, plan: list):
        return self.jobs.job(
            host,
            rep,
            slot,
            index=self.round_index,
            fragment=fragment,
            plan=plan,
            board=self.steps.board if self.steps is not None else None,
            reset=self.reset,
            restart=self.restart,
            snapshots=self._snapshot_plan(slot) if fragment == 0 else None,
        )

    def _collect(self, host: Host, launched: dict[int, Launch]) -> RoundPoll:
        deadlines, fragments = self.membership, self.sync_codec.sync_fragments
        timeout = None if deadlines.round_timeout_s is None else deadlines.round_timeout_s / fragments
        poll = PeriodPoll(
            launched,
            self.jobs.attempt,
            self.calls,
            self.steps,
            deadlines.stall_timeout_s,
            deadlines.abort_grace_s,
            check_servers=lambda: check_servers(host.server, "during the round"),
        )
        try:
            return poll.collect(timeout)
        finally:  # a lost server ends the collection too: its periods' steps count
            self.wasted_steps += poll.wasted_steps

    def _sync(self, host: Host, fragment: int, launched: dict, reported: dict, plans: dict) -> Period:
        """Hand the reports to the servers (a region's contribution tried first, with the
        held-out check); the handout moves on to the sync's message."""
        server = host.server
        buffers = {rid: launched[rid].buffers for rid in reported}
        contributions = per_server(buffers, token_weights(reported), len(server))
        if self.holdout is not None:
            tried = [rid for rid, stats in reported.items() if carries_update(rid, stats[0])]
            contributions = refused(contributions, self.holdout.refusals(host, contributions, tried))
        refs = server.sync(fragment, contributions, plans, unused_ranges(reported))
        # A streaming sync's message is a new version whatever its commit says; a plain
        # sync's becomes one only once its commit says it applied (attempt_round).
        advanced = sync_advances(applied=False, streaming=self.streaming)
        self.jobs.handout = Handout(refs.weights, full=False, version=self.jobs.handout.version + advanced)
        return Period(reported, refs, self.jobs.attempt)

    def _count_rejected(self, applied: list, periods: list[Period]) -> None:
        """The commits' rejected replicas: their steps move from the attempt's tally to the
        wasted ones (counted once, should the attempt still be lost with a server)."""
        for info, period in zip(applied, periods):
            self.jobs.note_sync(period.attempt, info, period.reported)
            rejected = wasted(period.reported, [rid for rid in period.reported if rid not in info.accepted])
            self.wasted_steps += rejected
            self.attempt_steps -= rejected

    def _snapshot_plan(self, slot: int) -> Optional[SnapshotPlan]:
        """In-flight snapshot settings for the replica in ``slot`` (None: not needed,
        because round checkpoints already come at least as often)."""
        every = self.checkpointing.checkpoint_steps
        if every is None or every >= self.run.max_steps:
            return None
        return SnapshotPlan(
            folder=snapshot.round_dir(self.inflight_root, self.round_index),
            slot=slot,
            every=every,
            resume_step=self.resume_steps.get(slot),
        )
