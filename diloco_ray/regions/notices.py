"""What the home tells a region over the channel, as types: a sync period to run (a
:class:`~diloco_ray.regions.wire.Notice`), a period to stop (:class:`Abort`), its part of a
checkpoint to save (:class:`SaveRequest`), and the end of the run (:class:`Stop`).

The gateway sends them (:func:`to_wire`) and the agent reads them (:func:`from_wire`); each
crosses as one JSON object with one key that names its kind, and a notice of a kind this
code does not know is refused rather than guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

from diloco_ray.regions.wire import Notice


@dataclass(frozen=True)
class Abort:
    """Stop the sync period launched as ``attempt`` (the home goes on without it)."""

    attempt: int


@dataclass(frozen=True)
class SaveRequest:
    """Save the region's part of the home's checkpoint of ``round``, first settling
    ``verdicts`` (``(attempt, applied)`` of its sends the home has not told it yet), and
    upload the answer as ``reply``."""

    round: int
    verdicts: tuple[tuple[int, bool], ...]
    reply: str


@dataclass(frozen=True)
class Stop:
    """The run is over: the agent leaves."""


HomeNotice = Union[Notice, Abort, SaveRequest, Stop]


def to_wire(notice: HomeNotice) -> dict:
    """``notice`` as the JSON object the channel carries."""
    if isinstance(notice, Notice):
        return {"job": notice.to_wire()}
    if isinstance(notice, Abort):
        return {"abort": int(notice.attempt)}
    if isinstance(notice, SaveRequest):
        verdicts = [[int(a), bool(ok)] for a, ok in notice.verdicts]
        return {"save": {"round": int(notice.round), "verdicts": verdicts, "reply": notice.reply}}
    if isinstance(notice, Stop):
        return {"stop": True}
    raise TypeError(f"not a notice to a region: {notice!r}")


def from_wire(data: Mapping) -> HomeNotice:
    """The notice the home sent (:func:`to_wire`), each field as its type.

    Raises:
        ValueError: not one notice of a known kind.
    """
    if not isinstance(data, Mapping) or len(data) != 1:
        raise ValueError(f"a notice from the home is one mapping of one kind, not {data!r:.200}")
    ((kind, body),) = data.items()
    if kind == "job":
        return Notice.from_wire(body)
    if kind == "abort":
        return Abort(int(body))
    if kind == "save":
        verdicts = tuple((int(a), bool(ok)) for a, ok in body.get("verdicts", ()))
        return SaveRequest(int(body["round"]), verdicts, str(body["reply"]))
    if kind == "stop":
        return Stop()
    raise ValueError(f"a notice of unknown kind {kind!r} from the home")
