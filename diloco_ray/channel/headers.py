"""What a call's header may hold: every field typed, finite and in range, or the call is refused.

A frame's header is JSON a region wrote, so nothing in it is believed as it comes: each call
(``Join``, ``Wait``, ``Put``, ``Get``, ``Beat``) names the fields it may carry, and
:func:`checked` returns them as Python values of the right type, or raises
:class:`BadHeader` naming the first field that is missing, of another type, not finite or
out of range. A JSON ``true`` is not a number here, a float is not a count, and a key is a
short name of plain characters, so nothing a region sends can make the home spin, overflow
or raise where it does not expect to.

Pure: dicts in, dicts out.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

MAX_WAIT_S = 30.0  # the longest a Wait or a Get is held open (the region calls again)
MAX_COUNT = (1 << 63) - 1
_KEY = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9/_.-]{0,199}")  # a name, never a path up
_HEX = re.compile(r"[0-9a-f]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TEXT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class BadHeader(ValueError):
    """A header field that is not what its call allows: ``why`` says which and what is allowed."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _count(low: int, high: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if type(value) is not int or not low <= value <= high:
            raise BadHeader(f"malformed: {name} must be a whole number from {low} to {high}")
        return value

    return check


def _seconds(name: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_WAIT_S:
        raise BadHeader(f"malformed: {name} must be seconds from 0 to {MAX_WAIT_S:g}")
    return float(value)


def _matching(pattern: re.Pattern, what: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise BadHeader(f"malformed: {name} must be {what}")
        return value

    return check


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadHeader(f"malformed: {name} must be true or false")
    return value


def _session(name: str, value: Any):
    """A session id as the region holds it (an unknown one is the home's to answer: join again)."""
    return None if value is None else _matching(_TEXT, "a session id")(name, value)


_region = _matching(re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"), "a region name")
_key = _matching(_KEY, "a key of at most 200 letters, digits and /_.-")

# Every call: who is calling (checked against the token's region), its session, whether it is ready.
COMMON = {"region": _region, "session": _session, "ready": _flag}
# Each call's own fields; None: bounded by the largest upload (filled in by checked).
CALLS: dict[str, dict[str, Any]] = {
    "Join": {"instance": _matching(_HEX, "the agent's instance id (hex)")},
    "Wait": {"after": _count(0, MAX_COUNT), "wait_s": _seconds},
    "Put": {"key": _key, "offset": None, "total": None, "digest": _matching(_DIGEST, "a SHA-256 in hex")},
    "Get": {"key": _key, "offset": _count(0, MAX_COUNT), "wait_s": _seconds},
    "Beat": {},
}


def checked(call: str, header: dict, max_total: int) -> dict:
    """``header`` of a ``call`` with every field checked (``max_total``: the largest
    upload the channel takes, which bounds a Put's ``total`` and ``offset``).

    Raises:
        BadHeader: a field missing (every field of the call but ``ready`` and ``session``
            is required), unknown, or not what its call allows.
    """
    fields = {**COMMON, **CALLS[call]}
    unknown = sorted(set(header) - set(fields))
    if unknown:
        raise BadHeader(f"malformed: {call} carries no field {unknown[0]!r}")
    out: dict = {"session": None, "ready": False}
    for name, check in fields.items():
        if name not in header:
            if name in out:
                continue
            raise BadHeader(f"malformed: {call} needs the field {name!r}")
        if check is None:  # a Put may probe with offset -1: where does the home's copy end?
            check = _count(-1 if name == "offset" else 0, max_total)
        out[name] = check(name, header[name])
    return out
