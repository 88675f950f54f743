"""Where a region's replicas find what came over the channel: :class:`Mailbox`.

A region's replicas take their weights as object refs, as a replica on the home's cluster
takes the servers'. The agent cannot hand them refs to bytes that have not crossed yet,
so it hands them refs of :meth:`Mailbox.take` calls on a small threaded actor, which
return once the agent has downloaded that message and put it there. With overlap a
replica starts its steps at once and merges the message at the period's end (its rank
prefetches it meanwhile), so the download rides under the steps, as the home's replicas'
does. :class:`FullWeightsOf` stands for a home server in the replicas' jobs: a replica
that must load everything asks it for the full weights, which come from the mailbox too
(the home's servers are never reached from a region).
"""

from __future__ import annotations

import threading
from typing import Iterable


class Mailbox:
    """Messages by channel key, for the region's replicas (a Ray actor with many threads:
    a take waits in one until its key is put)."""

    def __init__(self):
        self.items: dict[str, object] = {}
        self.generation = 0  # moves on with every keep(): a take from before it is void
        self.changed = threading.Condition()

    def put(self, key: str, data) -> None:
        with self.changed:
            self.items[key] = data
            self.changed.notify_all()

    def take(self, key: str):
        """The message ``key``, once it is put.

        Raises:
            LookupError: a new period began first (its message will never come: the period
                that asked for it was stopped).
        """
        with self.changed:
            generation = self.generation
            self.changed.wait_for(lambda: key in self.items or self.generation != generation)
            if key not in self.items:
                raise LookupError(f"message {key!r} is void: a new period began before it came")
            return self.items[key]

    def keep(self, keys: Iterable[str]) -> None:
        """Drop every message but ``keys`` (a new period: what the last one held is void)."""
        with self.changed:
            self.items = {k: v for k, v in self.items.items() if k in set(keys)}
            self.generation += 1
            self.changed.notify_all()


def full_key(index: int) -> str:
    """Where the full weights of home server ``index`` are put for the current period."""
    return f"full/{index}"


class FullWeightsOf:
    """Stands for home server ``index`` in a region's jobs: ``full_weights.remote()`` takes
    that server's full weights from the region's :class:`Mailbox`."""

    def __init__(self, mailbox, index: int):
        self.mailbox, self.index = mailbox, index

    @property
    def full_weights(self):
        return _TakeCall(self.mailbox, full_key(self.index))


class _TakeCall:
    def __init__(self, mailbox, key: str):
        self.mailbox, self.key = mailbox, key

    def remote(self):
        return self.mailbox.take.remote(self.key)
