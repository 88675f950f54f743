"""What one FSDP rank of one replica does: the inner loop.

A :class:`RankWorker` is a thin actor around a model shard and its named parts, built at
set-up, each with only what it needs:

* ``batches`` (:mod:`~diloco_ray.runtime.rank_batches`): its view of the data, round by round;
* ``state`` (:mod:`~diloco_ray.runtime.rank_state`): the inner optimizer, whose state stays
  with the replica across rounds, and its save and restore;
* ``sync`` (:mod:`diloco_ray.algo.rank_sync`): what it holds of the global weights (anchor,
  versions, error-feedback residuals), the messages it applies and the pseudo-gradient it
  packs; :func:`~diloco_ray.runtime.rank_weights.receive_weights` fetches those messages;
* ``output`` (:mod:`~diloco_ray.runtime.rank_output`): eval, the final save, a description;
* ``faults`` (:mod:`~diloco_ray.runtime.faults`): the fault plan's hook points.

Each sync period it loads its rows of the global weights, runs its inner steps, and returns
its stats; its rows of the pseudo-gradient ``global - local``, one packed buffer per server,
leave by a second call, :meth:`RankWorker.message` (with ``overlap_communication`` the next
period starts while they come down: :mod:`~diloco_ray.runtime.rank_outbox`). With
``sync_fragments`` > 1 one call covers one fragment's sync period. It is a plain class: the
replica wraps it with ``ray.remote`` at creation, and tests can drive it in-process. It keeps
the whole config (for tests and tools) but reads it by section (``sections``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time

import numpy as np
import torch

from diloco_ray.algo import loss
from diloco_ray.algo.inner_schedule import inner_lr_at, sync_period
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import tokenization
from diloco_ray.model import loading as modeling
from diloco_ray.runtime import fsdp, placement, transport
from diloco_ray.runtime.faults import RankFaults
from diloco_ray.runtime.messages import SnapshotPlan, SyncPeriod
from diloco_ray.runtime.placement import RankPlacement
from diloco_ray.runtime.rank_batches import RankBatches, load_tokens
from diloco_ray.runtime.rank_outbox import Outbox
from diloco_ray.runtime.rank_output import RankOutput
from diloco_ray.runtime.rank_period import BoardReports, PeriodTally
from diloco_ray.runtime.rank_state import RankState, local_rows
from diloco_ray.runtime.rank_weights import receive_weights
from diloco_ray.runtime.round_start import at_period_start


class RankWorker:
    """One rank of one replica.

    Args:
        config: the job's TrainerConfig (as a dict, so it pickles without surprises).
        replica_id: the replica this rank belongs to.
        rank: this rank's index inside the replica.
        world_size: ranks in the replica (``ranks_per_replica``).
        device: ``"cpu"`` or ``"cuda"``.
    """

    def __init__(self, config: dict, replica_id: int, rank: int, world_size: int, device: str = "cpu"):
        # Quiet, reproducible ranks: tokenizers' own thread pool fights the inner loop for
        # cores and warns after fork. Set here rather than as the actor's runtime_env,
        # which would keep Ray from using one of its already started worker processes.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.config = TrainerConfig.from_dict(config)
        self.sections = self.config.sections()
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        self.device_kind = device
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")  # until setup
        self._store = None  # the TCP store rank 0 serves when the replica spans nodes
        self.model = None
        self.state: RankState | None = None  # sync, batches, state and output: built by setup()
        self._abort_attempt = -1  # set from another thread by abort()
        decoupled = self.sections.run.sync_mode == "decoupled"
        self.faults = RankFaults.for_rank(self.sections.faults.fault_plan, replica_id, rank, at_or_after=decoupled)
        self.reports = BoardReports(replica_id, rank, world_size)
        # Where run_period leaves its messages for message() to send.
        self.outbox = Outbox()

    # ---- set-up -----------------------------------------------------------------------
    def where(self) -> tuple[str, list]:
        """(Ray node id, Ray's GPU ids) of this rank, asked before anything here touches CUDA."""
        import ray

        return ray.get_runtime_context().get_node_id(), list(ray.get_gpu_ids())

    def rendezvous(self, spans_nodes: bool = False) -> str:
        """Where the replica's ranks meet, asked of rank 0: a private store file, or, when they
        span nodes, a TCP store this rank serves on its node's cluster address."""
        if not spans_nodes:
            return fsdp.rendezvous()
        address, self._store = fsdp.serve_store(self.world_size)
        return address

    def setup(
        self, init_method: str | None = None, token_data: list | None = None, placed: RankPlacement | None = None
    ) -> dict[str, tuple]:
        """Bind this rank's device, join the replica's process group, build and shard the model,
        build the inner optimizer, take in the data. Returns name -> full shape of the trained
        parameters.

        Args:
            init_method: rank 0's :meth:`rendezvous` (``world_size > 1``).
            token_data: ``[ref]`` to the job's :class:`~diloco_ray.data.samples.TokenData` (the
                driver's one tokenising task; in a list, so Ray hands over the ref and
                the model is built while the task runs), or None to tokenise here.
            placed: where this rank runs and which GPUs it sees (the replica's
                :func:`~diloco_ray.runtime.placement.place_ranks`; None: as Ray started it).
        """
        sections = self.sections
        torch.set_num_threads(max(1, int(sections.placement.cpus_per_rank)))
        self.device = placement.bind_device(placed, self.device_kind, os.environ)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            fsdp.join_process_group(init_method, self.rank, self.world_size, self.device, placed, self._store)
        self.tokenizer = tokenization.load_tokenizer(sections.model)
        # Sharded while still empty (meta), so each rank allocates and loads its rows only.
        mixed_precision = sections.model.mixed_precision
        shard = functools.partial(fsdp.shard, mixed_precision=mixed_precision) if self.world_size > 1 else None
        here = (self.device, shard, self.world_size, self.rank)
        model = modeling.build_model(sections.model, sections.peft, self.tokenizer, *here)
        self.shapes = {n: tuple(p.shape) for n, p in modeling.trained_parameters(model)}
        if sections.model.torch_compile:
            model = torch.compile(model)  # attribute access still reaches the wrapped module
        self.model = model
        # Named as in the model itself: a compiled wrapper would prefix every name.
        self.params = modeling.trained_parameters(getattr(model, "_orig_mod", model))
        self._build_parts(token_data)
        return self.shapes

    def _build_parts(self, token_data: list | None) -> None:
        """The named parts around the built model, each given the section it reads."""
        sections = self.sections
        servers = sections.placement.num_param_servers
        self.sync = RankSync.of(sections.sync_codec, self.shapes, self.world_size, self.rank, servers)
        here = (self.rank, self.world_size, self.device)
        mixed_precision = sections.model.mixed_precision
        self.state = RankState(self.params, self.sync, sections.inner_optim, mixed_precision, *here, self.streamed)
        self.tokens = load_tokens(sections.data, self.tokenizer, token_data)
        self.batches = RankBatches(sections.data, self.tokens, *here)
        self.output = RankOutput(
            evaluation=sections.evaluation,
            batching=sections.data,
            model=self.model,
            params=self.params,
            sync=self.sync,
            tokens=self.tokens,
            tokenizer=self.tokenizer,
            fresh_model=functools.partial(modeling.build_model, sections.model, sections.peft, self.tokenizer),
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            streamed=self.streamed,
            autocast=self._autocast,
        )

    def seed_pieces(self):
        """This rank's rows of its freshly built weights, one fp32 buffer per server (a
        bare buffer for one server, as ``num_returns=1`` expects)."""
        buffers = self.sync.seed(local_rows(self.params))
        return buffers[0] if len(buffers) == 1 else buffers

    def adopt_initial(self, expected: list | None) -> tuple[list[str], bool]:
        """:meth:`~diloco_ray.algo.rank_sync.RankSync.adopt` of this rank's freshly built
        rows: seeding's check."""
        return self.sync.adopt(local_rows(self.params), expected)

    @property
    def streamed(self) -> bool:
        """Whether local weights may differ from the global ones at a round boundary."""
        codec = self.sections.sync_codec
        return codec.sync_fragments > 1 or codec.overlap_communication

    # ---- one sync period --------------------------------------------------------------
    def run_period(self, job: SyncPeriod):
        """Run one sync period: take in the server's latest weights, run this period's
        inner steps, and return its RoundStats as soon as its messages (this rank's
        pseudo-gradient for the period's fragment, one packed buffer per server) are on
        their way to the host; :meth:`message` returns them (see
        :mod:`~diloco_ray.runtime.rank_outbox`).

        Args:
            job: what the driver hands every rank of the replica for this period.
        """
        try:
            sent, stats = self._period(job)
        except BaseException as e:
            self.outbox.fail(job.period.attempt, f"{type(e).__name__}: {e}")
            raise
        self.outbox.post(job.period.attempt, sent)
        return stats

    def message(self, attempt: int):
        """The buffers of the period of launch ``attempt``, one per server (bare for one
        server, as ``num_returns=1`` expects), once they are on the host. Called with
        :meth:`run_period`, in the "messages" concurrency group, so it waits for the copy
        while the next period runs."""
        buffers = self._buffers(self.outbox.take(attempt))
        return buffers[0] if len(buffers) == 1 else buffers

    def _buffers(self, sent) -> list:
        """The host buffers of a period's messages (an empty one per server when the period
        was stopped: the return count stays fixed)."""
        if sent is None:
            return [np.zeros(0, dtype=np.uint8)] * self.sections.placement.num_param_servers
        return sent.wait()

    def _period(self, job: SyncPeriod) -> tuple:
        """One sync period: (its messages on their way to the host, or None when it was
        stopped; its RoundStats)."""
        t0 = time.perf_counter()
        self.faults.start_period()
        # Overlap: a fragment's new weights are merged one period late, so the steps run
        # while they travel; a full load (new replica, missed sync) cannot wait.
        late_merge = self.sections.sync_codec.overlap_communication and not job.full
        if job.reset_inner:  # its last pseudo-gradient was rejected as non-finite
            self.state.reset()
        # Reload everything when the servers were restored from a checkpoint, or after a
        # rejection: a fragment's message replaces its fragment's rows only, and the other
        # rows may hold the NaN that was rejected.
        if job.reset or job.reset_inner:
            self.sync.forget_versions()
        self.sync.start_period(job.reset_inner, job.reset, job.restart, dict(job.sent_verdicts))
        received = receive_weights(self.sync, self.params, job, merge=False, full_only=late_merge)
        fetched = transport.prefetch(job.messages) if late_merge else None  # downloads while the steps run
        restarted = job.period.fragment == 0 and self._begin_round(job, resuming=self._resuming(job))
        t1 = time.perf_counter()
        tally = self._run_steps(job, started=t1)
        t2 = time.perf_counter()
        if late_merge and not tally.aborted:
            received += receive_weights(self.sync, self.params, job, merge=True, fetched=fetched)
        t3 = time.perf_counter()
        # A dropped link (fault plan): the message never leaves; the driver gives up on it.
        if not tally.aborted and self.faults.hold_link(lambda: self._abort_attempt == job.period.attempt):
            tally.aborted = True
        # Kept under the launch's attempt until the driver's verdict on it (RankSync.settle).
        sent = None
        if not tally.aborted:
            local = self.faults.scaled(local_rows(self.params), self.sync.anchor)
            sent = self.sync.start_outgoing(job.period.fragment, local, job.link, job.period.attempt)
        unused = self.batches.unused_after(tally.last) if tally.out_of_time else []
        bytes_up = sum(sent.nbytes) if sent is not None else 0
        self.reports.flush()  # the driver reads the period's step events before its stats
        return sent, tally.stats(self.rank, bytes_up, received, restarted, t2 - t1, (t1 - t0) + (t3 - t2), unused)

    def _run_steps(self, job: SyncPeriod, started: float) -> PeriodTally:
        """This period's inner steps: from the first not yet run (after a snapshot's) to the
        period's last, or until an abort, or until the next step would not fit the budget."""
        self.model.train()
        source, steps = self.batches.for_round(job.period.round, job.plan)
        first, last = sync_period(job.period.fragment, len(steps), self.sections.sync_codec.sync_fragments)
        tally = PeriodTally(first, last, torch.zeros((), device=self.device), logged=(first, 0.0), at=first)
        if self._resuming(job):
            tally.resumed, tally.tokens, tally.counted = self.state.restore_snapshot(
                job.snapshots, job.plan, tally.loss_sum
            )
            tally.first = max(first, tally.resumed)
        # Adaptive inner steps: stop when the next would not fit the budget (the smaller of two).
        budget = min((b for b in (self.sections.run.inner_time_s, job.time_budget_s) if b is not None), default=None)
        for t, batches in self.batches.step_batches(source, steps[:last], tally.first):
            tally.at = t
            if self._stop_requested(job.period.attempt):
                tally.aborted = True
                break
            self.faults.before_step(job.period.round, t)
            self.reports.beat(job, t)
            self._train_step(job, t, batches, tally)
            self._after_step(job, t + 1, len(steps), tally)
            if t + 1 < last and not self.batches.another_step_fits(started, t + 1 - tally.first, budget):
                tally.last, tally.out_of_time = t + 1, True  # the rest of the plan goes back to the cursor
                break
        return tally

    def _train_step(self, job: SyncPeriod, step: int, batches: list, tally: PeriodTally) -> None:
        """One inner step over its micro-batches, gradients reduced once at its end."""
        self.state.set_lr(inner_lr_at(self._schedule_start(job) + step, self.sections.inner_optim))
        step_tokens = [loss.loss_tokens(b["labels"]) for b in batches]
        replica_tokens = fsdp.replica_total(sum(step_tokens), self.world_size, self.device)
        items = loss.items_per_rank(replica_tokens, self.world_size)
        sharded = self.world_size > 1 and self.sections.data.grad_accum > 1
        for m, batch in enumerate(batches):
            if sharded:  # reduce-scatter gradients once per step, not per micro-batch
                self.model.set_requires_gradient_sync(m == len(batches) - 1)
            tally.tokens += int(batch["attention_mask"].sum())  # on the host copy: no device sync
            tally.counted += step_tokens[m]
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with self._autocast():
                # Summed over the micro-batch's loss tokens and divided by the step's
                # (see diloco_ray.algo.loss): one big batch's per-token mean, whatever the
                # padding, masking or grad_accum.
                step_loss = self.model(**batch, num_items_in_batch=items).loss
            step_loss = self.faults.poison(step_loss)  # NaN on a step the fault plan poisons
            self.state.backward(step_loss)
            tally.loss_sum += step_loss.detach()
        self.state.step()

    def _after_step(self, job: SyncPeriod, done: int, total: int, tally: PeriodTally) -> None:
        """After ``done`` of the round's ``total`` steps: a step event every ``logging_steps``,
        an in-flight snapshot every ``snapshots.every`` (not at the round's end)."""
        if done % self.sections.observability.logging_steps == 0:
            self.reports.step(job, done, tally, self.state.lr, self._schedule_start(job) + done)
        snapshots = job.snapshots
        if snapshots and done % snapshots.every == 0 and done < total:
            self._save_snapshot(snapshots, job.plan, done, tally.loss_sum, (tally.tokens, tally.counted))

    def _save_snapshot(
        self, snapshots: SnapshotPlan, plan: list, step: int, loss_sum: torch.Tensor, tokens: tuple[int, int]
    ) -> None:
        """:meth:`RankState.save_snapshot` after step ``step`` (a method of the worker's
        own, so a test's worker can act at that moment)."""
        self.state.save_snapshot(snapshots, plan, step, loss_sum, tokens)

    @staticmethod
    def _resuming(job: SyncPeriod) -> bool:
        """Whether the period goes on from an in-flight snapshot."""
        return bool(job.snapshots and job.snapshots.resume_step)

    def _schedule_start(self, job: SyncPeriod) -> int:
        """The inner lr schedule's step at the period's step 0."""
        return job.period.round * self.sections.run.max_steps if job.schedule_step is None else job.schedule_step

    # ---- a round's start, and a re-run of it --------------------------------------------
    @torch.no_grad()
    def _begin_round(self, job: SyncPeriod, resuming: bool) -> bool:
        """At the start of a round: either start a re-run of the round from where its
        first attempt started or note that state for one.

        A re-run (``job.restart``: too few replicas reported, or the server was
        restored) always puts the local weights back to the global ones (local :=
        anchor), so the next pseudo-gradient spans this round's steps only. With
        ``restore_on_retry`` it also restores the inner optimizer, the RNG and the
        error-feedback residual of the round's start, so the re-run trains exactly as
        the first attempt did. Returns whether this was a re-run.
        """
        action = at_period_start(job.period.fragment, job.restart, self.sections.membership.restore_on_retry, resuming)
        if action == "rewind":
            self.state.rewind(job.period.round, keep=True)
        elif action == "note":
            self.state.note_round_start(job.period.round)
        return job.restart

    def rewind_round(self, round_index: int, keep: bool = False) -> None:
        """Back to the start of ``round_index`` (a re-run of it, or the run is stopping
        and checkpoints that round's boundary): local := anchor, and the round-start
        inner state when this rank has begun the round (a rank still at the boundary
        has nothing to undo). ``keep`` keeps that state for another re-run."""
        self.state.rewind(round_index, keep)

    def abort(self, attempt: int) -> None:
        """Ask a running sync period of launch ``attempt`` to stop at its next step boundary.

        Called from another thread (the replica's control concurrency group) when the
        round's deadline has passed, so a straggler is free for the next round at once.
        Keyed by the driver's launch counter, not the round: a re-run of the same round
        is a new attempt and must not stop at its first step.
        """
        self._abort_attempt = attempt

    def _stop_requested(self, attempt: int) -> bool:
        stop = self._abort_attempt == attempt
        run, membership = self.sections.run, self.sections.membership
        if self.world_size > 1 and (membership.round_timeout_s is not None or run.sync_mode == "decoupled"):
            # Every rank must stop at the same step, or FSDP's collectives hang. Without a
            # round deadline only decoupled mode stops a period (a stalled one, or on SIGTERM).
            import torch.distributed as dist

            flag = torch.tensor([float(stop)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _autocast(self):
        mixed_precision = self.sections.model.mixed_precision
        if mixed_precision == "no" or (mixed_precision == "bf16" and self.world_size > 1):
            return contextlib.nullcontext()  # no autocast, or FSDP's policy casts instead
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    # ---- outside the rounds: what the parts answer ---------------------------------------
    def save_inner_state(self, folder: str, slot: int, sent_verdicts: tuple = ()) -> dict:
        """:meth:`RankState.save_inner_state`: this rank's part of a round checkpoint, once
        the sends the driver has verdicts on are settled (``sent_verdicts``: as a
        :class:`~diloco_ray.runtime.messages.SyncPeriod` carries them), so the saved
        residual holds what a dropped message carried."""
        self.sync.settle(dict(sent_verdicts))
        return self.state.save_inner_state(folder, slot)

    def load_inner_state(self, folder: str, slot: int) -> bool:
        """:meth:`RankState.load_inner_state`: this rank's part of a round checkpoint."""
        return self.state.load_inner_state(folder, slot)

    def evaluate(self, weights: list) -> tuple[float, int, int]:
        """:meth:`RankOutput.evaluate` of the global weights (one buffer or ref per server)."""
        return self.output.evaluate(weights)

    def save_final(self, weights: list, path: str, merged_path: str | None = None) -> str:
        """:meth:`RankOutput.save_final`: ``final/`` (and the merged model), rank 0 only."""
        return self.output.save_final(weights, path, merged_path)

    def describe(self) -> dict:
        """:meth:`RankOutput.describe`: what this rank actually built."""
        return self.output.describe()

    # ---- kept between runs (runtime.warm_actors) ----------------------------------------
    def retire(self) -> bool:
        """Let go of everything of this run (model, optimizer, data, process group) so the
        process can be kept for the next run; False, keeping it all, while a period's
        messages are still waiting to be sent."""
        import torch.distributed as dist

        if not self.outbox.empty():
            return False
        if self.state is not None:
            self.state.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.__dict__.clear()
        gc.collect()
        return True

    def reset(self, config: dict, replica_id: int, rank: int, world_size: int, device: str = "cpu") -> None:
        """Become rank ``rank`` of replica ``replica_id`` of a new run, as a new actor would."""
        self.__init__(config, replica_id, rank, world_size, device)
