"""A region's replicas on its own Ray cluster, watched as the home watches its own: :class:`RegionReplicas`.

The region's agent runs one sync period of every replica per notice. Each replica is a
:class:`~diloco_ray.runtime.replica.Replica` in a slot of its own (the slot fixes its share of
the region's data plan), and a period is collected by the home's own
:class:`~diloco_ray.control.poll.PeriodPoll`: the replicas beat on a step board of the
region's cluster, so one frozen past ``stall_timeout_s`` is dropped as unresponsive, one
still running at the period's deadline (``round_timeout_s`` over the fragments, as at
home) is told to stop and dropped when it cannot, and one whose process died is dropped at
once. A dropped replica's slot gets a new replica (a new id, as at home), started while the
region's reply crosses; its share of the plan went back to the home's cursor with that
reply. Faults the home's ``fault_plan`` aims at the region's replicas come with the
region's config and fire in its ranks as they do at home.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import ray

from diloco_ray.config.sections import MembershipSection, SyncCodecSection
from diloco_ray.control.calls import RayCalls
from diloco_ray.control.poll import PeriodPoll
from diloco_ray.control.step_feed import StepFeed
from diloco_ray.regions import wire
from diloco_ray.runtime.messages import Launch, RoundPoll, SyncPeriod
from diloco_ray.runtime.replica import Replica

ABORT_WAIT_S = 60.0  # how long a period told to stop may take to end before the agent goes on


class RegionReplicas:
    """The region's replicas, one per slot.

    Args:
        start_replica: starts replica ``id`` (its placement group and ranks; see
            :class:`~diloco_ray.runtime.replica.Replica`), as the home's membership does.
        sizes: each slot's share of a period's plan, in sequences (one per slot).
        membership: the deadlines (``round_timeout_s``, ``stall_timeout_s``, ``abort_grace_s``).
        sync_codec: the syncs (``sync_fragments`` cut the round's deadline).
        sync_mode: ``sync`` or ``decoupled`` (a decoupled period has no deadline, as at home).
        log_line: where one-line notes go.
    """

    def __init__(
        self,
        start_replica: Callable[[int], Replica],
        sizes: Sequence[int],
        membership: MembershipSection,
        sync_codec: SyncCodecSection,
        sync_mode: str,
        log_line: Callable[[str], None],
    ):
        self.start_replica, self.sizes, self.log = start_replica, list(sizes), log_line
        self.membership, self.sync_codec, self.mode = membership, sync_codec, sync_mode
        self.slots: list[Replica] = [start_replica(i) for i in range(len(self.sizes))]
        self.next_id = len(self.sizes)
        self.feed = StepFeed(on_event=lambda event: None, warn=self.log)  # beats, to tell a frozen replica
        self.lost: list[int] = []  # slots whose replica was dropped: refilled between periods
        self.shapes = self._set_up(self.slots)

    @property
    def ids(self) -> list[int]:
        return [rep.id for rep in self.slots]

    def plans(self, plan: Sequence) -> dict[int, list]:
        """Replica id -> its share of the region's ``plan``, in slot order
        (:func:`~diloco_ray.regions.wire.split_plan`)."""
        return dict(zip(self.ids, wire.split_plan(plan, self.sizes)))

    @property
    def board(self):
        """The region's step board, which its replicas' jobs name."""
        return self.feed.board

    def launch(self, jobs: Mapping[int, SyncPeriod]) -> dict[int, Launch]:
        """Start one period on every replica (``jobs``: replica id -> its job)."""
        return {rep.id: Launch(rep, *rep.run_period(jobs[rep.id])) for rep in self.slots if rep.id in jobs}

    def collect(self, launched: Mapping[int, Launch], attempt: int) -> RoundPoll:
        """Wait for a period as the home waits for its replicas' (stalls, the deadline,
        failures); the slots of the replicas dropped are refilled by :meth:`refill`."""
        m = self.membership
        deadline = None
        if self.mode == "sync" and m.round_timeout_s is not None:
            deadline = m.round_timeout_s / self.sync_codec.sync_fragments
        poll = PeriodPoll(dict(launched), attempt, RayCalls(), self.feed, m.stall_timeout_s, m.abort_grace_s)
        result = poll.collect(deadline)
        for rep, why in result.failed:
            self.log(f"region: replica {rep.id} dropped ({why}); its data goes back, a new replica takes its slot")
            self.lost.append(self.slots.index(rep))
        return result

    def refill(self) -> bool:
        """A new replica in every slot whose replica was dropped; whether there was any."""
        slots, self.lost = self.lost, []
        if not slots:
            return False
        fresh = {slot: self.start_replica(self._take_id()) for slot in slots}
        for slot, rep in fresh.items():
            self.slots[slot] = rep
        self._set_up(list(fresh.values()))
        return True

    def stop_period(self, attempt: int, launched: Mapping[int, Launch]) -> None:
        """Stop the replicas' period of launch ``attempt`` and wait for it to end."""
        for launch in launched.values():
            launch.replica.abort(attempt)
            ray.wait(list(launch.stats), num_returns=len(launch.stats), timeout=ABORT_WAIT_S)

    def save_inner_state(self, folder: str) -> None:
        """Every replica's inner state into ``folder`` (by slot), as a home checkpoint holds its
        replicas', within ``call_timeout_s`` (raises what the wait raised)."""
        refs = [ref for slot, rep in enumerate(self.slots) for ref in rep.save_inner_state(folder, slot)]
        ray.get(refs, timeout=self.membership.call_timeout_s)

    def load_inner_state(self, folder: str) -> None:
        """Every replica's inner state from ``folder`` (by slot): a fresh optimizer where it
        holds none. A replica that cannot (lost, frozen) is dropped and its slot refilled."""
        for slot, rep in enumerate(self.slots):
            try:
                ray.get(rep.load_inner_state(folder, slot), timeout=self.membership.call_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self.log(f"region: replica {rep.id} dropped ({type(e).__name__} taking up its inner state)")
                rep.stop()
                self.lost.append(slot)
        self.refill()

    def close(self) -> None:
        for rep in self.slots:
            rep.stop()
        self.slots = []

    def _take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _set_up(self, replicas: list[Replica]) -> dict:
        ray.get([rep.placed_ref for rep in replicas])
        return [ray.get(rep.setup())[0] for rep in replicas][0]


def job_for(
    notice: wire.Notice, replica_id: int, plan: list, messages: list, servers: list, start, **extra
) -> SyncPeriod:
    """Replica ``replica_id``'s job for ``notice``'s period: the home's flags, and what the
    region's books add (``start``: a reload for every replica, a fresh inner state for some)."""
    return notice.job(
        plan,
        messages,
        servers,
        reset=notice.reset or start.reload,
        reset_inner=notice.reset_inner or replica_id in start.reset_inner,
        **extra,
    )
