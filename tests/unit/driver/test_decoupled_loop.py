"""The decoupled loop without Ray, against the math: real parameter servers in-process,
replicas whose "training" moves their weights by a known amount that depends only on the
data they were handed, and refs that arrive at the poll a test says.

Each test drives :class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop` merge by merge and
checks the global weights against a reference computed by hand (a synchronous round:
``torch.optim.SGD`` with Nesterov on the token-weighted mean of the pseudo-gradients), to
1e-6, or the documented rule (who is merged, how stale, which data goes back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pytest
import torch
from conftest import seal
from ray.exceptions import RayActorError

from diloco_ray.config import fault_plan
from diloco_ray.control.calls import ServerLost
from diloco_ray.data import plan as data
from diloco_ray.driver.loop import apply_next_update, loop_for
from diloco_ray.driver.policies import Action
from diloco_ray.observe.records import Evaluation
from diloco_ray.runtime.messages import RoundStats
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import SyncRefs, assemble_weights
from tests.unit.runtime.test_server_shards import SHAPES, Rank, ThroughRay, initial_weights, make_config, noise

STEP = 0.01  # how far a period moves a replica's weights, times the data's noise


@dataclass(eq=False)
class Ref:
    """A fake object ref: ready from poll ``ready_at`` on (never while ``held``)."""

    value: Any = None
    error: Optional[BaseException] = None
    ready_at: int = 0
    held: bool = False


class Calls:
    """The loop's calls over fake refs, on a clock of their own; each ``ready`` is one poll,
    and takes 2 ms of it (so stall and abort deadlines pass as polls go by)."""

    def __init__(self):
        self.polls, self.clock = 0, 1000.0

    def ready(self, refs, timeout_s):
        self.polls += 1
        self.clock += 0.002
        return [r for r in refs if r.ready_at <= self.polls and not r.held]

    def all_ready(self, refs, timeout_s):
        return self.ready(refs, timeout_s)

    def now(self):
        return self.clock

    def sleep(self, seconds):
        self.clock += max(0.0, seconds)

    def get(self, refs, timeout_s=None):
        if isinstance(refs, list):
            return [self.get(r) for r in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value


class Servers:
    """The server group's calls on real :class:`ParameterServer` objects, in-process; a
    killed group answers every call with RayActorError, as dead actors do."""

    def __init__(self, cfg, checkpoint: Optional[str] = None):
        self.cfg, self.dead = cfg, False
        self.actors = [ThroughRay(ParameterServer(cfg.to_dict(), index=0))]
        if checkpoint is None:
            seed = Rank(cfg, SHAPES, 1, 0, initial_weights()).sync
            self.actors[0].initialize(seed.seed({n: t.clone() for n, t in initial_weights().items()}), SHAPES)
        else:
            self.actors[0].load(checkpoint)

    def __len__(self):
        return 1

    def _call(self, name, *args, **kwargs):
        if self.dead:
            raise RayActorError()
        return getattr(self.actors[0], name)(*args, **kwargs)

    def reserve_plan(self, rid):
        return self._call("reserve_plan", rid)

    def release_plan(self, rid):
        return self._call("release_plan", rid)

    def version(self):
        return self._call("sync_version")

    def work(self):
        return self._call("merged_work")

    def round_index(self):
        return self._call("round_index")

    def ping(self):
        self._call("alive")

    def last_weights(self):
        return [self._call("last_weights")]

    def full_weights(self):
        return [self._call("full_weights")]

    def sync(self, fragment, contributions, plans, unused=None, merge=None):
        if self.dead:
            return SyncRefs(commits=[Ref(error=RayActorError())], weights=[None])
        srv, (divisor, shares) = self.actors[0], merge
        reduced = srv.reduce(srv.prepare(fragment, contributions[0], divisor))
        applied = srv.commit(plans, reduced, unused=unused, shares=shares)
        return SyncRefs(commits=[Ref(applied)], weights=[srv.new_weights_message(fragment)])

    def weights(self) -> dict[str, np.ndarray]:
        return assemble_weights([self.actors[0].global_weights()], SHAPES)


class Replica:
    """A replica whose period moves its weights by ``STEP`` x noise keyed by its plan's first
    position (so a period run again on the same data sends the same pseudo-gradient), and
    whose report arrives ``delays[k]`` polls after its k-th launch; its launches in ``nan``
    send NaN (the server rejects them)."""

    judged_by_steps = True  # its ranks beat (the Beats below), as a real replica's

    def __init__(self, rid: int, cfg, calls: Calls, delays=(), steps: Optional[int] = None, never=()):
        self.id, self.cfg, self.calls = rid, cfg, calls
        self.nan: set[int] = set()  # launches that send NaN (a test sets them)
        self.world_size = cfg.ranks_of(rid)
        self.rank = Rank(cfg, SHAPES, 1, 0, initial_weights())
        self.delays, self.steps, self.never = list(delays), steps or cfg.max_steps, set(never)
        self.jobs, self.stats, self.aborted, self.stopped = [], [], [], False

    def run_period(self, job):
        sync, local = self.rank.sync, self.rank.local
        if job.reset:
            sync.versions = [-1] * len(sync.versions)
        decision = sync.decide_load(job.version, fragment_message=not job.full)
        if decision == "full":
            sync.apply([s.full_weights() for s in job.servers], local)
            decision = sync.decide_load(job.version, fragment_message=not job.full)
        if decision == "apply":
            sync.apply(job.messages, local)
        moved = noise(SHAPES, job.plan[0][0], 0, 0)
        step = float("nan") if len(self.jobs) in self.nan else STEP
        for n, t in local.items():
            t.sub_(step * moved[n])
        per_step = self.cfg.sequences_per_replica_round // self.cfg.max_steps
        unused = data.ranges_of(data.plan_positions(job.plan)[self.steps * per_step :])
        tokens = 10 * self.steps  # equal replicas train equal tokens per step
        stats = RoundStats(0, self.steps, tokens, 1.0, 0.0, 0.0, 0, loss_tokens=tokens, unused=unused)
        ref = Ref(stats, ready_at=self.calls.polls + 1 + (self.delays.pop(0) if self.delays else 0))
        ref.held = len(self.jobs) in self.never  # this period never reports (until aborted)
        self.jobs.append(job)
        self.stats.append(ref)
        return [[buf] for buf in sync.outgoing(0, local)], [ref]

    def abort(self, attempt: int) -> None:
        self.aborted.append(attempt)

    def stop(self) -> None:
        self.stopped = True


class Members:
    def __init__(self, replicas):
        self.active, self.removed = list(replicas), []

    def remove(self, rep, why):
        rep.stop()
        self.active.remove(rep)
        self.removed.append((rep.id, why))


@dataclass
class Host:
    """What the loop asks of the trainer; checkpoints go to ``folder`` after every merge
    (when ``checkpoints``), and a lost server comes back from the latest."""

    server: Servers
    members: Members
    loop: Any = None
    folder: str = ""
    checkpoints: bool = False
    faults: list = field(default_factory=list)
    fired: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    fails_with_server: tuple = ()  # replicas whose period in flight fails when the server dies

    def notify(self, hook, *args):
        self.calls.append(hook)

    def evaluate(self, among=None, due=True):
        return Evaluation(1.0 if due else None)

    def inject_faults(self):
        self.calls.append(("inject_faults", self.loop.round_index, sorted(self.loop.flights)))
        for target in ("server", "driver"):
            for f in fault_plan.due(self.faults, self.loop.round_index, fired=frozenset(self.fired), target=target):
                self.fired.append(f.key)
                if target == "server":
                    self.server.dead = True
                    for rep in self.members.active:
                        if rep.id in self.fails_with_server:  # its weights' ref is lost with the server
                            rep.stats[-1].error = RayActorError()

    def recover_server(self):
        self.calls.append("recover_server")
        self.server = Servers(self.server.cfg, checkpoint=self.folder)
        self.loop.restore(self.server, reset=True)  # it takes up the restored merge count

    def reconcile(self):
        self.calls.append("reconcile")

    def merge(self) -> dict:
        record = apply_next_update(self.loop, self).to_record()
        if self.checkpoints:
            self.server.actors[0].save(self.folder)
            seal(self.folder)  # what the checkpoint commit writes: a server loads only what it vouches for
        return record


def make(tmp_path, replicas=2, faults=None, delays=None, steps=None, **overrides):
    cfg = make_config(sync_mode="decoupled", num_replicas=replicas, grace_window_s=0.0, fault_plan=faults, **overrides)
    calls = Calls()
    tmp_path.mkdir(parents=True, exist_ok=True)
    reps = [Replica(i, cfg, calls, (delays or {}).get(i, ()), (steps or {}).get(i)) for i in range(replicas)]
    host = Host(Servers(cfg), Members(reps), folder=str(tmp_path), faults=fault_plan.parse(cfg.fault_plan))
    host.loop = loop_for(cfg.sections(), "", calls=calls)
    host.loop.restore(host.server, reset=False)
    return host, reps


def synchronous_step(cfg, periods: list[tuple[list, float]], start=None) -> dict[str, torch.Tensor]:
    """One synchronous DiLoCo round by hand: the tokens-weighted mean of the periods'
    pseudo-gradients (``STEP`` x the noise of each plan), one Nesterov SGD step."""
    params = {n: t.clone().requires_grad_(True) for n, t in (start or initial_weights()).items()}
    opt = torch.optim.SGD(params.values(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    total = sum(w for _, w in periods)
    for n, p in params.items():
        p.grad = sum(STEP * noise(SHAPES, plan[0][0], 0, 0)[n] * w for plan, w in periods) / total
    opt.step()
    return {n: p.detach() for n, p in params.items()}


def max_diff(weights: dict[str, np.ndarray], reference: dict[str, torch.Tensor]) -> float:
    return max(float(np.abs(weights[n] - reference[n].numpy()).max()) for n in reference)


def test_a_delayed_cycle_of_single_merges_is_the_synchronous_round_at_the_default_power(tmp_path):
    """Both replicas start from the same weights; replica 1 arrives a poll later, so each is
    merged alone. With delayed Nesterov at the default staleness_power (1), the cycle is
    the synchronous round to 1e-6: replica 1 started in the cycle, so it is not stale (bug:
    it was one merge stale and merged at half weight: 8.9e-3 off a 2.5e-2 step)."""
    host, reps = make(tmp_path, decoupled_momentum="delayed", delays={0: [0, 9], 1: [1]})
    first, second = host.merge(), host.merge()
    assert (first["replica_ids"], second["replica_ids"]) == ([0], [1])
    assert second["staleness"] == {"1": 0} and second["work"] == pytest.approx(1.0)
    assert first["applied_weight"] + second["applied_weight"] == pytest.approx(1.0)
    cfg = host.server.cfg
    reference = synchronous_step(cfg, [(reps[0].jobs[0].plan, 40.0), (reps[1].jobs[0].plan, 40.0)])
    assert max_diff(host.server.weights(), reference) < 1e-6


def round_gradient(periods: list[tuple[list, float]]) -> dict[str, torch.Tensor]:
    """A synchronous round's outer gradient: its periods' pseudo-gradients (``STEP`` x the
    noise of each plan) times their coefficients (tokens over the round's tokens)."""
    return {n: sum(STEP * noise(SHAPES, plan[0][0], 0, 0)[n] * c for plan, c in periods) for n in SHAPES}


def synchronous_rounds(cfg, rounds: list[list[tuple[list, float]]], clip=None) -> dict[str, torch.Tensor]:
    """Synchronous DiLoCo rounds by hand, one Nesterov SGD step each on its
    :func:`round_gradient`, clipped to global norm ``clip`` first when one is given."""
    params = {n: t.clone().requires_grad_(True) for n, t in initial_weights().items()}
    opt = torch.optim.SGD(params.values(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    for periods in rounds:
        grad = round_gradient(periods)
        for n, p in params.items():
            p.grad = grad[n]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def test_unequal_replicas_merged_one_at_a_time_make_the_synchronous_rounds(tmp_path):
    """Replica 0 trains 3x replica 1's tokens (30 vs 10 a period). The first merge holds both;
    then each is merged alone, in turn, for three more cycles. Each absent replica stands in
    at its own latest period's tokens, so every merge divides by the round's 40 tokens, a
    cycle ends at each merge of replica 1 (work 1.0, 1.75, 2.0, ...), and the weights are the
    four synchronous rounds' (the last cycle's momentum step included) to 1e-6. (Bug: one
    running average per rank stood in for both: work 1.0, 1.5625, 1.896, ..., off the rounds.)
    staleness_power 0: replica 0's periods start before the cycle end that precedes their
    merge, and the rule under test is the weighting, not the discount."""
    cycles = 4
    delays = {0: [0, 0] + [1] * cycles, 1: [0] + [1] * cycles}
    host, reps = make(tmp_path, staleness_power=0.0, steps={0: 3, 1: 1}, delays=delays)
    records = [host.merge() for _ in range(2 * cycles - 1)]
    assert [r["replica_ids"] for r in records] == [[0, 1]] + [[0], [1]] * (cycles - 1)
    singles = [w for k in range(1, cycles) for w in (k + 0.75, k + 1)]
    assert [r["work"] for r in records] == pytest.approx([1.0] + singles)
    rounds = [[(reps[0].jobs[k].plan, 30 / 40), (reps[1].jobs[k].plan, 10 / 40)] for k in range(cycles)]
    assert max_diff(host.server.weights(), synchronous_rounds(host.server.cfg, rounds)) < 1e-6


def test_with_outer_grad_clip_each_delayed_cycle_is_the_synchronous_clipped_round(tmp_path):
    """As above, with ``outer_grad_clip`` at half the rounds' mean gradient norm, so every
    round is clipped: each merge moves what its cycle has applied to the cycle's gradient so
    far clipped by that gradient's norm (the norm gathered from the servers' parts), so each
    cycle ends on the synchronous round's clipped step, and the weights are the four clipped
    synchronous rounds' to 1e-6. (Before: each merge was clipped by its own norm, so a cycle
    applied the sum of separately clipped merges.)"""
    cycles = 4
    delays = {0: [0, 0] + [1] * cycles, 1: [0] + [1] * cycles}

    def run(folder, **overrides):
        host, reps = make(folder, staleness_power=0.0, steps={0: 3, 1: 1}, delays=delays, **overrides)
        for _ in range(2 * cycles - 1):
            host.merge()
        return host, [[(reps[0].jobs[k].plan, 30 / 40), (reps[1].jobs[k].plan, 10 / 40)] for k in range(cycles)]

    _, rounds = run(tmp_path / "plain")
    norms = [float(sum(t.pow(2).sum() for t in round_gradient(r).values()).sqrt()) for r in rounds]
    clip = 0.5 * sum(norms) / len(norms)
    host, clipped_rounds = run(tmp_path / "clipped", outer_grad_clip=clip)
    assert clipped_rounds == rounds and min(norms) > clip
    reference = synchronous_rounds(host.server.cfg, rounds, clip=clip)
    assert max_diff(host.server.weights(), reference) < 1e-6
    assert max_diff(host.server.weights(), synchronous_rounds(host.server.cfg, rounds)) > 1e-4  # the clip mattered


def test_a_replica_merged_before_the_other_has_reported_shifts_only_the_first_cycle(tmp_path):
    """As above, but replica 0 is merged alone first, before replica 1 ever reported: the
    running average per rank (its own 30) stands in for replica 1, so that merge applies
    30/60 of its pseudo-gradient instead of 30/40. Replica 1's first merge settles the count
    in hindsight (the first merge was 0.75 of a round, not 0.5), so the cycle still ends
    there, at work 1.0, and every later cycle is the synchronous round: the weights are the
    synchronous rounds' with the first round's gradient 0.5 g0 + 0.25 g1 instead of the mean."""
    cycles = 4
    host, reps = make(tmp_path, staleness_power=0.0, steps={0: 3, 1: 1}, delays={0: [0] + [1] * 9, 1: [1] * 9})
    records = [host.merge() for _ in range(2 * cycles)]
    assert [r["replica_ids"] for r in records] == [[0], [1]] * cycles
    singles = [w for k in range(1, cycles) for w in (k + 0.75, k + 1)]
    assert [r["work"] for r in records] == pytest.approx([0.5, 1.0] + singles)
    first = [(reps[0].jobs[0].plan, 30 / 60), (reps[1].jobs[0].plan, 10 / 40)]  # as applied
    rounds = [first] + [[(reps[0].jobs[k].plan, 30 / 40), (reps[1].jobs[k].plan, 10 / 40)] for k in range(1, cycles)]
    assert max_diff(host.server.weights(), synchronous_rounds(host.server.cfg, rounds)) < 1e-6


@pytest.mark.parametrize("every, evaluated", [(1, [False, True, False, True]), (2, [False, False, False, True])])
def test_merges_are_evaluated_every_eval_every_rounds_worth(tmp_path, every, evaluated):
    """Single merges of half a round each: an eval at each round's worth by default, at
    every second one with eval_every 2."""
    host, reps = make(tmp_path, eval_every=every, delays={0: [0, 9, 0, 9], 1: [1, 0, 1, 0]})
    merged = [host.merge() for _ in range(4)]
    assert [r["work"] for r in merged] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert [r["eval_loss"] is not None for r in merged] == evaluated


@pytest.mark.parametrize("rule, stale", [("delayed", 1), ("every_step", 2)])
def test_a_contribution_started_before_a_cycle_end_is_stale(tmp_path, rule, stale):
    """Replica 0 is merged twice, alone, while replica 1 trains: that ends a cycle. Replica 1
    is then one momentum step stale under delayed Nesterov (one cycle end), two under
    every_step (two merges), and its weight is discounted by it; its share of the work is not."""
    host, reps = make(tmp_path, decoupled_momentum=rule, delays={0: [0, 0, 9], 1: [2]})
    merged = [host.merge() for _ in range(3)]
    assert [r["replica_ids"] for r in merged] == [[0], [0], [1]]
    assert [r["work"] for r in merged] == pytest.approx([0.5, 1.0, 1.5])
    assert merged[2]["staleness"] == {"1": stale}
    assert merged[2]["applied_weight"] == pytest.approx(0.5 / (1 + stale))


def test_periods_cut_short_by_inner_time_s_merge_to_the_synchronous_mean(tmp_path):
    """inner_time_s: both replicas ran 3 of 4 steps and are merged together. The divisor is
    the tokens they trained on, so the update is the synchronous round's (bug: the tokens
    of full periods, 0.75x the synchronous update), and the merge is one round's worth."""
    host, reps = make(tmp_path, inner_time_s=5.0, steps={0: 3, 1: 2})
    record = host.merge()
    assert record["replica_ids"] == [0, 1] and record["work"] == pytest.approx(1.0)
    cfg = host.server.cfg
    reference = synchronous_step(cfg, [(reps[0].jobs[0].plan, 30.0), (reps[1].jobs[0].plan, 20.0)])
    assert max_diff(host.server.weights(), reference) < 1e-6
    per_step = cfg.sequences_per_replica_round // cfg.max_steps
    trained = sum(c for ranges in record["data_ranges"].values() for _, c in ranges)
    assert trained == (3 + 2) * per_step  # what they had no time for went back to the cursor


@pytest.mark.parametrize("target, kind", [("server", "kill"), ("driver", "kill"), ("driver", "term")])
def test_server_and_driver_faults_fire_in_their_merge_after_the_launch(tmp_path, target, kind):
    """The fault plan's server and driver faults fire on the driver in the merge they name,
    once the replicas have started it (bug: decoupled mode never fired them)."""
    faults = [{"kind": kind, "target": target, "round": 1}]
    host, reps = make(tmp_path, faults=faults, checkpoint_steps=4)
    host.checkpoints = True
    for _ in range(3):
        host.merge()
    injected = [c for c in host.calls if isinstance(c, tuple)]
    assert injected[0] == ("inject_faults", 0, [0, 1])  # every merge, with its replicas launched
    assert host.fired == [fault_plan.parse(faults)[0].key]
    assert ("recover_server" in host.calls) == (target == "server")


@pytest.mark.parametrize("fails", [(), (1,)], ids=["periods-run-on", "a-period-fails"])
def test_a_server_killed_mid_merge_is_restored_and_the_merges_since_run_again_exactly(tmp_path, fails):
    """Lockstep (min_quorum 2): a checkpoint after every merge; the server dies in merge 2
    after the replicas started it. The merge is abandoned as a unit: the periods in flight
    are thrown away, the server comes back from the merge-2 checkpoint, every replica
    reloads its weights, and merge 2 runs again on the same data: the weights equal the
    fault-free run's, and every stream position is merged once. A period that fails with
    the server (its weights' ref lost) is the server's doing: its replica is kept."""
    runs = {}
    for name, faults in (("clean", None), ("killed", [{"kind": "kill", "target": "server", "round": 2}])):
        host, reps = make(tmp_path / name, faults=faults, min_quorum=2, checkpoint_steps=4)
        host.checkpoints, host.fails_with_server = True, fails
        runs[name] = (host, [host.merge() for _ in range(4)], reps)
    (clean, _, _), (killed, records, reps) = runs["clean"], runs["killed"]
    assert killed.calls.count("recover_server") == 1 and killed.members.removed == []
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert [r["work"] for r in records] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert max_diff(killed.server.weights(), {n: torch.from_numpy(a) for n, a in clean.server.weights().items()}) < 1e-6
    relaunched = [job for job in reps[0].jobs if job.reset]
    assert len(relaunched) == 1 and relaunched[0].version == 2  # one full reload, of the restored weights
    positions = [p for r in records for ranges in r["data_ranges"].values() for s, c in ranges for p in range(s, s + c)]
    assert sorted(positions) == list(range(len(positions)))
    # Both abandoned periods (a failed one's steps are known by its beats: none here).
    assert records[2]["wasted_steps"] == (2 - len(fails)) * killed.server.cfg.max_steps


def test_a_merge_whose_server_dies_in_its_eval_counts_each_wasted_period_once(tmp_path):
    """Merge 0 holds both replicas and rejects replica 0's NaN; then its eval finds the
    server dead. Each of the two periods is wasted once (bug: the rejected one was counted
    at the merge and again when the merge was thrown away with the server)."""
    host, reps = make(tmp_path, min_quorum=2, checkpoint_steps=4)
    host.checkpoints = True
    host.server.actors[0].save(host.folder)
    seal(host.folder)
    reps[0].nan = {0}
    lost = iter([ServerLost("a server died during the eval")])

    def evaluate(among=None, due=True):
        for error in lost:
            host.server.dead = True
            raise error
        return Evaluation(1.0)

    host.evaluate = evaluate
    record = host.merge()
    assert host.calls.count("recover_server") == 1 and record["round"] == 0
    assert record["wasted_steps"] == 2 * host.server.cfg.max_steps


def test_staleness_starts_at_zero_after_a_full_reload_from_a_checkpoint(tmp_path):
    """Resumed from a checkpoint taken after two merges, replicas that start from the
    restored weights are not stale at their first merge."""
    host, _ = make(tmp_path, delays={0: [0, 0], 1: [1]}, checkpoint_steps=4)
    host.checkpoints = True
    host.merge(), host.merge()
    resumed, _ = make(tmp_path / "resumed", delays={0: [0], 1: [0]})
    resumed.server = Servers(resumed.server.cfg, checkpoint=str(tmp_path))
    resumed.loop.restore(resumed.server, reset=False)
    record = resumed.merge()
    assert record["round"] == 2 and record["staleness"] == {"0": 0, "1": 0}


class Beats:
    """A step feed whose board hears a beat from every period in flight just now, but for
    the replicas in ``silent``."""

    def __init__(self, loop, silent):
        self.loop, self.silent, self.board, self.last_beats = loop, set(silent), None, {}

    def poll(self):
        pass

    def beats(self):
        flights = self.loop.flights.items()
        now = self.loop.calls.now()
        self.last_beats = {(rid, 0): (f.attempt, 1, now) for rid, f in flights if rid not in self.silent}
        return self.last_beats


def test_a_stalled_replica_is_told_to_stop_and_trains_on_when_it_answers(tmp_path):
    """drop_link: replica 1's first period never reports. After stall_timeout_s it is told to
    stop; it answers (aborted), so its plan goes back and it trains on from the newest
    weights; merged in the next merge, not replaced."""
    host, reps = make(tmp_path, stall_timeout_s=0.01, abort_grace_s=30.0, delays={0: [0, 20]})
    reps[1].never = {0}
    host.loop.steps = Beats(host.loop, silent={1})
    original = reps[1].abort

    def answer(attempt):
        original(attempt)
        ref = reps[1].stats[0]
        ref.value, ref.held = RoundStats(0, 2, 0, 0.0, 0.0, 0.0, 0, aborted=True), False

    reps[1].abort = answer
    first, second = host.merge(), host.merge()
    assert first["replica_ids"] == [0] and reps[1].aborted and not host.members.removed
    assert 1 in second["replica_ids"] and first["wasted_steps"] + second["wasted_steps"] >= 2
    assert reps[1].jobs[1].plan == reps[1].jobs[0].plan  # its data went back and came out first again


def test_a_frozen_replica_that_does_not_answer_its_stop_is_dropped(tmp_path):
    """freeze: replica 1 neither reports nor answers its stop: abort_grace_s after it was told,
    it is dropped as unresponsive (and stopped), while replica 0 goes on merging."""
    host, reps = make(tmp_path, stall_timeout_s=0.01, abort_grace_s=0.01, delays={0: [0, 20]})
    reps[1].never = {0}
    host.loop.steps = Beats(host.loop, silent={1})
    records = [host.merge()]
    while not host.members.removed and len(records) < 20:
        records.append(host.merge())
    assert host.members.removed == [(1, "unresponsive")] and reps[1].stopped and reps[1].aborted
    assert 1 in records[-1]["dropped"] and all(r["replica_ids"] == [0] for r in records)


def test_a_merged_replica_hears_with_its_next_period_that_what_it_sent_was_applied(tmp_path):
    """Error feedback keeps a send until its verdict, which comes with the replica's next
    period (a rejected or lost one: False; see test_sync_loop for those)."""
    host, reps = make(tmp_path, delays={0: [0, 0, 9], 1: [1, 1]})
    host.merge()
    first = reps[0].jobs[0].period.attempt
    host.merge()
    assert reps[0].jobs[0].sent_verdicts == () and reps[0].jobs[1].sent_verdicts == ((first, True),)


def test_a_lost_period_hands_the_merge_to_the_trainer_and_the_next_call_goes_on_with_it(tmp_path):
    """The loop never reconciles: a replica dropped mid-merge ends the call with RUN_AGAIN
    (saying whose period and why), and the next call goes on with the same merge (no second
    on_round_begin, no second fault check) to merge replica 0's period."""
    host, reps = make(tmp_path, stall_timeout_s=0.01, abort_grace_s=0.01, delays={0: [30]})
    reps[1].never = {0}
    host.loop.steps = Beats(host.loop, silent={1})
    first = host.loop.run_round(host)
    assert first.action is Action.RUN_AGAIN and first.why.startswith("replica 1's period was lost: unresponsive")
    assert host.members.removed == [(1, "unresponsive")] and "reconcile" not in host.calls
    second = host.loop.run_round(host)
    assert second.action is Action.PROCEED and second.record.to_record()["replica_ids"] == [0]
    assert host.calls.count("on_round_begin") == 1
    assert sum(1 for c in host.calls if isinstance(c, tuple) and c[0] == "inject_faults") == 1


def test_a_member_whose_period_was_lost_hears_when_it_is_back_that_its_send_was_not_applied(tmp_path):
    """As test_sync_loop's: a region lost mid-period comes back with its message kept for
    a verdict, and its next period brings it: not applied."""
    host, reps = make(tmp_path, stall_timeout_s=0.01, abort_grace_s=0.01, delays={0: [30]})
    reps[1].never = {0}
    host.loop.steps = Beats(host.loop, silent={1})
    assert host.loop.run_round(host).action is Action.RUN_AGAIN
    lost = reps[1].jobs[0].period.attempt
    host.members.active.append(reps[1])  # back: it takes part from the next launch
    host.loop.steps = Beats(host.loop, silent=set())
    reps[1].never = set()
    host.loop.run_round(host)
    host.merge()
    assert reps[1].jobs[1].sent_verdicts == ((lost, False),)
