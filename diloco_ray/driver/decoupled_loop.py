"""Decoupled mode on the driver: replicas on their own clocks, merged as they arrive.

:class:`DecoupledLoop` keeps one sync period in flight per active replica, each with its
own data plan reserved on the server (:meth:`~diloco_ray.runtime.server.ParameterServer.reserve_plan`)
and its own starting point. It is the synchronous :class:`~diloco_ray.driver.sync_loop.SyncLoop`'s
sibling (one loop interface, :class:`~diloco_ray.driver.loop.OuterLoop`, over one
:class:`~diloco_ray.driver.host.Host`), launching from the same kind of
:class:`~diloco_ray.driver.period_jobs.PeriodJobs`. One call of :meth:`DecoupledLoop.run_round`
is one outer step (a *merge*; ``round_index`` counts them, as it counts a synchronous
loop's rounds), or as much of one as the loop can take alone:

1. launch every active replica that is not training (new ones, and the ones just merged),
   from the newest weights, a period that would end well after others' arrivals cut to
   land with them (:meth:`~diloco_ray.algo.merge_timing.MergeTiming.plan_launches`), then
   carry out the fault plan's server and driver faults due in this merge (as a
   synchronous round does once its replicas have started);
2. collect every report that is ready at each poll; a replica that dies gives its plan
   back and the call returns at once (``RUN_AGAIN``), so that the trainer replaces it (a
   hot spare steps in without waiting for a merge) and calls again to go on with the same
   merge; one that shows no step for ``stall_timeout_s`` is told to stop, and dropped
   as unresponsive if it cannot within ``abort_grace_s`` (a frozen process);
3. once ``min_quorum`` contributions are in, wait for the replicas expected within the
   grace window (``grace_fraction`` of a period, at most ``grace_window_s``:
   :meth:`~diloco_ray.algo.merge_timing.MergeTiming.merge_deadline`), then merge:
   each contribution weighted by its tokens and discounted by its staleness, divided by
   one round's worth of tokens (:func:`~diloco_ray.algo.decoupled.merge_weighting`);
4. when the merge completes ``eval_every`` rounds' worth of tokens (and at the end), evaluate on a
   replica that was merged (it is idle; the others keep training), and return the
   merge's record (``PROCEED``). Evaluating at every merge would keep merged replicas idle more often,
   and these points line up with a synchronous run's rounds (equal tokens).

If a parameter server dies, the merge is abandoned as a unit: every period in flight is
let finish and thrown away (it trained from weights the restored servers never had), and
the call returns ``RECOVER_SERVER``: the trainer restores the servers from the last
checkpoint and points the loop at them (:meth:`DecoupledLoop.restore`), the merges since
it are run again on the data its cursor hands out again, and every replica reloads the
restored weights. The run ends when ``diloco_loops`` rounds' worth of tokens has been
merged (``work``), so a decoupled run trains on as many tokens as a synchronous one.
"""

from __future__ import annotations

import time
from typing import Optional

from diloco_ray.algo import decoupled as decoupled_math
from diloco_ray.algo.merge_timing import InFlight, MergeTiming, Pace
from diloco_ray.config.sections import (
    DecoupledSection,
    EvalSection,
    MembershipSection,
    RunShapeSection,
    SyncCodecSection,
)
from diloco_ray.control.calls import RayCalls, ServerLost, check_servers, server_call
from diloco_ray.control.poll import STEP_POLL_S
from diloco_ray.driver.flights import Flight, FlightPoll, Lost
from diloco_ray.driver.host import Host
from diloco_ray.driver.period_jobs import Handout, PeriodJobs
from diloco_ray.driver.policies import Action, RoundOutcome
from diloco_ray.driver.round_parts import (
    RoundRecorder,
    per_server,
    token_weights,
    unused_ranges,
    wasted,
)
from diloco_ray.observe.records import MergeFacts, RoundRecord, Syncs
from diloco_ray.runtime.messages import AppliedRound, Launch, SyncPeriod


class DecoupledLoop:
    """Runs decoupled outer steps (merges) for a host.

    Args:
        run: the run's shape (``diloco_loops`` rounds' worth of ``max_steps`` inner steps).
        decoupled: how merges are made (quorum, grace window, staleness, momentum).
        sync_codec: the syncs (the links the jobs carry; ``sync_fragments`` for the record).
        membership: when a silent replica is stopped (``stall_timeout_s``, ``abort_grace_s``).
        evaluation: when to evaluate (``eval_every``).
        calls: how refs are waited on and the time read (Ray's and the wall clock by default).
        steps: the step feed, or None.
    """

    def __init__(
        self,
        *,
        run: RunShapeSection,
        decoupled: DecoupledSection,
        sync_codec: SyncCodecSection,
        membership: MembershipSection,
        evaluation: EvalSection,
        calls=None,
        steps=None,
    ):
        self.run, self.decoupled, self.sync_codec = run, decoupled, sync_codec
        self.membership = membership
        self.calls = calls or RayCalls()
        self.steps = steps
        self.round_index = 0  # the next merge (the servers' round index between merges)
        self.jobs = PeriodJobs(sync_codec)
        self.recorder = RoundRecorder(run, sync_codec, membership, evaluation)
        self.reset = False  # the servers were restored: every replica reloads (see reload)
        self.wasted_steps = 0  # replica inner steps this merge whose work reached no applied update
        self.flights: dict[int, Flight] = {}
        self.arrived: dict[int, Flight] = {}
        self.rejected: set[int] = set()  # arrived, and rejected by the merge: already in wasted_steps
        self.pace = Pace(run.max_steps)
        self.timing = MergeTiming(
            self.pace, decoupled.grace_fraction, decoupled.grace_window_s, decoupled.align_periods
        )
        # What stands in for a replica not in a merge, and the hindsight count of work.
        self.token_ledger = decoupled_math.TokenLedger()
        self.work = 0.0  # rounds' worth of tokens merged, from the server's last commit
        self.work_before = 0.0  # the same before the last merge
        self.failed: set[int] = set()
        self.reload: set[int] = set()  # replica ids whose next period reloads every weight
        self._staleness: dict[int, int] = {}
        self._applied_share = 0.0
        self.in_merge = False  # a merge has started and not been applied yet
        self.started: Optional[float] = None  # when the current attempt at the merge began

    # ---- what the trainer asks of its loop (driver.loop.OuterLoop) ----------------------
    @property
    def progress(self) -> float:
        """Rounds' worth of tokens merged: what checkpoints fall due by."""
        return self.work

    def finished(self) -> bool:
        """Whether ``diloco_loops`` rounds' worth of tokens has been merged."""
        return self.work + decoupled_math.CYCLE_EPS >= self.run.diloco_loops

    def restore(self, server, reset: bool) -> None:
        """Take up the servers' state: their merge count, latest message and work
        (``reset``: every replica reloads everything first)."""
        self.round_index = self.jobs.restore(server)
        self.reset = reset
        self.work = self.work_before = server.work()
        self.token_ledger.rewind(self.round_index)  # the merges since the servers' state are undone

    def resume_in_flight(self, replicas: list) -> None:
        """Nothing to resume: this mode takes no in-flight snapshots (the config refuses
        ``checkpoint_steps`` below ``max_steps``; a resumed run trains in-flight data again)."""

    def unmerged(self, replicas: list) -> dict[int, tuple[int, int]]:
        """Replica id -> (launch attempt, round index) of each period not merged yet (in
        flight, or arrived and waiting for the merge)."""
        return {rid: (f.attempt, f.round_index) for rid, f in {**self.flights, **self.arrived}.items()}

    # ---- one merge, recovered as a unit ------------------------------------------------
    def run_round(self, host: Host) -> RoundOutcome:
        """Run the merge (the trainer's round) as far as the loop can alone, and say how it
        ended: merged (``PROCEED`` with its record); a replica's period was lost, or none is
        training (``RUN_AGAIN``: the trainer replaces lost replicas, and the next call goes
        on with the same merge, launching the idle ones); or a server died (``RECOVER_SERVER``:
        every period in flight was let finish and thrown away, and the next call starts the
        merge again on the restored servers)."""
        if not self.in_merge:  # a new merge: its wasted steps and failures count from zero
            self.wasted_steps, self.failed, self.in_merge = 0, set(), True
        try:
            if self.started is None:
                self._begin(host)
            else:
                self._launch_idle(host)  # the trainer has replaced the lost replicas
            why = self._wait_for_merge(host)
            if why is not None:
                return RoundOutcome(Action.RUN_AGAIN, why=why)
            record = self._merge_and_record(host)
        except ServerLost as lost:
            self._throw_away_in_flight(host)
            self.started = None
            return RoundOutcome(Action.RECOVER_SERVER, why=str(lost))
        self.in_merge, self.started = False, None
        return RoundOutcome(Action.PROCEED, record=record)

    def _begin(self, host: Host) -> None:
        """Start an attempt at the merge: launch the idle replicas, then fire the faults due."""
        self.started = time.perf_counter()
        host.notify("on_round_begin", self.round_index, len(host.members.active))
        self._launch_idle(host)
        host.inject_faults()  # after the replicas have started, so faults hit a merge in flight

    def _merge_and_record(self, host: Host) -> RoundRecord:
        t_merge = time.perf_counter()
        applied, merged = self._merge(host)
        t_applied = time.perf_counter()
        self.round_index = applied.round + 1 if applied.applied else self.round_index
        syncs = Syncs([applied], [merged], late=set(), failed=self.failed)

        def facts() -> dict:
            merge = MergeFacts(
                staleness={str(rid): self._staleness[rid] for rid in applied.accepted},
                applied_weight=self._applied_share,
                in_flight=sorted(self.flights),
                work=applied.work if applied.applied else self.work,
                merge_seconds=t_applied - t_merge,
            )
            return dict(merge=merge, abandoned_steps=self._abandoned())

        # Evaluated on a replica just merged: it is idle, while the others go on training.
        record = self.recorder.record(
            host,
            syncs,
            self.wasted_steps,
            marks=(self.started, t_applied),
            progress=(self.work_before, self.work),
            finished=self.finished(),
            among=list(self.arrived),
            facts=facts,
        )
        self.arrived, self.rejected = {}, set()
        return record

    def _abandoned(self) -> Optional[int]:
        """When the run ends here: the steps of the periods still in flight, never merged
        (goodput counts them). None before the end."""
        if not self.finished():
            return None
        if self.steps is not None:
            self.steps.beats()
        return sum(self._flight_poll().steps_run(f) for f in self.flights.values())

    def _wait_for_merge(self, host: Host) -> Optional[str]:
        """Collect reports until the quorum is in and the grace window has passed (None);
        or why the trainer must replace replicas first: a period was lost, or none is left
        training or waiting to be merged."""
        deadline = None
        while True:
            wait = STEP_POLL_S if deadline is None else min(STEP_POLL_S, deadline - self.calls.now())
            lost = self._poll(host, max(0.0, wait))
            if lost is not None:
                return lost
            quorum = min(self.decoupled.min_quorum, max(1, len(host.members.active)))
            now = self.calls.now()
            training = self._training()
            deadline = self.timing.merge_deadline(now, len(self.arrived) >= quorum, training)
            if deadline is not None and (now >= deadline or not training):
                return None
            if not self.flights and not self.arrived:
                return "no replica is training"

    def _throw_away_in_flight(self, host: Host) -> None:
        """A server died: let every period in flight finish and throw it away (the trainer
        then restores the servers from the last checkpoint, and every replica reloads the
        weights: see :meth:`restore`)."""
        # Lost with the server: what arrived (merged or not), less what its merge rejected.
        self.wasted_steps += sum(f.stats[0].inner_steps for rid, f in self.arrived.items() if rid not in self.rejected)
        self.arrived, self.rejected = {}, set()
        poll = self._flight_poll()
        while self.flights:  # their plans went with the dead servers; the restored cursor has them
            done, lost = poll.poll(self.flights, STEP_POLL_S)
            self.wasted_steps += sum(poll.steps_run(flight) for _, flight in done)
            for gone in lost:
                self._lose(host, gone, server_alive=False)

    # ---- the steps of a merge ----------------------------------------------------------
    def _launch_idle(self, host: Host) -> None:
        """Start a sync period on every active replica that is not training."""
        if self.reset:  # the servers were restored: the weights replicas hold are not theirs
            self.reload = {rep.id for rep in host.members.active}
        idle = [(slot, rep) for slot, rep in enumerate(host.members.active) if rep.id not in self.flights]
        idle = [(slot, rep) for slot, rep in idle if rep.id not in self.arrived]
        now = self.calls.now()
        aims = dict.fromkeys((rep.id for _, rep in idle), None)
        if self.decoupled.min_quorum < len(host.members.active):  # (in lockstep every merge waits for all)
            aims = self.timing.plan_launches(now, self._training(), list(aims))
        for slot, rep in idle:
            self._launch(host, rep, slot, now, aims[rep.id])
        self.reset = False

    def _launch(self, host: Host, rep, slot: int, now: float, due: Optional[float]) -> None:
        """Start ``rep``'s period from the newest weights (``due``: the arrival its time
        budget aims at, None: a full period)."""
        plan = server_call(lambda: host.server.reserve_plan(rep.id), "reserving a plan")
        self.jobs.next_attempt()
        launch = Launch(rep, *rep.run_period(self._job(host, rep, slot, plan, now, due)))
        self.flights[rep.id] = Flight(
            launch,
            plan,
            version=self.jobs.handout.version,
            round_index=self.round_index,
            mark=self._mark(),
            launched_at=now,
            attempt=self.jobs.attempt,
            due=due,
            pending=set(launch.stats),
        )
        self.jobs.launched([rep.id])
        self.reload.discard(rep.id)

    def _job(self, host: Host, rep, slot: int, plan: list, now: float, due: Optional[float]) -> SyncPeriod:
        return self.jobs.job(
            host,
            rep,
            slot,
            index=self.round_index,
            fragment=0,
            plan=plan,
            board=self.steps.board if self.steps is not None else None,
            reset=rep.id in self.reload,
            # The inner lr schedule runs over the tokens merged, not over merges: a run that
            # takes more merges than diloco_loops would otherwise reach the schedule's end
            # (lr 0) early and train its last rounds' worth at no lr.
            schedule_step=round(self.work * self.run.max_steps),
            time_budget_s=self.timing.budget_s(rep.id, now, due) if due is not None else None,
        )

    def _mark(self) -> int:
        """The outer momentum steps taken so far (a period's staleness is counted from its mark)."""
        return decoupled_math.momentum_steps(self.jobs.handout.version, self.work, self.decoupled.decoupled_momentum)

    def _training(self) -> dict[int, InFlight]:
        """The periods in flight that may still report, as merge timing sees them."""
        return {rid: InFlight(f.launched_at, f.due) for rid, f in self.flights.items() if f.abort_by is None}

    def _poll(self, host: Host, wait: float) -> Optional[str]:
        """Move finished periods to ``arrived`` (their pace learned); a period stopped after
        a stall gives its plan back (the replica trains on from the newest weights). A lost
        replica leaves, and the poll says why (None: none was lost), so that the trainer
        replaces it at once (a spare, or a new replica, cut to land with the others)."""
        poll = self._flight_poll()
        done, lost = poll.poll(self.flights, wait)
        self._blame_servers_first(host, poll, done, lost)
        for gone in lost:
            self._lose(host, gone)
        stopped = False
        for rid, flight in done:
            if flight.aborted:  # told to stop: its work is lost, its data goes back
                self.wasted_steps += poll.steps_run(flight)
                server_call(lambda: host.server.release_plan(rid), "giving a plan back")
                stopped = True
                continue
            compute = max(s.compute_seconds for s in flight.stats)
            self.pace.observe(rid, self.calls.now() - flight.launched_at, compute, flight.stats[0].inner_steps)
            self.arrived[rid] = flight
        if lost:
            return "; ".join(self._why_lost(gone) for gone in lost)
        if stopped:
            self._launch_idle(host)
        return None

    def _blame_servers_first(self, host: Host, poll: FlightPoll, done: list, lost: list[Lost]) -> None:
        """A failed period may have failed because a server died: if so, raise ServerLost
        before any replica is blamed (the one that failed stays, idle, and is launched
        again on the restored servers); the periods this poll took are thrown away."""
        failed = [gone.flight for gone in lost if gone.why == "failed"]
        if not failed:
            return
        try:
            check_servers(host.server, "during the merge")
        except ServerLost:
            self.wasted_steps += sum(poll.steps_run(flight) for flight in [f for _, f in done] + failed)
            for gone in lost:
                if gone.why != "failed":
                    self._lose(host, gone, server_alive=False)
            raise

    @staticmethod
    def _why_lost(gone: Lost) -> str:
        """One line on a lost period: whose, why, and the last line of its error."""
        error = gone.error
        last = f" ({type(error).__name__}: {str(error).splitlines()[-1] if str(error) else ''})" if error else ""
        return f"replica {gone.replica_id}'s period was lost: {gone.why}{last}"

    def _flight_poll(self) -> FlightPoll:
        return FlightPoll(self.calls, self.steps, self.membership.stall_timeout_s, self.membership.abort_grace_s)

    def _lose(self, host: Host, gone: Lost, server_alive: bool = True) -> None:
        """A replica's period will never report: its steps are wasted, its plan goes back,
        and it leaves."""
        rid, flight = gone.replica_id, gone.flight
        self.wasted_steps += self._flight_poll().steps_run(flight)
        self.pace.forget(rid)
        self.failed.add(rid)
        self.jobs.note_dropped(flight.attempt, [rid])  # a member that comes back puts back what it sent
        host.members.remove(flight.launch.replica, gone.why)
        if server_alive:  # (a dead server's plans are gone with it: the restored cursor has them)
            server_call(lambda: host.server.release_plan(rid), "giving a plan back")

    def _merge(self, host: Host) -> tuple[AppliedRound, dict]:
        """One outer step from the contributions that arrived: the servers' report, and
        replica id -> the stats of each period merged."""
        version = self.jobs.handout.version
        # In replica id order, as a synchronous round sums them: with replicas in lockstep
        # the merge is then the synchronous round to the bit (a sum's order moves its last bits).
        self.arrived = dict(sorted(self.arrived.items()))
        merged = {rid: f.stats for rid, f in self.arrived.items()}
        weighting = self._weighting(host, merged)
        buffers = {rid: f.launch.buffers for rid, f in self.arrived.items()}
        contributions = per_server(buffers, weighting.weights, len(host.server), self._staleness)
        plans = {rid: f.plan for rid, f in self.arrived.items()}
        merge = (weighting.divisor, weighting.shares)
        refs = host.server.sync(0, contributions, plans, unused_ranges(merged), merge=merge)
        applied = server_call(lambda: self.calls.get(refs.commits)[0], "during the merge")
        for rid, flight in self.arrived.items():
            self.jobs.note_sync(flight.attempt, applied, [rid])
        self.rejected = {rid for rid in merged if rid not in applied.accepted}
        self.wasted_steps += wasted(merged, list(self.rejected))
        self.work_before = self.work
        if applied.applied:
            self.jobs.handout = Handout(refs.weights, full=False, version=version + 1)
            self.work = applied.work
        self._applied_share = sum(weighting.weights[rid] for rid in applied.accepted) / weighting.divisor
        return applied, merged

    def _weighting(self, host: Host, merged: dict) -> decoupled_math.Weighting:
        """Each contribution's weight (the tokens it trained on, discounted by its
        staleness) and one round's worth of tokens to divide by: the merged replicas'
        tokens, and for each active replica not merged the tokens of its own latest period
        (per rank, times its ranks: its ``world_size``) (:class:`~diloco_ray.algo.decoupled.TokenLedger`)."""
        tokens = token_weights(merged)
        ranks = {rid: self.arrived[rid].launch.replica.world_size for rid in merged}
        now = self._mark()
        self._staleness = {rid: now - f.mark for rid, f in self.arrived.items()}
        absent = {rep.id: rep.world_size for rep in host.members.active if rep.id not in merged}
        power = self.decoupled.staleness_power
        return self.token_ledger.weigh(tokens, ranks, absent, self._staleness, power, self.round_index)
