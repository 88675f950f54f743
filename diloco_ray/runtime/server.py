"""The parameter server: the one source of truth for the global weights.

``num_param_servers`` actors each own a slice of the parameters (row ranges, balanced by
bytes; see :mod:`diloco_ray.algo.partition`). Each holds the fp32 global weights of its slice
and their outer-optimizer state; server 0 also holds the data cursor, and every server
keeps the round index. A sync of one fragment (the whole model unless
``sync_fragments`` > 1) is three calls that Ray chains without the driver waiting:

1. :meth:`ParameterServer.prepare` resolves each replica's pieces straight from the
   object store (they never pass through the driver), decodes them, rejects a replica
   whose pieces are missing, mis-shaped or non-finite, and accumulates the others'
   weighted sum in fp32 as they arrive;
2. :meth:`~ParameterServer.reduce` gets every server's verdicts, so all servers agree on
   one accepted set, and returns the squared norms of its part of the mean;
3. :meth:`~ParameterServer.commit` gets every server's norms, so global-norm clipping
   uses the norm over the whole fragment, and takes the outer step.

A sync commits or aborts as one unit: the step, the version, the fragment, the round and
the data cursor move together in :meth:`~ParameterServer.commit`, or none of them does.

With ``server_gpus`` a server holds its rows, their outer state and its sum on the GPU Ray
gives it: the replicas' buffers are decoded there, summed there, stepped there, and the
weights messages are built there and come down through pinned memory. Without, all of it is
on the host.

The actor is thin: it owns named parts and delegates to them. Its rows and where they
stand are a :class:`~diloco_ray.runtime.server_store.SliceStore` (the data cursor a
:class:`~diloco_ray.runtime.server_store.PlanLedger`); the sum of a sync an
:class:`~diloco_ray.runtime.server_aggregator.Aggregator`; bytes in and out a
:class:`~diloco_ray.runtime.server_codec.SliceCodec`; the messages replicas get a
:class:`~diloco_ray.runtime.server_outbox.WeightsOutbox`; checkpoints a
:class:`~diloco_ray.persist.server_state.ServerCheckpoint`.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Optional

import numpy as np
import torch

from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.optimizers import build_outer_optimizer
from diloco_ray.algo.outer import OuterOptimizer
from diloco_ray.algo.screening import NormScreen
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.config.fields import is_region_member
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import DecoupledSection, OuterOptimSection, SyncCodecSection
from diloco_ray.data import plan as data
from diloco_ray.errors import ConfigError
from diloco_ray.persist.server_state import SavedServer, ServerCheckpoint
from diloco_ray.runtime import host_memory
from diloco_ray.runtime.messages import AppliedRound, Contribution, Prepared, Reduced
from diloco_ray.runtime.server_aggregator import Aggregator, Agreement
from diloco_ray.runtime.server_codec import SliceCodec
from diloco_ray.runtime.server_outbox import WeightsOutbox
from diloco_ray.runtime.server_store import PlanLedger, SliceStore
from diloco_ray.runtime.transport import resolve

__all__ = ["ParameterServer", "resolve"]


def warm_optimizer_imports(outer_optim: OuterOptimSection) -> None:
    """torch imports its optimizer machinery (``torch._dynamo``, slow to import) when the
    first optimizer is built: pay that while the replicas set up, rather than once they are done.
    A bad ``outer_opt`` is the preflight's to report (and :meth:`ParameterServer.initialize`'s,
    which builds the real one): an actor that fails in ``__init__`` would only say that it died."""
    try:
        build_outer_optimizer([torch.zeros(1, requires_grad=True)], outer_optim)
    except ConfigError:
        pass


def server_device(server_gpus: float) -> torch.device:
    """Where a server's tensors live: the GPU Ray gave it (it sees only that one) when it
    takes one, else the host.

    Raises:
        ConfigError: ``server_gpus`` is set but this process sees no CUDA device.
    """
    if not server_gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"server_gpus: {server_gpus:g} but this parameter server sees no CUDA device "
            "(a CPU-only torch, or no GPU on its node); set server_gpus: 0 to keep the servers on the host"
        )
    return torch.device("cuda", 0)


class ParameterServer:
    """Holds one slice of the global model state and applies outer updates to it.

    Args:
        config: the job's TrainerConfig, as a dict. The server keeps the sections its parts
            are built from, not the config.
        index: this server's position among the ``num_param_servers``.
    """

    def __init__(self, config: dict, index: int = 0):
        job = TrainerConfig.from_dict(config)
        sections = job.sections()
        self.index = index
        self.num_servers = sections.placement.num_param_servers
        self.sync_codec: SyncCodecSection = sections.sync_codec
        self.outer_optim: OuterOptimSection = sections.outer_optim
        self.merging: DecoupledSection = sections.decoupled
        threshold = sections.channel.region_screen_norm
        # A region's contributions screened by norm (kept across restores: the parties' history).
        self.screen = NormScreen(threshold) if sections.channel.regions and threshold is not None else None
        # Decoding, summing, clipping and stepping are vectorised torch ops: give them
        # the cores this actor reserves.
        torch.set_num_threads(max(1, int(sections.placement.server_cpus)))
        host_memory.fix_mmap_threshold(host_memory.SERVER_THRESHOLD)
        self.decoupled = sections.run.sync_mode == "decoupled"
        self.device = server_device(sections.placement.server_gpus)
        self.plans = PlanLedger(job.sequences_for, owner=f"server {index}")
        self.checkpoint = ServerCheckpoint(index, sections.checkpointing)
        # The parts that know the model's rows come with its shapes (initialize or load).
        self.layout: Optional[SliceLayout] = None
        self.codec: Optional[SliceCodec] = None
        self.aggregator: Optional[Aggregator] = None
        self.store: Optional[SliceStore] = None
        self.outbox: Optional[WeightsOutbox] = None
        warm_optimizer_imports(self.outer_optim)

    # ---- the parts ---------------------------------------------------------------------
    def _lay_out(self, shapes: dict) -> None:
        """The parts that need only the rows: layout, codec and aggregator."""
        self.layout = SliceLayout(shapes, self.index, self.num_servers, self.sync_codec.sync_fragments)
        self.codec = SliceCodec(self.layout, allocate=self._message_space, device=self.device)
        correct = self.merging.stale_correction == "momentum"
        by_cycle = (
            self.decoupled
            and self.merging.decoupled_momentum == "delayed"
            and self.outer_optim.outer_grad_clip is not None
        )
        self.aggregator = Aggregator(
            self.layout,
            self.codec,
            momentum_of=self._momentum_of if correct else None,
            cycle_of=self._cycle_of if by_cycle else None,
            screen=self.screen,
            from_region=is_region_member,
        )

    def _hold(self, params: dict) -> OuterOptimizer:
        """The parts that hold the rows: the store (around a new outer optimizer over
        ``params``, optimizer pieces by key) and the outbox, on the server's device."""
        optimizer = OuterOptimizer({k: t.to(self.device) for k, t in params.items()}, self.outer_optim)
        self.store = SliceStore(self.layout, optimizer, self.sync_codec.sync_fragments)
        self.outbox = WeightsOutbox(self.store, self.codec, Codec.for_weights(self.sync_codec))
        return optimizer

    def _message_space(self, nbytes: int) -> np.ndarray:
        return self.aggregator.message_space(nbytes)

    def _momentum_of(self, name: str) -> Optional[torch.Tensor]:
        return self.store.momentum_of(name)

    def _cycle_of(self, name: str) -> Optional[torch.Tensor]:
        return self.store.optimizer.cycle_grad(self.store.layout.pieces[(name, 0)])

    # ---- state ---------------------------------------------------------------------------
    def initialize(self, buffer_refs: list, shapes: dict[str, tuple]) -> None:
        """Seed this slice of the global weights from one replica's rank buffers (fp32
        pieces, as :meth:`~diloco_ray.runtime.rank.RankWorker.seed_pieces` packs them)."""
        self._lay_out(shapes)
        params = self.codec.receive(resolve(buffer_refs), self.layout.owned)
        self._hold(self.layout.split(params))
        self.outbox.reset_held()

    def alive(self) -> bool:
        """Answers (the driver's liveness question, :meth:`ServerGroup.ping`)."""
        return True

    # ---- kept between runs (runtime.warm_actors) ----------------------------------------
    def retire(self) -> bool:
        """Let go of this run's state so the process can be kept for the next run."""
        self.__dict__.clear()
        gc.collect()
        return True

    def reset(self, config: dict, index: int = 0) -> None:
        """Become server ``index`` of a new run, as a new actor would."""
        self.__init__(config, index)

    def round_index(self) -> int:
        """The index of the next round to apply."""
        return self.store.round

    def merged_work(self) -> float:
        """Decoupled mode: rounds' worth of tokens merged so far."""
        return self.store.work

    def sync_version(self) -> int:
        """Syncs committed so far: the version of the weights replicas should hold."""
        return self.store.version

    def data_plan(self, replica_ids: list[int]) -> list[list[tuple[int, int]]]:
        """The stream ranges each replica of ``replica_ids`` trains on next, in order (no
        state change); a replica with more ranks gets more (``ranks_per_replica`` list)."""
        return self.plans.plan_round(replica_ids)

    def reserve_plan(self, replica_id: int) -> list[tuple[int, int]]:
        """Decoupled mode: take the next plan for ``replica_id`` off the cursor; it is in
        flight until a merge trains it or :meth:`release_plan` gives it back."""
        return self.plans.reserve(replica_id)

    def release_plan(self, replica_id: int) -> None:
        """Decoupled mode: the replica's plan was never trained (it died): hand it out again."""
        self.plans.release(replica_id)

    def resume_cursor(self) -> data.DataCursor:
        """The cursor a resumed run starts from (in-flight plans given back)."""
        return self.plans.resume_cursor()

    # ---- what goes down to replicas ----------------------------------------------------
    def last_weights(self) -> np.ndarray:
        """The latest sync's weights message again (a resumed run's replicas merge it);
        before any sync, the full weights."""
        return self.outbox.last()

    def global_weights(self) -> np.ndarray:
        """This slice of the exact fp32 global weights, packed (for eval and final/)."""
        return self.outbox.exact()

    def trial_weights(self, contribution: Contribution) -> np.ndarray:
        """This slice of the global weights minus one contribution's pseudo-gradient, packed
        as :meth:`global_weights`: the weights the held-out check scores
        (:mod:`diloco_ray.driver.holdout`). One that does not decode leaves them as they are:
        its sync rejects it anyway. Changes nothing."""
        try:
            delta = self.codec.receive(resolve(contribution.refs), self.layout.owned)
        except ValueError:
            return self.outbox.exact()
        return self.outbox.minus(delta)

    def rows_of(self, name: str) -> tuple[int, np.ndarray] | None:
        """(first row, fp32 rows) of the global weights of ``name`` that this server
        holds, or None: what the final save streams, one tensor at a time. The rows are
        a view of the weights, not a copy: Ray copies them into its object store."""
        return self.store.rows_of(name)

    def full_weights(self) -> np.ndarray:
        """Every parameter of this slice as replicas hold it, packed fp32 (for a replica
        that starts from scratch or missed a sync). Changes nothing."""
        return self.outbox.full()

    def weights_digest(self) -> str:
        """A digest of this slice's fp32 global weights and their version: two copies of the
        server (the home's and a region's, :mod:`diloco_ray.regions.mirror`) hold the same
        bits exactly when their digests agree."""
        return self.store.digest()

    def new_weights_message(self, fragment: int) -> np.ndarray:
        """The message every replica applies after the sync of ``fragment``, packed; built
        once per committed version (see :meth:`WeightsOutbox.after_sync
        <diloco_ray.runtime.server_outbox.WeightsOutbox.after_sync>`)."""
        return self.outbox.after_sync(fragment)

    # ---- one sync: prepare -> reduce -> commit -------------------------------------------
    def prepare(
        self,
        fragment: int,
        contributions: list[Contribution],
        divisor: Optional[float] = None,
        scale: Optional[float] = None,
    ) -> Prepared:
        """Fetch, decode and check every contribution; accumulate the valid ones' weighted
        sum in fp32, one replica at a time (never more than one decoded copy held).
        ``divisor`` (decoupled mode) replaces the accepted weights as the sum's divisor;
        ``scale`` the power of two the weights are divided by (None: their own, see
        :meth:`Aggregator.prepare <diloco_ray.runtime.server_aggregator.Aggregator.prepare>`)."""
        if fragment != self.store.fragment:
            raise RuntimeError(
                f"server {self.index}: asked to sync fragment {fragment}, expected {self.store.fragment}"
            )
        return self.aggregator.prepare(fragment, contributions, divisor, scale)

    def reduce(self, *prepared: Prepared) -> Reduced:
        """Agree on the accepted replicas (rejected anywhere means rejected everywhere),
        form this slice's mean, and return its squared norms."""
        return self.aggregator.reduce(*prepared)

    def commit(
        self, plans: dict, *reduced: Reduced, unused: Optional[dict] = None, shares: Optional[dict] = None
    ) -> AppliedRound:
        """Take the outer step for this sync with the norm over every server's slice, and
        advance the fragment, round and (at a round's end) the data cursor as one unit.

        Args:
            plans: replica id -> stream ranges it was handed this round.
            unused: replica id -> the ranges of its plan it had no time to train on
                (``inner_time_s``); they go back to the cursor with the unapplied plans.
            reduced: every server's :meth:`reduce` result, in server order.
            shares: decoupled mode: replica id -> the share of a round's worth of tokens its
                contribution holds (see :meth:`_merge`).
        """
        before = self.store.version
        applied = self._commit(plans, reduced, unused, shares)
        return dataclasses.replace(applied, versions=(before, self.store.version))

    def _commit(self, plans: dict, reduced: tuple, unused: Optional[dict], shares: Optional[dict]) -> AppliedRound:
        agreed = Agreement.of(reduced)
        mean = self.aggregator.take_mean()  # the sync ends here, whether it commits or aborts
        if self.decoupled:
            return self._merge(agreed, mean, plans, unused or {}, shares or {})
        store = self.store
        lr, round_index, fragment = store.optimizer.lr_at(store.round), store.round, store.fragment
        if not agreed.accepted and self.sync_codec.sync_fragments == 1:
            # Plain DiLoCo: nothing usable arrived, so nothing moves and the round runs again.
            return AppliedRound(
                applied=False,
                round=round_index,
                fragment=0,
                outer_lr=lr,
                pseudo_grad_norm=None,
                rejected=agreed.rejected,
            )
        # The commit, as one unit: the step, then the version, fragment, round and cursor.
        if agreed.accepted:
            store.step(mean, lr, agreed.norm)
        trained = store.advance(agreed.accepted)
        consumed = {} if trained is None else self.plans.commit_round(plans, trained, unused or {})
        return self._applied(agreed, round_index, fragment, lr, consumed, round_done=trained is not None)

    def _merge(self, agreed: Agreement, mean: dict, plans: dict, unused: dict, shares: dict) -> AppliedRound:
        """Decoupled mode's commit: one outer step from the contributions that arrived.

        The accepted ones' plans are trained (less what they had no time for, which goes
        back with the rejected ones' plans). ``work`` grows by their shares of a round;
        the lr follows the schedule by ``work``, and delayed Nesterov applies its
        momentum each time ``work`` passes a whole round (:mod:`diloco_ray.algo.decoupled`).
        """
        store = self.store
        lr, step = store.merge_lr(), store.round
        # The merge, as one unit: its plans settle, and (if any was accepted) the step and the counters.
        consumed = self.plans.settle_merge(plans, agreed.accepted, unused)
        if agreed.accepted:
            share = sum(shares.get(rid, 0.0) for rid in agreed.accepted)
            delayed = self.merging.decoupled_momentum == "delayed"
            store.merge(mean, lr, agreed.norm, share, delayed=delayed, cycle_norm=agreed.cycle_norm)
        return self._applied(agreed, step, 0, lr, consumed, round_done=bool(agreed.accepted), work=store.work)

    @staticmethod
    def _applied(
        agreed: Agreement, round_index: int, fragment: int, lr: float, consumed: dict, round_done: bool, work=0.0
    ) -> AppliedRound:
        """What a commit reports (``work``: decoupled mode's rounds' worth merged so far)."""
        return AppliedRound(
            applied=bool(agreed.accepted),
            round=round_index,
            fragment=fragment,
            outer_lr=lr,
            pseudo_grad_norm=agreed.norm,
            accepted=list(agreed.accepted),
            rejected=agreed.rejected,
            data_ranges=consumed,
            round_done=round_done,
            seconds=time.time() - agreed.started,
            work=work,
        )

    # ---- checkpoints: each server writes and reads its own state ------------------------
    def save(self, where: str) -> dict:
        """Write this server's state into checkpoint ``where`` (see :mod:`diloco_ray.persist.server_state`)."""
        return self.checkpoint.save(where, self.store, self.outbox, self.plans)

    def load(self, where: str) -> None:
        """Restore the state :meth:`save` wrote (a folder or a bucket URI)."""
        self.restore(self.checkpoint.load(where))

    def state(self) -> SavedServer:
        """This server's state as :meth:`save` writes it, in memory; without what replicas
        hold when that is the weights themselves (before the first sync: :meth:`restore`
        then takes the weights for it), which halves what a region joining then downloads."""
        saved = self.checkpoint.gather(self.store, self.outbox, self.plans)
        held, params = self.outbox.held, self.store.params
        if held and held.keys() == params.keys() and all(torch.equal(held[k], params[k]) for k in held):
            saved.outer = {k: v for k, v in saved.outer.items() if k != "held"}
        return saved

    def restore(self, saved: SavedServer) -> None:
        """Take up a state :meth:`state` gave (or a checkpoint held)."""
        self._lay_out(saved.meta["shapes"])
        params = self.layout.split(saved.weights)
        optimizer = self._hold(params)
        optimizer.load_state_dict({"params": params, **saved.outer})
        self.store.restore_position(saved.meta)
        self.outbox.restore(saved.outer, self.store.version)
        self.plans.restore(data.DataCursor.from_dict(saved.meta["cursor"]))
