"""One outer round, as the driver runs it: launch, collect, sync, commit, record.

:class:`RoundLoop` owns the round's state on the driver: the round index, what replicas
load next (:class:`Handout`), the launch counter and the work lost to faults. It talks to
the rest through a *host* (the trainer; a test's fake): ``server`` (the server group),
``members`` (``active`` and ``remove``), ``notify``, ``evaluate``, ``inject_faults``,
``recover_server`` and ``reconcile``; and it waits on refs only through ``calls``
(:class:`~diloco_ray.driver.calls.RayCalls`). So its decisions -- who reported, whether the
round proceeds, runs again, recovers the servers or stops, which version replicas are handed --
are unit-tested with fakes and no Ray (``tests/unit/driver/test_round_loop.py``).

A round is ``sync_fragments`` sync periods, each ending with one fragment's sync (one for
plain DiLoCo). Every period: launch the active replicas, collect what they report by the
deadline, hand the reports to the servers, and move the handout on. Then the commits are
read once, and the round proceeds with its record or says why it must run again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from ray.exceptions import RayActorError

from diloco_ray.algo import links
from diloco_ray.algo.outer import Rejection, sync_advances
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.driver.calls import RayCalls
from diloco_ray.driver.policies import RoundOutcome, attempt_verdict, eval_due, give_up_after, too_few_reported
from diloco_ray.driver.poll import PeriodPoll
from diloco_ray.observe.records import round_record
from diloco_ray.persist import snapshot
from diloco_ray.runtime.messages import Contribution, Launch, SnapshotPlan, SyncPeriod


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


@dataclass
class Period:
    """One sync period's results: what the replicas reported, and the servers' refs."""

    reported: dict
    refs: object


class RoundLoop:
    """Runs outer rounds for a host.

    Args:
        config: the job.
        inflight_root: the run's in-flight snapshot folder (for snapshot plans).
        calls: how refs are waited on (Ray's by default).
        steps: the step feed (``poll``, ``beats``, ``last_beats``), or None.
    """

    def __init__(self, config: TrainerConfig, inflight_root: str = "", calls=None, steps=None):
        self.config = config
        self.inflight_root = inflight_root
        self.calls = calls or RayCalls()
        self.steps = steps
        self.round_index = 0
        self.handout = Handout()
        self.reset = False  # replicas must reload everything (the servers were restored)
        self.restart = False  # the next launch re-runs a round: replicas restart from the global weights
        self.reset_inner: set[int] = set()  # replica ids whose inner state is poisoned (NaN/Inf rejected)
        self.resume_steps: dict[int, int] = {}  # slot -> in-flight step to continue from
        self.attempt = 0  # launches so far: keys aborts, so a re-run is not stopped by an old abort
        self.wasted_steps = 0  # replica inner steps this round whose work reached no applied update
        self.in_round = False  # a round has started and not yet been applied (see unmerged)

    @property
    def streaming(self) -> bool:
        return self.config.sync_fragments > 1

    def restore(self, server, reset: bool) -> None:
        """Point replicas at the servers' state: the latest sync's message (a resumed
        replica merges it; one without the weights loads everything first)."""
        version = server.version()
        messages = server.last_weights() if version else server.full_weights()
        self.handout = Handout(messages, full=version == 0, version=version)
        self.reset = reset

    # ---- the round, retried ------------------------------------------------------------
    def run_round(self, host) -> dict:
        """Run and apply one outer round, running it again while an attempt says so.

        A re-run starts every replica again from the global weights of the round (and,
        with ``restore_on_retry``, from its inner state at the round's start), on the
        same data plan: the cursor only moves when a round is applied.
        """
        self.wasted_steps = 0
        self.in_round = True
        attempts = 0
        while True:
            attempts += 1
            outcome = give_up_after(self.attempt_round(host), attempts, self.round_index)
            if outcome.action == "proceed":
                self.in_round = False
                return outcome.record
            if outcome.action == "stop":
                raise RuntimeError(outcome.why)
            if outcome.action == "recover_server":
                host.recover_server()
            self.restart = True
            host.reconcile()

    def attempt_round(self, host) -> RoundOutcome:
        """One attempt: the sync periods, the commit, the record."""
        t_start = time.perf_counter()
        members = list(host.members.active)
        host.notify("on_round_begin", self.round_index, len(members))
        try:
            ids = [rep.id for rep in members]
            plans = dict(zip(ids, host.server.data_plan(ids)))
        except RayActorError:
            return RoundOutcome("recover_server", why="a server died before the round")
        slots = {rep.id: slot for slot, rep in enumerate(members)}
        periods, late, failed, held = [], set(), set(), self.handout
        active = members
        for fragment in range(self.config.sync_fragments):
            launched = self._launch(host, active, slots, plans, fragment)
            poll = self._collect(launched)
            for rep, why in poll.failed:
                host.members.remove(rep, why)
            late |= set(poll.late)
            failed |= {rep.id for rep, _ in poll.failed}
            verdict = too_few_reported(len(poll.reported), self.config.min_replicas, self.streaming)
            if verdict is not None:
                self.wasted_steps += sum(s.inner_steps for stats in poll.reported.values() for s in stats[:1])
                return verdict
            periods.append(self._sync(host.server, fragment, launched, poll.reported, plans))
            active = [rep for rep in active if rep.id in poll.reported]  # one that missed a sync sits out the round
        try:
            applied = [self.calls.get(p.refs.commits)[0] for p in periods]
        except RayActorError:
            return RoundOutcome("recover_server", why="a server died during the sync")
        self._count_rejected(applied, periods)
        if not self.streaming:
            verdict = attempt_verdict(applied[0].applied, streaming=False)
            if verdict is not None:
                self.handout = held  # no new version: replicas keep what they hold
                return verdict
            self.handout.version += sync_advances(applied=True, streaming=False)
        t_applied = time.perf_counter()
        self.round_index = applied[-1].round + 1
        return RoundOutcome("proceed", record=self._record(host, applied, periods, late, failed, t_start, t_applied))

    # ---- the steps of an attempt -------------------------------------------------------
    def _launch(self, host, active: list, slots: dict, plans: dict, fragment: int) -> dict[int, Launch]:
        """Start one sync period on every active replica."""
        self.attempt += 1
        launched = {
            rep.id: Launch(rep, *rep.run_period(self._job(host, rep, slots[rep.id], fragment, plans[rep.id])))
            for rep in active
        }
        # Resume steps, a reload, a re-run's restart and a reset apply to the first period only.
        self.resume_steps, self.reset, self.restart = {}, False, False
        self.reset_inner -= set(launched)
        if fragment == 0:
            host.inject_faults()  # after the replicas have started, so faults hit a round in flight
        return launched

    def _collect(self, launched: dict[int, Launch]):
        cfg = self.config
        timeout = None if cfg.round_timeout_s is None else cfg.round_timeout_s / cfg.sync_fragments
        poll = PeriodPoll(launched, self.attempt, self.calls, self.steps, cfg.stall_timeout_s, cfg.abort_grace_s)
        result = poll.collect(timeout)
        self.wasted_steps += poll.wasted_steps
        return result

    def _sync(self, server, fragment: int, launched: dict, reported: dict, plans: dict) -> Period:
        """Hand the reports to the servers; the handout moves on to the sync's message."""
        # Each replica counts by the tokens that carried loss (see diloco_ray.algo.loss).
        weight = {rid: float(sum(s.loss_tokens for s in stats)) for rid, stats in reported.items()}
        contributions = [
            [Contribution(rid, launched[rid].buffers[s], weight[rid]) for rid in reported] for s in range(len(server))
        ]
        # With inner_time_s, what each replica had no time for goes back to the cursor.
        unused = {rid: stats[0].unused for rid, stats in reported.items() if stats[0].unused}
        refs = server.sync(fragment, contributions, plans, unused)
        # A streaming sync's message is a new version whatever its commit says; a plain
        # sync's becomes one only once its commit says it applied (attempt_round).
        advanced = sync_advances(applied=False, streaming=self.streaming)
        self.handout = Handout(refs.weights, full=False, version=self.handout.version + advanced)
        return Period(reported, refs)

    def _count_rejected(self, applied: list, periods: list[Period]) -> None:
        for info, period in zip(applied, periods):
            # A replica rejected for NaN/Inf starts its next period with a fresh inner state.
            self.reset_inner |= {rid for rid, why in info.rejected.items() if why.reason is Rejection.NON_FINITE}
            self.wasted_steps += sum(
                stats[0].inner_steps for rid, stats in period.reported.items() if rid not in info.accepted
            )

    def _record(self, host, applied, periods, late, failed, t_start, t_applied) -> dict:
        t_eval = time.perf_counter()
        eval_loss = self._evaluate(host)
        eval_seconds = time.perf_counter() - t_eval
        record = round_record(self.config, applied, [p.reported for p in periods], late, failed)
        record["wasted_steps"] = self.wasted_steps
        record.update(
            eval_loss=eval_loss,
            eval_ppl=math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
            round_seconds=time.perf_counter() - t_start,
            sync_seconds=max(0.0, (t_applied - t_start) - record["compute_seconds"]),
            eval_seconds=eval_seconds,
            eval_bytes_down=host.eval_bytes_down,
        )
        return record

    def _evaluate(self, host):
        """After the round just applied (``round_index`` is the next one), when ``eval_every``
        says so (None otherwise)."""
        due = eval_due(self.round_index - 1, self.round_index, self.config.eval_every, self.finished())
        return host.evaluate(due=due)

    def finished(self) -> bool:
        """Whether the run has trained what it was asked to (``diloco_loops`` rounds)."""
        return self.round_index >= self.config.diloco_loops

    def unmerged(self, replicas: list) -> dict[int, tuple[int, int]]:
        """Replica id -> (launch attempt, round) of its period whose work is not in the
        weights yet: between rounds none; inside a round (told to stop in it) every
        replica's, which a stop rewinds to the round's start."""
        return {rep.id: (self.attempt, self.round_index) for rep in replicas} if self.in_round else {}

    @property
    def progress(self) -> float:
        """Rounds applied so far: what checkpoints fall due by (``checkpoint_steps``)."""
        return float(self.round_index)

    def _job(self, host, rep, slot: int, fragment: int, plan: list) -> SyncPeriod:
        """What every rank of ``rep`` gets for one sync period (see RankWorker.run_period)."""
        cfg = self.config
        return SyncPeriod(
            round=self.round_index,
            fragment=fragment,
            plan=plan,
            attempt=self.attempt,
            messages=self.handout.messages,
            full=self.handout.full,
            version=self.handout.version,
            servers=host.server.actors,
            reset=self.reset,
            restart=self.restart,
            reset_inner=rep.id in self.reset_inner,
            board=self.steps.board if self.steps is not None else None,
            link=links.link_for_slot(cfg.link_mbps, cfg.link_latency_ms, slot),
            snapshots=self._snapshot_plan(slot) if fragment == 0 else None,
        )

    def _snapshot_plan(self, slot: int) -> Optional[SnapshotPlan]:
        """In-flight snapshot settings for the replica in ``slot`` (None: not needed,
        because round checkpoints already come at least as often)."""
        every = self.config.checkpoint_steps
        if every is None or every >= self.config.max_steps:
            return None
        return SnapshotPlan(
            folder=snapshot.round_dir(self.inflight_root, self.round_index),
            slot=slot,
            every=every,
            resume_step=self.resume_steps.get(slot),
        )
