"""What a loop may ask of the trainer (:class:`Host`), and what the trainer does for a
loop's outcome (:class:`Recovery`).

Both loops (:class:`~diloco_ray.driver.sync_loop.SyncLoop` and
:class:`~diloco_ray.driver.decoupled_loop.DecoupledLoop`) ask the trainer only through
:class:`Host`: the servers, the replicas, the callbacks, the fault plan and the eval. They
never recover, reconcile or restore: they return an outcome, and
:func:`~diloco_ray.driver.loop.apply_next_update` carries it out through :class:`Recovery`.
:class:`~diloco_ray.driver.trainer.DilocoFSDPTrainer` implements both; the loops' unit tests
hand them a fake with the same members, over fake servers and replicas (no Ray).
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


class Recovery(Host, Protocol):
    """What the trainer does for a loop's outcome that did not apply the update."""

    def reconcile(self) -> None:
        """Move the replica count towards the target (replace lost replicas)."""
        ...

    def recover_server(self) -> None:
        """A server died: start new ones from the latest checkpoint, and point the loop at
        them (``restore`` with ``reset``: every replica reloads)."""
        ...
