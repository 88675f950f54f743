"""Who takes part in the next round: the pure membership policy, and the driver's
bookkeeping of replicas that are starting or waiting as hot spares.

:func:`decide` is a pure function from (target, active ids, starting ids, spare ids) to a
:class:`Decision`; :class:`Membership` carries it out with Ray: it promotes ready spares at
once, requests placement groups, starts set-up once a group is placed, and admits a replica
(or keeps it as a spare) once its set-up is done, all without blocking the round loop
unless asked to wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import ray

from diloco_ray.config.sections import MembershipSection, PlacementSection
from diloco_ray.errors import first_line
from diloco_ray.observe.events import MembershipEvent
from diloco_ray.regions.members import RegionMember
from diloco_ray.runtime.replica import Replica, resources_for_replica


@dataclass
class Decision:
    """What to change at a round boundary.

    Args:
        start: how many new replicas to request.
        stop: ids of placed replicas to stop (newest first; spares before active ones).
        cancel: ids of starting replicas to give up on (newest first).
        promote: ids of ready spares that become active now (oldest first).
    """

    start: int = 0
    stop: list[int] = field(default_factory=list)
    cancel: list[int] = field(default_factory=list)
    promote: list[int] = field(default_factory=list)


def decide(
    target: int, active: list[int], starting: list[int], spares: Sequence[int] = (), spares_wanted: int = 0
) -> Decision:
    """Move towards ``target`` active replicas and ``spares_wanted`` ready spares.

    A shortfall of active replicas is filled from the spares first (at once: they are
    placed and set up), then by starting new replicas; starting replicas count towards
    what is missing, so a slow start is not requested twice. Extras are stopped, newest
    first.
    """
    promote = sorted(spares)[: max(0, target - len(active))]
    left = [s for s in spares if s not in promote]
    stop = sorted(active, reverse=True)[: max(0, len(active) + len(promote) - target)]
    stop += sorted(left, reverse=True)[: max(0, len(left) - spares_wanted)]
    missing = max(0, target - len(active) - len(promote)) + max(0, spares_wanted - len(left))
    cancel = sorted(starting, reverse=True)[: max(0, len(starting) - missing)]
    return Decision(start=max(0, missing - len(starting)), stop=stop, cancel=cancel, promote=promote)


def capacity_shortfall(placement: PlacementSection, num_replicas: int, device: str, available: dict) -> Optional[str]:
    """Why the cluster's resources (``ray.cluster_resources()``) cannot hold
    ``num_replicas`` replicas placed as ``placement`` says plus the servers at once, or None
    when they add up.

    A sum, not a packing: it catches the common mistake (too few CPUs or GPUs in total)
    without promising that what adds up also fits node by node.
    """
    need: dict[str, float] = {}

    def add(resources: dict, times: float = 1.0) -> None:
        for name, amount in resources.items():
            need[name] = need.get(name, 0.0) + amount * times

    for rid in range(num_replicas):
        add(
            {
                "CPU": placement.cpus_per_rank,
                **({"GPU": 1} if device == "cuda" else {}),
                **resources_for_replica(placement.replica_resources, rid),
            },
            placement.ranks_of(rid),
        )
    servers = (
        placement.server_resources
        if isinstance(placement.server_resources, list)
        else [placement.server_resources] * placement.num_param_servers
    )
    server_gpus = {"GPU": placement.server_gpus} if placement.server_gpus else {}
    for extra in servers:
        add({"CPU": placement.server_cpus, **server_gpus, **extra})
    short = {
        name: (amount, available.get(name, 0.0))
        for name, amount in need.items()
        if amount > available.get(name, 0.0) + 1e-9
    }
    if not short:
        return None
    what = ", ".join(f"{name} {want:g} (the cluster has {have:g})" for name, (want, have) in sorted(short.items()))
    return (
        f"{num_replicas} replicas of {placement.ranks_per_replica} rank(s) and "
        f"{placement.num_param_servers} server(s) need {what}; "
        "lower num_replicas or cpus_per_rank, or give the cluster more (ray start --num-cpus ...)"
    )


class Membership:
    """The active replicas (in slot order), the ready spares (``spare_replicas``) and the
    ones still starting; with regions, the regions that take part in the round after this
    cluster's own replicas (:class:`~diloco_ray.regions.members.RegionMembers`).

    Args:
        membership: how many replicas, spares, and the deadlines for placing and asking them.
        placement: what a replica reserves (to warn when the cluster cannot hold the run).
        device: ``"cpu"`` or ``"cuda"``.
        start_replica: starts replica ``id`` (requests its placement group; see
            :class:`~diloco_ray.runtime.replica.Replica`).
        on_event: called with each :class:`~diloco_ray.observe.events.MembershipEvent`, for metrics.jsonl.
        round_of: the index of the round the run is at, for the events.
        on_admit: called with (replica, slot) just before a replica becomes active, e.g.
            to restore its inner state from a checkpoint.
        regions: the regions taking part (None: one cluster).
    """

    def __init__(
        self,
        membership: MembershipSection,
        placement: PlacementSection,
        device: str,
        start_replica: Callable[[int], Replica],
        on_event: Callable[[MembershipEvent], None],
        round_of: Callable[[], int],
        on_admit: Optional[Callable[[Replica, int], None]] = None,
        regions=None,
    ):
        self.membership, self.placement, self.device = membership, placement, device
        self.start_replica = start_replica
        self.on_event, self.round_of, self.on_admit = on_event, round_of, on_admit
        self.home: list[Replica] = []  # this cluster's active replicas, in slot order
        self.regions = regions
        self.spares: list[Replica] = []  # placed and set up, not training: a lost replica's place at once
        self.starting: list[Replica] = []
        self.target = membership.num_replicas
        self._next_id = 0

    @property
    def active(self) -> list:
        """Every member of the round, in slot order: this cluster's replicas, then the
        regions taking part."""
        return self.home + (self.regions.active if self.regions is not None else [])

    @property
    def ids(self) -> list[int]:
        return [r.id for r in self.home]

    def place_initial(self, warn: Callable[[str], None]) -> None:
        """Place the run's first ``num_replicas`` replicas, waiting up to
        ``placement_timeout_s``; go on with fewer (warning) if at least ``min_replicas`` fit."""
        membership = self.membership
        shortfall = capacity_shortfall(self.placement, membership.num_replicas, self.device, ray.cluster_resources())
        if shortfall:
            # An autoscaler may still add nodes, so this warns rather than fails; without
            # one, the wait below ends at placement_timeout_s with the replicas that fit.
            warn(
                f"{shortfall}. Waiting up to placement_timeout_s={membership.placement_timeout_s:g}s for room, "
                f"then going on with the replicas that fit (at least min_replicas={membership.min_replicas})."
            )
        self.reconcile(membership.num_replicas, wait_s=membership.placement_timeout_s)
        if membership.min_replicas <= len(self.home) < membership.num_replicas:
            warn(
                f"starting with {len(self.home)} of num_replicas={membership.num_replicas} replicas; "
                "the others join at a round boundary when they are placed"
            )
        if len(self.home) < membership.min_replicas:
            totals = {k: v for k, v in ray.cluster_resources().items() if "_group_" not in k}
            raise RuntimeError(
                f"only {len(self.home)} of min_replicas={membership.min_replicas} replicas were placed "
                f"and set up within placement_timeout_s={membership.placement_timeout_s:g}s "
                f"(cluster resources: {totals})"
            )

    def at_boundary(self, target: int) -> None:
        """Move towards ``target`` at a round boundary (waiting up to ``join_timeout_s`` for
        joiners); with fewer than ``min_replicas`` left, wait up to ``placement_timeout_s`` for
        starting ones, and fail when still too few. Regions connected since take part from
        the next round."""
        membership = self.membership
        if self.regions is not None:
            self.regions.at_boundary()
        self.reconcile(target, wait_s=membership.join_timeout_s)
        if len(self.home) < membership.min_replicas:
            self.admit_ready(membership.placement_timeout_s)
            if len(self.home) < membership.min_replicas:
                raise RuntimeError(
                    f"{len(self.home)} replicas are running and no more could be placed within "
                    f"placement_timeout_s={membership.placement_timeout_s:g}s; min_replicas={membership.min_replicas}"
                )

    def first_answer(self, call: Callable, among: Optional[list] = None, check: Optional[Callable[[], None]] = None):
        """``ray.get(call(replica))`` on the first active replica that is alive and answers
        within ``call_timeout_s`` (dead or frozen ones met on the way are removed), or
        None when none is left. Replicas whose ids are in ``among`` are asked first.
        ``check`` is called before a failed replica is removed and raises when the call
        failed for another party (a server whose weights it read died: every replica's
        call would fail, and none of them is to blame)."""
        first = set(among or ())
        for rep in sorted(self.home, key=lambda r: r.id not in first):
            try:
                return ray.get(call(rep), timeout=self.membership.call_timeout_s)
            except ray.exceptions.RayActorError:
                if check is not None:
                    check()
                self.remove(rep, "failed")
            except ray.exceptions.GetTimeoutError:
                self.remove(rep, "unresponsive")
        return None

    def adopt_initial(self, seed: Replica) -> list[int]:
        """Let each active replica whose ranks built the seeding replica's weights (same
        world size, equal digests rank by rank) take them as the servers' version 0, so the
        round-0 full load does not send them back down its link; the ids that did (the
        rest, and any that fail to answer, load them as before)."""
        wait, adopted = self.membership.call_timeout_s, []
        expected = [digests for digests, _ in ray.get(seed.adopt_initial(None), timeout=wait)]
        for rep in self.home:
            if rep.world_size != seed.world_size:
                continue
            try:
                if all(held for _, held in ray.get(rep.adopt_initial(expected), timeout=wait)):
                    adopted.append(rep.id)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # its first period finds it dead or slow, as any other
        return adopted

    def reconcile(self, target: int, wait_s: float = 0.0) -> None:
        """Apply :func:`decide` (spares first), then admit starting replicas that are
        ready, waiting up to ``wait_s`` seconds for as many as the target still lacks."""
        self.target = target
        spares = {r.id: r for r in self.spares}
        d = decide(target, self.ids, [r.id for r in self.starting], list(spares), self.membership.spare_replicas)
        for rid in d.promote:
            self.spares.remove(spares[rid])
            self._activate(spares[rid], reason="spare")
        for rid in d.stop:
            if rid in spares:  # decide() never stops a spare it promotes
                self.spares.remove(spares[rid])
                spares[rid].stop()
                self.on_event(MembershipEvent("leave", self.round_of(), replica_id=rid, reason="spare not needed"))
            else:
                self.remove(next(r for r in self.home if r.id == rid), "scaled down")
        for rid in d.cancel:
            rep = next(r for r in self.starting if r.id == rid)
            self.starting.remove(rep)
            rep.stop()
        for _ in range(d.start):
            rep = self.start_replica(self._next_id)
            rep.requested_at = time.time()
            self._next_id += 1
            self.starting.append(rep)
        self.admit_ready(wait_s)

    def admit_ready(self, wait_s: float) -> None:
        """Advance starting replicas (placed -> set up -> active, or a spare once the target
        is met), waiting up to ``wait_s`` while the target lacks replicas (never for spares)."""
        deadline = time.monotonic() + wait_s
        while self.starting:
            for rep in list(self.starting):
                self._advance(rep)
            waiting = [ref for rep in self.starting for ref in rep.pending_refs()]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0 or len(self.home) >= self.target:
                return
            ray.wait(waiting, num_returns=1, timeout=remaining)

    def _advance(self, rep: Replica) -> None:
        try:
            if rep.setup_refs is None:
                if ray.wait([rep.placed_ref], timeout=0)[0]:
                    rep.setup_refs = rep.setup()
                return
            if len(ray.wait(rep.setup_refs, num_returns=len(rep.setup_refs), timeout=0)[0]) < len(rep.setup_refs):
                return
            self.starting.remove(rep)
            rep.shapes = ray.get(rep.setup_refs)[0]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._failed_start(rep, e)
            return
        if len(self.home) >= self.target:
            self.spares.append(rep)
            self.on_event(MembershipEvent("spare", self.round_of(), replica_id=rep.id, replicas=len(self.home)))
            return
        self._activate(rep)

    def _activate(self, rep: Replica, reason: Optional[str] = None) -> None:
        """``rep`` (set up) takes the next slot: ``on_admit`` first, then it is active."""
        try:
            if self.on_admit is not None:
                self.on_admit(rep, len(self.home))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._failed_start(rep, e)
            return
        self.home.append(rep)
        joined = MembershipEvent(
            "join",
            self.round_of(),
            replica_id=rep.id,
            replicas=len(self.home),
            start_seconds=time.time() - rep.requested_at,
            nodes=list(rep.nodes),
            **({"reason": reason} if reason else {}),
        )
        self.on_event(joined)

    def _failed_start(self, rep: Replica, error: BaseException) -> None:
        """Died (or froze) while starting: give it up; a later boundary starts another."""
        if rep in self.starting:
            self.starting.remove(rep)
        rep.stop()
        reason = first_line(error)[:200]
        self.on_event(MembershipEvent("failed_start", self.round_of(), replica_id=rep.id, reason=reason))

    def remove(self, rep: Replica | RegionMember, reason: str) -> None:
        """Stop ``rep`` and forget it (its placement group is released); a region leaves
        the round until it is connected again at a later boundary."""
        if isinstance(rep, RegionMember):
            self.regions.drop(rep, reason)
            return
        rep.stop()
        if rep in self.home:
            self.home.remove(rep)
        self.on_event(
            MembershipEvent("leave", self.round_of(), replica_id=rep.id, reason=reason, replicas=len(self.home))
        )

    def stop_all(self, keep: bool = False) -> None:
        """Stop every replica; ``keep``: keep the set-up ones' actors for the next run
        (runtime.warm_actors), not those still starting."""
        for rep in self.home + self.spares:
            rep.stop(keep)
        for rep in self.starting:
            rep.stop()
        self.home, self.spares, self.starting = [], [], []
