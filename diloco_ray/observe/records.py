"""The round record: what one outer round did, as one ``metrics.jsonl`` line.

A pure function of the servers' reports and the ranks' statistics, so the figures users
read (bytes per sync, replicas applied, loss) are computed in one place and tested
without Ray.
"""

from __future__ import annotations

import math

from diloco_ray.algo.inner_schedule import sync_period
from diloco_ray.config.schema import TrainerConfig


def round_record(cfg: TrainerConfig, applied: list, reported: list[dict], late: set, failed: set) -> dict:
    """The round's record (a ``metrics.jsonl`` line, less eval and timing) from its syncs.

    Args:
        cfg: the job's config.
        applied: per sync, server 0's :class:`~diloco_ray.runtime.server.AppliedRound`.
        reported: per sync, replica id -> its ranks' :class:`~diloco_ray.runtime.rank.RoundStats`.
        late: ids that missed a deadline this round.
        failed: ids whose process or node died this round.
    """
    last = applied[-1]
    fragments, rejected = [], {}
    for info, stats in zip(applied, reported):
        rejected.update({str(k): str(v) for k, v in info.rejected.items()})
        fragments.append(
            {
                "fragment": info.fragment,
                "step": sync_period(info.fragment, cfg.max_steps, cfg.sync_fragments)[1],
                "replicas": len(info.accepted),
                "bytes_up": sum(s.bytes_up for ranks in stats.values() for s in ranks),
                # a replica's ranks read the same messages (once per node): count one rank
                "bytes_down": sum(max(s.bytes_down for s in ranks) for ranks in stats.values()),
                "pseudo_grad_norm": info.pseudo_grad_norm,
                "seconds": info.seconds,
            }
        )
    accepted = [rid for rid in last.accepted if rid in last.data_ranges]
    per_replica = {}
    for period in reported:
        for rid, ranks in period.items():
            per_replica.setdefault(rid, []).append(ranks)
    ok = [s for rid in accepted for ranks in per_replica[rid] for s in ranks]
    steps = sum(s.inner_steps for s in ok)
    compute = max(
        (sum(max(s.compute_seconds for s in ranks) for ranks in per_replica[rid]) for rid in accepted), default=0.0
    )
    norms = [f["pseudo_grad_norm"] for f in fragments if f["pseudo_grad_norm"] is not None]
    first = reported[0]
    return {
        "event": "round",
        "round": last.round,
        "replicas": len(accepted),
        "replica_ids": accepted,
        "dropped": sorted(late | failed | {int(k) for k in rejected}),
        "late": sorted(late),
        "rejected": rejected,
        "inner_steps": cfg.max_steps,
        # each applied replica's steps this round: max_steps, or fewer with inner_time_s
        "replica_steps": {str(rid): sum(ranks[0].inner_steps for ranks in per_replica[rid]) for rid in accepted},
        "tokens": sum(s.tokens for s in ok),
        "train_loss": sum(s.loss_sum for s in ok) / max(steps, 1),
        "outer_lr": last.outer_lr,
        "pseudo_grad_norm": math.sqrt(sum(n * n for n in norms)) if norms else None,
        "data_ranges": {str(k): v for k, v in last.data_ranges.items()},
        "resumed_steps": {
            str(rid): first[rid][0].resumed_step for rid in accepted if rid in first and first[rid][0].resumed_step
        },
        "bytes_up": sum(f["bytes_up"] for f in fragments),
        "bytes_down": sum(f["bytes_down"] for f in fragments),
        "peak_bytes_up": max(f["bytes_up"] for f in fragments),
        "peak_bytes_down": max(f["bytes_down"] for f in fragments),
        "fragments": fragments,
        "compute_seconds": compute,
    }
