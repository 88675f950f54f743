"""The errors a user can fix: bad config, bad data, bad paths.

Everything raised as a :class:`UserInputError` reaches the CLI as one line and exit
status 2; anything else is a bug or an environment failure (exit 1). Errors raised inside
Ray actors arrive wrapped in ``RayTaskError``; :func:`unwrap` recovers the original.
"""

from __future__ import annotations


class UserInputError(Exception):
    """Input the user can correct: the message names the field or file and what is allowed."""


class ConfigError(UserInputError, ValueError):
    """A TrainerConfig field is unknown, mistyped, out of range or inconsistent."""


class DataError(UserInputError):
    """A data set, file or column cannot be used as configured."""


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
