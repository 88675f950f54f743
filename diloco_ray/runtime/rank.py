"""What one FSDP rank of one replica does: the inner loop.

A :class:`RankWorker` owns a model shard, its inner optimizer (whose state stays with the
replica across rounds) and its view of the data. Each round it loads its rows of the
global weights, runs its inner steps, and returns its rows of the pseudo-gradient
``global - local``, one packed buffer per server (see :mod:`diloco_ray.algo.rank_sync`). With
``sync_fragments`` > 1 one call covers one fragment's sync period. It is a plain class:
the replica wraps it with ``ray.remote`` at creation, and tests can drive it in-process.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch

from diloco_ray.algo import loss
from diloco_ray.algo.inner_schedule import inner_lr_at, sync_period
from diloco_ray.algo.optimizers import build_inner_optimizer
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config import fault_plan as faults
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import samples, tokenization
from diloco_ray.model import loading as modeling
from diloco_ray.observe.events import StepEvent
from diloco_ray.runtime import host_memory, transport
from diloco_ray.runtime.messages import RoundStats, SyncPeriod
from diloco_ray.runtime.rank_batches import RankBatches
from diloco_ray.runtime.rank_output import RankOutput
from diloco_ray.runtime.rank_state import RankState, local_rows_of
from diloco_ray.runtime.round_start import RoundStart

BEAT_S = 2.0  # how often a rank tells the driver it is alive (seconds)


class RankWorker(RankBatches, RankState, RankOutput):
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
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.model = None
        self._abort_attempt = -1  # set from another thread by abort()
        plan = faults.for_rank(faults.parse(self.config.fault_plan), replica_id, rank)
        self.faults = faults.RankFaults(plan, at_or_after=self.config.sync_mode == "decoupled")
        # The optimizer, RNG and residual at the start of the current round (on local
        # disk), so a re-run of the round starts exactly where the first attempt did.
        self._round_start = RoundStart()
        self._last_beat = 0.0

    # ---- set-up -----------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """(node ip, free port) for the process group; asked of rank 0."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(
        self, master_addr: str | None = None, master_port: int | None = None, token_data: list | None = None
    ) -> dict[str, tuple]:
        """Join the replica's process group, build and shard the model, build the inner
        optimizer, take in the data. Returns name -> full shape of the trained parameters.

        Args:
            master_addr, master_port: rank 0's rendezvous address (``world_size > 1``).
            token_data: ``[ref]`` to the job's :class:`~diloco_ray.data.samples.TokenData` (the
                driver's one tokenising task; in a list, so Ray hands over the ref and
                the model is built while the task runs), or None to tokenise here.
        """
        cfg = self.config
        torch.set_num_threads(max(1, int(cfg.cpus_per_rank)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            import torch.distributed as dist

            # FSDP's all-gathered layers come and go every step: keep glibc from
            # holding on to their pages (see diloco_ray.runtime.host_memory).
            host_memory.fix_mmap_threshold(host_memory.FSDP_RANK_THRESHOLD)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank, world_size=self.world_size
            )
        self.tokenizer = tokenization.load_tokenizer(cfg)
        # Sharded while still empty (meta), so each rank allocates and loads its rows only.
        model = modeling.build_model(
            cfg, self.tokenizer, self.device, self._shard if self.world_size > 1 else None, self.world_size, self.rank
        )
        self.shapes = {n: tuple(p.shape) for n, p in modeling.trained_parameters(model)}
        if cfg.torch_compile:
            model = torch.compile(model)  # attribute access still reaches the wrapped module
        self.model = model
        # Named as in the model itself: a compiled wrapper would prefix every name.
        self.params = modeling.trained_parameters(getattr(model, "_orig_mod", model))
        self.optimizer = build_inner_optimizer([p for _, p in self.params], cfg)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.mixed_precision == "fp16" else None
        self.sync = RankSync(
            *(self.shapes, self.world_size, self.rank, cfg.num_param_servers, cfg.sync_fragments),
            *(cfg.pseudo_grad_compression, cfg.error_feedback, cfg.fragment_alpha, cfg.compression_block),
            *(cfg.anchor_on_host, cfg.topk_fraction, cfg.overlap_communication, cfg.error_feedback_decay),
        )
        self.tokens = self._token_data(token_data)
        self._batches: tuple | None = None
        return self.shapes

    def _token_data(self, shared: list | None) -> samples.TokenData:
        cfg = self.config
        if cfg.streaming:  # each rank reads the stream itself, round by round
            reader, evals = samples.open_stream(cfg, self.tokenizer)
            empty = samples.Samples(*(np.zeros((0, cfg.seq_len), dtype=np.int64),) * 2, np.zeros(0, dtype=np.int64))
            return samples.TokenData(empty, evals, reader)
        if shared is None:
            return samples.load_token_data(cfg, self.tokenizer)
        import ray

        # Read-only arrays in the node's object store, shared by its ranks. No deadline
        # here: the driver bounds a replica's whole start (placement_timeout_s).
        return ray.get(shared[0])

    def _shard(self, model: torch.nn.Module) -> None:
        """FSDP2 over the replica's ranks: each decoder layer one unit, the rest the root."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 compute with fp32 gradient reduction; fp16 goes through autocast + scaler.
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.config.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        for layer in modeling.decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    def seed_pieces(self):
        """This rank's rows of its freshly built weights, one fp32 buffer per server (a
        bare buffer for one server, as ``num_returns=1`` expects)."""
        buffers = self.sync.seed(self._local_rows())
        return buffers[0] if len(buffers) == 1 else buffers

    def adopt_initial(self, expected: list | None) -> tuple[list[str], bool]:
        """:meth:`~diloco_ray.algo.rank_sync.RankSync.adopt` of this rank's freshly built rows."""
        return self.sync.adopt(self._local_rows(), expected)

    def _local_rows(self) -> dict[str, torch.Tensor]:
        return {n: local_rows_of(p) for n, p in self.params}

    @property
    def streamed(self) -> bool:
        """Whether local weights may differ from the global ones at a round boundary."""
        return self.config.sync_fragments > 1 or self.config.overlap_communication

    # ---- one sync period --------------------------------------------------------------
    def run_period(self, job: SyncPeriod):
        """Run one sync period: take in the server's latest weights, run this period's
        inner steps, and return ``(*buffers, RoundStats)``: this rank's pseudo-gradient
        for the period's fragment, one packed buffer per server.

        Args:
            job: what the driver hands every rank of the replica for this period.
        """
        cfg = self.config
        round_index, fragment, plan = job.round, job.fragment, job.plan
        snapshots, attempt = job.snapshots, job.attempt
        t0 = time.perf_counter()
        self.faults.start_period()
        # Overlap: a fragment's new weights are merged one period late, so the steps run
        # while they travel; a full load (new replica, missed sync) cannot wait.
        late_merge = cfg.overlap_communication and not job.full
        if job.reset:  # the servers were restored from a checkpoint: reload everything
            self.sync.versions = [-1] * len(self.sync.versions)
        received = self._receive(job, merge=False, full_only=late_merge)
        fetched = transport.prefetch(job.messages) if late_merge else None  # downloads while the steps run
        restarted = False
        if fragment == 0:
            restarted = self._begin_round(job, resuming=bool(snapshots and snapshots.resume_step))
        t1 = time.perf_counter()
        self.model.train()
        source, steps = self._round_batches(round_index, plan)
        first, last = sync_period(fragment, len(steps), cfg.sync_fragments)
        sharded = self.world_size > 1 and cfg.grad_accum > 1
        loss_sum = torch.zeros((), device=self.device)
        tokens, counted, aborted, resumed, t = 0, 0, False, 0, first
        logged = (first, 0.0)  # (step, loss_sum) at the last step event
        if snapshots and snapshots.resume_step:
            resumed, tokens, counted = self._restore_snapshot(snapshots, plan, loss_sum)
            first = max(first, resumed)
        # Adaptive inner steps: stop when the next would not fit the budget (the smaller of two).
        budget = min((b for b in (cfg.inner_time_s, job.time_budget_s) if b is not None), default=None)
        out_of_time = False
        schedule_start = self._schedule_start(job)
        for t, batches in self._step_batches(source, steps[:last], first):
            if self._stop_requested(attempt):
                aborted = True
                break
            poison = self.faults.at_step(round_index, t)
            self._beat(job, t)
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr_at(schedule_start + t, cfg)
            step_tokens = [loss.loss_tokens(b["labels"]) for b in batches]
            items = loss.items_per_rank(self._replica_total(sum(step_tokens)), self.world_size)
            for m, batch in enumerate(batches):
                final = m == len(batches) - 1
                if sharded:  # reduce-scatter gradients once per step, not per micro-batch
                    self.model.set_requires_gradient_sync(final)
                tokens += int(batch["attention_mask"].sum())  # on the host copy: no device sync
                counted += step_tokens[m]
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                with self._autocast():
                    # Summed over the micro-batch's loss tokens and divided by the step's
                    # (see diloco_ray.algo.loss): one big batch's per-token mean, whatever the
                    # padding, masking or grad_accum.
                    step_loss = self.model(**batch, num_items_in_batch=items).loss
                if poison:
                    step_loss = step_loss * float("nan")  # the fault plan's poisoned step
                (self.scaler.scale(step_loss) if self.scaler else step_loss).backward()
                loss_sum += step_loss.detach()
            self._optimizer_step()
            if (t + 1) % cfg.logging_steps == 0:
                logged = self._report_step(job, t + 1, loss_sum, logged, tokens)
            if snapshots and (t + 1) % snapshots.every == 0 and t + 1 < len(steps):
                self._save_snapshot(snapshots, plan, t + 1, loss_sum, (tokens, counted))
            if budget is not None and t + 1 < last and not self._another_step_fits(t1, t + 1 - first, budget):
                last, out_of_time = t + 1, True  # the rest of the plan goes back to the cursor
                break
        t2 = time.perf_counter()
        if late_merge and not aborted:
            received += self._receive(job, merge=True, fetched=fetched)
        t3 = time.perf_counter()
        if self.faults.drop_link and not aborted:
            self._wait_for_abort(attempt)  # the message never leaves; the driver gives up on it
            aborted = True
        buffers = [] if aborted else self._outgoing(fragment, job.link)
        stats = RoundStats(
            rank=self.rank,
            inner_steps=(t - first) if aborted else last - first,
            tokens=tokens,
            loss_sum=float(loss_sum),
            compute_seconds=t2 - t1,
            load_seconds=(t1 - t0) + (t3 - t2),
            bytes_up=sum(b.nbytes for b in buffers),
            bytes_down=received,
            aborted=aborted,
            resumed_step=resumed,
            restarted=restarted,
            loss_tokens=counted,
            unused=self._unused_after(last) if out_of_time else [],
        )
        if aborted:  # nothing to send: an empty message per server keeps the return count fixed
            buffers = [np.zeros(0, dtype=np.uint8)] * cfg.num_param_servers
        return (*buffers, stats)

    def _report_step(self, job: SyncPeriod, step: int, loss_sum: torch.Tensor, logged: tuple, tokens: int) -> tuple:
        """Rank 0 sends a step event (mean loss since the last one, lr, tokens) to the
        driver's board, without waiting. Reading ``loss_sum`` syncs the device, which is
        why it happens every ``logging_steps`` and not every step."""
        board = job.board
        if board is None or self.rank != 0:
            return logged
        total = float(loss_sum)
        since = max(1, step - logged[0])
        board.report.remote(
            StepEvent(
                round=job.round,
                replica=self.replica_id,
                step=step,
                global_step=self._schedule_start(job) + step,
                loss=(total - logged[1]) / since,
                lr=self.optimizer.param_groups[0]["lr"],
                # rank 0's count for the whole replica: its ranks see equal batches
                tokens=tokens * self.world_size,
                time=time.time(),
            )
        )
        return step, total

    def _schedule_start(self, job: SyncPeriod) -> int:
        """The inner lr schedule's step at the period's step 0."""
        return job.round * self.config.max_steps if job.schedule_step is None else job.schedule_step

    def _outgoing(self, fragment: int, link) -> list[np.ndarray]:
        """This rank's packed pseudo-gradient of ``fragment``, one buffer per server."""
        return self.sync.outgoing(fragment, self._local_rows(), link)

    def _receive(self, job: SyncPeriod, merge: bool, full_only: bool = False, fetched=None) -> int:
        """Bring this rank up to the weights of the job's sync version: skip messages it
        already holds, load everything after a gap, else apply them (blending them in
        with ``merge``; ``fetched``: the messages' prefetch, if one was started). The transport
        waits out a simulated downlink. Returns the bytes received."""
        version = job.version
        decision = self.sync.decide_load(version, fragment_message=not job.full)
        received = 0
        if decision == "full":
            full = transport.receive([s.full_weights.remote() for s in job.servers], job.link)
            received += self._apply(full, merge=False)
            decision = self.sync.decide_load(version, fragment_message=not job.full)
        if decision == "apply" and not full_only:
            received += self._apply(transport.receive(fetched or job.messages, job.link), merge=merge)
        return received

    @torch.no_grad()
    def _apply(self, buffers: list, merge: bool) -> int:
        self.sync.apply(buffers, self._local_rows(), merge=merge)
        return sum(len(b) for b in buffers)

    def _replica_total(self, count: int) -> int:
        """``count`` summed over the replica's ranks (one small all-reduce per step)."""
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        total = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return int(total.item())

    # ---- a round's start, and a re-run of it --------------------------------------------
    @torch.no_grad()
    def _begin_round(self, job: SyncPeriod, resuming: bool) -> bool:
        """At the start of a round: reset a poisoned replica, and either start a re-run
        of the round from where its first attempt started or note that state for one.

        A re-run (``job.restart``: too few replicas reported, or the server was
        restored) always puts the local weights back to the global ones (local :=
        anchor), so the next pseudo-gradient spans this round's steps only. With
        ``restore_on_retry`` it also restores the inner optimizer, the RNG and the
        error-feedback residual of the round's start, so the re-run trains exactly as
        the first attempt did. Returns whether this was a re-run.
        """
        round_index, restart = job.round, job.restart
        if job.reset_inner:
            self._reset_inner_state()
        if restart:
            self.rewind_round(round_index, keep=True)
        elif self.config.restore_on_retry and not resuming:
            self._round_start.save(round_index, {**self._optimizer_and_rng(), "residual": self.sync.residual})
        return restart

    @torch.no_grad()
    def rewind_round(self, round_index: int, keep: bool = False) -> None:
        """Back to the start of ``round_index`` (a re-run of it, or the run is stopping
        and checkpoints that round's boundary): local := anchor, and the round-start
        inner state when this rank has begun the round (a rank still at the boundary
        has nothing to undo). ``keep`` keeps that state for another re-run."""
        for name, rows in self._local_rows().items():
            if name in self.sync.anchor:
                rows.copy_(self.sync.anchor[name].to(rows.dtype))
        saved = self._round_start.load(round_index)  # a fresh copy each time: load_state_dict may alias it
        if saved is not None:
            self._restore_optimizer_and_rng(saved)
            self.sync.residual = {n: t.to("cpu") for n, t in saved["residual"].items()}
            if not keep:
                self._round_start.clear()

    def _reset_inner_state(self) -> None:
        """A fresh inner optimizer (and scaler) and no residual: what a replica whose
        pseudo-gradient was rejected as non-finite gets, so its poisoned state (NaN in
        AdamW's moments) does not make it diverge again next round."""
        self.optimizer = build_inner_optimizer([p for _, p in self.params], self.config)
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.sync.residual = {}
        self._round_start.clear()

    def _beat(self, job: SyncPeriod, step: int) -> None:
        """Tell the driver this rank is alive and at ``step`` (at most every BEAT_S), so a
        frozen rank is told apart from a slow one even without a round deadline."""
        board, now = job.board, time.monotonic()
        if board is not None and now - self._last_beat >= BEAT_S:
            self._last_beat = now
            board.beat.remote(self.replica_id, self.rank, job.attempt, step)

    def abort(self, attempt: int) -> None:
        """Ask a running sync period of launch ``attempt`` to stop at its next step boundary.

        Called from another thread (the replica's control concurrency group) when the
        round's deadline has passed, so a straggler is free for the next round at once.
        Keyed by the driver's launch counter, not the round: a re-run of the same round
        is a new attempt and must not stop at its first step.
        """
        self._abort_attempt = attempt

    def _wait_for_abort(self, attempt: int) -> None:
        while self._abort_attempt != attempt:
            time.sleep(0.05)

    def _stop_requested(self, attempt: int) -> bool:
        stop = self._abort_attempt == attempt
        cfg = self.config
        if self.world_size > 1 and (cfg.round_timeout_s is not None or cfg.sync_mode == "decoupled"):
            # Every rank must stop at the same step, or FSDP's collectives hang. Without a
            # round deadline only decoupled mode stops a period (a stalled one, or on SIGTERM).
            import torch.distributed as dist

            flag = torch.tensor([float(stop)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _optimizer_step(self) -> None:
        cfg = self.config
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params], cfg.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _autocast(self):
        cfg = self.config
        if cfg.mixed_precision == "no" or (cfg.mixed_precision == "bf16" and self.world_size > 1):
            return contextlib.nullcontext()  # no autocast, or FSDP's policy casts instead
        dtype = torch.bfloat16 if self.config.mixed_precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def shutdown(self) -> None:
        import torch.distributed as dist

        self._round_start.close()
        if dist.is_initialized():
            dist.destroy_process_group()
