"""The run's events, typed: one frozen dataclass per kind of line in metrics.jsonl.

Each place that notes something (a checkpoint saved, a replica joining, a fault fired)
builds one of these instead of a dict, so a kind's fields are written down once, here.
:meth:`Event.to_record` is the metrics.jsonl line (``MetricsLogger`` adds ``time`` where
the event has none); a field left at :data:`OMIT` is not written, so a line holds no key
for a fact it does not have (docs/interface.md lists each kind's keys). The round record
is not here: it has a module of its own (:class:`diloco_ray.observe.records.RoundRecord`,
the dict the callbacks get).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"

    def __reduce__(self) -> str:
        return "OMIT"  # unpickles as the module's one OMIT, so `is OMIT` still holds


OMIT: Any = _Omit()  # a field this event does not write


def _key(name: str) -> dict:
    """Field metadata: write this field under ``name`` (a Python keyword, say)."""
    return {"key": name}


@dataclass(frozen=True)
class Event:
    """Base of every event; ``event`` is the kind written in the line."""

    event: ClassVar[str] = ""

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"event": self.event}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not OMIT:
                record[f.metadata.get("key", f.name)] = value
        return record


@dataclass(frozen=True)
class StepEvent(Event):
    """Rank 0 of a replica, every ``logging_steps``: mean loss since its last one, lr, and
    the replica's tokens so far this round (all its ranks)."""

    event: ClassVar[str] = "step"
    round: int
    replica: int
    step: int
    global_step: int
    loss: float
    lr: float
    tokens: int
    time: float


@dataclass(frozen=True)
class MembershipEvent(Event):
    """A replica joined, left or failed to start, or the target count changed (``scale``)."""

    event: ClassVar[str] = "membership"
    action: str
    round: int
    replica_id: Any = OMIT
    target: Any = OMIT
    reason: Any = OMIT
    replicas: Any = OMIT
    start_seconds: Any = OMIT
    region: Any = OMIT
    nodes: Any = OMIT  # join: each rank's Ray node id, in rank order


@dataclass(frozen=True)
class CheckpointEvent(Event):
    """A checkpoint saved, failed, skipped as unusable, or loaded (``resume``, ``restore``)."""

    event: ClassVar[str] = "checkpoint"
    action: str
    path: Any = OMIT
    round: Any = OMIT
    reason: Any = OMIT
    pruned: Any = OMIT


@dataclass(frozen=True)
class ServerEvent(Event):
    """The servers were restarted from checkpoint ``from`` after one died."""

    event: ClassVar[str] = "server"
    action: str
    round: int
    from_path: str = field(default="", metadata=_key("from"))


@dataclass(frozen=True)
class FaultEvent(Event):
    """A driver-side fault of the fault plan fired."""

    event: ClassVar[str] = "fault"
    target: str
    kind: str
    round: int


@dataclass(frozen=True)
class EarlyStopEvent(Event):
    """Training stopped: eval loss did not improve for ``patience`` rounds."""

    event: ClassVar[str] = "early_stop"
    round: int
    best_eval_loss: float
    patience: int


@dataclass(frozen=True)
class WarningEvent(Event):
    """Something the user should know that does not stop the run."""

    event: ClassVar[str] = "warning"
    message: str
    round: int
