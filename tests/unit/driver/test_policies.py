"""The driver's decisions on plain values: when to checkpoint, when to stop, when to run again."""

import pytest

from diloco_ray.driver.policies import (
    MAX_ROUND_RETRIES,
    Action,
    RoundOutcome,
    attempt_verdict,
    checkpoint_due,
    early_stop,
    eval_due,
    give_up_after,
    too_few_reported,
)


@pytest.mark.parametrize(
    "round_index, last, every, due",
    [
        (1, None, None, False),  # checkpoint_steps unset: never
        (1, None, 4, True),  # one round of 4 steps: 4 >= 4
        (1, None, 6, False),  # 4 < 6: rounded up to whole rounds...
        (2, None, 6, True),  # ...so the second round (8 >= 6)
        (3, 2, 6, False),  # counted from the last checkpoint
        (4, 2, 6, True),
        # Decoupled mode counts rounds' worth of tokens merged, not merges: a merge of one
        # replica out of two is half a round's worth of inner steps.
        (0.5, None, 4, False),
        (1.0, None, 4, True),
        (1.5, 1.0, 4, False),
        (0.1 + 0.2 + 0.3 + 0.4, None, 4, True),  # shares that add up to a round, with round-off
    ],
)
def test_checkpoint_every_checkpoint_steps_rounded_up_to_rounds(round_index, last, every, due):
    assert checkpoint_due(round_index, last, every, max_steps=4) is due


@pytest.mark.parametrize(
    "before, after, every, finished, due",
    [
        (0, 1, 1, False, True),  # the default: after every round
        (0, 1, 3, False, False),
        (2, 3, 3, False, True),  # after rounds 3, 6, ...
        (3, 4, 3, True, True),  # and after the last, whatever the count
        # Decoupled mode counts rounds' worth of merged tokens: half-round merges.
        (1.5, 2.0, 2, False, True),
        (2.0, 2.5, 2, False, False),
        (0.1 + 0.2 + 0.3, 0.1 + 0.2 + 0.3 + 0.4, 1, False, True),  # shares that add up, with round-off
    ],
)
def test_eval_after_every_eval_every_rounds_and_the_last(before, after, every, finished, due):
    assert eval_due(before, after, every, finished) is due


def test_early_stop_after_patience_rounds_without_improvement():
    assert early_stop([3.0, 2.0, 2.1, 2.05], patience=2, threshold=0.0).best == 2.0
    assert early_stop([3.0, 2.0, 2.1, 1.99], patience=2, threshold=0.0) is None  # improved
    assert early_stop([3.0, 2.0, 2.1, 1.99], patience=2, threshold=0.05) is not None  # not by enough
    assert early_stop([3.0, 2.0, 2.1], patience=3, threshold=0.0) is None  # too few rounds yet
    assert early_stop([3.0, None, 2.0, None, 2.1, 2.2], patience=2, threshold=0.0).patience == 2  # no-eval rounds skip
    assert early_stop([3.0, 3.0, 3.0], patience=None, threshold=0.0) is None


def test_plain_diloco_runs_again_with_too_few_or_nothing_applied():
    assert too_few_reported(1, min_replicas=2, streaming=False).action is Action.RUN_AGAIN
    assert too_few_reported(2, min_replicas=2, streaming=False) is None
    assert too_few_reported(0, min_replicas=2, streaming=True) is None  # streaming goes on with who reported
    assert attempt_verdict(applied=False, streaming=False).action is Action.RUN_AGAIN
    assert attempt_verdict(applied=True, streaming=False) is None
    assert attempt_verdict(applied=False, streaming=True) is None


def test_a_round_run_again_past_the_retries_stops_the_run():
    again = RoundOutcome(Action.RUN_AGAIN, why="no update applied")
    assert give_up_after(again, attempts=MAX_ROUND_RETRIES, round_index=3) is again
    stop = give_up_after(again, attempts=MAX_ROUND_RETRIES + 1, round_index=3)
    assert (
        stop.action is Action.STOP
        and stop.why == f"round 3: not applied in {MAX_ROUND_RETRIES + 1} attempts (the last: no update applied)"
    )
    done = RoundOutcome(Action.PROCEED, record=None)
    assert give_up_after(done, attempts=99, round_index=3) is done


def test_min_regions_counts_the_regions_whose_replicas_reported():
    from diloco_ray.driver.round_parts import reported_counts
    from diloco_ray.runtime.messages import RegionFacts, RoundStats

    def stats(region=None):
        return [RoundStats(0, 1, 1, 1.0, 0.0, 0.0, 0, region=region)]

    home_and_eu = {0: stats(), 1: stats(), 1_000_000: stats(RegionFacts(name="eu", replica_ids=(0, 1, 2)))}
    assert reported_counts(home_and_eu) == (5, 2)  # the region's three replicas; the home and eu
    assert reported_counts({1_000_000: stats(RegionFacts(name="eu", replica_ids=(0,)))}) == (1, 1)
    assert too_few_reported(5, min_replicas=1, streaming=False, regions=2, min_regions=3).action is Action.RUN_AGAIN
    assert "min_regions=3" in too_few_reported(5, 1, False, regions=2, min_regions=3).why
    assert too_few_reported(5, min_replicas=1, streaming=False, regions=3, min_regions=3) is None
