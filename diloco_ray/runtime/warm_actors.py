"""Actor processes kept from one run to the next in this Python process.

Starting an actor means starting its process: Ray launches a Python worker, which imports
torch and, on a rank, transformers' model code, FSDP and ``torch._dynamo`` (which torch's
optimizers import at their first use). That is seconds of CPU a process, and on a small job
most of its start-up. A process that runs several jobs one after another on the same Ray
(a notebook, a script of runs, a test suite) can set ``DILOCO_RAY_KEEP_ACTORS=1``: a run
that ends cleanly then keeps its ranks (with their placement group), its servers and its step
board, and the next run takes those whose resources match instead of starting new ones.

What is kept is a process, never a run's state. Kept, an actor has let go of everything of
its run (``retire``: model, optimizer, process group); taken, it is built again from the new
run's config (``reset``: what a new actor's ``__init__`` does), and its set-up then goes
as a new actor's would, so a run's results do not depend on whether its actors were kept.
An actor that does not answer either call in time, or says it still holds work, is killed
instead. A run that ends with an error keeps nothing.

Only the last run's actors are kept: the first actor a run cannot take from what is kept
lets all of it go (their reservations must not hold up the new one; the step board, which
reserves nothing, is the exception), and so does the end of a run's set-up (the trainer
calls :meth:`WarmActors.release`). Kept actors belong to the Ray they were started on:
after ``ray.shutdown`` they are forgotten.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import ray
from ray.util.placement_group import remove_placement_group

from diloco_ray.logs import log

ENV = "DILOCO_RAY_KEEP_ACTORS"

# Both calls are quick on an idle actor; one busy for longer is not kept.
RETIRE_TIMEOUT_S = 10.0
RESET_TIMEOUT_S = 30.0


def enabled() -> bool:
    """Whether this process keeps a cleanly ended run's actors (``DILOCO_RAY_KEEP_ACTORS=1``)."""
    return os.environ.get(ENV, "") == "1"


@dataclass
class Kept:
    """Actors kept together (one replica's ranks, or one server) and the group holding them."""

    key: tuple
    actors: list
    pg: object = None

    def kill(self) -> None:
        """Kill the actors and release the group (idempotent: what is gone stays gone)."""
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass


class WarmActors:
    """The actors this process keeps between runs (see the module's docstring)."""

    def __init__(self):
        self._kept: list[Kept] = []
        self._cluster: Optional[str] = None  # the Ray they were started on
        # Trainers in threads of one process (a callback's, a test's) take and keep in turn.
        self._lock = threading.RLock()

    def keep(self, key: tuple, actors: list, pg=None) -> bool:
        """Retire ``actors`` (of one placement group ``pg``, if any) and keep them under
        ``key``; those that cannot retire are killed (with ``pg``). Returns whether kept."""
        unit = Kept(key, list(actors), pg)
        try:
            retired = ray.get([a.retire.remote() for a in unit.actors], timeout=RETIRE_TIMEOUT_S)
        except Exception as e:  # dead, or still busy with the run
            log.info("not keeping actors %s: %s", key, e)
            retired = [False]
        if not all(retired):
            unit.kill()
            return False
        cluster = _cluster()
        with self._lock:
            if self._cluster != cluster:
                self._kept, self._cluster = [], cluster
            self._kept.append(unit)
        return True

    def take(self, key: tuple, reset: Callable[[list], list], release_on_miss: bool = True) -> Optional[Kept]:
        """A kept unit of ``key``, its actors reset by ``reset(actors)`` (refs to wait on),
        or None: then nothing is kept any more, so a new unit finds the room it needs
        (``release_on_miss=False``, for an actor that reserves nothing: the rest stays kept)."""
        cluster = _cluster()
        while True:
            with self._lock:
                if self._cluster != cluster:
                    self._kept, self._cluster = [], cluster
                unit = next((u for u in self._kept if u.key == key), None)
                if unit is not None:
                    self._kept.remove(unit)
            if unit is None:
                if release_on_miss:
                    self.release()
                return None
            try:
                ray.get(reset(unit.actors), timeout=RESET_TIMEOUT_S)
                return unit
            except Exception as e:  # died while kept (a killed process, a lost node)
                log.info("a kept actor of %s is gone (%s): starting a new one", key, e)
                unit.kill()

    def release(self) -> None:
        """Kill every kept actor and free its reservation."""
        with self._lock:
            kept, self._kept = self._kept, []
        for unit in kept:
            unit.kill()

    def actors(self) -> list:
        """Every kept actor's handle."""
        with self._lock:
            return [a for unit in self._kept for a in unit.actors]

    def __len__(self) -> int:
        return len(self._kept)


def _cluster() -> Optional[str]:
    """Which Ray this process is connected to (None: none)."""
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


# This process's kept actors.
POOL = WarmActors()


def take(key: tuple, reset: Callable[[list], list], release_on_miss: bool = True) -> Optional[Kept]:
    """:meth:`WarmActors.take` from this process's kept actors, when it keeps any."""
    return POOL.take(key, reset, release_on_miss) if enabled() else None


def keep(key: tuple, actors: list, pg=None) -> bool:
    """:meth:`WarmActors.keep`, when this process keeps actors (else False: kill them)."""
    return enabled() and POOL.keep(key, actors, pg)


def release() -> None:
    """:meth:`WarmActors.release` of this process's kept actors."""
    POOL.release()
