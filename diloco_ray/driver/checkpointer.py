"""Round checkpoints as the driver takes them: when, what goes in, and the one on stop.

:class:`Checkpointer` decides for itself whether a round is due (``maybe_save``, as
torchtitan's ``checkpointer.save(step, last_step=...)`` does), writes the servers' state and
every active replica's inner state as one checkpoint that commits or fails as a unit
(temp folder, checksums, rename: :mod:`diloco_ray.persist.run_folder`), prunes old ones,
and writes the checkpoint of the last completed round when the run is told to stop.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from diloco_ray.config.sections import CheckpointSection, MembershipSection
from diloco_ray.driver.policies import checkpoint_due
from diloco_ray.errors import first_line
from diloco_ray.observe.events import CheckpointEvent
from diloco_ray.persist import snapshot


class Checkpointer:
    """Takes the run's round checkpoints.

    Args:
        checkpointing: when to checkpoint, how many to keep, and what a manifest records.
        deadlines: the membership section: how long a save may wait on a replica
            (``call_timeout_s``) and a checkpoint on stop in all (``shutdown_grace_s``).
        run_dir: the run's :class:`~diloco_ray.persist.run_folder.RunFolder`.
        log: called with each :class:`CheckpointEvent`.
        warn: called with a message for whoever watches.
        sent_verdicts: replica id -> what the driver has learnt of its earlier sends and not
            yet told it (:meth:`PeriodJobs.verdicts_for
            <diloco_ray.driver.period_jobs.PeriodJobs.verdicts_for>`): a replica settles
            them before it saves, so its saved residual holds what a dropped message carried.
    """

    def __init__(
        self,
        checkpointing: CheckpointSection,
        deadlines: MembershipSection,
        run_dir,
        log: Callable,
        warn: Callable[[str], None],
        sent_verdicts: Callable[[int], tuple] = lambda replica_id: (),
    ):
        self.checkpointing, self.deadlines = checkpointing, deadlines
        self.run_dir, self.log, self.warn = run_dir, log, warn
        self.sent_verdicts = sent_verdicts
        self.last_round: Optional[int] = None  # the round of the latest checkpoint written or loaded
        self.last_progress: Optional[float] = None  # the rounds' worth of work it held (see OuterLoop.progress)

    def maybe_save(self, server, replicas: dict, round_index: int, progress: float) -> Optional[str]:
        """Checkpoint ``round_index`` when ``checkpoint_steps`` say it is due by ``progress``
        (rounds' worth of inner steps done, :attr:`~diloco_ray.driver.loop.OuterLoop.progress`);
        its path, or None."""
        checkpointing = self.checkpointing
        if not checkpoint_due(progress, self.last_progress, checkpointing.checkpoint_steps, checkpointing.max_steps):
            return None
        return self.save(server, replicas, round_index, progress=progress)

    def save(
        self,
        server,
        replicas: dict,
        round_index: int,
        timeout_s: Optional[float] = None,
        progress: Optional[float] = None,
    ) -> Optional[str]:
        """Write the servers' state and the inner state of ``replicas`` (slot -> replica) as
        one checkpoint; prune old ones. Returns its path, or None if a replica died while it
        was being written (the round goes on, and the last checkpoint stands)."""
        checkpointing = self.checkpointing
        where = self.run_dir.begin_checkpoint(round_index)
        refs = server.save(where)
        for slot, rep in replicas.items():
            refs += rep.save_inner_state(where, slot, self.sent_verdicts(rep.id))
        try:
            hashes = ray.get(refs, timeout=timeout_s or self.deadlines.call_timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            self.log(CheckpointEvent("failed", round=round_index, reason=first_line(e)[:200]))
            return None
        files = {k: v for part in hashes for k, v in (part or {}).items()}
        meta = {
            "replica_ids": [r.id for r in replicas.values()],
            "replica_slots": list(replicas),
            "ranks_per_replica": checkpointing.ranks_per_replica,
            "seed": checkpointing.seed,
            "max_steps": checkpointing.max_steps,
        }
        path = self.run_dir.commit_checkpoint(where, round_index, meta, files)
        self.last_round = round_index
        self.last_progress = float(round_index) if progress is None else progress
        snapshot.clear_before(self.run_dir.inflight, round_index)
        pruned = self.run_dir.prune(checkpointing.save_total_limit)
        self.log(CheckpointEvent("saved", path=path, round=round_index, pruned=pruned))
        return path

    def on_stop(self, server, replicas: dict, round_index: int, progress: float, unmerged: dict) -> Optional[str]:
        """Told to stop: abandon the periods in flight and, with ``checkpoint_steps`` set,
        checkpoint the last completed round (or merge) within ``shutdown_grace_s``.

        Args:
            server: the server group.
            replicas: slot -> replica, every active one.
            round_index: the rounds (merges) applied and recorded.
            progress: rounds' worth of work done (see :meth:`maybe_save`).
            unmerged: replica id -> (launch attempt, round) of its period whose work is not
                in the weights: every replica's in a synchronous round in flight. Those
                replicas are told to stop and rewind to that period's start (its weights
                and inner state), so a resume from the checkpoint continues exactly.

        Returns the checkpoint, or None (a merge the driver did not record was committed,
        or the time ran out: the last checkpoint stands)."""
        checkpointing = self.checkpointing
        if checkpointing.checkpoint_steps is None or server is None or not replicas:
            return None
        if checkpointing.sync_fragments > 1 or checkpointing.overlap_communication:
            # Local weights differ from the global ones between rounds and a rank keeps no
            # copy of them from the round's start: the last round checkpoint stands.
            self.warn("stopped: streaming runs keep their last round checkpoint (none written on stop)")
            return None
        deadline = time.monotonic() + self.deadlines.shutdown_grace_s
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        busy = [(rep, unmerged[rep.id]) for rep in replicas.values() if rep.id in unmerged]
        try:
            for rep, (attempt, _) in busy:
                rep.abort(attempt)
            if server.round_index() != round_index:
                return None  # the server committed a round the driver has not recorded
            if self.last_round == round_index:
                return self.run_dir.latest_valid()[0]
            ray.get([r.rewind_round.remote(start) for rep, (_, start) in busy for r in rep.ranks], timeout=left())
            return self.save(server, replicas, round_index, timeout_s=left(), progress=progress)
        except (RayActorError, GetTimeoutError, KeyboardInterrupt) as e:
            self.warn(f"no checkpoint on stop ({type(e).__name__}): the run resumes from its last one")
            return None
