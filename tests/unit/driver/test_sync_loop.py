"""The round loop without Ray: fake servers, fake replicas, faults from a declarative plan.

As Ray Train tests its controller with a dummy worker group, these drive
:class:`~diloco_ray.driver.sync_loop.SyncLoop` with plain objects: a ref is a value (or an
error) that is ready or never will be, a replica answers from the config's ``fault_plan``,
and the server group applies what it is given by the rules the real one keeps (a replica
rejected anywhere is rejected everywhere; a sync advances the version when it applies, or
always when streaming). Each test checks the decision the math and the docs say: who is
applied, who is dropped and why, what version replicas are handed, what is run again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from conftest import tiny_config
from ray.exceptions import RayActorError

from diloco_ray.algo.outer import Rejected, Rejection
from diloco_ray.config import fault_plan
from diloco_ray.control.calls import ServerLost
from diloco_ray.control.poll import STEP_POLL_S
from diloco_ray.driver.loop import apply_next_update, loop_for
from diloco_ray.observe.records import Evaluation
from diloco_ray.regions import wire
from diloco_ray.runtime.messages import AppliedRound, RoundStats
from diloco_ray.runtime.server_group import SyncRefs


@dataclass(eq=False)
class Ref:
    """A fake object ref: a value, or an error raised on get; ``ready`` False never arrives."""

    value: Any = None
    error: Optional[BaseException] = None
    ready: bool = True


class Calls:
    """The loop's calls over fake refs, on a clock of their own: a wait that finds nothing
    new lasts its whole timeout (an unbounded one a second), one that does a millisecond."""

    def __init__(self):
        self.clock = 1000.0

    def ready(self, refs, timeout_s):
        ready = [r for r in refs if r.ready]
        self.clock += 0.001 if ready else (1.0 if timeout_s is None else timeout_s)
        return ready

    def all_ready(self, refs, timeout_s):
        ready = [r for r in refs if r.ready]
        self.clock += 0.001 if len(ready) == len(refs) else (1.0 if timeout_s is None else timeout_s)
        return ready

    def now(self):
        return self.clock

    def get(self, refs, timeout_s=None):
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value


class Replica:
    """A replica of ``ranks`` ranks whose periods end as the fault plan says (each fault once)."""

    judged_by_steps = True  # its ranks beat (the Beats below), as a real replica's

    def __init__(self, rid: int, plan: list, ranks: int = 1, steps: int = 4):
        self.id, self.plan, self.ranks, self.steps = rid, plan, ranks, steps
        self.world_size = ranks
        self.jobs, self.aborted, self.stopped, self.fired = [], [], False, set()
        self.kinds, self.stats = set(), []

    def run_period(self, job):
        self.jobs.append(job)
        mine = fault_plan.for_rank(self.plan, self.id, 0)
        due = [f for f in mine if f.round == job.period.round and f.key not in self.fired][:1]  # one per launch
        self.fired |= {f.key for f in due}
        self.kinds = {f.kind for f in due}
        payload = ("nan" if "nan" in self.kinds else "ok", self.id)
        self.stats = []
        for rank in range(self.ranks):
            if "kill" in self.kinds:
                self.stats.append(Ref(error=RayActorError()))
            elif self.kinds & {"freeze", "slow"}:
                stopped = RoundStats(rank, 1, 0, 0.0, 0.0, 0.0, 0, aborted=True)
                self.stats.append(Ref(stopped, ready=False))
            else:
                stats = RoundStats(rank, self.steps, 100, 2.0, 0.1, 0.0, 1000, loss_tokens=10 * (self.id + 1))
                self.stats.append(Ref(stats))
        return [[Ref(payload) for _ in range(self.ranks)]], self.stats

    def abort(self, attempt: int) -> None:
        self.aborted.append(attempt)
        if "slow" in self.kinds:  # a slow replica stops at its next step; a frozen one never answers
            for ref in self.stats:
                ref.ready = True

    def stop(self) -> None:
        self.stopped = True


class Members:
    def __init__(self, replicas):
        self.active, self.removed = list(replicas), []

    def remove(self, rep, why):
        self.active.remove(rep)
        self.removed.append((rep.id, why))


class Servers:
    """One fake server: the data cursor hands each replica 10 rows a round; a commit
    applies the weighted contributions that are not NaN."""

    def __init__(self, streaming: bool):
        self.streaming, self.version, self.round, self.fragment = streaming, 0, 0, 0
        self.actors, self.dead, self.synced = [], False, []

    def __len__(self):
        return 1

    def ping(self):
        if self.dead:
            raise RayActorError()

    def data_plan(self, replica_ids):
        self.ping()
        return [[(10 * i, 10)] for i in range(len(replica_ids))]

    def sync(self, fragment, contributions, plans, unused=None):
        (mine,) = contributions
        self.synced.append({c.replica_id: c.weight for c in mine})
        nan = Rejected(Rejection.NON_FINITE, "non-finite values in 'w'")
        rejected = {c.replica_id: nan for c in mine if c.refs[0].value[0] == "nan"}
        accepted = [c.replica_id for c in mine if c.replica_id not in rejected]
        applied = bool(accepted)
        round_index = self.round
        done = fragment == (2 if self.streaming else 1) - 1
        if (applied or self.streaming) and not self.dead:  # a dead server commits nothing
            self.version += 1
            if done:
                self.round += 1
        info = AppliedRound(
            applied=applied,
            round=round_index,
            fragment=fragment,
            outer_lr=0.7,
            pseudo_grad_norm=1.0 if applied else None,
            accepted=accepted,
            rejected=rejected,
            data_ranges={rid: plans[rid] for rid in accepted} if done else {},
            round_done=done,
        )
        commit = Ref(error=RayActorError()) if self.dead else Ref(info)
        return SyncRefs(commits=[commit], weights=[f"weights v{self.version}"])


@dataclass
class Host:
    """What the loop asks of the trainer (driver.host.Host)."""

    server: Servers
    members: Members
    plan: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def notify(self, hook, *args):
        self.calls.append(hook)

    def evaluate(self, among=None, due=True):
        return Evaluation(1.5 if due else None)

    def inject_faults(self):
        fired = frozenset(c for c in self.calls if isinstance(c, tuple))
        for f in fault_plan.due(self.plan, self.server.round, fired=fired, target="server"):
            self.calls.append(f.key)
            self.server.dead = True
            self.calls.append(f"kill server {f.index}")

    def recover_server(self):
        self.calls.append("recover_server")
        self.server.dead = False

    def reconcile(self):
        self.calls.append("reconcile")


def make(tmp_path, replicas=2, faults=None, **overrides):
    cfg = tiny_config(tmp_path / "run", num_replicas=replicas, fault_plan=faults, **overrides)
    plan = fault_plan.parse(cfg.fault_plan)
    reps = [Replica(i, plan) for i in range(replicas)]
    host = Host(Servers(streaming=cfg.sync_fragments > 1), Members(reps), plan)
    return loop_for(cfg.sections(), "", calls=Calls()), host, reps


def test_every_replica_reports_and_the_round_is_applied(tmp_path):
    loop, host, reps = make(tmp_path)
    record = apply_next_update(loop, host).to_record()
    assert record["replicas"] == 2 and record["dropped"] == [] and record["eval_loss"] == 1.5
    assert host.server.synced == [{0: 10.0, 1: 20.0}]  # each weighted by the tokens that carried loss
    assert loop.round_index == 1 and loop.jobs.handout.version == 1 == host.server.version
    assert loop.jobs.handout.messages == ["weights v1"] and not loop.jobs.handout.full
    assert [job.version for job in reps[0].jobs] == [0]


def test_eval_every_evaluates_every_nth_round_and_the_last(tmp_path):
    loop, host, reps = make(tmp_path, eval_every=2, diloco_loops=5)
    losses = [apply_next_update(loop, host).evaluation.loss for _ in range(5)]
    assert losses == [None, 1.5, None, 1.5, 1.5]  # after rounds 2 and 4, and the last (5)


def test_a_killed_replica_is_dropped_and_the_others_are_applied(tmp_path):
    loop, host, reps = make(tmp_path, replicas=3, faults=[{"kind": "kill", "replica": 1, "round": 0}])
    record = apply_next_update(loop, host).to_record()
    assert host.members.removed == [(1, "failed")] and reps[1].stopped
    assert record["replica_ids"] == [0, 2] and record["dropped"] == [1]
    assert host.server.synced == [{0: 10.0, 2: 30.0}]
    assert loop.wasted_steps == 0  # it reported nothing: no steps of it are counted as run


def test_too_few_reporting_runs_the_round_again_from_the_same_plan(tmp_path):
    loop, host, reps = make(tmp_path, faults=[{"kind": "kill", "replica": 1, "round": 0}], min_replicas=2)
    host.reconcile = lambda: host.members.active.append(reps[1])  # a replacement joins at the boundary
    record = apply_next_update(loop, host).to_record()
    assert host.members.removed == [(1, "failed")]
    assert len(host.server.synced) == 1 and record["replicas"] == 2 and loop.round_index == 1
    first, again = reps[0].jobs
    assert not first.restart and again.restart  # the re-run starts from the round's global weights
    assert again.plan == first.plan and again.period.round == first.period.round == 0  # on the same data
    assert again.version == first.version == 0 and again.period.attempt > first.period.attempt
    assert loop.wasted_steps == 4  # replica 0's round, run twice


def test_a_round_never_applied_is_fatal_after_the_retries(tmp_path):
    faults = [{"kind": "nan", "replica": 0, "round": 0, "step": s} for s in range(4)]  # every attempt
    loop, host, reps = make(tmp_path, replicas=1, faults=faults)
    with pytest.raises(RuntimeError, match=r"round 0: not applied in 4 attempts \(the last: no update applied"):
        apply_next_update(loop, host)
    assert host.calls.count("on_round_begin") == 4 and host.calls.count("reconcile") == 3  # between the attempts
    assert loop.jobs.handout.version == 0 and loop.jobs.handout.messages == []  # replicas keep what they hold


def test_a_nan_replica_is_rejected_and_restarts_with_a_fresh_inner_state(tmp_path):
    loop, host, reps = make(tmp_path, faults=[{"kind": "nan", "replica": 0, "round": 0}])
    record = apply_next_update(loop, host).to_record()
    assert record["replica_ids"] == [1] and "non-finite" in record["rejected"]["0"]
    assert loop.wasted_steps == 4  # its round's steps reached no update
    apply_next_update(loop, host)
    assert [j.reset_inner for j in reps[0].jobs] == [False, True]
    assert [j.reset_inner for j in reps[1].jobs] == [False, False]


def test_a_lost_server_is_recovered_and_the_round_runs_again(tmp_path):
    faults = [{"kind": "kill", "target": "server", "round": 0}]
    loop, host, reps = make(tmp_path, faults=faults)
    record = apply_next_update(loop, host).to_record()
    assert host.calls.index("kill server 0") < host.calls.index("recover_server") < host.calls.index("reconcile")
    assert record["round"] == 0 and loop.round_index == 1
    assert [j.restart for j in reps[0].jobs] == [False, True]  # the re-run starts from the global weights
    assert record["wasted_steps"] == 2 * 4  # both replicas' first periods reported, then were thrown away


def test_an_update_whose_server_dies_in_its_eval_counts_each_wasted_step_once(tmp_path):
    """The commit rejected replica 0 (NaN) and applied replica 1; then the eval finds a
    server dead: the round runs again on restored servers. Each first-attempt period is
    wasted once (bug: the rejected one was counted at the commit and again with the attempt)."""
    loop, host, reps = make(tmp_path, faults=[{"kind": "nan", "replica": 0, "round": 0}])
    lost = iter([ServerLost("a server died during the eval")])

    def evaluate(among=None, due=True):
        for error in lost:
            raise error
        return Evaluation(1.5)

    host.evaluate = evaluate
    record = apply_next_update(loop, host).to_record()
    assert "recover_server" in host.calls and [j.restart for j in reps[1].jobs] == [False, True]
    assert record["wasted_steps"] == 2 * 4


def test_a_period_failed_by_a_dead_server_restores_the_servers_and_keeps_its_replica(tmp_path):
    """Replica 0's period fails because the server it fetches from died (as a rank's does
    when the weights' ref is lost with its server): the servers are asked before the replica
    is blamed, so the round is run again on restored servers with both replicas, and the
    one still training is told to stop rather than dropped."""
    faults = [{"kind": "kill", "target": "server", "round": 0}, {"kind": "kill", "replica": 0, "round": 0}]
    loop, host, reps = make(tmp_path, faults=faults, round_timeout_s=10.0)  # (on the fake clock)
    reps[1].plan = fault_plan.parse([{"kind": "slow", "replica": 1, "round": 0, "seconds": 1}])
    loop.steps = Beats(alive={1}, calls=loop.calls)  # replica 1 beats step 3 before it is stopped
    record = apply_next_update(loop, host).to_record()
    assert record["wasted_steps"] == 3  # the steps of the cut-short attempt: replica 1's 3, replica 0's none
    assert host.calls.index("kill server 0") < host.calls.index("recover_server") < host.calls.index("reconcile")
    assert host.members.removed == [] and not reps[0].stopped and reps[1].aborted == [1]
    assert record["replica_ids"] == [0, 1] and record["round"] == 0 and record["dropped"] == []
    assert [j.restart for j in reps[0].jobs] == [False, True]


def test_streaming_hands_each_period_the_next_version_before_its_commit(tmp_path):
    loop, host, reps = make(tmp_path, sync_fragments=2, max_steps=4)
    apply_next_update(loop, host)
    apply_next_update(loop, host)
    assert [j.version for j in reps[0].jobs] == [0, 1, 2, 3]
    assert [j.period.fragment for j in reps[0].jobs] == [0, 1, 0, 1]
    assert loop.jobs.handout.version == host.server.version == 4  # one count, by one rule


def test_a_frozen_replica_is_stopped_at_the_deadline_and_dropped(tmp_path):
    faults = [{"kind": "freeze", "replica": 1, "round": 0}]
    loop, host, reps = make(tmp_path, faults=faults, round_timeout_s=0.01, abort_grace_s=0.01)
    record = apply_next_update(loop, host).to_record()
    assert reps[1].aborted == [loop.jobs.attempt]
    assert host.members.removed == [(1, "unresponsive")] and reps[1].stopped
    assert record["dropped"] == [1] and record["late"] == [] and record["replica_ids"] == [0]


def test_a_slow_replica_stops_when_told_and_stays(tmp_path):
    faults = [{"kind": "slow", "replica": 1, "round": 0, "seconds": 1.0}]
    loop, host, reps = make(tmp_path, faults=faults, round_timeout_s=STEP_POLL_S / 100, abort_grace_s=0.01)
    record = apply_next_update(loop, host).to_record()
    assert host.members.removed == [] and record["late"] == [1] and record["replica_ids"] == [0]
    assert loop.wasted_steps == 1  # the step it had run when it stopped
    record = apply_next_update(loop, host).to_record()
    assert record["replica_ids"] == [0, 1]


@pytest.mark.parametrize("fragments", [1, 2])
def test_each_replica_hears_with_its_next_period_whether_what_it_sent_was_applied(tmp_path, fragments):
    """Error feedback keeps a send until its verdict: late (told to stop) is not applied, a
    NaN rejection is not either (and resets the replica), a sync that took it is; one that
    sat out a streaming round's later fragments hears of its one send."""
    faults = [{"kind": "slow", "replica": 1, "round": 0, "seconds": 1.0}, {"kind": "nan", "replica": 0, "round": 1}]
    loop, host, reps = make(
        tmp_path, faults=faults, round_timeout_s=STEP_POLL_S / 100, abort_grace_s=0.01, sync_fragments=fragments
    )
    apply_next_update(loop, host)
    round0 = [j.period.attempt for j in reps[0].jobs]
    apply_next_update(loop, host)
    round1 = [j.period.attempt for j in reps[0].jobs[fragments:]]
    assert reps[0].jobs[fragments].sent_verdicts == tuple((a, True) for a in round0)
    assert reps[1].jobs[1].sent_verdicts == ((round0[0], False),)  # late, then sat the round out
    apply_next_update(loop, host)
    assert reps[0].jobs[2 * fragments].reset_inner
    assert reps[0].jobs[2 * fragments].sent_verdicts[0] == (round1[0], False)  # rejected for NaN


class Beats:
    """A step feed whose board heard only from the ranks in ``alive`` (None: the board is
    lost), each of them just now by ``calls``' clock."""

    def __init__(self, alive, calls, board_lost=False):
        self.alive, self.calls, self.board_lost, self.last_beats, self.board = alive, calls, board_lost, {}, None
        self.polls = 0

    def poll(self):
        self.polls += 1

    def beats(self):
        if self.board_lost:
            return None
        self.last_beats = {(rid, 0): (1, 3, self.calls.now()) for rid in self.alive}  # attempt 1, step 3, now
        return self.last_beats


def test_a_frozen_replica_is_dropped_by_its_silence_without_a_deadline(tmp_path):
    loop, host, reps = make(tmp_path, faults=[{"kind": "freeze", "replica": 1, "round": 0}], stall_timeout_s=2.5)
    loop.steps = Beats(alive={0}, calls=loop.calls)  # replica 0 beats; replica 1 says nothing
    started = loop.calls.now()
    record = apply_next_update(loop, host).to_record()
    assert host.members.removed == [(1, "unresponsive")] and record["replica_ids"] == [0]
    # Judged at the first poll (one a STEP_POLL_S) past stall_timeout_s since the launch, not before.
    assert 2.5 < loop.calls.now() - started <= 2.5 + STEP_POLL_S + 0.1
    assert loop.steps.polls >= 1  # step events were passed on while waiting


def test_a_lost_board_judges_nobody(tmp_path):
    faults = [{"kind": "freeze", "replica": 1, "round": 0}]
    loop, host, reps = make(tmp_path, faults=faults, stall_timeout_s=0.01, round_timeout_s=0.2, abort_grace_s=0.01)
    loop.steps = Beats(alive=set(), calls=loop.calls, board_lost=True)
    record = apply_next_update(loop, host).to_record()
    assert record["dropped"] == [1]  # by the deadline, not by silence the lost board cannot vouch for
    assert reps[1].aborted == [1]


def test_a_regions_next_notice_in_a_round_is_the_one_the_home_sends(tmp_path):
    # With overlap a region starts a round's next period before its notice comes, from the
    # one the home sent ahead with the last notice; it must be the one the loop's next
    # launch makes, and never the next round's (a new data plan) or a re-run's.
    loop, host, reps = make(tmp_path, sync_fragments=2, overlap_communication=True, diloco_loops=2)
    for _ in range(2):
        apply_next_update(loop, host)

    def notice(job, region="eu"):
        keys = wire.message_keys("h1", job.version, 1)
        restore = {"id": "d1", "save": None}
        reply = wire.reply_key("h1", region, job.period)
        sent = wire.notice_of(job, keys, [], reply, restore, "h1", 2, region)
        return wire.Notice.from_wire(json.loads(json.dumps(sent.to_wire())))  # as it crosses

    sent = [notice(job) for job in reps[0].jobs]
    assert [(n.period.round, n.period.fragment) for n in sent] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sent[0].ahead == sent[1] and sent[2].ahead == sent[3]
    assert sent[1].ahead is None  # the round's last period: the next plan is not known
    assert notice(reps[0].jobs[0], "us").ahead != sent[1]  # another region's reply key


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_member_lost_mid_period_hears_when_it_is_back_that_its_send_was_not_applied(tmp_path, fragments):
    """A region cut off mid-period is lost to the round, but its agent lives on with the
    message it merged kept for its verdict: back at a later round, it must hear that the
    message reached no sync, so it puts its values back (not lose them for good)."""
    loop, host, reps = make(tmp_path, faults=[{"kind": "kill", "replica": 1, "round": 0}], sync_fragments=fragments)
    apply_next_update(loop, host)
    assert host.members.removed == [(1, "failed")]
    lost = reps[1].jobs[0].period.attempt
    host.members.active.append(reps[1])  # it joins again at the boundary, as a region does
    apply_next_update(loop, host)
    assert reps[1].jobs[1].sent_verdicts == ((lost, False),)
