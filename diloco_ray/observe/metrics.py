"""Where a run's figures go: ``metrics.jsonl`` always, TensorBoard and W&B when asked.

:class:`MetricsLogger` takes one dict per event (``{"event": "round", ...}``) and fans it
out. ``metrics.jsonl`` is appended and flushed line by line, so a crash loses at most the
line being written and ``diloco-ray report`` can read a run while it goes on. It is
opened with :func:`diloco_ray.files.open_append`: never through a link planted at its name.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

from diloco_ray import files
from diloco_ray.config.sections import ObservabilitySection
from diloco_ray.errors import DataError
from diloco_ray.observe.events import StepEvent


class StepBoard:
    """Where rank 0 of every replica drops its step events (``report``, called without
    waiting) until the driver collects them (``drain``). A plain class: the trainer
    makes it an actor with ``ray.remote`` when it creates it, so tests can use it as is."""

    def __init__(self):
        self._events: list[StepEvent] = []
        self._beats: dict[tuple[int, int], tuple[int, int, float]] = {}

    def report(self, event: StepEvent) -> None:
        self._events.append(event)

    def beat(self, replica_id: int, rank: int, attempt: int, step: int) -> None:
        """A rank is alive at ``step`` of launch ``attempt`` (called without waiting)."""
        import time

        self._beats[(replica_id, rank)] = (attempt, step, time.time())

    def beats(self) -> dict[tuple[int, int], tuple[int, int, float]]:
        """(replica id, rank) -> (attempt, step, wall time) of each rank's latest beat."""
        return dict(self._beats)

    def drain(self) -> list[StepEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> bool:
        """Forget every event and beat: a kept board taken by a new run
        (:mod:`diloco_ray.runtime.warm_actors`), or one let go to be kept (``retire``)."""
        self._events, self._beats = [], {}
        return True

    retire = reset


class MetricsLogger:
    """Writes events to ``output_dir/metrics.jsonl`` and the configured trackers.

    Args:
        output_dir: the run's folder (must exist).
        log_with: None, or a list of ``"tensorboard"`` / ``"wandb"``.
        log_dir: TensorBoard folder, and W&B's (default ``output_dir/logs``).
        run_config: the resolved config, recorded by W&B.
        wandb_settings: ``project``, ``entity``, ``name``, ``tags`` for ``wandb.init``
            (unset ones take W&B's defaults; project ``diloco-ray``, name the folder's).
    """

    def __init__(
        self,
        output_dir: str,
        log_with: Optional[list] = None,
        log_dir: Optional[str] = None,
        run_config: Optional[dict] = None,
        wandb_settings: Optional[dict] = None,
    ):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = files.open_append(self.path, buffering=1)  # a planted link: one line, exit 2
        self._tb = None
        self._wandb = None
        log_with = log_with or []
        self.log_dir = log_dir or os.path.join(output_dir, "logs")
        if "tensorboard" in log_with:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.log_dir)
        if "wandb" in log_with:
            import wandb

            settings = {k: v for k, v in (wandb_settings or {}).items() if v}
            os.makedirs(self.log_dir, exist_ok=True)
            self._wandb = wandb.init(
                dir=self.log_dir,
                config=run_config or {},
                **{"project": "diloco-ray", "name": os.path.basename(os.path.abspath(output_dir)), **settings},
            )
            # Round figures and inner-step figures advance on different axes.
            self._wandb.define_metric("round")
            self._wandb.define_metric("round/*", step_metric="round")
            self._wandb.define_metric("inner_step")
            self._wandb.define_metric("inner/*", step_metric="inner_step")

    def log(self, record: dict[str, Any]) -> None:
        """Append one event (stamped with ``time``). Round events go to the trackers as
        ``round/<key>`` against the round; step events as ``inner/replica<id>/loss`` and
        ``.../lr`` against the run's inner step."""
        record = {**record, "time": record.get("time", time.time())}
        try:
            self._file.write(json.dumps(record, default=_jsonable) + "\n")
        except OSError as e:  # a write to an open file names no file: name it (a full disk, say)
            raise OSError(e.errno, e.strerror, self.path) from e
        if record.get("event") == "step":
            self._log_step(record)
        if record.get("event") != "round":
            return
        scalars = {k: v for k, v in record.items() if _is_number(v) and k not in ("round", "time")}
        step = record["round"]
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"round/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"round": step, **{f"round/{k}": v for k, v in scalars.items()}})

    def _log_step(self, record: dict) -> None:
        scalars = {
            f"inner/replica{record['replica']}/{k}": record[k] for k in ("loss", "lr") if _is_number(record.get(k))
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record["global_step"])
        if self._wandb is not None:
            self._wandb.log({"inner_step": record["global_step"], **scalars})

    def truncate_rounds(self, from_round: int) -> int:
        """Drop the round records from ``from_round`` on (they are about to be rerun),
        keeping this logger appending to the rewritten file."""
        self._file.close()
        try:
            return truncate_rounds(os.path.dirname(self.path), from_round)
        finally:
            self._file = files.open_append(self.path, buffering=1)

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


# The longest line read back: a round record of a large run is a few kB, a step event less.
MAX_LINE_BYTES = 1 << 20


def read_events(output_dir: str, event: Optional[str] = None) -> list[dict]:
    """The events of ``output_dir/metrics.jsonl`` (optionally one kind), skipping a torn
    last line. A line no diloco-ray run writes (over :data:`MAX_LINE_BYTES`, nested past
    what the parser can follow, or not a JSON object) is a :class:`DataError` naming the
    file and the line, not a traceback."""
    out = []
    path = os.path.join(output_dir, "metrics.jsonl")
    with open(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}: line {number} is over {MAX_LINE_BYTES} bytes; not a diloco-ray record")
            line = raw.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a line cut short by a crash
            except RecursionError:
                raise DataError(f"{path}: line {number} is nested too deeply; not a diloco-ray record") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}: line {number} is not a JSON object; not a diloco-ray record")
            if event is None or rec.get("event") == event:
                out.append(rec)
    return out


def truncate_rounds(output_dir: str, from_round: int) -> int:
    """Drop the round records with ``round >= from_round`` from metrics.jsonl (atomically),
    before those rounds are run again after a resume. Returns how many were dropped."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line torn by the crash being recovered from
                continue
            if rec.get("event") == "round" and rec.get("round", -1) >= from_round:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    files.write_atomic(path, "".join(kept))
    return dropped


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def logger_for(observability: ObservabilitySection, run_config: dict, folder: str, run_name: str) -> MetricsLogger:
    """The run's :class:`MetricsLogger`: ``metrics.jsonl`` in ``folder`` and the trackers
    ``log_with`` names, W&B set up from the ``wandb_*`` fields (recording ``run_config``,
    the whole resolved config as a plain dict)."""
    return MetricsLogger(
        folder,
        observability.log_with,
        observability.log_dir,
        run_config,
        wandb_settings={
            "project": observability.wandb_project,
            "entity": observability.wandb_entity,
            "name": observability.wandb_run_name or run_name,
            "tags": observability.wandb_tags,
        },
    )
