"""What a sweep's trials did, read from their own runs, and the files that say so.

A trial's figures come from its run's ``metrics.jsonl`` (the rounds it ran, its final eval
loss), not from what reached Tune; Tune says only whether it failed and why. A trial is
``finished`` when it ran every round, ``stopped`` when the scheduler ended it early, and
``failed`` when its run raised. ``results.jsonl`` holds one line a trial, in grid order;
``best.yaml`` the full config of the finished trial with the lowest final eval loss.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from diloco_ray import files
from diloco_ray.errors import unwrap
from diloco_ray.observe.metrics import read_events

RESULTS_FILE = "results.jsonl"
BEST_FILE = "best.yaml"


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """One trial as it ended.

    Args:
        trial: its name (its folder under ``OUTPUT_DIR/sweep``).
        overrides: the grid's values for it.
        status: ``finished``, ``stopped`` (early, by the scheduler) or ``failed``.
        eval_loss: its last round's eval loss (None before any eval).
        rounds: rounds it ran, of ``planned_rounds``.
        seconds: wall time from its start to its end, as the sweep saw it.
        error: why it failed (one line), else None.
        output_dir: its run's folder.
        eval_curve: ``[round (1-based), eval_loss]`` for each round it evaluated.
    """

    trial: str
    overrides: dict
    status: str
    eval_loss: Optional[float]
    rounds: int
    planned_rounds: int
    seconds: Optional[float]
    error: Optional[str]
    output_dir: str
    eval_curve: list = dataclasses.field(default_factory=list)

    @property
    def stopped_early(self) -> bool:
        return self.status == "stopped"

    def to_record(self) -> dict:
        record = dataclasses.asdict(self)
        record["stopped_early"] = self.stopped_early
        return record


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """Every trial of a sweep, in grid order, and where its files are.

    Args:
        trials: one :class:`TrialResult` a trial.
        folder: ``OUTPUT_DIR/sweep``.
    """

    trials: list
    folder: str

    @property
    def best(self) -> Optional[TrialResult]:
        """The finished trial with the lowest final eval loss (the first of equals)."""
        done = [t for t in self.trials if t.status == "finished" and t.eval_loss is not None]
        done = [t for t in done if math.isfinite(t.eval_loss)]
        return min(done, key=lambda t: t.eval_loss, default=None)


def collect(trials: list, plans: dict, tune_results: dict, seconds: dict, folder: str) -> SweepResult:
    """Each trial's result from its run's records, Tune's error for it and its time;
    ``folder`` is the sweep's (``OUTPUT_DIR/sweep``)."""
    out = []
    for trial in trials:
        plan = plans[trial.name]
        result = tune_results.get(trial.name)
        if result is None:
            error = "Tune returned no result for this trial"
        elif result.error:
            error = error_line(result.error) or type(unwrap(result.error)).__name__
        else:
            error = None
        curve, rounds = run_rounds(plan.output_dir)
        planned = trial.config.diloco_loops
        status = "failed" if error else ("finished" if rounds >= planned else "stopped")
        out.append(
            TrialResult(
                trial=trial.name,
                overrides=trial.overrides,
                status=status,
                eval_loss=curve[-1][1] if curve else None,
                rounds=rounds,
                planned_rounds=planned,
                seconds=seconds.get(trial.name),
                error=error,
                output_dir=plan.output_dir,
                eval_curve=curve,
            )
        )
    return SweepResult(out, folder)


def run_rounds(output_dir: str) -> tuple[list, int]:
    """``([[round, eval_loss], ...], rounds run)`` from a run's records (a round run again
    after a restore counts once, as its last record)."""
    if not os.path.isfile(os.path.join(output_dir, "metrics.jsonl")):
        return [], 0
    latest = {r["round"]: r for r in read_events(output_dir, "round")}
    curve = [[i + 1, latest[i]["eval_loss"]] for i in sorted(latest) if latest[i].get("eval_loss") is not None]
    return curve, len(latest)


def write_results(result: SweepResult, trials: list) -> None:
    """``results.jsonl`` (a line a trial) and, when a trial finished, ``best.yaml``."""
    files.write_atomic(
        os.path.join(result.folder, RESULTS_FILE), "".join(json.dumps(t.to_record()) + "\n" for t in result.trials)
    )
    best = result.best
    if best is not None:
        config = next(t.config for t in trials if t.name == best.trial)
        files.write_atomic(os.path.join(result.folder, BEST_FILE), config.yaml_text())


def read_results(folder: str) -> SweepResult:
    """A sweep's ``results.jsonl`` back as a :class:`SweepResult`."""
    with open(os.path.join(folder, RESULTS_FILE)) as f:
        records = [json.loads(line) for line in f if line.strip()]
    fields = {f.name for f in dataclasses.fields(TrialResult)}
    return SweepResult([TrialResult(**{k: v for k, v in r.items() if k in fields}) for r in records], folder)


def table(result: SweepResult) -> str:
    """One row a trial: its grid values, final eval loss, rounds run, status, seconds; then the best."""
    fields = list(result.trials[0].overrides) if result.trials else []
    width = {f: max(len(f), *(len(_value(t.overrides[f])) for t in result.trials)) for f in fields}
    head = ["#".rjust(3), *(f.rjust(width[f]) for f in fields), "eval_loss", "rounds", "status".ljust(8), "seconds"]
    rows = ["  ".join(head)]
    for i, t in enumerate(result.trials):
        loss = "-" if t.eval_loss is None else f"{t.eval_loss:.4f}"
        secs = "-" if t.seconds is None else f"{t.seconds:.0f}"
        cells = [str(i).rjust(3), *(_value(t.overrides[f]).rjust(width[f]) for f in fields)]
        cells += [loss.rjust(9), f"{t.rounds}/{t.planned_rounds}".rjust(6), t.status.ljust(8), secs.rjust(7)]
        rows.append("  ".join(cells) + (f"  {t.error}" if t.error else ""))
    best = result.best
    if best is None:
        rows.append("no trial finished: no best.yaml")
    else:
        config = os.path.join(result.folder, BEST_FILE)
        rows.append(f"best: {best.trial} (eval_loss {best.eval_loss:.4f}); its config: {config}")
    return "\n".join(rows)


def _value(v) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def error_line(error, limit: int = 500) -> Optional[str]:
    """A trial's error in one line: the innermost cause's message behind Ray's wrappers (not
    their remote traceback), its last line, at most ``limit`` characters; None when empty.
    ``error`` is an exception or Tune's text of one."""
    if isinstance(error, BaseException):
        cause = unwrap(error)
        error = cause.args[0] if getattr(cause, "args", None) else str(cause)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1][:limit] if lines else None
