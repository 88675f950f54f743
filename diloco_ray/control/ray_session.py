"""This process's hold on Ray for one job, and letting go of it.

A trainer and a sweep each join the Ray this process is already connected to, or start a
private one (``connect``: :func:`~diloco_ray.control.ray_connection.connect` sizes it for the
job), and may send Ray's own log lines and what the actors print to a file instead of the
console (:class:`~diloco_ray.observe.ray_output.RayOutputFile`). :class:`RaySession` is that
decision and its undoing, in one place: at :meth:`close` a private Ray is stopped, a joined
one is left as it was, and the output file is closed.
"""

from __future__ import annotations

from typing import Callable, Optional

from diloco_ray.observe.ray_output import RayOutputFile


class RaySession:
    """Ray for one job.

    Args:
        connect: starts a private Ray and returns True, or joins one and returns False;
            called only when this process is not connected yet.
        output_file: where Ray's output goes (None: the console, as Ray sends it).

    Attributes:
        quiet: the open output file, while there is one.
        started: whether :meth:`open` started the Ray that :meth:`close` stops.
    """

    def __init__(self, connect: Callable[[], bool], output_file: Optional[str] = None):
        self._connect, self.output_file = connect, output_file
        self.quiet: Optional[RayOutputFile] = None
        self.started = False

    def open(self) -> RaySession:
        """Connect (through the output file when there is one); returns this session."""
        if self.output_file is None:
            self.started = self._connect_once()
        else:
            self.quiet = RayOutputFile(self.output_file)
            self.started = self.quiet.around_connect(self._connect_once)
        return self

    def _connect_once(self) -> bool:
        import ray

        return False if ray.is_initialized() else self._connect()

    def close(self) -> None:
        """Stop the Ray this session started, and close the output file; twice is once."""
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
        if self.quiet is not None:
            self.quiet.close()
            self.quiet = None

    def __enter__(self) -> RaySession:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
