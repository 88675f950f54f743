"""DilocoFSDPTrainer: the driver that owns the server, the replicas and the round loop.

Each outer round: hand every active replica the current global weights (an object ref)
and its slice of the data stream, wait for the replicas until the straggler deadline,
have the server apply the pseudo-gradients that arrived, evaluate, record, checkpoint.
Between rounds the driver reconciles the replica count with the target that
:meth:`DilocoFSDPTrainer.scale` sets. The driver only ever holds object refs and small
stats; weights and pseudo-gradients go between replicas and server through Ray's object
store. If the server dies, it is recreated from the latest checkpoint.
"""

from __future__ import annotations

import os
import threading
import time
from functools import partial
from typing import Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from diloco_ray.config.schema import TrainerConfig, redacted, without_secrets
from diloco_ray.control import ray_connection
from diloco_ray.control.calls import check_servers
from diloco_ray.control.ray_session import RaySession
from diloco_ray.driver import preflight
from diloco_ray.driver.checkpointer import Checkpointer
from diloco_ray.driver.loop import apply_next_update, loop_for
from diloco_ray.driver.membership import Membership
from diloco_ray.driver.policies import early_stop
from diloco_ray.driver.result import TrainResult
from diloco_ray.driver.round_parts import eval_loss
from diloco_ray.driver.run_events import RunEvents
from diloco_ray.errors import ConfigError, Stopped, UserInputError, unwrap
from diloco_ray.logs import log
from diloco_ray.observe.events import (
    CheckpointEvent,
    EarlyStopEvent,
    MembershipEvent,
    ServerEvent,
)
from diloco_ray.observe.ray_output import RAY_LOG
from diloco_ray.observe.records import Evaluation
from diloco_ray.persist import final_save
from diloco_ray.persist.run_folder import RunFolder, resolve_resume
from diloco_ray.regions.members import open_channel
from diloco_ray.runtime import warm_actors
from diloco_ray.runtime.faults import DriverFaults
from diloco_ray.runtime.rank import RankWorker
from diloco_ray.runtime.replica import Replica, start_token_data
from diloco_ray.runtime.server import ParameterServer
from diloco_ray.runtime.server_group import ServerGroup, assemble_weights


class DilocoFSDPTrainer:
    """Runs a DiLoCo job on the connected Ray cluster (or a local one).

    Args:
        config: the job.
        callbacks: objects that may define any of ``on_train_begin(trainer)`` (after
            set-up or resume; ``trainer.round_index`` is the next round),
            ``on_round_begin(trainer, round_index, replicas)``, ``on_step(trainer, event)``
            (a replica's step event, every ``logging_steps``),
            ``on_round_end(trainer, record)`` and ``on_train_end(trainer)``.
        stop_on_sigterm: make SIGTERM stop :meth:`train` as Ctrl-C does (raising
            :class:`~diloco_ray.errors.Stopped` after a checkpoint on stop); the CLI sets
            it. Installed once Ray is connected, since ``ray.init`` sets its own handler.
        ray_output_to_file: send Ray's own log lines and what the actors print to
            ``output_dir/logs/ray.log`` instead of this process's console (the CLI does,
            unless ``--verbose``); see :mod:`~diloco_ray.observe.ray_output`.

    The rank and parameter-server classes are the class attributes ``worker_cls`` and
    ``server_cls``, made Ray actors when they are started; tests swap in fakes by
    subclassing the trainer.
    """

    worker_cls: type = RankWorker
    server_cls: type = ParameterServer

    def __init__(
        self,
        config: TrainerConfig,
        callbacks: Optional[list] = None,
        stop_on_sigterm: bool = False,
        ray_output_to_file: bool = False,
    ):
        self.config = config
        self.sections = sections = config.sections()  # what each part reads; the config itself is shipped whole
        self.ray_output_to_file = ray_output_to_file
        self.ray_session: Optional[RaySession] = None
        self.stop_on_sigterm = stop_on_sigterm
        self._previous_sigterm = None
        self.callbacks = list(callbacks or [])
        self._target = sections.membership.num_replicas
        self._lock = threading.Lock()
        self._scale_mtime = 0.0
        self.records: list[dict] = []
        self.server: Optional[ServerGroup] = None
        self.members: Optional[Membership] = None
        self.regions = None  # the regions taking part (RegionMembers), when the config names any
        # output_dir: a folder, or a bucket and its staging copy
        self.run_dir = RunFolder(sections.checkpointing, sections.observability.log_dir)
        self.inflight_root = self.run_dir.inflight
        # metrics.jsonl, the Ray dashboard, the callbacks; the ranks' step events
        self.events = RunEvents(self, self.callbacks, lambda: self.round_index)
        self.loop = loop_for(sections, self.inflight_root)  # the update index, what replicas load next
        self.checkpointer = Checkpointer(
            *(sections.checkpointing, sections.membership, self.run_dir, self.events.log, self.events.warn),
            sent_verdicts=self.loop.jobs.verdicts_for,
        )
        self._inner_state_from: Optional[str] = None  # checkpoint the replicas placed at set-up resume from
        self.chaos = DriverFaults(sections.faults.fault_plan)  # the fault plan's server and driver faults
        self._global_refs: Optional[list] = None  # the servers' exact fp32 weights, once asked for
        self.stop_checkpoint: Optional[str] = None  # written when the run was told to stop
        self.stopped_by: Optional[str] = None  # the signal that stopped it (SIGTERM), when one did
        self._ended_cleanly = False  # its actors may then be kept for the next run (runtime.warm_actors)

    # ---- public API -------------------------------------------------------------------
    def scale(self, n: int) -> int:
        """Set the target replica count (clamped to [min_replicas, max_replicas]); it
        takes effect at the next round boundary. Returns the target set. Thread-safe."""
        lo, hi = self.sections.membership.replica_bounds
        if not isinstance(n, int) or isinstance(n, bool):
            raise ConfigError(f"scale: {n!r} is not an integer replica count")
        with self._lock:
            self._target = min(max(n, lo), hi)
            return self._target

    @property
    def target_replicas(self) -> int:
        with self._lock:
            return self._target

    @property
    def round_index(self) -> int:
        """The next round to run (decoupled: the next merge; the servers' round index between them)."""
        return self.loop.round_index

    @property
    def board(self):
        """The StepBoard actor ranks report inner steps to (None before set-up)."""
        return self.events.steps.board if self.events.steps is not None else None

    @property
    def replicas(self) -> list[Replica]:
        """The active replicas, in slot order."""
        return self.members.home if self.members else []

    def global_weights(self) -> dict:
        """A copy of the current global weights on the driver (name -> numpy array).

        For inspection and tests: the round loop itself never pulls weights here.
        """
        return assemble_weights(ray.get(self.server.global_weights()), self.shapes)

    def train(self) -> TrainResult:
        """Run outer rounds until ``diloco_loops`` are applied; blocks. Returns the records."""
        result = TrainResult(output_dir=self.sections.checkpointing.output_dir)
        try:
            self.setup()
            self.notify("on_train_begin")
            while not self.loop.finished() and not self._early_stop():
                self.run_round()
            result.final_path = self.save_final()
            self.notify("on_train_end")
            self._ended_cleanly = True
        except RayTaskError as e:
            cause = unwrap(e)
            if isinstance(cause, UserInputError):
                raise cause from None
            raise
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through errors.Stopped
            self.stop_checkpoint = self._checkpoint_on_stop()
            raise
        finally:
            self.shutdown()
        result.rounds = list(self.records)
        return result

    # ---- set-up -----------------------------------------------------------------------
    def setup(self) -> None:
        """Prepare output_dir, connect to Ray, start (or restore) the server and the
        replicas."""
        cfg = self.config
        # Everything that can be checked without Ray is checked before Ray starts.
        s = self.sections
        resume_from = s.checkpointing.resume_from
        resume = resolve_resume(resume_from, s.checkpointing, s.model, s.peft) if resume_from else None
        preflight.check(cfg, resuming=resume is not None)
        self.run_dir.lock()  # before anything in output_dir changes
        self.run_dir.prepare(resuming=resume is not None)
        output = os.path.join(self.run_dir.local, "logs", RAY_LOG) if self.ray_output_to_file else None
        self.ray_session = RaySession(lambda: ray_connection.connect(s.membership, s.placement), output).open()
        self._catch_sigterm()
        self.device = ray_connection.resolve_device(s.placement.device)
        self._open_records(s)
        self.loop.steps = self.events.steps
        token_data = start_token_data(s.data, s.model)  # first: it runs while the actors start
        self.server = ServerGroup(cfg, self.server_cls)
        self._place(token_data, resume)
        if resume:
            self._load_server(resume[0], skipped=resume[1], reason="resume")
            self.loop.resume_in_flight(self.replicas)
            if self.regions is not None:  # (a new home starts them fresh otherwise)
                self.regions.restore(resume[0])
        else:
            seed, self.shapes = self.replicas[0], self.replicas[0].shapes  # every rank builds the same model
            self.server.initialize(seed.seed_pieces(), seed.shapes)
            adopted = self.members.adopt_initial(seed)
            log.info("replicas %s built the initial weights: no round-0 load", adopted)
            self._after_restore(reset=False)
            if s.checkpointing.checkpoint_steps is not None:
                self.save_checkpoint()  # so a lost server can always be recreated

    def _place(self, token_data: list, resume: Optional[tuple]) -> None:
        """Open the channel when other regions take part (they dial in to its actor, here),
        and place this cluster's first replicas: those placed now resume their inner state
        from the checkpoint being resumed; later ones start fresh. The first round waits for
        every region to join, up to ``placement_timeout_s``."""
        s = self.sections
        if s.channel.regions:
            self.regions = open_channel(
                without_secrets(self.config.to_dict()), s, self.events.log, lambda: self.round_index
            )
        self._inner_state_from = resume[0] if resume else None
        self.members = Membership(
            s.membership,
            s.placement,
            self.device,
            lambda rid: Replica(rid, self.config, self.device, self.worker_cls, token_data),
            self.events.log,
            lambda: self.round_index,
            on_admit=self._restore_inner,
            regions=self.regions,
        )
        self._tell_regions_of_syncs()
        self.members.place_initial(self.events.warn)
        warm_actors.release()  # what this run's first members and servers did not take
        if self.regions is not None:
            self.regions.at_boundary(wait_s=s.membership.placement_timeout_s)
        self._inner_state_from = None

    def _tell_regions_of_syncs(self) -> None:
        """Regions that take the outer step themselves hear of every sync the servers chain."""
        if self.regions is not None and self.server.digest:
            self.server.on_sync = self.regions.note_sync

    def _after_restore(self, reset: bool) -> None:
        """Point the loop at the servers' state: their index, what replicas load (see
        :meth:`~diloco_ray.driver.loop.OuterLoop.restore`)."""
        self.loop.restore(self.server, reset)
        self._global_refs = None  # fetched when eval or final/ needs them

    def _restore_inner(self, rep: Replica, slot: int) -> None:
        """A replica about to join: with set-up resuming a checkpoint, its inner state."""
        if self._inner_state_from is not None:
            ray.get(rep.load_inner_state(self._inner_state_from, slot), timeout=self.sections.membership.call_timeout_s)

    def _load_server(self, path: str, skipped: list, reason: str) -> None:
        """Load the server state from checkpoint ``path`` and rewind the records to it."""
        for bad, why in skipped:
            log.warning("checkpoint %s is unusable (%s); using an older one", bad, why)
            self.events.log(CheckpointEvent("skipped", path=bad, reason=why))
        self.server.load(path)
        if self.replicas:  # (with none left, as when a region alone trains on, the shapes stay as they were)
            self.shapes = self.replicas[0].shapes
        # The loop takes up the servers' round; a restarted server is behind what the
        # replicas hold: they reload everything.
        self._after_restore(reset=reason == "server_restart")
        self.checkpointer.last_round = self.round_index
        # Rounds after the checkpoint will be run again; their old records go.
        self.events.metrics.truncate_rounds(self.round_index)
        self.records = [r for r in self.records if r["round"] < self.round_index]
        self.checkpointer.last_progress = self.loop.progress
        self.events.log(CheckpointEvent(reason, path=path, round=self.round_index))

    def _open_records(self, sections) -> None:
        """config.yaml and the run's event sinks (metrics.jsonl, TensorBoard, W&B): secrets
        in mapping fields are ``***`` in both (:func:`~diloco_ray.config.schema.redacted`)."""
        self.config.to_yaml(os.path.join(self.run_dir.local, "config.yaml"))
        self.events.open(sections.observability, redacted(self.config.to_dict()), self.run_dir)

    def _catch_sigterm(self) -> None:
        def stopped(name: str) -> None:
            # Noted here too: Ray's blocking calls re-raise an interrupt as a plain one.
            self.stopped_by = name
            raise Stopped(name)

        if self.stop_on_sigterm:
            self._previous_sigterm = ray_connection.on_sigterm(stopped)

    # ---- one round --------------------------------------------------------------------
    def run_round(self) -> dict:
        """Run and apply one outer round (decoupled: one merge), carrying out what the loop
        asks for on the way (:func:`~diloco_ray.driver.loop.apply_next_update`: replace lost
        replicas, restore the servers, or stop); then record it, checkpoint when due,
        publish, and reconcile the replica count."""
        record = apply_next_update(self.loop, self).to_record()
        self.records.append(record)
        self.events.round_done(record)
        self.checkpointer.maybe_save(self.server, self._checkpointed_replicas, self.round_index, self.loop.progress)
        self.run_dir.publish()
        self.notify("on_round_end", record)
        self.reconcile()
        return record

    # ---- what the loop asks of its host (driver.host.Host) ------------------------------
    def notify(self, hook: str, *args) -> None:
        """Call the callbacks' ``hook`` (see :class:`RunEvents`)."""
        self.events.notify(hook, *args)

    def _current_globals(self) -> list:
        """Refs to the servers' current fp32 weights, asked for once per update (packing
        them costs a pass over the model, which a run without eval should not pay)."""
        if self._global_refs is None:
            self._global_refs = self.server.global_weights()
        return self._global_refs

    def evaluate(self, among: Optional[list] = None, due: bool = True) -> Evaluation:
        """After every update: eval loss of the new global weights on a live replica when ``due``
        (None: not due, no eval, or none left); ``among``: ids to try first (decoupled: idle ones)."""
        started = time.perf_counter()
        self._global_refs = None  # the weights moved: fetched on demand
        loss, bytes_down = self._eval_loss(among) if due and self.sections.evaluation.eval_batches != 0 else (None, 0)
        return Evaluation(loss, time.perf_counter() - started, bytes_down)

    def _eval_loss(self, among: Optional[list]) -> tuple[Optional[float], int]:
        """The eval loss, and the bytes of global weights it fetched to a replica (None:
        every replica died since the update; the next boundary replaces them)."""
        return eval_loss(self.members, self.server, self._current_globals(), among)

    def inject_faults(self) -> None:
        """Carry out the fault plan's server and driver faults due in this round."""
        self.chaos.fire(self.round_index, self.server, self.events.log)

    # ---- what the trainer does for a loop's outcome (driver.host.Recovery), checkpoints --
    def reconcile(self) -> None:
        """Move the replica count towards the target, at a round boundary."""
        self._read_scale_request()
        self.members.at_boundary(self.target_replicas)

    def _read_scale_request(self) -> None:
        """Apply a target written by ``diloco-ray scale OUTPUT_DIR N`` (another process)."""
        request = self.run_dir.read_scale_request(self._scale_mtime)
        if request is None:
            return
        self._scale_mtime, target = request
        self.scale(target)
        self.events.log(MembershipEvent("scale", self.round_index, target=self.target_replicas))

    def _early_stop(self) -> bool:
        """Whether eval loss has stopped improving (:func:`~diloco_ray.driver.policies.early_stop`):
        then the run ends, and final/ is still written."""
        evaluation = self.sections.evaluation
        patience, threshold = evaluation.early_stopping_patience, evaluation.early_stopping_threshold
        stop = early_stop([r["eval_loss"] for r in self.records], patience, threshold)
        if stop is not None:
            self.events.log(EarlyStopEvent(self.round_index, stop.best, stop.patience))
        return stop is not None

    def save_checkpoint(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Checkpoint the current round now (see :meth:`Checkpointer.save`); its path, or None."""
        return self.checkpointer.save(
            self.server, self._checkpointed_replicas, self.round_index, timeout_s, self.loop.progress
        )

    @property
    def _checkpointed_replicas(self) -> dict:
        """Slot -> replica, whose inner state a checkpoint holds: the replicas between
        periods (every one at a synchronous round boundary; in decoupled mode the ones just
        merged), and the regions between periods by their ids. One still training has no
        state that goes with these weights: its slot is left out and it resumes fresh."""
        busy = self.loop.unmerged(self.replicas)
        idle = {slot: rep for slot, rep in enumerate(self.replicas) if rep.id not in busy}
        return {**idle, **{rep.id: rep for rep in (self.regions.active if self.regions else []) if rep.id not in busy}}

    def _checkpoint_on_stop(self) -> Optional[str]:
        unmerged = self.loop.unmerged(self.replicas)
        return self.checkpointer.on_stop(
            self.server, dict(enumerate(self.replicas)), self.round_index, self.loop.progress, unmerged
        )

    def recover_server(self) -> None:
        """The server died: start a new one from the latest good checkpoint."""
        path, skipped = self.run_dir.latest_valid()
        if path is None:
            raise RuntimeError(
                "the parameter server died and there is no checkpoint to recreate it from; "
                "set checkpoint_steps to make a run survive that"
            )
        self.events.log(ServerEvent("restart", self.round_index, from_path=path))
        self.server.kill()
        self.server = ServerGroup(self.config, self.server_cls)
        self._tell_regions_of_syncs()
        was_at = self.round_index
        self._load_server(path, skipped, reason="server_restart")
        if self.round_index < was_at or self.sections.run.sync_mode == "decoupled":
            # The checkpoint is older than the round the replicas were at (or, decoupled, they
            # finished periods that were thrown away): their state is the checkpoint's, not
            # the one they keep in memory.
            for slot, rep in enumerate(list(self.replicas)):
                try:
                    ray.get(rep.load_inner_state(path, slot), timeout=self.sections.membership.call_timeout_s)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    self.members.remove(rep, "failed")
            if self.regions is not None:
                self.regions.restore(path)

    # ---- output and teardown ----------------------------------------------------------
    def save_final(self) -> str:
        """Write the global weights as a Hugging Face model to ``output_dir/final``:
        sharded safetensors streamed from the servers one tensor at a time (see
        :mod:`diloco_ray.persist.final_save`), or the PEFT adapter."""
        path = self.run_dir.path("final")
        if self.sections.checkpointing.merge_adapter:
            # Merging needs the base weights beside the adapter: a replica, which has
            # them, writes both folders (that rank builds the whole base model).
            merged = self.run_dir.path("final_merged")
            write = lambda rep: rep.save_final(self._current_globals(), path, merged)  # noqa: E731
            check = partial(check_servers, self.server, "while final/ was written")
            if self.members.first_answer(write, check=check) is None:
                raise RuntimeError("no replica is left to write final/")
            return path
        s = self.sections
        model, peft, shard_mb = s.model, s.peft, s.checkpointing.final_shard_mb
        return final_save.save_from_servers(model, peft, shard_mb, path, self.server.tensor, self.shapes)

    def shutdown(self) -> None:
        """Stop replicas and server; stop Ray if this trainer started it."""
        if self.regions is not None:
            self.regions.close()
        # Kept only from a clean end, and only on a Ray that outlives this trainer.
        keep = self._ended_cleanly and self.ray_session is not None and not self.ray_session.started
        if self.members is not None:
            self.members.stop_all(keep)
        if self.server is not None:
            self.server.kill(keep)
            self.server = None
        self.events.close(publish=self.run_dir.publish, keep=keep)
        if self.ray_session is not None:
            self.ray_session.close()
        self.run_dir.unlock()
        if self._previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
