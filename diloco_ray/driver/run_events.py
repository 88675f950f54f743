"""Where a run's events go, and where the ranks' step events come in.

:class:`RunEvents` is the trainer's one outlet: each event (a typed
:class:`~diloco_ray.observe.events.Event`, or a round record's dict) becomes a line of
metrics.jsonl (and a point in TensorBoard or W&B), round figures and step losses go to the
Ray dashboard, and callbacks are called with the trainer. The ranks' step events and
heartbeats come in through its :class:`~diloco_ray.control.step_feed.StepFeed`.
"""

from __future__ import annotations

from typing import Callable, Optional

from diloco_ray.config.sections import ObservabilitySection
from diloco_ray.control.step_feed import StepFeed
from diloco_ray.logs import log
from diloco_ray.observe.events import Event, WarningEvent
from diloco_ray.observe.metrics import MetricsLogger, logger_for
from diloco_ray.observe.ray_metrics import RoundMetrics
from diloco_ray.persist.run_folder import RunFolder


class RunEvents:
    """A run's outlets (open once the run folder is prepared; events before go nowhere).

    Args:
        owner: what callbacks get as their first argument (the trainer).
        callbacks: objects that may define the ``on_*`` hooks
            (:class:`~diloco_ray.driver.trainer.DilocoFSDPTrainer` lists them).
        round_of: the current round's index (a warning names it).
    """

    def __init__(self, owner, callbacks: list, round_of: Callable[[], int]):
        self.owner, self.callbacks, self.round_of = owner, callbacks, round_of
        self.metrics: Optional[MetricsLogger] = None  # metrics.jsonl, TensorBoard, W&B
        self.ray_metrics: Optional[RoundMetrics] = None  # the round figures for the Ray dashboard
        self.steps: Optional[StepFeed] = None  # the ranks' step events and heartbeats

    def open(self, observability: ObservabilitySection, run_config: dict, run_dir: RunFolder) -> None:
        """Start metrics.jsonl (and the trackers ``observability`` names; W&B records
        ``run_config``, the resolved config as a dict), the Ray metrics and the step feed."""
        self.metrics = logger_for(observability, run_config, run_dir.local, run_dir.name)
        self.steps = StepFeed(self.on_step, self.warn)
        self.ray_metrics = RoundMetrics(run_dir.name)

    def notify(self, hook: str, *args) -> None:
        """Call every callback's ``hook`` that it defines, with the owner first."""
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self.owner, *args)

    def log(self, event: Event | dict) -> None:
        """One line in metrics.jsonl: a typed event, or a round record (a dict)."""
        if self.metrics is not None:
            self.metrics.log(event.to_record() if isinstance(event, Event) else event)

    def warn(self, message: str) -> None:
        """A warning for whoever watches (:mod:`diloco_ray.logs`), and a ``warning`` event in metrics.jsonl."""
        log.warning(message)
        self.log(WarningEvent(message, self.round_of()))

    def on_step(self, event) -> None:
        """A rank's step event, from the step feed: to metrics.jsonl, Ray metrics and ``on_step``."""
        self.log(event)
        self.ray_metrics.step(event.replica, event.loss, event.lr)
        self.notify("on_step", event.to_record())

    def round_done(self, record: dict) -> None:
        """A round's record: to metrics.jsonl and the Ray dashboard."""
        self.log(record)
        self.ray_metrics.record(record)

    def close(self, publish: Callable[[], None], keep: bool = False) -> None:
        """Close every outlet; ``publish`` runs once metrics.jsonl is complete (a bucket's copy);
        ``keep``: the step board is kept for the next run (runtime.warm_actors)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
            publish()  # the closed, complete files
        if self.ray_metrics is not None:
            self.ray_metrics.close()
            self.ray_metrics = None
        if self.steps is not None:
            self.steps.close(keep)
            self.steps = None
