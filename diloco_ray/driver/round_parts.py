"""What both loops build the same way from the periods they hand to the servers.

A synchronous round (:class:`~diloco_ray.driver.sync_loop.SyncLoop`) and a decoupled merge
(:class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`) differ in who is waited for and
how each contribution is weighted, not in what they send: every replica's pseudo-gradient
buffers by server, weighted by the tokens that carried loss; the stream ranges it had no
time for; and, once the update is applied, one record evaluated on the new weights (the
scoring of weights on a home replica, :func:`eval_loss`, which the held-out check of
:mod:`diloco_ray.driver.holdout` shares). Those are built here, once, as plain functions
over the periods' stats.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Iterable, Mapping, Optional

from diloco_ray.config.sections import EvalSection, MembershipSection, RunShapeSection, SyncCodecSection
from diloco_ray.control.calls import check_servers
from diloco_ray.driver.host import Host
from diloco_ray.driver.policies import eval_due
from diloco_ray.observe.records import RoundRecord, Syncs, Timing
from diloco_ray.runtime.messages import Contribution

# A replica's period reports one stats object per rank; the first rank's speaks for the
# replica where every rank trained the same steps (steps, unused ranges).


def token_weights(reported: Mapping[int, list]) -> dict[int, float]:
    """Replica id -> the tokens that carried loss in its period, summed over its ranks
    (each replica counts by them: see :mod:`diloco_ray.algo.loss`)."""
    return {rid: float(sum(s.loss_tokens for s in stats)) for rid, stats in reported.items()}


def per_server(
    buffers: Mapping[int, list],
    weights: Mapping[int, float],
    servers: int,
    staleness: Optional[Mapping[int, int]] = None,
) -> list[list[Contribution]]:
    """For each of ``servers`` servers, every replica's contribution to it, in the order of
    ``buffers`` (replica id -> its packed buffers, one per server): the buffer, its weight
    and, in decoupled mode, its staleness."""
    extra = (lambda rid: (staleness[rid],)) if staleness is not None else (lambda rid: ())
    return [[Contribution(rid, buffers[rid][s], weights[rid], *extra(rid)) for rid in buffers] for s in range(servers)]


def unused_ranges(reported: Mapping[int, list]) -> dict[int, list]:
    """Replica id -> the stream ranges its period had no time for (``inner_time_s``), which
    go back to the data cursor; replicas that used all their data are left out."""
    return {rid: stats[0].unused for rid, stats in reported.items() if stats[0].unused}


def reported_counts(reported: Mapping[int, list]) -> tuple[int, int]:
    """(replicas, regions) behind the periods that reported: a region's member counts the
    replicas its message merged, and the home's replicas count as one region."""
    facts = [stats[0].region for stats in reported.values()]
    replicas = sum(len(f.replica_ids) if f else 1 for f in facts)
    regions = sum(1 for f in facts if f) + any(f is None for f in facts)
    return replicas, regions


def wasted(reported: Mapping[int, list], replica_ids: Iterable[int]) -> int:
    """The inner steps of those replicas' periods (work that reached no applied update)."""
    return sum(reported[rid][0].inner_steps for rid in replica_ids)


class RoundRecorder:
    """What both loops record an applied update with, fixed for the run by its config: when
    its weights are evaluated (``eval_every``) and the record's shape (the round's steps and
    syncs, and the home's name when other regions take part: their facts go under
    ``regions``)."""

    def __init__(
        self, run: RunShapeSection, sync_codec: SyncCodecSection, membership: MembershipSection, evaluation: EvalSection
    ):
        self.eval_every = evaluation.eval_every
        home = membership.home_region if membership.regions else None
        self.shape = dict(max_steps=run.max_steps, sync_fragments=sync_codec.sync_fragments, home_region=home)

    def record(
        self,
        host: Host,
        syncs: Syncs,
        wasted_steps: int,
        *,
        marks: tuple[float, float],
        progress: tuple[float, float],
        finished: bool,
        among: Optional[list] = None,
        facts: Callable[[], dict] = dict,
    ) -> RoundRecord:
        """The record of an update just applied: its weights evaluated when ``eval_every``
        says so (``progress``: rounds' worth done before and after it; ``finished``: it ends
        the run; ``among``: the replicas to evaluate on first), its timing from ``marks``
        (perf_counter seconds at its start and when it was applied), and the further facts
        :meth:`RoundRecord.build` takes (a decoupled merge's), read once the eval is done."""
        due = eval_due(*progress, self.eval_every, finished)
        evaluation = host.evaluate(among=among, due=due)
        started, applied_at = marks
        timing = Timing(round_seconds=time.perf_counter() - started, until_applied=applied_at - started)
        return RoundRecord.build(syncs, wasted_steps, evaluation, timing, **self.shape, **facts())


def eval_loss(
    members, server, weight_refs: list, among: Optional[list] = None, what: str = "the eval"
) -> tuple[Optional[float], int]:
    """The per-token eval loss of the weights ``weight_refs`` (one packed ref per server of
    the group ``server``) on the first home replica that answers (``among`` first), and the
    bytes it read; (None, 0) when no replica is left. A server that died raises
    :class:`~diloco_ray.control.calls.ServerLost` naming ``what`` it died during (its
    weights could not be read: the replicas are not at fault)."""
    check = partial(check_servers, server, f"during {what}")
    results = members.first_answer(lambda rep: rep.evaluate(weight_refs), among, check)
    if results is None:
        return None, 0
    # The eval replica's ranks share its node's object store: the weights crossed once.
    # (Evaluating the next round's weights message instead saves nothing over a star of
    # links: the other replicas then pull it from the eval replica, up its link.)
    total, count = sum(r[0] for r in results), sum(r[1] for r in results)
    return (total / count if count else None), max(r[2] for r in results)
