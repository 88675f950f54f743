"""The package's log: warnings and notices for whoever watches, as ``logging`` records.

Library code logs to :data:`log` (``logging.getLogger("diloco_ray")``) and leaves the
handlers to the application: from Python, warnings reach stderr through ``logging``'s
last-resort handler until the application configures its own. The CLI (and so ``ray job
submit``) calls :func:`to_stderr`, which prints ``diloco-ray: <notice>`` and
``diloco-ray: warning: <message>`` lines. The run's own record of a warning is the
``warning`` event in metrics.jsonl.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("diloco_ray")


class _Stderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record comes
    (pytest and notebooks replace it), not to the one it was made with."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"diloco-ray: {level}{record.getMessage()}"


def to_stderr(level: int = logging.INFO) -> None:
    """Print the package's records of ``level`` and above on stderr, one line each
    (idempotent: a second call adds no second handler)."""
    if not any(getattr(h, "_diloco_stderr", False) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(_Format())
        handler._diloco_stderr = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # one line per record, not a second one from the root logger
