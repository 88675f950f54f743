"""Screening what another party sends: a region's contribution far outside the others is not applied.

A region is another party (another team, cloud account or company): what it sends is checked
against what the home planned (its claims) and, here, against what the others sent. The
rule is on the contribution's L2 norm, which every server can compute from its own rows and
agree on exactly (each server's sum of squares, added in server order):

    a screened contribution is rejected when its norm is over ``threshold`` times the
    median norm of the sync's other contributions; with no other contribution, over
    ``threshold`` times the median of its own last :data:`HISTORY` accepted norms.

The median, not the mean, so that one loud party does not raise its own bar, nor a minority
of them theirs. What it catches and misses (a scaled copy of an honest update: caught once
the scale passes ``threshold``; a sign flip or a plausible wrong update of the same size:
missed; a replayed message: the channel's keys refuse it before it gets here) is measured
in docs/security.md. Pure: floats in, rejections out; no torch, no Ray.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable, Mapping

from diloco_ray.algo.aggregate import Rejected, Rejection

HISTORY = 8  # a contribution's own last accepted norms, its reference when it is alone


class NormScreen:
    """The rule above, with each screened party's history of accepted norms.

    Args:
        threshold: how many times the reference norm a screened contribution may reach.
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.history: dict[int, deque] = {}

    def judge(self, norms: Mapping[int, float], screened: Iterable[int]) -> dict[int, Rejected]:
        """The screened contributions of one sync that are rejected, and why. ``norms``:
        id -> L2 norm of every contribution still in the sync (not rejected by another
        check); the accepted screened ones join their history."""
        out: dict[int, Rejected] = {}
        for rid in sorted(set(screened) & set(norms)):
            norm = norms[rid]
            others = [n for r, n in norms.items() if r != rid and math.isfinite(n)]
            own = self.history.get(rid, ())
            reference = statistics.median(others) if others else (statistics.median(own) if own else None)
            if reference is not None and reference > 0 and not norm <= self.threshold * reference:
                whose = "the sync's other contributions" if others else "its own last accepted ones"
                detail = (
                    f"screened out: its norm {norm:.3g} is {norm / reference:.3g}x the median {reference:.3g} "
                    f"of {whose} (region_screen_norm {self.threshold:g})"
                )
                out[rid] = Rejected(Rejection.SCREENED, detail)
        for rid in set(screened) & set(norms) - set(out):
            self.history.setdefault(rid, deque(maxlen=HISTORY)).append(norms[rid])
        return out
