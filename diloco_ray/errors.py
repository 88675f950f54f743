"""The errors a user can fix: bad config, bad data, bad paths.

Everything raised as a :class:`UserInputError` reaches the CLI as one line and exit
status 2; anything else is a bug or an environment failure (exit 1). Errors raised inside
Ray actors arrive wrapped in ``RayTaskError``; :func:`unwrap` recovers the original, and
:func:`disk_full` finds a full disk (``ENOSPC``/``EDQUOT``) however deep it is wrapped.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

# A full disk, or a full quota: the environment, not the input (exit 1, one line).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class UserInputError(Exception):
    """Input the user can correct: the message names the field or file and what is allowed."""


class ConfigError(UserInputError, ValueError):
    """A TrainerConfig field is unknown, mistyped, out of range or inconsistent."""


class DataError(UserInputError):
    """A data set, file or column cannot be used as configured."""


class UsageError(UserInputError):
    """The command line itself is wrong: a missing or unknown argument, a bad value."""


class Stopped(KeyboardInterrupt):
    """The driver was told to stop (SIGTERM: a spot preemption, ``ray job stop``).

    A KeyboardInterrupt, so Ctrl-C and SIGTERM take the same way out of the round loop.

    Args:
        signal_name: the signal that asked for it, e.g. ``"SIGTERM"``.
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type when it has none): loaders' errors
    run to pages, and a user error is one line."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause inside a (possibly nested) Ray task error, else ``exc``.

    Ray re-raises a remote error as a class that is both ``RayTaskError`` and the
    original's class, so the first :class:`UserInputError` met may still be a wrapper
    (whose ``str`` carries the remote traceback): follow ``cause`` to the innermost."""
    found = exc if isinstance(exc, UserInputError) else None
    for _ in range(8):
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or cause is exc:
            break
        exc = cause
        if isinstance(exc, UserInputError):
            found = exc
    return found if found is not None else exc


def disk_full(exc: BaseException) -> Optional[OSError]:
    """The ``OSError`` with ``errno`` ENOSPC or EDQUOT behind ``exc``, else None.

    Follows Ray's ``cause`` (an error raised inside an actor) and Python's ``__cause__``
    and ``__context__`` (an error raised while handling another, such as a file's close
    failing after its write did), so a full disk is recognised wherever it surfaced; of
    several, the first that names its file. Libraries that wrap the OS error in their own
    (safetensors' Rust ``os error 28``, torch's writers) keep only its words: those are
    recognised too, as an ``OSError`` naming no file."""
    chain = _chain(exc)
    errors = [e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS]
    if errors:
        return next((e for e in errors if e.filename), errors[0])
    return next((found for found in map(_from_text, chain) if found is not None), None)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every error behind it, breadth first (at most 32: a cycle ends it)."""
    out, todo = [], [exc]
    while todo and len(out) < 32:
        e = todo.pop(0)
        if any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [c for c in (getattr(e, "cause", None), e.__cause__, e.__context__) if isinstance(c, BaseException)]
    return out


def _from_text(e: BaseException) -> Optional[OSError]:
    """A full disk that another library reported in words only (its first argument)."""
    text = str(e.args[0]) if e.args else ""
    for code in DISK_FULL_ERRNOS:
        if os.strerror(code) in text or f"os error {code})" in text:
            return OSError(code, os.strerror(code))
    return None
