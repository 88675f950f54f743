"""Screening what another party sends: a region's contribution far outside the others is not applied.

A region is another party (another team, cloud account or company): what it sends is checked
against what the home planned (its claims) and, here, against what the others sent. The
rule is on the contribution's L2 norm, which every server can compute from its own rows and
agree on exactly (each server's sum of squares, added in server order):

    a screened contribution is rejected when its norm is over ``threshold`` times the
    median norm of the sync's other contributions; with no other contribution, over
    ``threshold`` times the median of the last :data:`HISTORY` norms accepted in syncs of
    the same rows (the home's and the regions'); with neither, it is rejected: there is
    nothing yet to hold it against.

The median, not the mean, so that one loud party does not raise its own bar, nor a minority
of them theirs. The history is kept per fragment (its rows' norms differ from another's) and
holds everyone's accepted norms, so a party alone in a sync (decoupled merges take whoever
arrived) is held against the others' recent size, not only its own: a region whose first
contribution is already scaled has no honest history of its own. What it catches and misses
(a scaled copy of an honest update: caught once the scale passes ``threshold``; a sign flip
or a plausible wrong update of the same size: missed, for the held-out check of
:mod:`diloco_ray.driver.holdout`; a replayed message: the channel's keys refuse it before it
gets here) is measured in docs/security.md. Pure: floats in, rejections out; no torch, no Ray.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable, Mapping

from diloco_ray.algo.aggregate import Rejected, Rejection

HISTORY = 8  # accepted norms kept per fragment: a contribution's reference when it is alone


class NormScreen:
    """The rule above, with each fragment's history of accepted norms.

    Args:
        threshold: how many times the reference norm a screened contribution may reach.
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.history: dict[int, deque] = {}

    def judge(self, norms: Mapping[int, float], screened: Iterable[int], fragment: int = 0) -> dict[int, Rejected]:
        """The screened contributions of one sync of ``fragment`` that are rejected, and why.
        ``norms``: id -> L2 norm of every contribution still in the sync (not rejected by
        another check); the accepted ones, screened or not, join the fragment's history."""
        out: dict[int, Rejected] = {}
        recent = self.history.setdefault(fragment, deque(maxlen=HISTORY))
        for rid in sorted(set(screened) & set(norms)):
            norm = norms[rid]
            others = [n for r, n in norms.items() if r != rid and math.isfinite(n)]
            whose = "the sync's other contributions" if others else f"the last {len(recent)} accepted ones"
            reference = statistics.median(others) if others else (statistics.median(recent) if recent else None)
            if reference is None:
                detail = "screened out: alone in its sync, with no accepted norm yet to hold it against"
            elif reference > 0 and not norm <= self.threshold * reference:
                detail = (
                    f"screened out: its norm {norm:.3g} is {norm / reference:.3g}x the median {reference:.3g} "
                    f"of {whose} (region_screen_norm {self.threshold:g})"
                )
            else:
                continue
            out[rid] = Rejected(Rejection.SCREENED, detail)
        recent.extend(n for rid, n in sorted(norms.items()) if rid not in out and math.isfinite(n))
        return out
