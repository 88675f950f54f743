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


def unwrap(exc: BaseException) -> BaseException:
    """The user-facing cause inside a (possibly nested) Ray task error, else ``exc``."""
    seen = 0
    while seen < 8 and not isinstance(exc, UserInputError):
        cause = getattr(exc, "cause", None)
        if cause is None or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc
