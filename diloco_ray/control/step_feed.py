"""The ranks' step events and heartbeats, as the driver reads them while a round runs.

Rank 0 of every replica drops its step events on a :class:`~diloco_ray.observe.metrics.StepBoard`
actor and every rank beats on it. :class:`StepFeed` owns that actor: it passes the events on
(metrics.jsonl, Ray metrics, the ``on_step`` callbacks) and hands the round loop the beats it
needs to tell a frozen rank from a slow one. A lost board costs the undelivered events, not
the run: a new one takes its place.
"""

from __future__ import annotations

from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError

from diloco_ray.observe.metrics import StepBoard
from diloco_ray.runtime import warm_actors


def board_key() -> tuple:
    """What a kept board must match to be taken (runtime.warm_actors): this node."""
    return ("step-board", ray.get_runtime_context().get_node_id())


def new_board():
    """The StepBoard actor, on the driver's own node: a lost worker node must not take the
    board (and the driver's polling) with it. A board kept by the last run on this node is
    taken first (it reserves nothing: a miss lets nothing else go)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    kept = warm_actors.take(board_key(), lambda boards: [b.reset.remote() for b in boards], release_on_miss=False)
    if kept is not None:
        return kept.actors[0]
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(StepBoard).remote()


class StepFeed:
    """The driver's end of the step board.

    Args:
        on_event: called with each step event, in order (the trainer logs it and tells callbacks).
        warn: called with a message when the board was lost and replaced.
    """

    def __init__(self, on_event: Callable, warn: Callable[[str], None]):
        self.on_event, self.warn = on_event, warn
        self.board = new_board()
        self.last_beats: dict = {}  # the ranks' latest beats, as the board last reported them

    def poll(self) -> None:
        """Pass on the step events ranks have reported since the last call."""
        try:
            events = ray.get(self.board.drain.remote())
        except RayActorError as e:  # includes ActorUnavailableError
            # Step events are a view on training: lose the undelivered ones, not the run.
            self.warn(f"the step board died ({type(e).__name__}); step events since the last poll are lost")
            self.board = new_board()
            return
        for event in events:
            self.on_event(event)

    def beats(self) -> Optional[dict]:
        """(replica id, rank) -> (attempt, step, wall time) of each rank's latest beat; None
        while the board is lost (it is replaced by the next :meth:`poll`)."""
        try:
            self.last_beats = ray.get(self.board.beats.remote())
        except RayActorError:
            return None
        return self.last_beats

    def close(self, keep: bool = False) -> None:
        """Let the board go: kept for the next run in this process when ``keep`` (a run that
        ended cleanly, runtime.warm_actors), else killed."""
        if not (keep and warm_actors.keep(board_key(), [self.board])):
            ray.kill(self.board)
