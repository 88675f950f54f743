"""The sweep's console while Tune runs it: a line when a trial starts, a line a round it
reports, a line when it ends (finished, stopped early, or failed and why), and how long
each took, which the results keep.

Tune's own status tables are off (``verbose=0``): these lines are plain text, one event
each, the same on a terminal and in a log.
"""

from __future__ import annotations

import time
from typing import Callable

from ray import tune

from diloco_ray.sweep.results import error_line


class TrialLines(tune.Callback):
    """Tune callback that writes one line per trial event.

    Args:
        write: where a line goes (``print``, or a test's list append).
        planned: trial name -> its rounds (``diloco_loops``).
    """

    def __init__(self, write: Callable[[str], None], planned: dict[str, int]):
        self.write = write
        self.planned = planned
        self.started: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.last_round: dict[str, int] = {}

    def __getstate__(self) -> dict:
        # Tune saves its experiment state with the callbacks in it: the console stream
        # (a terminal, or a file open for writing) stays out; a restored copy writes nothing.
        return {**self.__dict__, "write": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.write = self.write or (lambda line: None)

    def on_trial_start(self, iteration, trials, trial, **info):
        name = trial.config["trial"]
        self.started[name] = time.monotonic()
        self.write(f"{name}: started")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        name = trial.config["trial"]
        self.last_round[name] = int(result["round"])
        self.write(f"{name}: round {result['round']}/{self.planned[name]}  eval_loss {result['eval_loss']:.4f}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        name = self._ended(trial)
        done, planned = self.last_round.get(name, 0), self.planned[name]
        how = "finished" if done >= planned else f"stopped early after round {done}/{planned}"
        self.write(f"{name}: {how} ({self.seconds[name]:.0f}s)")

    def on_trial_error(self, iteration, trials, trial, **info):
        name = self._ended(trial)
        error = getattr(trial, "error_message", None) or "see its log"
        self.write(f"{name}: failed ({self.seconds[name]:.0f}s): {error_line(error, limit=300) or 'see its log'}")

    def _ended(self, trial) -> str:
        name = trial.config["trial"]
        self.seconds[name] = time.monotonic() - self.started.get(name, time.monotonic())
        return name
