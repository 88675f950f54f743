"""How the driver waits on the actors' answers: the few Ray calls the round loop makes.

The round loop holds object refs and asks three things of them: which are ready, their
values, and all of a list within a deadline; and it asks the time (launch times, beats and
deadlines are measured by it).
:class:`RayCalls` does that with Ray and the wall clock; tests hand the loop an object
with the same methods over plain values (and a fake clock), as Ray Train tests its
controller with a dummy worker group, so the loop's decisions run without a cluster.

Both loops call the parameter servers through :func:`server_call`: a dead server raises
:class:`ServerLost`, which each loop's ``run_round`` turns into the one outcome that asks
the trainer to restore the servers (``Action.RECOVER_SERVER``). Both ask the servers
first when a period fails (:func:`check_servers`), so that a replica is never dropped for
a server's death.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, TypeVar

from ray.exceptions import RayActorError

T = TypeVar("T")


class ServerLost(Exception):
    """A parameter server died during a loop's call: the update in progress is abandoned
    as a unit and the servers are restored from the last checkpoint."""


def server_call(call: Callable[[], T], when: str) -> T:
    """``call()``, a call to the parameter servers (or a wait on their answer); a dead
    server raises :class:`ServerLost` saying ``when`` it died (e.g. "during the sync")."""
    try:
        return call()
    except RayActorError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ServerLost(f"a server died {when} ({first})") from e


def check_servers(server, when: str) -> None:
    """Raise :class:`ServerLost` if a server of ``server`` (a server group) is dead. Asked
    before a failed period's replica is blamed: a period that failed because a server died
    (its weights could not be fetched, its message had nowhere to go) costs its replica
    nothing, and the round is restored as a unit instead."""
    server_call(server.ping, when)


class RayCalls:
    """The round loop's calls, made with Ray."""

    def ready(self, refs: Sequence[Any], timeout_s: Optional[float]) -> list:
        """Every ref of ``refs`` that is ready, waiting up to ``timeout_s`` for the first
        (without fetching their values to the driver). All of them, not only the first:
        replicas that finish together must be merged together."""
        import ray

        refs = list(refs)
        first, _ = ray.wait(refs, num_returns=1, timeout=timeout_s, fetch_local=False)
        if not first or len(refs) == 1:
            return first
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return done

    def all_ready(self, refs: Sequence[Any], timeout_s: Optional[float]) -> list:
        """The refs of ``refs`` ready within ``timeout_s``, waiting for all of them."""
        import ray

        if not refs:
            return []
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s, fetch_local=False)
        return done

    def get(self, refs: Any, timeout_s: Optional[float] = None) -> Any:
        """The value of a ref (or the values of a list of refs); raises what the call raised."""
        import ray

        return ray.get(refs, timeout=timeout_s)

    def now(self) -> float:
        """Wall-clock seconds (what launch times, arrivals and deadlines are measured in)."""
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
