"""The round record: what one outer round (decoupled: one merge) did, as one ``metrics.jsonl`` line.

:class:`RoundRecord` is written once, when the round is over, from what its syncs reported
(:class:`Syncs`), its evaluation (:class:`Evaluation`), its timing (:class:`Timing`) and, in
decoupled mode, the merge's own facts (:class:`MergeFacts`). :meth:`RoundRecord.to_record`
is the dict that metrics.jsonl, ``on_round_end(trainer, record)`` and ``TrainResult.rounds``
get, with the keys docs/interface.md lists. Pure, so the figures users read (bytes per sync,
replicas applied, loss) are computed in one place and tested without Ray.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from diloco_ray.algo.inner_schedule import sync_period


@dataclass(frozen=True)
class Syncs:
    """What the syncs of one round reported.

    Args:
        applied: per sync, server 0's :class:`~diloco_ray.runtime.messages.AppliedRound`.
        reported: per sync, replica id -> its ranks' :class:`~diloco_ray.runtime.messages.RoundStats`.
        late: ids that missed a deadline this round.
        failed: ids whose process or node died this round.
    """

    applied: list
    reported: list[dict]
    late: set = field(default_factory=set)
    failed: set = field(default_factory=set)


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the global weights after an update.

    Args:
        loss: eval loss (None: not due, no eval, or no replica left to run it).
        seconds: wall time it took.
        bytes_down: bytes of global weights it fetched to a replica.
    """

    loss: Optional[float] = None
    seconds: float = 0.0
    bytes_down: int = 0

    @property
    def ppl(self) -> Optional[float]:
        return math.exp(min(self.loss, 50.0)) if self.loss is not None else None


@dataclass(frozen=True)
class Timing:
    """A round's wall times.

    Args:
        round_seconds: from its start to its record, eval included.
        until_applied: from its start until its update was applied.
    """

    round_seconds: float
    until_applied: float


@dataclass(frozen=True)
class MergeFacts:
    """What a decoupled merge's record adds.

    Args:
        staleness: merged replica id (a string) -> its staleness.
        applied_weight: the share of a round's worth of tokens the merge applied.
        in_flight: ids of the replicas still training.
        work: rounds' worth of tokens merged so far.
        merge_seconds: from the end of the wait to the applied merge.
    """

    staleness: dict[str, int]
    applied_weight: float
    in_flight: list[int]
    work: float
    merge_seconds: float

    def to_record(self) -> dict[str, Any]:
        return {"sync_mode": "decoupled", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class FragmentRecord:
    """One sync of a round (a fragment's; the whole model's in plain DiLoCo).

    Args:
        fragment: the fragment synced.
        step: the inner step it followed.
        replicas: how many replicas it applied.
        bytes_up: bytes the replicas sent.
        bytes_down: bytes the replicas read (a replica's ranks read the same messages,
            once per node: one rank counts).
        pseudo_grad_norm: its outer gradient's norm (None: nothing applied).
        seconds: from the first piece received to the step taken.
    """

    fragment: int
    step: int
    replicas: int
    bytes_up: int
    bytes_down: int
    pseudo_grad_norm: Optional[float]
    seconds: float

    @classmethod
    def of(cls, info, stats: dict, max_steps: int, sync_fragments: int) -> FragmentRecord:
        """From a sync's ``AppliedRound`` and replica id -> its ranks' stats, in a round of
        ``max_steps`` inner steps cut into ``sync_fragments`` sync periods."""
        return cls(
            fragment=info.fragment,
            step=sync_period(info.fragment, max_steps, sync_fragments)[1],
            replicas=len(info.accepted),
            bytes_up=sum(s.bytes_up for ranks in stats.values() for s in ranks),
            bytes_down=sum(max(s.bytes_down for s in ranks) for ranks in stats.values()),
            pseudo_grad_norm=info.pseudo_grad_norm,
            seconds=info.seconds,
        )


@dataclass(frozen=True)
class RoundRecord:
    """One round's record (build it with :meth:`build`; the fields are its keys, less the
    totals :meth:`to_record` adds up from ``fragments``).

    Args:
        round: the applied round's index (decoupled: the merge's).
        replica_ids: ids of the replicas applied.
        dropped: ids expected but failed, late or rejected.
        late: ids that missed a deadline.
        rejected: replica id (a string) -> why it was rejected.
        inner_steps: ``max_steps``.
        replica_steps: each applied replica's inner steps this round.
        tokens: tokens the applied replicas trained on.
        train_loss: their mean inner loss.
        outer_lr: the outer lr used.
        pseudo_grad_norm: the outer gradient's norm over every fragment (None: none applied).
        data_ranges: replica id (a string) -> the stream ranges it consumed.
        resumed_steps: replica id (a string) -> the in-flight step it resumed from.
        fragments: one :class:`FragmentRecord` per sync.
        compute_seconds: the longest applied replica's inner-step time.
        wasted_steps: replica inner steps this round whose work reached no applied update.
        evaluation: the eval after the update.
        timing: the round's wall times.
        merge: decoupled mode's facts (None: a synchronous round).
        abandoned_steps: decoupled mode, at the run's end: steps of the periods never merged.
        regions: across regions, region name -> the replicas it merged (its own ids), whether
            its message was applied, and its bytes both ways (the home's: its replicas' to
            and from the servers; another region's: the channel's); None: one cluster.
    """

    round: int
    replica_ids: list[int]
    dropped: list[int]
    late: list[int]
    rejected: dict[str, str]
    inner_steps: int
    replica_steps: dict[str, int]
    tokens: int
    train_loss: float
    outer_lr: float
    pseudo_grad_norm: Optional[float]
    data_ranges: dict[str, Any]
    resumed_steps: dict[str, int]
    fragments: tuple[FragmentRecord, ...]
    compute_seconds: float
    wasted_steps: int
    evaluation: Evaluation
    timing: Timing
    merge: Optional[MergeFacts] = None
    abandoned_steps: Optional[int] = None
    regions: Optional[dict[str, dict]] = None

    @classmethod
    def build(
        cls,
        syncs: Syncs,
        wasted_steps: int,
        evaluation: Evaluation,
        timing: Timing,
        *,
        max_steps: int,
        sync_fragments: int,
        merge: Optional[MergeFacts] = None,
        abandoned_steps: Optional[int] = None,
        home_region: Optional[str] = None,
    ) -> RoundRecord:
        """The record of a round whose syncs reported ``syncs``: a round of ``max_steps``
        inner steps cut into ``sync_fragments`` sync periods (the config's values);
        ``home_region``: the home's name, when other regions take part."""
        last, first = syncs.applied[-1], syncs.reported[0]
        rejected = {str(k): str(v) for info in syncs.applied for k, v in info.rejected.items()}
        accepted = [rid for rid in last.accepted if rid in last.data_ranges]
        per_replica = _by_replica(syncs.reported)
        ok = [s for rid in accepted for ranks in per_replica[rid] for s in ranks]
        norms = [info.pseudo_grad_norm for info in syncs.applied if info.pseudo_grad_norm is not None]
        return cls(
            round=last.round,
            replica_ids=accepted,
            dropped=sorted(syncs.late | syncs.failed | {int(k) for k in rejected}),
            late=sorted(syncs.late),
            rejected=rejected,
            inner_steps=max_steps,
            # each applied replica's steps this round: max_steps, or fewer with inner_time_s
            replica_steps={str(rid): sum(ranks[0].inner_steps for ranks in per_replica[rid]) for rid in accepted},
            tokens=sum(s.tokens for s in ok),
            train_loss=sum(s.loss_sum for s in ok) / max(sum(s.inner_steps for s in ok), 1),
            outer_lr=last.outer_lr,
            pseudo_grad_norm=math.sqrt(sum(n * n for n in norms)) if norms else None,
            data_ranges={str(k): v for k, v in last.data_ranges.items()},
            resumed_steps={
                str(rid): first[rid][0].resumed_step for rid in accepted if rid in first and first[rid][0].resumed_step
            },
            fragments=tuple(
                FragmentRecord.of(info, stats, max_steps, sync_fragments)
                for info, stats in zip(syncs.applied, syncs.reported)
            ),
            compute_seconds=_compute_seconds(per_replica, accepted),
            wasted_steps=wasted_steps,
            evaluation=evaluation,
            timing=timing,
            merge=merge,
            abandoned_steps=abandoned_steps,
            regions=None if home_region is None else _regions(syncs.reported, accepted, home_region),
        )

    @property
    def sync_seconds(self) -> float:
        """Time spent outside inner steps until the update was applied."""
        return max(0.0, self.timing.until_applied - self.compute_seconds)

    def to_record(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line (less ``time``): the keys docs/interface.md lists, and more."""
        ups, downs = [f.bytes_up for f in self.fragments], [f.bytes_down for f in self.fragments]
        record = {
            "event": "round",
            "round": self.round,
            "replicas": len(self.replica_ids),
            "replica_ids": self.replica_ids,
            "dropped": self.dropped,
            "late": self.late,
            "rejected": self.rejected,
            "inner_steps": self.inner_steps,
            "replica_steps": self.replica_steps,
            "tokens": self.tokens,
            "train_loss": self.train_loss,
            "outer_lr": self.outer_lr,
            "pseudo_grad_norm": self.pseudo_grad_norm,
            "data_ranges": self.data_ranges,
            "resumed_steps": self.resumed_steps,
            "bytes_up": sum(ups),
            "bytes_down": sum(downs),
            "peak_bytes_up": max(ups),
            "peak_bytes_down": max(downs),
            "fragments": [dataclasses.asdict(f) for f in self.fragments],
            "compute_seconds": self.compute_seconds,
            "wasted_steps": self.wasted_steps,
            "eval_loss": self.evaluation.loss,
            "eval_ppl": self.evaluation.ppl,
            "round_seconds": self.timing.round_seconds,
            "sync_seconds": self.sync_seconds,
            "eval_seconds": self.evaluation.seconds,
            "eval_bytes_down": self.evaluation.bytes_down,
        }
        merge = self.merge.to_record() if self.merge is not None else {}
        abandoned = {"abandoned_steps": self.abandoned_steps} if self.abandoned_steps is not None else {}
        regions = {"regions": self.regions} if self.regions is not None else {}
        return {**record, **merge, **abandoned, **regions}


def _by_replica(reported: list[dict]) -> dict[int, list[list]]:
    """Replica id -> its ranks' stats, per sync it reported in."""
    per_replica: dict[int, list[list]] = {}
    for period in reported:
        for rid, ranks in period.items():
            per_replica.setdefault(rid, []).append(ranks)
    return per_replica


def _regions(reported: list[dict], accepted: list[int], home_region: str) -> dict[str, dict]:
    """Region name -> what it did this round: the home's replicas (the members without a
    region's stats) and every region that reported in one of the round's syncs."""
    out: dict[str, dict] = {}
    for period in reported:
        for rid, ranks in period.items():
            facts = ranks[0].region
            name = facts.name if facts else home_region
            entry = out.setdefault(name, {"replica_ids": [], "applied": False, "bytes_up": 0, "bytes_down": 0})
            entry["bytes_up"] += sum(s.bytes_up for s in ranks)
            entry["bytes_down"] += max(s.bytes_down for s in ranks)
            if facts and facts.resends:  # the servers' whole state sent down to it so far, by reason
                entry["state_resends"] = dict(facts.resends)
            if rid in accepted:
                entry["applied"] = True
                ids = facts.replica_ids if facts else [rid]
                entry["replica_ids"] = sorted(set(entry["replica_ids"]) | set(ids))
    return out


def _compute_seconds(per_replica: dict[int, list[list]], accepted: list[int]) -> float:
    """The longest applied replica's inner-step time: per sync period, its slowest rank's."""
    return max(
        (sum(max(s.compute_seconds for s in ranks) for ranks in per_replica[rid]) for rid in accepted), default=0.0
    )
