"""The fault room: where the fault plan's faults are carried out.

:mod:`diloco_ray.config.fault_plan` parses the plan and says which faults are due (pure);
this module makes them happen, so the loops that train and sync hold no fault branches,
only calls at named hook points, each a no-op when no fault is due:

A rank's inner loop (:class:`RankFaults`, one per rank, replica faults aimed at it):

* ``start_period()``: at the start of each sync period; a ``slow`` fault and a dropped link
  last one period (a ``slowdown`` lasts the run).
* ``before_step(round, step)``: before each inner step. ``kill`` (SIGKILL) and ``freeze``
  (SIGSTOP) fire here and never return; ``slow`` sleeps its extra seconds before each
  remaining step of the period; ``slowdown`` sleeps ``factor - 1`` times the last step's time
  (or its fixed ``seconds``) before every step from then on.
* ``poison(loss)``: each micro-batch's loss on its way to ``backward``: NaN on the step a
  ``nan`` fault names.
* ``hold_link(released)``: when the period's steps are done, before the pseudo-gradient is
  packed: with ``drop_link`` it never leaves; the rank waits until the driver gives up on it.

The driver (:class:`DriverFaults`, through the trainer's ``inject_faults``, which both loops
call once the replicas have started the round or merge the fault names):

* ``fire(round, server, log)``: ``server`` faults kill a server actor; ``driver`` faults
  SIGKILL or SIGTERM the driver's own process. Each is noted in metrics.jsonl first.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional

from diloco_ray.config import fault_plan
from diloco_ray.config.fault_plan import Fault
from diloco_ray.observe.events import FaultEvent

# How often a rank holding a dropped link looks whether the driver has given up on it.
_HOLD_POLL_S = 0.05


class RankFaults:
    """Carries out one rank's replica faults as its inner loop reaches them.

    Args:
        plan: the faults aimed at this rank (:func:`~diloco_ray.config.fault_plan.for_rank`).
        at_or_after: fire a fault in the first period at or after its round (decoupled
            mode, see :mod:`diloco_ray.config.fault_plan`), not only in that round.
    """

    def __init__(self, plan: list[Fault], at_or_after: bool = False):
        self.plan, self.at_or_after = plan, at_or_after
        self.fired: set = set()
        self.extra_seconds = 0.0  # slow: added to each remaining step of the period
        self.drop_link = False  # drop_link: the pseudo-gradient of this period never leaves
        self.factor = 1.0  # slowdown: every step takes this many times as long, for the rest of the run
        self.paced_seconds = 0.0  # slowdown by seconds: added to every step, for the rest of the run
        self.scale = 1.0  # scale: this period's pseudo-gradient leaves this many times what it is
        self._poison_step = False  # nan: the current step's loss turns NaN
        self._step_seconds = 0.0  # the last step's own time, which a slowdown multiplies
        self._since: Optional[float] = None  # when the last step began (after its slowdown sleep)

    @classmethod
    def for_rank(cls, plan: Optional[list], replica_id: int, rank: int, at_or_after: bool = False) -> RankFaults:
        """The faults of the config's ``fault_plan`` aimed at rank ``rank`` of ``replica_id``."""
        return cls(fault_plan.for_rank(fault_plan.parse(plan), replica_id, rank), at_or_after)

    def start_period(self) -> None:
        """A new sync period: slowness and a dropped link last one period (a slowdown lasts)."""
        self.extra_seconds, self.drop_link, self._poison_step, self._since = 0.0, False, False, None
        self.scale = 1.0

    def before_step(self, round_index: int, step: int) -> None:
        """Fire what is due at inner step ``step`` of ``round_index`` (kill and freeze never
        return), then sleep what slowness asks for before the step runs."""
        self._poison_step = False
        for fault in fault_plan.due(self.plan, round_index, step, frozenset(self.fired), at_or_after=self.at_or_after):
            self.fired.add(fault.key)
            self._fire(fault)
        if self.extra_seconds or self.paced_seconds:
            time.sleep(self.extra_seconds + self.paced_seconds)
        if self.factor > 1:
            now = time.monotonic()
            if self._since is not None:  # the step just run (the first of a period uses the last one seen)
                self._step_seconds = now - self._since
            time.sleep((self.factor - 1) * self._step_seconds)
            self._since = time.monotonic()

    def _fire(self, fault: Fault) -> None:
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "slow":
            self.extra_seconds += fault.seconds
        elif fault.kind == "slowdown" and fault.factor:
            self.factor = fault.factor
        elif fault.kind == "slowdown":
            self.paced_seconds = fault.seconds
        elif fault.kind == "nan":
            self._poison_step = True
        elif fault.kind == "drop_link":
            self.drop_link = True
        elif fault.kind == "scale":
            self.scale = fault.factor

    def scaled(self, local: dict, anchor: dict) -> dict:
        """``local`` as a party whose update is ``scale`` times this one's would hold it
        (``anchor - scale * (anchor - local)``: its pseudo-gradient times ``scale``); ``local``
        itself when no scale fault fired this period. The replica's own weights are untouched."""
        if self.scale == 1.0:
            return local
        return {n: anchor[n] - self.scale * (anchor[n] - t) if n in anchor else t for n, t in local.items()}

    def poison(self, step_loss):
        """``step_loss``, or NaN times it on the step a ``nan`` fault names (so its gradients,
        and the inner optimizer's state after it, turn NaN)."""
        return step_loss * float("nan") if self._poison_step else step_loss

    def hold_link(self, released: Callable[[], bool]) -> bool:
        """With a dropped link this period, wait until ``released()`` (the driver has given up
        on this rank) and return True: the pseudo-gradient never leaves. Else False at once."""
        if not self.drop_link:
            return False
        while not released():
            time.sleep(_HOLD_POLL_S)
        return True


class DriverFaults:
    """Fires the plan's ``server`` and ``driver`` faults, each once, on the driver.

    A server or the driver cannot carry out its own fault at a given round, so the driver
    does, once the replicas have started the round the fault names (so it hits a round in
    flight).

    Args:
        plan: the config's ``fault_plan`` (None: no faults).
    """

    def __init__(self, plan: Optional[list]):
        self.plan = fault_plan.parse(plan)
        self.fired: set = set()

    def fire(self, round_index: int, server, log: Callable) -> None:
        """Carry out the faults due in ``round_index``: kill a server actor of ``server`` (a
        :class:`~diloco_ray.runtime.server_group.ServerGroup`), or kill (or SIGTERM) this
        process; each is first handed to ``log`` as a :class:`FaultEvent`."""
        due = []
        for target in ("server", "driver"):
            due += fault_plan.due(self.plan, round_index, fired=frozenset(self.fired), target=target)
        for fault in due:
            self.fired.add(fault.key)
            log(FaultEvent(fault.target, fault.kind, round_index))
            if fault.target == "server":
                import ray  # here, not at the top: a rank imports this module for RankFaults alone

                ray.kill(server.actors[fault.index % len(server)], no_restart=True)
            else:
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)
