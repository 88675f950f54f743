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
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from diloco_ray.algo import compression, links, loss, partition
from diloco_ray.algo.optimizers import build_inner_optimizer
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config import fault_plan as faults
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data
from diloco_ray.data import samples, tokenization
from diloco_ray.model import loading as modeling
from diloco_ray.observe.events import StepEvent
from diloco_ray.persist import snapshot
from diloco_ray.runtime import host_memory
from diloco_ray.runtime.messages import SnapshotPlan, SyncPeriod
from diloco_ray.runtime.round_start import RoundStart
from diloco_ray.runtime.server import resolve

BEAT_S = 2.0  # how often a rank tells the driver it is alive (seconds)


def inner_lr_at(step: int, config: TrainerConfig) -> float:
    """Inner learning rate at global inner step ``step`` (0-based, counted over the run).

    Linear warmup over ``warmup_steps``, then ``lr_schedule`` decays from ``lr`` towards
    ``lr * min_lr_ratio``, reached at step ``max_steps * diloco_loops`` (one past the last
    step, as in transformers' schedules).
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    total = max(1, config.max_steps * config.diloco_loops - config.warmup_steps)
    frac = min(1.0, (step - config.warmup_steps) / total)
    floor = config.lr * config.min_lr_ratio
    if config.lr_schedule == "cosine":
        return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return floor + (config.lr - floor) * (1.0 - frac)


def sync_period(fragment: int, steps: int, fragments: int) -> tuple[int, int]:
    """The inner steps ``[first, last)`` of a round that end with ``fragment``'s sync:
    syncs fall at ``floor((k + 1) * steps / fragments)``, so periods differ by at most one."""
    return fragment * steps // fragments, (fragment + 1) * steps // fragments


@dataclass
class RoundStats:
    """What a rank reports about its round (small; travels through the driver)."""

    rank: int
    inner_steps: int
    tokens: int  # tokens trained on (attention mask), for throughput
    loss_sum: float  # sum over steps of each step's per-token mean loss (this rank's share)
    compute_seconds: float  # the inner steps alone
    load_seconds: float  # waiting for and applying the server's weights
    bytes_up: int  # pseudo-gradient bytes this rank sent (payload + scales + headers)
    bytes_down: int = 0  # weight bytes this rank received
    aborted: bool = False  # stopped early by abort(): nothing to apply
    restarted: bool = False  # a re-run round: started again from the global weights (and the round-start state)
    loss_tokens: int = 0  # tokens that carried loss: the replica's weight in the outer mean
    resumed_step: int = 0  # inner steps restored from an in-flight snapshot


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
        self.replica_id, self.rank, self.world_size = replica_id, rank, world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.model = None
        self._abort_attempt = -1  # set from another thread by abort()
        self.faults = faults.RankFaults(faults.for_rank(faults.parse(self.config.fault_plan), replica_id, rank))
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
            self.shapes,
            self.world_size,
            self.rank,
            cfg.num_param_servers,
            cfg.sync_fragments,
            cfg.pseudo_grad_compression,
            cfg.error_feedback,
            cfg.fragment_alpha,
            cfg.compression_block,
            cfg.anchor_on_host,
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

    def _local_rows(self) -> dict[str, torch.Tensor]:
        return {n: _local(p) for n, p in self.params}

    @property
    def streamed(self) -> bool:
        """Whether local weights may differ from the global ones at a round boundary."""
        return self.config.sync_fragments > 1 or self.config.overlap_communication

    # ---- one sync period --------------------------------------------------------------
    def run_round(self, job: SyncPeriod):
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
        for t, batches in self._step_batches(source, steps[:last], first):
            if self._stop_requested(attempt):
                aborted = True
                break
            poison = self.faults.at_step(round_index, t)
            self._beat(job, t)
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr_at(round_index * cfg.max_steps + t, cfg)
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
        t2 = time.perf_counter()
        if late_merge and not aborted:
            received += self._receive(job, merge=True)
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
                global_step=job.round * self.config.max_steps + step,
                loss=(total - logged[1]) / since,
                lr=self.optimizer.param_groups[0]["lr"],
                # rank 0's count for the whole replica: its ranks see equal batches
                tokens=tokens * self.world_size,
                time=time.time(),
            )
        )
        return step, total

    def _outgoing(self, fragment: int, link) -> list[np.ndarray]:
        """This rank's packed pseudo-gradient of ``fragment``, one buffer per server."""
        return self.sync.outgoing(fragment, self._local_rows(), link)

    def _receive(self, job: SyncPeriod, merge: bool, full_only: bool = False) -> int:
        """Bring this rank up to the weights of the job's sync version: skip messages it
        already holds, load everything after a gap, else apply them (blending them in
        with ``merge``). Waits out the simulated downlink. Returns the bytes received."""
        version = job.version
        decision = self.sync.plan(version, fragment_message=not job.full)
        received = 0
        if decision == "full":
            received += self._apply(resolve([s.full_weights.remote() for s in job.servers]), job, merge=False)
            decision = self.sync.plan(version, fragment_message=not job.full)
        if decision == "apply" and not full_only:
            received += self._apply(resolve(job.messages), job, merge=merge)
        return received

    @torch.no_grad()
    def _apply(self, buffers: list, job: SyncPeriod, merge: bool) -> int:
        nbytes = sum(len(b) for b in buffers)
        link = job.link
        if link is not None:
            sent = max(compression.packed_meta(b).get("sent_at", 0.0) for b in buffers)
            links.wait_for([sent + link.seconds(nbytes)])
        self.sync.apply(buffers, self._local_rows(), merge=merge)
        return nbytes

    def _round_batches(self, round_index: int, plan: list):
        """(samples, ``[step][micro] -> indices``) for this rank's round, computed once per
        round (a round's sync periods share it)."""
        key = (round_index, tuple(map(tuple, plan)))
        if self._batches is None or self._batches[0] != key:
            self._batches = (key, *self._plan_batches(plan))
        return self._batches[1], self._batches[2]

    def _plan_batches(self, plan: list):
        """(samples to cut from, ``[step][micro] -> indices``) for the ranges ``plan``; a
        streamed data set is read at the plan's positions first."""
        cfg = self.config
        stream = self.tokens.stream
        if stream is None:
            train = self.tokens.train
            return train, data.rank_batches(plan, cfg, self.rank, len(train), train.lengths)
        train = stream.read(data.plan_positions(plan))
        order = np.arange(len(train))
        if cfg.group_by_length:
            order = data.group_by_length(order, train.lengths, data.GROUP_WINDOW_BATCHES * cfg.batch_size)
        return train, data.split_for_rank(order, cfg, self.rank)

    def _micro_batches(self, source, steps: list, first: int):
        """``(step, micro, batch)`` in order from step ``first`` on, cut from ``source``;
        by DataLoader workers when ``num_workers`` > 0, so batching overlaps the steps."""
        items = [(t, m, idx) for t in range(first, len(steps)) for m, idx in enumerate(steps[t])]
        dynamic = self.config.dynamic_batch
        if self.config.num_workers == 0:
            for t, m, idx in items:
                yield t, m, source.batch(idx, dynamic)
            return
        loader = torch.utils.data.DataLoader(
            _BatchList(source, [idx for *_, idx in items], dynamic),
            batch_size=None,
            shuffle=False,
            num_workers=self.config.num_workers,
        )
        for (t, m, _), batch in zip(items, loader):
            yield t, m, batch

    def _step_batches(self, source, steps: list, first: int):
        """``(step, [micro-batches])`` from step ``first`` on: a step's micro-batches
        together, so its loss can be normalised by all of their loss tokens."""
        pending: list = []
        for t, m, batch in self._micro_batches(source, steps, first):
            pending.append(batch)
            if m == len(steps[t]) - 1:
                yield t, pending
                pending = []

    def _replica_total(self, count: int) -> int:
        """``count`` summed over the replica's ranks (one small all-reduce per step)."""
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        total = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return int(total.item())

    def _save_snapshot(
        self, snapshots: SnapshotPlan, plan: list, step: int, loss_sum: torch.Tensor, tokens: tuple[int, int]
    ) -> None:
        """``tokens``: (tokens, loss tokens) trained on so far this round."""
        state = {
            **self._optimizer_and_rng(),
            "rows": {n: _local(p).detach().cpu() for n, p in self.params},
            "plan": [list(r) for r in plan],
            "loss_sum": float(loss_sum),
            "tokens": tokens[0],
            "loss_tokens": tokens[1],
        }
        snapshot.save(snapshots.folder, snapshots.slot, self.rank, step, state)

    @torch.no_grad()
    def _restore_snapshot(self, snapshots: SnapshotPlan, plan: list, loss_sum: torch.Tensor) -> tuple[int, int, int]:
        """Continue a round from an in-flight snapshot: (first step to run, tokens and
        loss tokens so far). A snapshot taken with another data plan does not apply: zeros."""
        step = snapshots.resume_step
        state = snapshot.load(snapshots.folder, snapshots.slot, self.rank, step)
        if state["plan"] != [list(r) for r in plan]:
            return 0, 0, 0
        for name, p in self.params:
            _local(p).copy_(state["rows"][name])
        self._restore_optimizer_and_rng(state)
        loss_sum += state["loss_sum"]
        return step, state["tokens"], state.get("loss_tokens", 0)

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
        if self.world_size > 1 and self.config.round_timeout_s is not None:
            # Every rank must stop at the same step, or FSDP's collectives hang.
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

    # ---- eval and output --------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, weights: list) -> tuple[float, int]:
        """Summed token loss and loss-token count over this rank's share of the eval batches, for
        the global weights ``weights`` (one packed buffer or ref per server). The rank's
        own training state is left as it was.

        Every rank runs the same number of forwards (FSDP's collectives need it); a rank
        with no batch left scores a repeat with weight 0.
        """
        kept = {n: t.detach().to("cpu", copy=True) for n, t in self._local_rows().items()} if self.streamed else None
        self._copy_in(resolve(weights))
        try:
            return self._evaluate()
        finally:
            if kept is not None:
                for n, t in self._local_rows().items():
                    t.copy_(kept[n])

    @torch.no_grad()
    def _copy_in(self, buffers: list) -> None:
        """Overwrite this rank's rows with the weights in ``buffers`` (anchor untouched)."""
        local = self._local_rows()
        for buf in buffers:
            pieces, _ = compression.unpack_pieces(buf, self.sync.names)
            for name, (start, piece) in pieces.items():
                span = (start, start + partition.num_rows(piece.shape))
                held = self.sync.held[name]
                mine = partition.intersect({name: span}, {name: held}).get(name)
                if mine is not None:
                    partition.take(local[name], mine, held[0]).copy_(partition.take(piece, mine, start))

    def _evaluate(self) -> tuple[float, int]:
        """(summed token loss, loss tokens) over this rank's eval batches: the driver
        divides the sums over all ranks, a per-token mean as in training."""
        cfg = self.config
        self.model.eval()
        evals = self.tokens.eval
        mine = data.eval_batches_for_rank(len(evals), cfg.eval_batches, cfg.batch_size, self.rank, self.world_size)
        per_rank = -(-cfg.eval_batches // self.world_size)
        total, count = 0.0, 0
        for i in range(per_rank):
            real = i < len(mine)
            idx = mine[i] if real else np.arange(min(cfg.batch_size, max(1, len(evals))))
            if len(evals) == 0:
                break
            batch = {k: v.to(self.device) for k, v in evals.batch(idx, cfg.dynamic_batch).items()}
            with self._autocast():
                mean = self.model(**batch).loss
            if real:
                n = loss.loss_tokens(batch["labels"])
                total, count = total + float(mean) * n, count + n
        return total, count

    def save_final(self, weights: list, path: str, merged_path: str | None = None) -> str:
        """Write the global weights (one packed buffer or ref per server) as a Hugging
        Face model folder (rank 0 only): the model, or with PEFT its adapter, plus the
        merged model at ``merged_path``."""
        if self.rank == 0:
            from diloco_ray.runtime.server_group import assemble_weights

            full = {n: torch.from_numpy(w) for n, w in assemble_weights(resolve(weights), self.shapes).items()}
            # An unsharded copy of the starting model supplies what DiLoCo does not train
            # (frozen weights, buffers); the global weights overwrite the rest.
            from diloco_ray.persist import staging

            model = modeling.build_model(self.config, self.tokenizer)
            modeling.save_hf(model, self.tokenizer, full, staging.scratch(path))
            staging.publish_tree(path)
            if merged_path is not None:
                modeling.save_merged(model, self.tokenizer, staging.scratch(merged_path))
                staging.publish_tree(merged_path)
        return path

    def describe(self) -> dict:
        """What this rank actually built (for tests and debugging)."""
        module = getattr(self.model, "_orig_mod", self.model)
        return {
            "compiled": module is not self.model,
            "attn_implementation": getattr(module.config, "_attn_implementation", None),
            "gradient_checkpointing": bool(
                getattr(module, "is_activation_checkpointing", getattr(module, "is_gradient_checkpointing", False))
            ),
            "trained": {n: tuple(p.shape) for n, p in self.params},
            "frozen": sum(p.numel() for p in module.parameters() if not p.requires_grad),
            "train_samples": len(self.tokens.train),
        }

    # ---- inner state: what a checkpoint keeps of a replica -------------------------------
    def save_inner_state(self, folder: str, slot: int) -> dict:
        """Write this rank's inner optimizer state and RNG state to ``folder`` as
        ``replicas/slot-{slot}-rank-{rank}`` (safetensors + JSON, never pickle).
        ``folder`` may be a bucket URI; returns :func:`staging.publish`'s hashes."""
        from diloco_ray.persist import checkpoint, staging

        state = {
            **self._optimizer_and_rng(),
            "world_size": self.world_size,
            "sync": self.sync.state_dict(with_anchor=self.streamed),
        }
        if self.streamed:  # local weights differ from the global ones between rounds
            state["rows"] = {n: t.detach().cpu().clone() for n, t in self._local_rows().items()}
        sub = os.path.join(staging.scratch(folder), "replicas")
        os.makedirs(sub, exist_ok=True)
        written = checkpoint.save_state(sub, f"slot-{slot}-rank-{self.rank}", state)
        return staging.publish(folder, [f"replicas/{name}" for name in written])

    def load_inner_state(self, folder: str, slot: int) -> bool:
        """Restore what :meth:`save_inner_state` wrote; False (and a fresh optimizer) when
        the checkpoint has no state for this slot and rank."""
        from diloco_ray.persist import checkpoint, staging

        name = f"slot-{slot}-rank-{self.rank}"
        folder = staging.localize(folder, [f"replicas/{name}.json", f"replicas/{name}.safetensors"])
        sub = os.path.join(folder, "replicas")
        if not os.path.exists(os.path.join(sub, f"{name}.json")):
            return False
        state = checkpoint.load_state(sub, name)
        if state["world_size"] != self.world_size:
            return False
        self._restore_optimizer_and_rng(state)
        self.sync.load_state_dict(state.get("sync") or {})
        if "rows" in state and "anchor" in (state.get("sync") or {}):
            with torch.no_grad():
                for n, t in self._local_rows().items():
                    t.copy_(state["rows"][n])
        return True

    def _optimizer_and_rng(self) -> dict:
        """The inner optimizer state (local shards) and RNG state: what must carry over
        for training to go on exactly as if never interrupted."""
        return {
            "optimizer": _to_local_tree(self.optimizer.state_dict()),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
        }

    def _restore_optimizer_and_rng(self, state: dict) -> None:
        self.optimizer.load_state_dict(_like_params(state["optimizer"], [p for _, p in self.params]))
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"])

    def shutdown(self) -> None:
        import torch.distributed as dist

        self._round_start.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _local(p: torch.Tensor) -> torch.Tensor:
    """The rows of ``p`` this process holds (the local shard of an FSDP DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p.data


class _BatchList(torch.utils.data.Dataset):
    """Micro-batches by position, for DataLoader workers."""

    def __init__(self, samples, indices: list, dynamic: bool):
        self.samples, self.indices, self.dynamic = samples, indices, dynamic

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.samples.batch(self.indices[i], self.dynamic)


def _to_local_tree(obj):
    """The same structure with every DTensor replaced by its local shard."""
    if hasattr(obj, "to_local"):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local_tree(v) for v in obj)
    return obj


def _like_params(optim_state: dict, params: list) -> dict:
    """Wrap saved local optimizer tensors back into DTensors shaped like their params,
    so a sharded optimizer can load them (plain tensors for unsharded params)."""
    from torch.distributed.tensor import DTensor

    state = {}
    for idx, entries in optim_state["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.to_local().shape)
            else v
            for k, v in entries.items()
        }
    return {**optim_state, "state": state}
