"""The held-out check: a region's update may not make the home's held-out loss worse.

Screening by norm (:mod:`diloco_ray.algo.screening`) cannot tell a sign flip, or any wrong
update of an honest size, from an honest one. With ``region_holdout_margin`` set, each
region's contribution is tried before the round's sync is handed to the servers: the servers
build the round's weights minus it (its update alone, at learning rate 1: where the region's
own replicas ended, as its message carries them), a home replica scores them on the eval
batches (held out from training), and a contribution whose eval loss is more than the margin
above the round's weights' own is refused, as a reply the home refused is: it stands in the
sync as a message every server rejects with the reason, which the round record's
``rejected`` shows.

An honest region's update is the mean of its replicas' inner steps: while the model learns
it lowers the held-out loss, and a sign-flipped copy raises it by about as much, so a margin
of 0 tells them apart (late in a run both move the loss little, and a larger margin lets a
flip through: docs/results.md, Screening regions). It runs only where
the home's replicas wait anyway, between reporting and the round's weights: sync mode, whole
rounds (config validation says so). Its cost, per round with a region in it: one eval of the
round's weights and one per region, each moving the fp32 weights to the eval replica.
"""

from __future__ import annotations

import math
from typing import Optional

from diloco_ray.config.fields import is_region_member
from diloco_ray.driver.round_parts import eval_loss
from diloco_ray.runtime.messages import Contribution, RoundStats
from diloco_ray.runtime.server_aggregator import refusal_message

HELD_OUT = "the held-out check"  # what a server lost while it scores weights died during


def worse_than_margin(trial: Optional[float], base: float, margin: float) -> Optional[str]:
    """Why an update whose weights score ``trial`` is refused, against the round's weights'
    ``base``; None when it is within ``margin`` (a loss that is not a number is refused)."""
    if trial is not None and math.isfinite(trial) and trial <= base + margin:
        return None
    shown = "no number" if trial is None else f"{trial:.4f}"
    return (
        f"held-out check: the round's weights minus its update score eval loss {shown} against their "
        f"{base:.4f} (region_holdout_margin {margin:g})"
    )


class HoldoutCheck:
    """Tries each region's contribution of a sync on a home replica (see the module).

    Args:
        margin: ``region_holdout_margin``: how far above the round's weights' eval loss may go.
    """

    def __init__(self, margin: float):
        self.margin = margin

    def refusals(self, host, contributions: list[list[Contribution]], tried: list[int]) -> dict[int, str]:
        """Region member id -> why its contribution is refused, for the ids ``tried`` (the
        region members whose replies carry a contribution); ``contributions``: per server,
        the sync's contributions."""
        if not tried:
            return {}
        base, _ = eval_loss(host.members, host.server, host.server.global_weights(), what=HELD_OUT)
        if base is None or not math.isfinite(base):  # nothing to hold them against: none is applied
            why = "held-out check: no home replica could score the round's weights"
            return dict.fromkeys(tried, why)
        out = {}
        for rid in tried:
            parts = [next(c for c in per_server if c.replica_id == rid) for per_server in contributions]
            trial, _ = eval_loss(host.members, host.server, host.server.trial_weights(parts), what=HELD_OUT)
            why = worse_than_margin(trial, base, self.margin)
            if why is not None:
                out[rid] = why
        return out


def carries_update(replica_id: int, stats: RoundStats) -> bool:
    """Whether a report is a region's contribution to try: a region's member (as the servers
    tell: :func:`~diloco_ray.config.fields.is_region_member`) whose reply was neither told to
    stop nor refused already."""
    return is_region_member(replica_id) and not stats.aborted and (stats.region is None or stats.region.refused is None)


def refused(contributions: list[list[Contribution]], why: dict[int, str]) -> list[list[Contribution]]:
    """``contributions`` (per server) with each of ``why``'s ids standing for a refusal
    message that every server rejects with its reason."""
    if not why:
        return contributions
    message = {rid: refusal_message(reason) for rid, reason in why.items()}
    return [
        [Contribution(c.replica_id, [message[c.replica_id]], c.weight) if c.replica_id in why else c for c in per]
        for per in contributions
    ]
