"""What crosses the driver's boundaries, typed: one dataclass per message.

The driver builds a :class:`SyncPeriod` for every rank of a replica at the start of each
sync period and the rank only reads it, so both sides agree on one definition instead of
on the keys of a dict. A :class:`Launch` is what the driver holds of one replica's period
while it runs, and a :class:`RoundPoll` what came back of all of them by the deadline.
A sync hands each server the replicas' :class:`Contribution`; the servers agree through
:class:`Prepared` and :class:`Reduced`, and report an :class:`AppliedRound`.
Plain data, no Ray: the references and actor handles inside are opaque here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Sequence

if TYPE_CHECKING:  # for annotations only: these messages import no torch
    from diloco_ray.algo.outer import Rejected


@dataclass(frozen=True, order=True)
class PeriodId:
    """Which sync period a job, a region's notice and its reply belong to: the outer round
    (decoupled: the merge), the fragment synced at the period's end (0-based within the round;
    always 0 without streaming), and the driver's launch counter (``attempt``: a round run
    again is launched again, so an abort or a verdict names one launch, never an older one)."""

    round: int
    fragment: int
    attempt: int


@dataclass(frozen=True)
class SnapshotPlan:
    """In-flight snapshots of a replica's progress inside a long round.

    Args:
        folder: the round's snapshot folder.
        slot: the replica's slot (its ranks' files are named by it).
        every: save after every ``every`` inner steps.
        resume_step: resume from this step's snapshot (None: start the round afresh).
    """

    folder: str
    slot: int
    every: int
    resume_step: Optional[int] = None


@dataclass(frozen=True)
class SyncPeriod:
    """What every rank of a replica gets for one sync period (see ``RankWorker.run_period``).

    Args:
        period: which period (its round, fragment and launch attempt; an abort names the
            attempt it stops).
        plan: the replica's stream ranges ``[(start, count), ...]`` for the round.
        messages: one packed weights message (or its object ref) per server, of sync
            ``version``.
        full: whether ``messages`` hold every parameter (not one fragment's).
        version: the sync the messages bring the replica to.
        servers: the server actor handles, for a full load after a missed sync.
        reset: the servers were restored from a checkpoint: load everything again.
        restart: the round runs again (too few replicas reported, or a lost server).
        reset_inner: start with a fresh inner optimizer and residual, and reload every
            weight (the replica's last pseudo-gradient was rejected as non-finite).
        sent_verdicts: ``(attempt, applied)`` for each of the replica's earlier sends whose
            fate the driver has learnt since its last period, in launch order: what a send
            not applied carried goes back into the residual (error feedback).
        board: the driver's step board (step events, heartbeats), or None.
        link: the simulated link of the replica's slot (``links.Link``), or None.
        snapshots: in-flight snapshot settings (first period of a round only), or None.
        schedule_step: the inner lr schedule's position at the period's first step; None:
            ``round * max_steps`` (decoupled mode passes the tokens merged so far, in steps,
            since its outer steps are not rounds).
        time_budget_s: seconds for this period's inner steps, on top of ``inner_time_s``
            (the smaller wins): a spare stepping into a lost replica's period in decoupled
            mode gets what remained of it. None: ``inner_time_s`` alone.
    """

    period: PeriodId
    plan: Sequence[tuple[int, int]]
    messages: Sequence[Any]
    full: bool
    version: int
    servers: Sequence[Any] = ()
    reset: bool = False
    restart: bool = False
    reset_inner: bool = False
    sent_verdicts: tuple[tuple[int, bool], ...] = ()
    board: Any = None
    link: Any = None
    snapshots: Optional[SnapshotPlan] = None
    schedule_step: Optional[int] = None
    time_budget_s: Optional[float] = None


@dataclass(frozen=True)
class Launch:
    """One replica's sync period as the driver holds it while it runs.

    Args:
        replica: the replica (``diloco_ray.runtime.replica.Replica``).
        buffers: per server, the ranks' pseudo-gradient buffer refs.
        stats: per rank, the ref of its ``RoundStats``.
    """

    replica: Any
    buffers: Sequence[Sequence[Any]]
    stats: Sequence[Any]


@dataclass(frozen=True)
class RoundPoll:
    """What the replicas of one sync period sent back by its deadline.

    Args:
        reported: replica id -> its ranks' ``RoundStats`` (rank order), for the replicas
            whose every rank finished the period.
        late: ids of the replicas still running at the deadline (told to stop).
        failed: ``(replica, why)`` for the replicas dropped (``"failed"``, ``"unresponsive"``).
    """

    reported: dict[int, list] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)
    failed: list[tuple[Any, str]] = field(default_factory=list)


# ---- one sync, between the driver and the parameter servers ---------------------------
@dataclass
class Contribution:
    """One replica's pieces for one server in one sync.

    Args:
        replica_id: the replica.
        refs: one object ref per rank, each resolving to a :func:`compression.pack`
            buffer of that rank's rows for this server. Wrapped in a list so Ray hands
            the refs over unresolved and the server fetches them itself.
        weight: its weight in the mean (tokens it trained on).
        staleness: decoupled mode: the outer momentum steps taken since it started (a
            stale one may be corrected, ``stale_correction``); 0 in sync mode.
    """

    replica_id: int
    refs: list
    weight: float
    staleness: int = 0


@dataclass
class Prepared:
    """A server's verdict on one sync's contributions (small; goes server -> server)."""

    order: list[int]  # replica ids in contribution order
    weights: dict[int, float]
    reasons: dict[int, Rejected]  # replica id -> why rejected here
    arrived: float  # wall-clock time the last piece arrived
    sumsq: dict[int, float] = field(default_factory=dict)  # with screening: replica id -> its rows' squared norm here


@dataclass
class Reduced:
    """A server's part of the accepted mean: squared norms by (param position, row start)."""

    accepted: list[int]
    sumsq: list[tuple[int, int, float]]
    reasons: dict[int, Rejected]
    started: float
    cycle_sumsq: Optional[list[tuple[int, int, float]]] = None  # delayed + outer_grad_clip: the cycle's with this mean


@dataclass
class AppliedRound:
    """What a commit reports (small; goes to the driver)."""

    applied: bool
    round: int  # the round this sync belongs to
    fragment: int
    outer_lr: float
    pseudo_grad_norm: float | None
    accepted: list[int] = field(default_factory=list)  # replica ids
    rejected: dict[int, Rejected] = field(default_factory=dict)  # replica id -> reason
    data_ranges: dict[int, list] = field(default_factory=dict)  # replica id -> consumed stream ranges
    round_done: bool = False  # this sync completed its round
    seconds: float = 0.0  # from the first piece received to the step taken
    work: float = 0.0  # decoupled mode: rounds' worth of tokens merged so far
    versions: tuple[int, int] = (0, 0)  # the servers' version before the commit and after it


# ---- what a rank reports of its sync period -------------------------------------------
@dataclass(frozen=True)
class RegionFacts:
    """What a region's one stats object says beyond what a replica's does: it stands for the
    region's replicas.

    The region's own claims, the only ones that cross the channel (``CLAIMS``), each checked
    by the home (:func:`~diloco_ray.regions.wire.facts_of`):

    Args:
        replica_ids: the region's replicas its message merged.
        reload: a replica of it was replaced: it loads the full weights at its next period.
        reload_at_round: a replica was reset: it loads them at its next round's start.
        copy_version: with ``region_downlink: step``, the version of the global weights the
            region's copy of the servers holds; -1: none (it asks for the whole state).
        copy_differed: its copy's digest differed from the home's (the reason it holds nothing).
        name: the region's name (the home's gateway sets it).
        refused: why the home refused the region's reply (None: it did not; the gateway sets it).
        resends: how often the home has sent the region its servers' whole state in this
            home's run, by reason (``region_downlink: step``; the gateway sets it).
    """

    replica_ids: tuple[int, ...] = ()
    reload: bool = False
    reload_at_round: bool = False
    copy_version: int = -1
    copy_differed: bool = False
    name: str = ""
    refused: Optional[str] = None
    resends: tuple[tuple[str, int], ...] = ()

    CLAIMS: ClassVar[dict[str, type]] = {
        "replica_ids": list,
        "reload": bool,
        "reload_at_round": bool,
        "copy_version": int,
        "copy_differed": bool,
    }

    def claims(self) -> dict:
        """What the region sends of these facts: its claims, as JSON values."""
        return {
            "replica_ids": list(self.replica_ids),
            "reload": self.reload,
            "reload_at_round": self.reload_at_round,
            "copy_version": self.copy_version,
            "copy_differed": self.copy_differed,
        }


@dataclass
class RoundStats:
    """What a rank reports about its round (small; travels through the driver)."""

    rank: int
    inner_steps: int
    tokens: int  # tokens trained on (attention mask), for throughput
    loss_sum: float  # sum over steps of each step's per-token mean loss (this rank's share)
    compute_seconds: float  # the inner steps alone
    load_seconds: float  # waiting for and applying the server's weights
    bytes_up: int  # pseudo-gradient bytes this rank sent (payload + scales + headers)
    bytes_down: int = 0  # weight bytes this rank received
    aborted: bool = False  # stopped early by abort(): nothing to apply
    restarted: bool = False  # a re-run round: started again from the global weights (and the round-start state)
    loss_tokens: int = 0  # tokens that carried loss: the replica's weight in the outer mean
    resumed_step: int = 0  # inner steps restored from an in-flight snapshot
    unused: list = field(default_factory=list)  # plan ranges left untrained (inner_time_s ran out)
    region: Optional[RegionFacts] = None  # a region's one stats object: what it says of its replicas

    @classmethod
    def empty(cls, **fields) -> RoundStats:
        """The stats of a period that trained and sent nothing (told to stop, declined,
        refused), with ``fields`` (``aborted``, ``unused``, ``region``) set."""
        nothing = dict(rank=0, inner_steps=0, tokens=0, loss_sum=0.0, compute_seconds=0.0, load_seconds=0.0, bytes_up=0)
        return cls(**nothing, **fields)
