"""Unit tests for diloco_ray.observe.progress: the driver's console display, plain and with bars (no Ray)."""

import io
import math
import re

import pytest

from diloco_ray.observe.progress import Progress


class FakeClock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def record(round_index=2, **overrides):
    rec = {
        "event": "round",
        "round": round_index,
        "replicas": 2,
        "replica_ids": [0, 1],
        "dropped": [],
        "inner_steps": 30,
        "tokens": 7680,
        "train_loss": 1.23451,
        "eval_loss": 1.1,
        "outer_lr": 0.7,
        "pseudo_grad_norm": 0.5,
        "bytes_up": 10,
        "bytes_down": 20,
        "round_seconds": 12.34,
        "sync_seconds": 0.41,
        "compute_seconds": 11.0,
        "eval_seconds": 0.5,
    }
    rec.update(overrides)
    return rec


def plain(clock=None, **kwargs):
    stream = io.StringIO()
    kwargs.setdefault("min_interval_s", 5.0)
    return Progress(10, 30, stream=stream, interactive=False, clock=clock or FakeClock(), **kwargs), stream


def lines(stream):
    return stream.getvalue().splitlines()


def test_round_line_format_is_the_one_users_read():
    """Losses rounded, replicas applied of those wanted, tokens/s, bytes each way, seconds,
    and the time left at this run's pace (none after the last round)."""
    clock = FakeClock()
    progress, stream = plain(clock)
    progress.start(0)
    progress.begin_round(2, replicas=2, target=2)
    clock.advance(30.0)  # 3 rounds' worth in 30 s: 7 left take 70 s
    progress.end_round(record(bytes_up=1_234_567, bytes_down=123_456))
    progress.begin_round(3, replicas=1, target=2)
    clock.advance(10.0)
    empty = dict(eval_loss=None, replicas=1, tokens=0, round_seconds=0.0, sync_seconds=0.0, bytes_up=0, bytes_down=0)
    progress.end_round(record(round_index=3, **empty))
    progress.end_round(record(round_index=9, bytes_up=12_345_678_901, bytes_down=45_678))
    assert lines(stream) == [
        "round 3/10  train_loss 1.2345  eval_loss 1.1000  replicas 2/2  tokens/s 622  up 1.23 MB  down 123 kB"
        "  12.3s (sync 0.41s)  ETA 1m10s",
        "round 4/10  train_loss 1.2345  eval_loss -  replicas 1/2  tokens/s -  up 0 B  down 0 B"
        "  0.0s (sync 0.00s)  ETA 1m00s",
        "round 10/10  train_loss 1.2345  eval_loss 1.1000  replicas 2/2  tokens/s 622  up 12.3 GB  down 45.7 kB"
        "  12.3s (sync 0.41s)",
    ]


def test_step_lines_are_throttled_for_the_whole_job():
    clock = FakeClock()
    progress, stream = plain(clock)
    progress.begin_round(2, replicas=2)
    clock.advance(1.0)
    progress.step(0, 1, 2.0, 1e-3, 100)  # first event: printed at once
    clock.advance(1.0)
    progress.step(1, 1, 2.0, 1e-3, 100)  # 1 s later: held back, even from another replica
    clock.advance(3.9)
    progress.step(0, 2, 2.0, 1e-3, 200)  # 4.9 s after the last line: still held back
    clock.advance(0.1)
    progress.step(1, 3, 2.0, 1e-3, 300)  # 5 s: printed
    step_lines = [line for line in lines(stream) if line.startswith("  round")]
    # Both replicas train from the start: the one yet to report counts at the other's rate.
    assert step_lines == [
        "  round 3/10  step 1/30  loss 2.0000  replicas 2/2  tokens/s 200",
        "  round 3/10  step 2/30  loss 2.0000  replicas 2/2  tokens/s 83",
    ]


def test_tokens_per_second_counts_every_replica_training_since_begin_round():
    clock = FakeClock()
    progress, stream = plain(clock, min_interval_s=0.0)
    clock.advance(50.0)  # time before the round does not count
    progress.begin_round(0, replicas=3, target=4)
    clock.advance(4.0)
    progress.step(0, 10, 1.0, 1e-3, 4000)
    progress.step(1, 12, 3.0, 1e-3, 4000)
    progress.step(0, 20, 2.0, 1e-3, 8000)  # replica 0's latest replaces its earlier report
    summary = progress.summary()
    # Two of the three training replicas reported 12000 tokens in 4 s: the third at their mean rate.
    assert summary["tokens_per_s"] == pytest.approx((8000 + 4000) / 4.0 * 3 / 2)
    assert (summary["replicas"], summary["reporting"], summary["expected"]) == (3, 2, 4)
    assert lines(stream)[-1] == "  round 1/10  step 12/30  loss 2.5000  replicas 3/4  tokens/s 4.5k"


def test_step_is_the_slowest_reporting_replica_and_loss_the_mean_of_latest():
    progress, _ = plain()
    progress.begin_round(5, replicas=3)  # replica 2 never reports
    progress.step(0, 7, 1.0, 1e-3, 10)
    progress.step(1, 4, 2.0, 1e-3, 10)
    progress.step(0, 9, 1.5, 1e-3, 10)
    summary = progress.summary()
    assert summary["round"] == 5 and summary["step"] == 4
    assert summary["loss"] == pytest.approx(1.75)
    assert (summary["replicas"], summary["reporting"], summary["expected"]) == (3, 2, 3)
    progress.step(1, 11, 2.0, 1e-3, 10)
    assert progress.summary()["step"] == 9


def test_a_new_round_forgets_the_last_rounds_replicas():
    clock = FakeClock()
    progress, _ = plain(clock)
    progress.begin_round(0, replicas=2)
    progress.step(0, 30, 1.0, 1e-3, 3000)
    progress.step(1, 30, 1.0, 1e-3, 3000)
    progress.end_round(record(round_index=0))
    progress.begin_round(1, replicas=2)
    clock.advance(2.0)
    progress.step(1, 3, 4.0, 1e-3, 300)
    summary = progress.summary()
    assert (summary["round"], summary["step"], summary["reporting"]) == (1, 3, 1)
    assert summary["loss"] == 4.0 and summary["tokens_per_s"] == pytest.approx(2 * 150.0)


def test_a_retried_round_starts_over():
    # A round that was not applied (server lost, too few replicas) is begun again
    # without an end_round: the aborted attempt's reports must not linger.
    progress, _ = plain()
    progress.begin_round(1, replicas=2)
    progress.step(0, 20, 1.0, 1e-3, 2000)
    progress.begin_round(1, replicas=2)
    progress.step(1, 2, 5.0, 1e-3, 200)
    summary = progress.summary()
    assert (summary["step"], summary["reporting"], summary["loss"]) == (2, 1, 5.0)


def test_nan_losses_zero_seconds_and_a_resume_do_not_crash():
    progress, stream = plain(min_interval_s=0.0)
    progress.start(4)
    progress.end_round(record(round_index=4, train_loss=math.nan, eval_loss=math.inf))  # no begin_round
    progress.step(0, 1, math.nan, 1e-3, 100)  # no begin_round either; no time has passed
    progress.step(1, 1, None, None, math.nan)  # a report without figures counts as NaN, 0 tokens
    summary = progress.summary()
    assert summary["round"] == 5 and summary["tokens_per_s"] is None and math.isnan(summary["loss"])
    assert summary["replicas"] == 2
    progress.step(0, 2, 3.0, 1e-3, 200)
    assert math.isnan(progress.summary()["loss"])  # replica 1's missing loss is not a 0
    progress.close()
    progress.close()
    progress.step(0, 2, 1.0, 1e-3, 100)  # after close: ignored, not an error
    assert lines(stream) == [
        "round 5/10  train_loss nan  eval_loss inf  replicas 2  tokens/s 622  up 10 B  down 20 B"
        "  12.3s (sync 0.41s)  ETA 0s",
        "  round 6/10  step 1/30  loss nan  replicas 1/1  tokens/s -",
        "  round 6/10  step 1/30  loss nan  replicas 2/2  tokens/s -",
        "  round 6/10  step 1/30  loss nan  replicas 2/2  tokens/s -",
    ]


def test_default_mode_follows_the_stream():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert Progress(1, 1, stream=io.StringIO()).interactive is False
    assert Progress(1, 1, stream=Terminal()).interactive is True


def test_interactive_bars_show_rounds_and_steps():
    clock = FakeClock()
    stream = io.StringIO()
    progress = Progress(10, 30, stream=stream, interactive=True, clock=clock)
    progress.start(2)
    progress.begin_round(2, replicas=2)
    clock.advance(2.0)
    progress.step(0, 10, 1.0, 1e-3, 1000)
    clock.advance(2.0)
    progress.step(1, 6, math.nan, 1e-3, 600)
    shown = stream.getvalue()
    assert "rounds:  20%" in shown and "2/10" in shown
    # The steps bar: slowest replica, mean loss (NaN shows as nan), replicas of expected, tokens/s.
    assert re.search(r"round 3:  20%.*\b6/30\b.*loss=nan, replicas=2/2, tokens/s=400", shown)
    progress.end_round(record(round_index=2, eval_loss=0.98765))
    shown = stream.getvalue()
    assert re.search(r"rounds:  30%.*3/10.*eval_loss=0\.9877, replicas=2", shown)
    # The round line is kept above the bars.
    assert "round 3/10  train_loss 1.2345  eval_loss 0.9877  replicas 2  tokens/s 622" in shown
    progress.close()
    progress.close()


def test_interactive_redraws_are_throttled():
    clock = FakeClock()
    stream = io.StringIO()
    progress = Progress(10, 30, stream=stream, interactive=True, clock=clock)
    progress.begin_round(0, replicas=1)
    clock.advance(1.0)
    progress.step(0, 7, 1.0, 1e-3, 100)
    progress.step(0, 8, 1.0, 1e-3, 100)  # same instant: not redrawn
    assert "7/30" in stream.getvalue() and "8/30" not in stream.getvalue()
    clock.advance(0.2)
    progress.step(0, 9, 1.0, 1e-3, 100)
    assert "9/30" in stream.getvalue()
    progress.close()
