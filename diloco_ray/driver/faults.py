"""The fault plan's server and driver faults, carried out by the driver.

Ranks carry out their own faults (:class:`~diloco_ray.config.fault_plan.RankFaults`); a
server or the driver cannot, so the driver does, once the replicas have started the round
the fault names (so it hits a round in flight), and notes each in metrics.jsonl.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

import ray

from diloco_ray.config import fault_plan
from diloco_ray.observe.events import FaultEvent


class DriverFaults:
    """Fires the plan's ``server`` and ``driver`` faults, each once.

    Args:
        plan: the config's ``fault_plan`` (None: no faults).
    """

    def __init__(self, plan: Optional[list]):
        self.plan = fault_plan.parse(plan)
        self.fired: set = set()

    def fire(self, round_index: int, server, log: Callable) -> None:
        """Carry out the faults due in ``round_index``: kill a server actor, or kill (or
        SIGTERM) this process."""
        due = []
        for target in ("server", "driver"):
            due += fault_plan.due(self.plan, round_index, fired=frozenset(self.fired), target=target)
        for fault in due:
            self.fired.add(fault.key)
            log(FaultEvent(fault.target, fault.kind, round_index))
            if fault.target == "server":
                ray.kill(server.actors[fault.index % len(server)], no_restart=True)
            else:
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)
