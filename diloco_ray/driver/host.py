"""What a loop may ask of the trainer: the :class:`Host` protocol.

Both loops (:class:`~diloco_ray.driver.sync_loop.SyncLoop` and
:class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`) call back only through it, and
nothing else of the trainer. :class:`~diloco_ray.driver.trainer.DilocoFSDPTrainer`
implements it; the loops' unit tests hand them a fake with the same members, over fake
servers and replicas (no Ray).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

from diloco_ray.observe.records import Evaluation

if TYPE_CHECKING:  # for annotations only
    from diloco_ray.runtime.replica import Replica
    from diloco_ray.runtime.server_group import ServerGroup


class Members(Protocol):
    """The replicas taking part (:class:`~diloco_ray.driver.membership.Membership`)."""

    @property
    def active(self) -> list[Replica]:
        """The active replicas, in slot order."""
        ...

    def remove(self, rep: Replica, reason: str) -> None:
        """``rep`` leaves (``reason``: ``"failed"``, ``"late"``, ``"unresponsive"``, ...)."""
        ...


class Host(Protocol):
    """What a loop may ask of the trainer while it runs a round (or a merge)."""

    @property
    def server(self) -> ServerGroup:
        """The parameter servers (a new group after :meth:`recover_server`)."""
        ...

    @property
    def members(self) -> Members:
        """The replicas: who runs the next period, and who leaves."""
        ...

    def notify(self, hook: str, *args) -> None:
        """Call the callbacks' ``hook`` (``on_round_begin``: the round's index and its replica count)."""
        ...

    def inject_faults(self) -> None:
        """Carry out the fault plan's server and driver faults due now (the replicas have started)."""
        ...

    def evaluate(self, among: Optional[list[int]] = None, due: bool = True) -> Evaluation:
        """The global weights just updated: evaluate them when ``due`` (on a replica of
        ``among`` first: idle ones, in decoupled mode)."""
        ...

    def reconcile(self) -> None:
        """Move the replica count towards the target (replace lost replicas)."""
        ...

    def recover_server(self) -> None:
        """A server died: start new ones from the latest checkpoint; the trainer then
        points the loop at them (``restore`` with ``reset``)."""
        ...
