"""The driver's progress display: what a person watching a run sees while it goes on.

:class:`Progress` owns the console output of training (``metrics.jsonl`` and the trackers
stay with :mod:`diloco_ray.observe.metrics`). It takes events from the driver: a round begins, a
replica reached an inner step, a round ended with its record. On a terminal it draws two
tqdm bars (rounds, and the inner steps of the current round); elsewhere (a log file, a Ray
job's captured output, CI) it writes plain lines, one per round and throttled step lines,
because carriage-return bars make such logs unreadable.

The display is best effort: odd input (NaN losses, a replica that never reports, a round
that ends without having begun after a resume) must never stop training.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Callable, Optional, TextIO

# A terminal redraws the bars at most this often, so per-step events from many replicas
# cost little; tqdm's own default.
_BAR_REFRESH_S = 0.1


class Progress:
    """Shows training progress on ``stream``, as bars on a terminal or as plain lines.

    Round indices are 0-based as in the round record (``record["round"]``) and shown
    1-based (``round 3/10`` is ``record["round"] == 2``), like the lines users already see.

    Args:
        total_rounds: rounds the run is meant to do (``diloco_loops``).
        steps_per_round: inner steps per round (``max_steps``).
        stream: where to write (default ``sys.stderr``, so stdout stays free for results).
        interactive: draw tqdm bars (True) or write plain lines (False); default: whether
            ``stream`` is a terminal.
        min_interval_s: plain mode: at most one step line per this many seconds. A step
            line sums up all replicas (slowest step, mean loss, total tokens/s), so the
            throttle is for the whole job, not per replica: a log grows by a line every
            few seconds however many replicas run.
        clock: monotonic seconds (tests inject a fake one).
    """

    def __init__(
        self,
        total_rounds: int,
        steps_per_round: int,
        stream: Optional[TextIO] = None,
        interactive: Optional[bool] = None,
        min_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total_rounds = int(total_rounds)
        self.steps_per_round = int(steps_per_round)
        self.stream = stream if stream is not None else sys.stderr
        if interactive is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                interactive = bool(isatty()) if isatty is not None else False
            except (ValueError, OSError):  # a closed or detached stream
                interactive = False
        self.interactive = interactive
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        # step() may come from a thread that drains replica reports while the main
        # thread ends a round: one lock keeps the per-round state and the output whole.
        self._lock = threading.Lock()
        self._closed = False
        self._done = 0  # rounds finished (for the rounds bar)
        self._round: Optional[int] = None
        self._expected = 0  # replicas training this round (begin_round's count)
        self._target: Optional[int] = None  # replicas the run wants (the scale target)
        self._round_start = clock()
        self._started_at = clock()  # when start() was called: the ETA's clock
        self._work_at_start = 0.0  # rounds' worth done before start() (a resume)
        self._eta_s: Optional[float] = None
        self._latest: dict[int, tuple[int, float, int]] = {}  # replica id -> (step, loss, tokens)
        self._last_line = -math.inf  # plain mode: when the last step line went out
        self._last_refresh = -math.inf  # interactive mode: when the steps bar was last drawn
        self._rounds_bar = None
        self._steps_bar = None

    # ------------------------------------------------------------------ events

    def start(self, first_round: int) -> None:
        """The run (re)starts with ``first_round`` rounds already done (0 for a new run,
        the resumed round index after a resume)."""
        with self._lock:
            if self._closed:
                return
            self._done = max(0, int(first_round))
            self._started_at, self._work_at_start = self._clock(), float(self._done)
            if self.interactive:
                bar = self._get_rounds_bar()
                bar.n = self._done
                bar.refresh()

    def begin_round(self, round_index: int, replicas: int, target: Optional[int] = None) -> None:
        """Round ``round_index`` (0-based) starts with ``replicas`` replicas training, of
        ``target`` the run wants (default: ``replicas``)."""
        with self._lock:
            if self._closed:
                return
            self._reset_round(int(round_index), int(replicas))
            self._target = int(target) if target is not None else None
            if self.interactive:
                bar = self._get_steps_bar()
                bar.reset(total=self.steps_per_round)
                bar.set_description(f"round {self._round + 1}", refresh=False)
                bar.set_postfix(self._step_postfix(), refresh=False)
                bar.refresh()
                self._last_refresh = self._clock()

    def step(self, replica_id: int, step: int, loss: float, lr: float, tokens: int) -> None:
        """Replica ``replica_id`` reached inner step ``step`` (1-based, within the round),
        with mean ``loss`` over its last logging window and ``tokens`` processed so far
        this round. ``lr`` is accepted for symmetry with the metrics exporter; the display
        leaves it out to stay on one line."""
        with self._lock:
            if self._closed:
                return
            if self._round is None:
                # Steps before any begin_round (a driver that does not announce rounds,
                # or a resume): count them against the next round to run.
                self._reset_round(self._done, 0)
            self._latest[replica_id] = (_as_int(step), _as_float(loss), _as_int(tokens))
            now = self._clock()
            if self.interactive:
                bar = self._get_steps_bar()
                summary = self._summary(now)
                bar.set_postfix(self._step_postfix(summary), refresh=False)
                bar.n = summary["step"]
                if now - self._last_refresh >= _BAR_REFRESH_S:
                    bar.refresh()
                    self._last_refresh = now
            elif now - self._last_line >= self.min_interval_s:
                self._last_line = now
                self._write(self._step_line(self._summary(now)))

    def end_round(self, record: dict) -> None:
        """Round ``record["round"]`` ended; ``record`` is its round record."""
        with self._lock:
            if self._closed:
                return
            index = record.get("round")
            if isinstance(index, int):
                self._done = max(self._done, index + 1)
            self._eta_s = self._eta(record)
            line = self.round_line(record)
            if self.interactive:
                bar = self._get_rounds_bar()
                bar.n = self._done
                ev = record.get("eval_loss")
                bar.set_postfix(
                    {"eval_loss": _fmt_loss(ev), "replicas": self._alive(record), "ETA": _fmt_eta(self._eta_s)},
                    refresh=False,
                )
                # The round line also goes above the bars, so a terminal keeps the
                # history a bar alone would overwrite.
                self._rounds_bar.write(line, file=self.stream)
                bar.refresh()
                if self._steps_bar is not None:
                    self._steps_bar.n = self._steps_bar.total or 0
                    self._steps_bar.refresh()
            else:
                self._write(line)
            self._round = None
            self._latest = {}

    def close(self) -> None:
        """Finish the display (bars are closed, the stream flushed); safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for bar in (self._steps_bar, self._rounds_bar):
                if bar is not None:
                    bar.close()
            self._steps_bar = self._rounds_bar = None
            _flush(self.stream)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ figures

    def summary(self) -> dict:
        """The current round as shown: ``round`` (0-based, None between rounds), ``step``
        (the slowest reporting replica's step), ``loss`` (mean of the replicas' latest),
        ``replicas`` (training this round, as begin_round said), ``reporting`` (how many
        reported yet), ``expected`` (the replicas the run wants), ``tokens_per_s`` (None
        until time has passed), ``eta_s`` (None before a round ended)."""
        with self._lock:
            return self._summary(self._clock())

    def _summary(self, now: float) -> dict:
        latest = list(self._latest.values())
        # The slowest replica bounds when the round can sync, so it is the round's step;
        # a replica that has not reported yet is left out rather than pinning it to 0.
        step = min((s for s, _, _ in latest), default=0)
        losses = [loss for _, loss, _ in latest]
        loss = sum(losses) / len(losses) if losses else math.nan
        elapsed = now - self._round_start
        tokens = sum(t for _, _, t in latest)
        # Every replica training runs at about its peers' rate: one that has not reported
        # yet counts at the mean of those that have (not as 0).
        training = max(self._expected, len(latest))
        rate = tokens / elapsed * training / len(latest) if elapsed > 0 and latest else None
        return {
            "round": self._round,
            "step": step,
            "loss": loss,
            "replicas": training,
            "reporting": len(latest),
            "expected": self._target if self._target is not None else training,
            "tokens_per_s": rate,
            "eta_s": self._eta_s,
        }

    def round_line(self, record: dict) -> str:
        """The one line per round: its losses, replicas applied of those wanted, tokens/s,
        bytes each way, time (of it sync) and the time left."""
        index = record.get("round")
        shown = index + 1 if isinstance(index, int) else "?"
        seconds = record.get("round_seconds")
        rate = record.get("tokens", 0) / seconds if isinstance(seconds, (int, float)) and seconds > 0 else None
        last = isinstance(index, int) and index + 1 >= self.total_rounds
        eta = "" if last else f"  ETA {_fmt_eta(self._eta_s)}"
        return (
            f"round {shown}/{self.total_rounds}  train_loss {_fmt_loss(record.get('train_loss'))}  "
            f"eval_loss {_fmt_loss(record.get('eval_loss'))}  replicas {self._alive(record)}  "
            f"tokens/s {_fmt_count(rate)}  up {_fmt_bytes(record.get('bytes_up'))}  "
            f"down {_fmt_bytes(record.get('bytes_down'))}  {_fmt_float(seconds, '.1f')}s "
            f"(sync {_fmt_float(record.get('sync_seconds'), '.2f')}s){eta}"
        )

    def _alive(self, record: dict) -> str:
        applied = record.get("replicas", "-")
        return f"{applied}/{self._target}" if self._target is not None else str(applied)

    def _eta(self, record: dict) -> Optional[float]:
        """Time left at the pace of the rounds this process ran (decoupled: rounds' worth)."""
        index = record.get("round")
        work = record.get("work", index + 1 if isinstance(index, int) else None)
        if not isinstance(work, (int, float)):
            return None
        done_here = work - self._work_at_start
        if done_here <= 0:
            return None
        return max(0.0, (self._clock() - self._started_at) / done_here * (self.total_rounds - work))

    def _step_line(self, s: dict) -> str:
        return (
            f"  round {s['round'] + 1}/{self.total_rounds}  step {s['step']}/{self.steps_per_round}  "
            f"loss {_fmt_loss(s['loss'])}  replicas {s['replicas']}/{s['expected']}  "
            f"tokens/s {_fmt_count(s['tokens_per_s'])}"
        )

    def _step_postfix(self, s: Optional[dict] = None) -> dict:
        if s is None:
            return {"loss": "-", "replicas": f"{self._expected}/{self._target or self._expected}", "tokens/s": "-"}
        return {
            "loss": _fmt_loss(s["loss"]),
            "replicas": f"{s['replicas']}/{s['expected']}",
            "tokens/s": _fmt_count(s["tokens_per_s"]),
        }

    # ------------------------------------------------------------------ plumbing

    def _reset_round(self, round_index: int, replicas: int) -> None:
        self._round = round_index
        self._expected = replicas
        self._round_start = self._clock()
        self._latest = {}

    def _write(self, line: str) -> None:
        # Flushed line by line: plain mode is for logs read while the run goes on.
        self.stream.write(line + "\n")
        _flush(self.stream)

    def _get_rounds_bar(self):
        if self._rounds_bar is None:
            from tqdm import tqdm

            self._rounds_bar = tqdm(
                total=self.total_rounds,
                initial=self._done,
                desc="rounds",
                unit="round",
                file=self.stream,
                position=0,
                leave=True,
                dynamic_ncols=True,
            )
        return self._rounds_bar

    def _get_steps_bar(self):
        if self._steps_bar is None:
            from tqdm import tqdm

            self._get_rounds_bar()  # the rounds bar sits on top
            # leave=False: the steps bar is the current round's, gone when the run ends.
            desc = "round -" if self._round is None else f"round {self._round + 1}"
            self._steps_bar = tqdm(
                total=self.steps_per_round,
                desc=desc,
                unit="step",
                file=self.stream,
                position=1,
                leave=False,
                dynamic_ncols=True,
            )
        return self._steps_bar


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _as_int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # None, NaN, inf
        return 0


def _fmt_loss(value) -> str:
    return _fmt_float(value, ".4f")


def _fmt_float(value, spec: str) -> str:
    """``value`` formatted, or ``-`` when there is none; NaN and inf print as themselves."""
    if value is None:
        return "-"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return "-"


def _fmt_count(value) -> str:
    """47663 -> ``47.7k``; 830 -> ``830``; None -> ``-``."""
    if value is None or not math.isfinite(value):
        return "-"
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _fmt_bytes(value) -> str:
    """Bytes in kB, MB or GB (decimal, as the round records and the report count them)."""
    if not isinstance(value, (int, float)):
        return "-"
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            digits = 0 if value >= 100 * scale else 1 if value >= 10 * scale else 2
            return f"{value / scale:.{digits}f} {unit}"
    return f"{value:.0f} B"


def _fmt_eta(seconds) -> str:
    """``45s``, ``12m05s``, ``3h02m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _flush(stream) -> None:
    flush = getattr(stream, "flush", None)
    if flush is not None:
        try:
            flush()
        except (ValueError, OSError):  # closed under us at interpreter exit
            pass
