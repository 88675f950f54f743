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

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from diloco_ray.algo import links
from diloco_ray.config import fault_plan as faults
from diloco_ray.config import preflight
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import tokenization
from diloco_ray.driver import ray_connection
from diloco_ray.driver.membership import Membership, capacity_shortfall
from diloco_ray.errors import ConfigError, Stopped, UserInputError, first_line, unwrap
from diloco_ray.logs import log
from diloco_ray.model import loading as modeling
from diloco_ray.observe.events import (
    CheckpointEvent,
    EarlyStopEvent,
    Event,
    FaultEvent,
    MembershipEvent,
    ServerEvent,
    WarningEvent,
)
from diloco_ray.observe.metrics import MetricsLogger, StepBoard
from diloco_ray.observe.ray_metrics import RoundMetrics
from diloco_ray.observe.records import round_record
from diloco_ray.persist import final_save, snapshot, staging
from diloco_ray.persist.run_folder import RunFolder, resolve_resume
from diloco_ray.runtime.messages import Launch, RoundPoll, SnapshotPlan, SyncPeriod
from diloco_ray.runtime.rank import RankWorker
from diloco_ray.runtime.replica import Replica, start_token_data
from diloco_ray.runtime.server import NON_FINITE, Contribution, ParameterServer
from diloco_ray.runtime.server_group import ServerGroup, assemble_weights

# A round that too few replicas finish is run again; this many times in a row is fatal.
MAX_ROUND_RETRIES = 3


@dataclass(frozen=True)
class RoundOutcome:
    """How one attempt at a round ended, as a decision for :meth:`DilocoFSDPTrainer.run_round`.

    Args:
        action: ``"proceed"`` (applied: ``record`` is its round record), ``"run_again"``
            (the round runs again from its start), or ``"recover_server"`` (restore the
            servers from the last checkpoint, then run the round again).
        record: the round record, when applied.
        why: what made the round run again (for errors and debugging).
    """

    action: Literal["proceed", "run_again", "recover_server"]
    record: Optional[dict] = None
    why: str = ""


STEP_POLL_S = 1.0  # how often the driver collects step events while a round runs


@dataclass
class TrainResult:
    """What :meth:`DilocoFSDPTrainer.train` returns.

    Args:
        rounds: the round records of this run (as in metrics.jsonl), in order.
        output_dir: the run's folder.
        final_path: the Hugging Face model folder (``output_dir/final``).
    """

    rounds: list[dict] = field(default_factory=list)
    output_dir: str = ""
    final_path: str = ""

    @property
    def final_eval_loss(self) -> Optional[float]:
        return self.rounds[-1]["eval_loss"] if self.rounds else None


class DilocoFSDPTrainer:
    """Runs a DiLoCo job on the connected Ray cluster (or a local one).

    Args:
        config: the job.
        callbacks: objects that may define any of ``on_train_begin(trainer)`` (after
            set-up or resume; ``trainer.round_index`` is the next round),
            ``on_round_begin(trainer, round_index, replicas)``, ``on_step(trainer, event)``
            (a replica's step event, every ``logging_steps``),
            ``on_round_end(trainer, record)`` and ``on_train_end(trainer)``.
        worker_cls: the rank class (tests swap in fakes).
        server_cls: the parameter-server class (likewise).
        stop_on_sigterm: make SIGTERM stop :meth:`train` as Ctrl-C does (raising
            :class:`~diloco_ray.errors.Stopped` after a checkpoint on stop); the CLI sets
            it. Installed once Ray is connected, since ``ray.init`` sets its own handler.
    """

    def __init__(
        self,
        config: TrainerConfig,
        callbacks: Optional[list] = None,
        worker_cls: type = RankWorker,
        server_cls: type = ParameterServer,
        stop_on_sigterm: bool = False,
    ):
        self.config = config
        self.stop_on_sigterm = stop_on_sigterm
        self._previous_sigterm = None
        self.callbacks = list(callbacks or [])
        self.worker_cls, self.server_cls = worker_cls, server_cls
        self._target = config.num_replicas
        self._lock = threading.Lock()
        self._started_ray = False
        self._scale_mtime = 0.0
        self.round_index = 0  # mirrors the server's round index between rounds
        self.records: list[dict] = []
        self.server: Optional[ServerGroup] = None
        self.members: Optional[Membership] = None
        self.metrics: Optional[MetricsLogger] = None
        self.run_dir = RunFolder(config)  # output_dir: a folder, or a bucket and its staging copy
        self.inflight_root = self.run_dir.inflight
        self._last_checkpoint_round: Optional[int] = None
        self._resume_steps: dict[int, int] = {}  # slot -> in-flight step to continue from
        self._inner_state_from: Optional[str] = None  # checkpoint the replicas placed at set-up resume from
        # What replicas load next: one weights message per server, of sync `_version`.
        self._messages: list = []
        self._messages_full = True
        self._version = 0
        self._reset = False  # replicas must reload everything (the servers were restored)
        self._restart = False  # the next launch re-runs a round: replicas restart from the global weights
        self._reset_inner: set[int] = set()  # replica ids whose inner state is poisoned (NaN/Inf rejected)
        self._attempt = 0  # launches so far: keys aborts, so a re-run is not stopped by an old abort
        self._wasted_steps = 0  # replica inner steps run this round whose work reached no applied update
        self._faults = faults.parse(config.fault_plan)
        self._fired: set = set()  # driver-side faults already carried out
        self._beats: dict = {}  # the ranks' latest beats, as the board last reported them
        self._global_refs: Optional[list] = None  # the servers' exact fp32 weights, once asked for
        self.board = None  # the StepBoard actor ranks report inner steps to
        self.ray_metrics: Optional[RoundMetrics] = None  # the round figures for the Ray dashboard
        self.stop_checkpoint: Optional[str] = None  # written when the run was told to stop
        self.stopped_by: Optional[str] = None  # the signal that stopped it (SIGTERM), when one did

    # ---- public API -------------------------------------------------------------------
    def scale(self, n: int) -> int:
        """Set the target replica count (clamped to [min_replicas, max_replicas]); it
        takes effect at the next round boundary. Returns the target set. Thread-safe."""
        lo, hi = self.config.replica_bounds
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
    def replicas(self) -> list[Replica]:
        """The active replicas, in slot order."""
        return self.members.active if self.members else []

    def global_weights(self) -> dict:
        """A copy of the current global weights on the driver (name -> numpy array).

        For inspection and tests: the round loop itself never pulls weights here.
        """
        return assemble_weights(ray.get(self.server.global_weights()), self.shapes)

    def train(self) -> TrainResult:
        """Run outer rounds until ``diloco_loops`` are applied; blocks. Returns the records."""
        result = TrainResult(output_dir=self.config.output_dir)
        try:
            self.setup()
            self._notify("on_train_begin")
            while self.round_index < self.config.diloco_loops and not self._early_stop():
                self.run_round()
            result.final_path = self.save_final()
            self._notify("on_train_end")
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
        resume = resolve_resume(cfg.resume_from) if cfg.resume_from else None
        preflight.check(cfg, resuming=resume is not None)
        self.run_dir.lock()  # before anything in output_dir changes
        self.run_dir.prepare(resuming=resume is not None)
        self._connect_ray()
        self._catch_sigterm()
        self.device = self._resolve_device()
        cfg.to_yaml(os.path.join(self.run_dir.local, "config.yaml"))
        run_name = (
            os.path.basename(os.path.abspath(cfg.output_dir) if not self.run_dir.remote else cfg.output_dir.rstrip("/"))
            or "diloco"
        )
        self.metrics = MetricsLogger(
            self.run_dir.local,
            cfg.log_with,
            cfg.log_dir,
            cfg.to_dict(),
            wandb_settings={
                "project": cfg.wandb_project,
                "entity": cfg.wandb_entity,
                "name": cfg.wandb_run_name or run_name,
                "tags": cfg.wandb_tags,
            },
        )
        self.board = self._new_board()
        self.ray_metrics = RoundMetrics(run_name)
        token_data = start_token_data(cfg)  # first: it runs while the actors start
        self.server = ServerGroup(cfg, self.server_cls)
        # Replicas placed now resume their inner state from the checkpoint; later ones start fresh.
        self._inner_state_from = resume[0] if resume else None
        self.members = Membership(
            cfg,
            self.device,
            self.worker_cls,
            self._log,
            lambda: self.round_index,
            on_admit=self._restore_inner,
            token_data=token_data,
        )
        shortfall = capacity_shortfall(cfg, self.device, ray.cluster_resources())
        if shortfall:
            # An autoscaler may still add nodes, so this warns rather than fails; without
            # one, the wait below ends at placement_timeout_s with the replicas that fit.
            self._warn(
                f"{shortfall}. Waiting up to placement_timeout_s={cfg.placement_timeout_s:g}s for room, "
                f"then going on with the replicas that fit (at least min_replicas={cfg.min_replicas})."
            )
        self.members.reconcile(cfg.num_replicas, wait_s=cfg.placement_timeout_s)
        if cfg.min_replicas <= len(self.replicas) < cfg.num_replicas:
            self._warn(
                f"starting with {len(self.replicas)} of num_replicas={cfg.num_replicas} replicas; "
                "the others join at a round boundary when they are placed"
            )
        if len(self.replicas) < cfg.min_replicas:
            totals = {k: v for k, v in ray.cluster_resources().items() if "_group_" not in k}
            raise RuntimeError(
                f"only {len(self.replicas)} of min_replicas={cfg.min_replicas} replicas were placed "
                f"and set up within placement_timeout_s={cfg.placement_timeout_s:g}s "
                f"(cluster resources: {totals})"
            )
        self._inner_state_from = None
        if resume:
            self._load_server(resume[0], skipped=resume[1], reason="resume")
            folder = snapshot.round_dir(self.inflight_root, self.round_index)
            for slot in range(len(self.replicas)):
                step = snapshot.common_step(folder, slot, cfg.ranks_per_replica)
                if step is not None:
                    self._resume_steps[slot] = step
        else:
            seed = self.replicas[0]  # every rank builds the same initial model
            self.shapes = seed.shapes
            self.server.initialize(seed.seed_pieces(), seed.shapes)
            self.round_index = 0
            self._after_restore(reset=False)
            if cfg.checkpoint_steps is not None:
                self.save_checkpoint()  # so a lost server can always be recreated

    def _after_restore(self, reset: bool) -> None:
        """Point replicas at the servers' state: the latest sync's message (a resumed
        replica merges it; one without the weights loads everything first)."""
        self._version = self.server.version()
        self._messages = self.server.last_weights() if self._version else self.server.full_weights()
        self._messages_full = self._version == 0
        self._global_refs = None  # fetched when eval or final/ needs them
        self._reset = reset

    def _restore_inner(self, rep: Replica, slot: int) -> None:
        """A replica about to join: with set-up resuming a checkpoint, its inner state."""
        if self._inner_state_from is not None:
            ray.get(rep.load_inner_state(self._inner_state_from, slot), timeout=self.config.call_timeout_s)

    def _load_server(self, path: str, skipped: list, reason: str) -> None:
        """Load the server state from checkpoint ``path`` and rewind the records to it."""
        for bad, why in skipped:
            log.warning("checkpoint %s is unusable (%s); using an older one", bad, why)
            self._log(CheckpointEvent("skipped", path=bad, reason=why))
        self.server.load(path)
        self.shapes = self.replicas[0].shapes if self.replicas else None
        self.round_index = self.server.round_index()
        self._last_checkpoint_round = self.round_index
        # Rounds after the checkpoint will be run again; their old records go.
        self.metrics.truncate_rounds(self.round_index)
        self.records = [r for r in self.records if r["round"] < self.round_index]
        # A restarted server is behind what the replicas hold: they reload everything.
        self._after_restore(reset=reason == "server_restart")
        self._log(CheckpointEvent(reason, path=path, round=self.round_index))

    def _connect_ray(self) -> None:
        if not ray.is_initialized():
            self._started_ray = ray_connection.connect(self.config)

    def _catch_sigterm(self) -> None:
        import signal

        if not self.stop_on_sigterm or threading.current_thread() is not threading.main_thread():
            return

        def stop(signum, frame):
            # Noted here too: Ray's blocking calls re-raise an interrupt as a plain one.
            self.stopped_by = signal.Signals(signum).name
            raise Stopped(self.stopped_by)

        self._previous_sigterm = signal.signal(signal.SIGTERM, stop)

    def _resolve_device(self) -> str:
        want = self.config.device
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if want == "cuda" and not has_gpu:
            raise ConfigError("device: 'cuda' but the Ray cluster has no GPUs; use device: cpu or auto")
        return "cuda" if want == "cuda" or (want == "auto" and has_gpu) else "cpu"

    # ---- one round --------------------------------------------------------------------
    def run_round(self) -> dict:
        """Run and apply one outer round (retrying if too few replicas report).

        A re-run starts every replica again from the global weights of the round (and,
        with ``restore_on_retry``, from its inner state at the round's start), on the
        same data plan: the cursor only moves when a round is applied.
        """
        self._wasted_steps = 0
        for _ in range(MAX_ROUND_RETRIES + 1):
            outcome = self._attempt_round()
            if outcome.action == "proceed":
                return outcome.record
            if outcome.action == "recover_server":
                self._recover_server()
            self._restart = True
            self._reconcile()
        raise RuntimeError(
            f"round {self.round_index}: not applied in {MAX_ROUND_RETRIES + 1} attempts (the last: {outcome.why})"
        )

    def _attempt_round(self) -> RoundOutcome:
        """One round: ``sync_fragments`` sync periods, each ending with one fragment's
        sync. Proceeds with its record, or says why it must run again (plain DiLoCo with
        too few replicas reporting or no update applied, or a lost server)."""
        cfg = self.config
        t_start = time.perf_counter()
        members = list(self.replicas)
        slots = {rep.id: slot for slot, rep in enumerate(members)}
        self._notify("on_round_begin", self.round_index, len(members))
        try:
            plans = dict(zip(slots, self.server.plan(len(members))))
        except RayActorError:
            return RoundOutcome("recover_server", why="a server died before the round")
        active, late_ids, failed_ids = list(members), set(), set()
        periods: list[dict] = []  # per sync: reported stats and the servers' refs
        timeout = None if cfg.round_timeout_s is None else cfg.round_timeout_s / cfg.sync_fragments
        held = (self._messages, self._messages_full)  # what replicas hold, if this sync commits nothing
        for fragment in range(cfg.sync_fragments):
            self._attempt += 1
            launched = {
                rep.id: Launch(rep, *rep.run_round(self._job(rep, slots[rep.id], fragment, plans[rep.id])))
                for rep in active
            }
            # Resume steps, a reload, a re-run's restart and a reset apply to the first period only.
            self._resume_steps, self._reset, self._restart = {}, False, False
            self._reset_inner -= set(launched)
            if fragment == 0:
                self._inject_driver_faults()
            poll = self._gather(launched, timeout)
            reported = poll.reported
            for rep, why in poll.failed:
                self.members.remove(rep, why)
            late_ids |= set(poll.late)
            failed_ids |= {rep.id for rep, _ in poll.failed}
            if cfg.sync_fragments == 1 and len(reported) < cfg.min_replicas:
                self._wasted_steps += sum(s.inner_steps for stats in reported.values() for s in stats[:1])
                return RoundOutcome("run_again", why=f"{len(reported)} < min_replicas={cfg.min_replicas} reported")
            # Each replica counts by the tokens that carried loss (see diloco_ray.algo.loss).
            weight = {rid: float(sum(s.loss_tokens for s in stats)) for rid, stats in reported.items()}
            contributions = [
                [Contribution(rid, launched[rid].buffers[s], weight[rid]) for rid in reported]
                for s in range(len(self.server))
            ]
            refs = self.server.sync(fragment, contributions, plans)
            periods.append({"reported": reported, "refs": refs})
            self._messages, self._messages_full = refs.weights, False
            if cfg.sync_fragments > 1:
                self._version += 1  # a streaming sync always advances, applied or not
            active = [rep for rep in active if rep.id in reported]  # a replica that missed one sits out the round
        try:
            applied = [ray.get(p["refs"].commits)[0] for p in periods]
        except RayActorError:
            return RoundOutcome("recover_server", why="a server died during the sync")
        for info, period in zip(applied, periods):
            # A replica rejected for NaN/Inf starts its next period with a fresh inner state.
            self._reset_inner |= {rid for rid, why in info.rejected.items() if why.startswith(NON_FINITE)}
            self._wasted_steps += sum(
                stats[0].inner_steps for rid, stats in period["reported"].items() if rid not in info.accepted
            )
        if cfg.sync_fragments == 1:
            if not applied[0].applied:
                self._messages, self._messages_full = held  # no new version: replicas keep what they hold
                return RoundOutcome("run_again", why="no update applied (every pseudo-gradient rejected)")
            self._version += 1
        t_applied = time.perf_counter()
        self.round_index = applied[-1].round + 1
        self._global_refs = None  # fetched when eval or final/ needs them

        t_eval = time.perf_counter()
        eval_loss = self._evaluate()
        eval_seconds = time.perf_counter() - t_eval
        record = round_record(self.config, applied, [p["reported"] for p in periods], late_ids, failed_ids)
        record["wasted_steps"] = self._wasted_steps
        record.update(
            eval_loss=eval_loss,
            eval_ppl=math.exp(min(eval_loss, 50.0)) if eval_loss is not None else None,
            round_seconds=time.perf_counter() - t_start,
            sync_seconds=max(0.0, (t_applied - t_start) - record["compute_seconds"]),
            eval_seconds=eval_seconds,
        )
        self.records.append(record)
        self._log(record)
        self.ray_metrics.record(record)
        self._maybe_checkpoint()
        self.run_dir.publish()
        self._notify("on_round_end", record)
        self._reconcile()
        return RoundOutcome("proceed", record=record)

    def _job(self, rep: Replica, slot: int, fragment: int, plan: list) -> SyncPeriod:
        """What every rank of ``rep`` gets for one sync period (see RankWorker.run_round)."""
        cfg = self.config
        return SyncPeriod(
            round=self.round_index,
            fragment=fragment,
            plan=plan,
            attempt=self._attempt,
            messages=self._messages,
            full=self._messages_full,
            version=self._version,
            servers=self.server.actors,
            reset=self._reset,
            restart=self._restart,
            reset_inner=rep.id in self._reset_inner,
            board=self.board,
            link=links.link_for_slot(cfg.link_mbps, cfg.link_latency_ms, slot),
            snapshots=self._snapshot_plan(slot) if fragment == 0 else None,
        )

    def _snapshot_plan(self, slot: int) -> Optional[SnapshotPlan]:
        """In-flight snapshot settings for the replica in ``slot`` (None: not needed,
        because round checkpoints already come at least as often)."""
        every = self.config.checkpoint_steps
        if every is None or every >= self.config.max_steps:
            return None
        return SnapshotPlan(
            folder=snapshot.round_dir(self.inflight_root, self.round_index),
            slot=slot,
            every=every,
            resume_step=self._resume_steps.get(slot),
        )

    def _gather(self, launched: dict[int, Launch], timeout_s: Optional[float]) -> RoundPoll:
        """Collect every replica's stats as they arrive, until the deadline.

        A rank that fails takes its whole replica down at once: its partners would
        otherwise wait in an FSDP collective forever. So does a replica whose ranks show
        no progress for ``stall_timeout_s`` (a frozen process answers nothing, and Ray
        cannot tell it from a slow one). Replicas still running at the deadline are told
        to stop and get ``abort_grace_s`` to do so; one that does not is dropped as
        unresponsive.
        """
        cfg = self.config
        owner = {ref: (rid, r) for rid, launch in launched.items() for r, ref in enumerate(launch.stats)}
        results: dict[int, list] = {rid: [] for rid in launched}
        failed: dict[int, tuple[Replica, str]] = {}
        pending = set(owner)
        launched_at = time.time()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def drop(rid: int, why: str) -> None:
            nonlocal pending
            failed[rid] = (launched[rid].replica, why)
            launched[rid].replica.stop()  # frees ranks blocked in a collective with the lost one
            pending = {r for r in pending if owner[r][0] != rid}

        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Wake at least every STEP_POLL_S to pass the ranks' step events on.
            wait = STEP_POLL_S if remaining is None else min(remaining, STEP_POLL_S)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait, fetch_local=False)
            self._pass_on_steps()
            for ref in ready:
                if ref not in pending:
                    continue
                pending.discard(ref)
                rid = owner[ref][0]
                try:
                    results[rid].append(ray.get(ref))
                except (RayActorError, RayTaskError) as e:
                    if isinstance(e, RayTaskError) and isinstance(unwrap(e), UserInputError):
                        raise
                    drop(rid, "failed")
            for rid in self._stalled(pending, owner, launched_at):
                drop(rid, "unresponsive")
            if not ready and remaining is not None and remaining <= STEP_POLL_S:
                break  # the deadline passed
        late = sorted({owner[r][0] for r in pending})
        for rid in late:
            launched[rid].replica.abort(self._attempt)
        # A late replica stops at its next step; one that cannot (frozen) is dropped, so it
        # neither holds up the next round nor is launched again and again.
        acks = [r for r in pending if owner[r][0] in late]
        done, _ = ray.wait(acks, num_returns=len(acks), timeout=cfg.abort_grace_s) if acks else ([], [])
        for ref in done:
            try:
                results[owner[ref][0]].append(ray.get(ref))
            except (RayActorError, RayTaskError):
                pass  # counted below as not having answered
        for rid in late:
            if len(results[rid]) < len(launched[rid].stats) and rid not in failed:
                drop(rid, "unresponsive")
        reported = {}
        for rid in launched:
            stats = results[rid]
            if rid in failed or rid in late or any(s.aborted for s in stats):
                beat = max((b[1] for (r, _), b in self._beats.items() if r == rid and b[0] == self._attempt), default=0)
                self._wasted_steps += max([s.inner_steps for s in stats] + [beat])
                continue
            reported[rid] = sorted(stats, key=lambda s: s.rank)
        late = [rid for rid in launched if rid not in failed and rid not in reported]
        return RoundPoll(reported, late, list(failed.values()))

    def _stalled(self, pending: set, owner: dict, launched_at: float) -> set[int]:
        """Replica ids with a rank still running that has shown no progress (a step
        beat on the board) for ``stall_timeout_s`` since the launch."""
        if self.board is None or not pending:
            return set()
        try:
            beats = self._beats = ray.get(self.board.beats.remote())
        except RayActorError:
            return set()  # the board is replaced by the next _pass_on_steps
        now, limit = time.time(), self.config.stall_timeout_s
        stalled = set()
        for ref in pending:
            rid, rank = owner[ref]
            attempt, _, at = beats.get((rid, rank), (None, 0, 0.0))
            last = at if attempt == self._attempt else launched_at
            if now - max(last, launched_at) > limit:
                stalled.add(rid)
        return stalled

    def _pass_on_steps(self) -> None:
        """Log the step events ranks have reported since the last call and hand them to
        the callbacks' ``on_step``."""
        if self.board is None:
            return
        try:
            events = ray.get(self.board.drain.remote())
        except RayActorError as e:  # includes ActorUnavailableError
            # Step events are a view on training: lose the undelivered ones, not the run.
            self._warn(f"the step board died ({type(e).__name__}); step events since the last poll are lost")
            self.board = self._new_board()
            return
        for event in events:
            self._log(event)
            self.ray_metrics.step(event.replica, event.loss, event.lr)
            self._notify("on_step", event.to_record())

    def _new_board(self):
        """The StepBoard actor, on the driver's own node: a lost worker node must not
        take the board (and the driver's polling) with it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(num_cpus=0, scheduling_strategy=here)(StepBoard).remote()

    def _notify(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def _current_globals(self) -> list:
        """Refs to the servers' current fp32 weights, asked for once per update (packing
        them costs a pass over the model, which a run without eval should not pay)."""
        if self._global_refs is None:
            self._global_refs = self.server.global_weights()
        return self._global_refs

    def _evaluate(self) -> Optional[float]:
        if self.config.eval_batches == 0:
            return None
        results = self._on_a_live_replica(lambda rep: rep.evaluate(self._current_globals()))
        if results is None:
            return None  # every replica died since the update; the next boundary replaces them
        total, count = sum(r[0] for r in results), sum(r[1] for r in results)
        return total / count if count else None

    def _on_a_live_replica(self, call):
        """``ray.get(call(replica))`` on the first active replica that is alive and answers
        within ``call_timeout_s`` (dead or frozen ones met on the way are removed), or
        None when none is left."""
        for rep in list(self.replicas):
            try:
                return ray.get(call(rep), timeout=self.config.call_timeout_s)
            except RayActorError:
                self.members.remove(rep, "failed")
            except ray.exceptions.GetTimeoutError:
                self.members.remove(rep, "unresponsive")
        return None

    def _inject_driver_faults(self) -> None:
        """Carry out the fault plan's server and driver faults due in this round (after
        the replicas have started it, so they hit a round in flight)."""
        for fault in faults.due(
            self._faults, self.round_index, fired=frozenset(self._fired), target="server"
        ) + faults.due(self._faults, self.round_index, fired=frozenset(self._fired), target="driver"):
            self._fired.add(fault.key)
            self._log(FaultEvent(fault.target, fault.kind, self.round_index))
            if fault.target == "server":
                ray.kill(self.server.actors[fault.index % len(self.server)], no_restart=True)
            else:
                import signal

                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGTERM)

    # ---- membership, checkpoints, recovery --------------------------------------------
    def _reconcile(self) -> None:
        """Move the replica count towards the target, at a round boundary."""
        self._read_scale_request()
        self.members.reconcile(self.target_replicas, wait_s=self.config.join_timeout_s)
        if len(self.replicas) < self.config.min_replicas:
            # Too few to run a round at all: wait for starting replicas, up to the limit.
            self.members.admit_ready(self.config.placement_timeout_s)
            if len(self.replicas) < self.config.min_replicas:
                raise RuntimeError(
                    f"{len(self.replicas)} replicas are running and no more could be placed within "
                    f"placement_timeout_s={self.config.placement_timeout_s:g}s; "
                    f"min_replicas={self.config.min_replicas}"
                )

    def _read_scale_request(self) -> None:
        """Apply a target written by ``diloco-ray scale OUTPUT_DIR N`` (another process)."""
        request = self.run_dir.read_scale_request(self._scale_mtime)
        if request is None:
            return
        self._scale_mtime, target = request
        self.scale(target)
        self._log(MembershipEvent("scale", self.round_index, target=self.target_replicas))

    def _early_stop(self) -> bool:
        """Whether eval loss has not improved by early_stopping_threshold for
        early_stopping_patience rounds (then the run ends, final/ is still written)."""
        patience = self.config.early_stopping_patience
        losses = [r["eval_loss"] for r in self.records if r["eval_loss"] is not None]
        if patience is None or len(losses) <= patience:
            return False
        best_before = min(losses[:-patience])
        if min(losses[-patience:]) < best_before - self.config.early_stopping_threshold:
            return False
        self._log(EarlyStopEvent(self.round_index, min(losses), patience))
        return True

    def _maybe_checkpoint(self) -> None:
        every = self.config.checkpoint_steps
        if every is None:
            return
        since = (self.round_index - (self._last_checkpoint_round or 0)) * self.config.max_steps
        if since >= every:
            self.save_checkpoint()

    def save_checkpoint(self, timeout_s: Optional[float] = None) -> Optional[str]:
        """Write the server's state and every active replica's inner state as one
        checkpoint (temp folder, checksums, rename); prune old ones. Returns its path,
        or None if a replica died while it was being written (the round goes on)."""
        cfg = self.config
        where = self.run_dir.begin_checkpoint(self.round_index)
        members = list(self.replicas)
        refs = self.server.save(where)
        for slot, rep in enumerate(members):
            refs += rep.save_inner_state(where, slot)
        try:
            files = {
                k: v
                for hashes in ray.get(refs, timeout=timeout_s or cfg.call_timeout_s)
                for k, v in (hashes or {}).items()
            }
        except (RayActorError, ray.exceptions.GetTimeoutError) as e:
            self._log(CheckpointEvent("failed", round=self.round_index, reason=first_line(e)[:200]))
            return None
        meta = {
            "replica_ids": [r.id for r in members],
            "ranks_per_replica": cfg.ranks_per_replica,
            "seed": cfg.seed,
            "max_steps": cfg.max_steps,
        }
        path = self.run_dir.commit_checkpoint(where, self.round_index, meta, files)
        self._last_checkpoint_round = self.round_index
        snapshot.clear_before(self.inflight_root, self.round_index)
        pruned = self.run_dir.prune(cfg.save_total_limit)
        self._log(CheckpointEvent("saved", path=path, round=self.round_index, pruned=pruned))
        return path

    def _checkpoint_on_stop(self) -> Optional[str]:
        """Told to stop: abandon the round in flight and, with ``checkpoint_steps`` set,
        checkpoint the last completed round within ``shutdown_grace_s``. The ranks first
        rewind to that round's boundary (the state they started the round with), so a
        resume from it continues exactly. Returns the checkpoint, or None."""
        cfg = self.config
        if cfg.checkpoint_steps is None or self.server is None or not self.replicas:
            return None
        if cfg.sync_fragments > 1 or cfg.overlap_communication:
            # Local weights differ from the global ones between rounds and a rank keeps no
            # copy of them from the round's start: the last round checkpoint stands.
            self._warn("stopped: streaming runs keep their last round checkpoint (none written on stop)")
            return None
        deadline = time.monotonic() + cfg.shutdown_grace_s
        left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
        try:
            for rep in self.replicas:
                rep.abort(self._attempt)
            if self.server.round_index() != self.round_index:
                return None  # the server committed a round the driver has not recorded
            if self._last_checkpoint_round == self.round_index:
                return self.run_dir.latest_valid()[0]
            ray.get(
                [r.rewind_round.remote(self.round_index) for rep in self.replicas for r in rep.ranks], timeout=left()
            )
            return self.save_checkpoint(timeout_s=left())
        except (RayActorError, ray.exceptions.GetTimeoutError, KeyboardInterrupt) as e:
            self._warn(f"no checkpoint on stop ({type(e).__name__}): the run resumes from its last one")
            return None

    def _recover_server(self) -> None:
        """The server died: start a new one from the latest good checkpoint."""
        path, skipped = self.run_dir.latest_valid()
        if path is None:
            raise RuntimeError(
                "the parameter server died and there is no checkpoint to recreate it from; "
                "set checkpoint_steps to make a run survive that"
            )
        self._log(ServerEvent("restart", self.round_index, from_path=path))
        self.server.kill()
        self.server = ServerGroup(self.config, self.server_cls)
        was_at = self.round_index
        self._load_server(path, skipped, reason="server_restart")
        if self.round_index < was_at:
            # The checkpoint is older than the round the replicas were at: their state at
            # that round's start is the checkpoint's, not the one they keep in memory.
            for slot, rep in enumerate(list(self.replicas)):
                try:
                    ray.get(rep.load_inner_state(path, slot), timeout=self.config.call_timeout_s)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    self.members.remove(rep, "failed")

    # ---- output and teardown ----------------------------------------------------------
    def save_final(self) -> str:
        """Write the global weights as a Hugging Face model to ``output_dir/final``:
        sharded safetensors streamed from the servers one tensor at a time (see
        :mod:`diloco_ray.persist.final_save`), or the PEFT adapter."""
        path = self.run_dir.path("final")
        if self.config.merge_adapter:
            # Merging needs the base weights beside the adapter: a replica, which has
            # them, writes both folders (that rank builds the whole base model).
            merged = self.run_dir.path("final_merged")
            if self._on_a_live_replica(lambda rep: rep.save_final(self._current_globals(), path, merged)) is None:
                raise RuntimeError("no replica is left to write final/")
            return path
        cfg = self.config
        tokenizer = tokenization.load_tokenizer(cfg)
        model = modeling.meta_model(cfg, tokenizer)

        def write(folder: str) -> None:
            if cfg.use_peft:
                adapter = {n: torch.from_numpy(self.server.tensor(n, s)) for n, s in self.shapes.items()}
                final_save.save_adapter(folder, model, tokenizer, adapter)
            else:
                final_save.save_model(
                    folder,
                    model,
                    tokenizer,
                    self.shapes,
                    lambda n: self.server.tensor(n, self.shapes[n]),
                    int(cfg.final_shard_mb * 2**20),
                )

        modeling.write_atomically(staging.scratch(path), write)
        staging.publish_tree(path)
        return path

    def _warn(self, message: str) -> None:
        """A warning for whoever watches (:mod:`diloco_ray.logs`), and a ``warning`` event in metrics.jsonl."""
        log.warning(message)
        self._log(WarningEvent(message, self.round_index))

    def _log(self, event: Event | dict) -> None:
        """One line in metrics.jsonl: a typed event, or a round record (a dict)."""
        if self.metrics is not None:
            self.metrics.log(event.to_record() if isinstance(event, Event) else event)

    def shutdown(self) -> None:
        """Stop replicas and server; stop Ray if this trainer started it."""
        if self.members is not None:
            self.members.stop_all()
        if self.server is not None:
            self.server.kill()
            self.server = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
            self.run_dir.publish()  # the closed, complete files
        if self.ray_metrics is not None:
            self.ray_metrics.close()
            self.ray_metrics = None
        if self.board is not None:
            ray.kill(self.board)
            self.board = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
        self.run_dir.unlock()
        if self._previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
