"""Ray's own output, kept off the console: its driver-side log records (the token notice,
"Started a local Ray instance") and the lines its actors and tasks print, which Ray
forwards to the driver prefixed with their pid.

None of it needs a person's action (an actor's failure reaches the driver as an error,
which the CLI prints as such), and on a console it buries the round lines. While a
:class:`RayOutputFile` is open, all of it goes to one file in the run's ``logs/`` folder;
``diloco-ray train --verbose`` leaves it on the console. The Python API leaves Ray alone
unless asked (``DilocoFSDPTrainer(..., ray_output_to_file=True)``).

Worker lines reach the driver through Ray's stdstream dispatcher (``ray._private``: no
public hook exists); where it is missing, worker output stays on the console as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Callable, Optional, TypeVar

from diloco_ray import files

T = TypeVar("T")

RAY_LOG = "ray.log"


class RayOutputFile:
    """Ray's driver log records and forwarded worker output, appended to ``path``.

    Args:
        path: the file (its folder is created; a link at its name is refused, see
            :func:`diloco_ray.files.open_append`).
    """

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = files.open_append(path, buffering=1, errors="replace")
        self._lock = threading.Lock()
        self._logger_state: Optional[tuple] = None
        self._dispatcher = None
        self._removed: list = []

    def around_connect(self, connect: Callable[[], T]) -> T:
        """Run ``connect`` (which may call ``ray.init``) with Ray's output captured from before
        it (``ray.init`` logs) to after it (the worker-line handler it installs is replaced);
        returns what ``connect`` returns."""
        self.capture_logger()
        connected = connect()
        self.capture_workers()
        return connected

    def capture_logger(self) -> None:
        """Ray's ``ray`` logger writes here only (call before ``ray.init``, which logs)."""
        ray_log = logging.getLogger("ray")
        handler = logging.StreamHandler(self._file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._logger_state = (list(ray_log.handlers), ray_log.propagate, handler)
        ray_log.handlers = [handler]
        ray_log.propagate = False

    def capture_workers(self) -> None:
        """Worker lines forwarded to this driver are written here (call after ``ray.init``,
        which installs the console handler this replaces)."""
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return
        with dispatcher._lock:
            self._removed = [pair for pair in dispatcher.handlers if pair[0] == "ray_print_logs"]
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("diloco_ray_output_file", self._write_worker_lines)
        self._dispatcher = dispatcher

    @contextlib.contextmanager
    def redirected(self):
        """This process's own stdout and stderr go to the file too while inside (Ray Tune
        prints its experiment tables with ``print``)."""
        with contextlib.redirect_stdout(self._file), contextlib.redirect_stderr(self._file):
            yield

    def close(self) -> None:
        """Put Ray's console output back as it was; safe to call twice."""
        if self._dispatcher is not None:
            self._dispatcher.remove_handler("diloco_ray_output_file")
            for name, handler in self._removed:
                self._dispatcher.add_handler(name, handler)
            self._dispatcher = None
        if self._logger_state is not None:
            handlers, propagate, _ = self._logger_state
            ray_log = logging.getLogger("ray")
            ray_log.handlers, ray_log.propagate = handlers, propagate
            self._logger_state = None
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def _write_worker_lines(self, data: dict) -> None:
        who = data.get("actor_name") or data.get("task_name") or "worker"
        prefix = f"({who} pid={data.get('pid')}{' stderr' if data.get('is_err') else ''}) "
        with self._lock:
            if self._file.closed:
                return
            for line in data.get("lines", []):
                self._file.write(prefix + line + "\n")
