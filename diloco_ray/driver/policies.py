"""The driver's decisions, as pure functions that return them (no Ray, no files).

In the manner of Ray Train v2's scaling and failure policies: the round loop and the
trainer ask, these answer, and the caller acts. Each is unit-tested on plain values.

* :class:`RoundOutcome` -- how an attempt at an outer update (a round, or a merge) ended
  (an :class:`Action` and why): proceed, run again, recover the servers, or stop
  (:func:`give_up_after` turns any of them into a stop once the retries are spent).
* :func:`attempt_verdict` -- whether a sync's result lets plain DiLoCo proceed.
* :func:`checkpoint_due` -- whether the round just applied is checkpointed.
* :func:`early_stop` -- whether eval loss has stopped improving.
* :func:`eval_due` -- whether the global weights are evaluated after this update.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from diloco_ray.observe.records import RoundRecord

# An outer update that is not applied is attempted again (a round run again; a merge
# that lost a replica's period, or whose servers were restored, goes on); this many
# retries in a row, in either mode, stop the run (driver.loop.apply_next_update).
MAX_ROUND_RETRIES = 3


class Action(enum.Enum):
    """What the trainer does after a loop's attempt at an outer update."""

    PROCEED = "proceed"  # applied: go on with its record
    RUN_AGAIN = "run_again"  # replace lost replicas, then call again (a round reruns from its start; a merge goes on)
    RECOVER_SERVER = "recover_server"  # restore the servers from the last checkpoint, then call again
    STOP = "stop"  # the run cannot go on


@dataclass(frozen=True)
class RoundOutcome:
    """How one attempt at a round ended, as a decision for the round loop.

    Args:
        action: what to do (:class:`Action`).
        record: the round record, when applied (``PROCEED``).
        why: what made the round run again, or stop (for errors and debugging).
    """

    action: Action
    record: Optional[RoundRecord] = None
    why: str = ""


def give_up_after(outcome: RoundOutcome, attempts: int, round_index: int) -> RoundOutcome:
    """``outcome``, or a stop once ``attempts`` attempts in a row at the update have all
    failed to apply it (``MAX_ROUND_RETRIES`` + 1 in all), in either mode."""
    if outcome.action is Action.PROCEED or attempts <= MAX_ROUND_RETRIES:
        return outcome
    why = f"round {round_index}: not applied in {attempts} attempts (the last: {outcome.why})"
    return RoundOutcome(Action.STOP, why=why)


def too_few_reported(reported: int, min_replicas: int, streaming: bool, regions: int = 1, min_regions: int = 1):
    """Plain DiLoCo runs a round again when fewer than ``min_replicas`` replicas reported,
    or (across regions) replicas of fewer than ``min_regions`` regions (a streaming sync
    goes on with whoever reported: its fragments are committed one by one)."""
    if streaming or (reported >= min_replicas and regions >= min_regions):
        return None
    if reported < min_replicas:
        return RoundOutcome(Action.RUN_AGAIN, why=f"{reported} < min_replicas={min_replicas} reported")
    return RoundOutcome(Action.RUN_AGAIN, why=f"replicas of {regions} < min_regions={min_regions} regions reported")


def attempt_verdict(applied: bool, streaming: bool) -> Optional[RoundOutcome]:
    """After the commit: plain DiLoCo with nothing applied (every pseudo-gradient rejected)
    runs the round again; anything else proceeds (None)."""
    if streaming or applied:
        return None
    return RoundOutcome(Action.RUN_AGAIN, why="no update applied (every pseudo-gradient rejected)")


def checkpoint_due(
    progress: float, last_checkpoint_progress: Optional[float], every_steps: Optional[int], max_steps: int
) -> bool:
    """Whether to checkpoint now, with ``progress`` rounds' worth of inner steps done (rounds
    applied; in decoupled mode, rounds' worth of tokens merged, whatever the merge count):
    every ``checkpoint_steps`` inner steps (rounded up to whole rounds; None: never)."""
    if every_steps is None:
        return False
    # A merge's share of a round is a fraction of tokens: allow its round-off.
    return (progress - (last_checkpoint_progress or 0.0)) * max_steps >= every_steps - 1e-6


@dataclass(frozen=True)
class EarlyStop:
    """The decision to stop: the best eval loss so far, and the patience that ran out."""

    best: float
    patience: int


def early_stop(
    eval_losses: Sequence[Optional[float]], patience: Optional[int], threshold: float
) -> Optional[EarlyStop]:
    """Stop when eval loss has not improved on the best before the last ``patience`` rounds
    by more than ``threshold`` (rounds without eval are skipped; None: keep going)."""
    losses = [x for x in eval_losses if x is not None]
    if patience is None or len(losses) <= patience:
        return None
    best_before = min(losses[:-patience])
    if min(losses[-patience:]) < best_before - threshold:
        return None
    return EarlyStop(best=min(losses), patience=patience)


def eval_due(rounds_before: float, rounds_after: float, every: int, finished: bool) -> bool:
    """Whether the update that moved the rounds done (decoupled mode: rounds' worth of merged
    tokens) from ``rounds_before`` to ``rounds_after`` is evaluated: when it passes a multiple
    of ``every`` (``eval_every``), or ends the run.

    An eval fetches the fp32 global weights to a replica, a whole model down its link each
    time (40x what ``topk`` sends up), so over slow links a user evaluates less often."""
    eps = 1e-9  # fractions of a round that add up to a whole one, with round-off
    return finished or math.floor((rounds_after + eps) / every) > math.floor((rounds_before + eps) / every)
