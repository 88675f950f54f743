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

A round's step and the cursor advance together, or not at all. The math lives in
:mod:`diloco_ray.algo.aggregate` (the sum, mean and norm, shared with
:meth:`OuterOptimizer.step <diloco_ray.algo.outer.OuterOptimizer.step>`),
:mod:`diloco_ray.algo.outer`, :mod:`diloco_ray.algo.compression` and :mod:`diloco_ray.algo.partition`;
the checkpoint files in :mod:`diloco_ray.persist.server_state`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from diloco_ray.algo import compression, decoupled, partition
from diloco_ray.algo.aggregate import (
    NonFiniteError,
    mean_in_place,
    norm_of_parts,
    squares_by_part,
)
from diloco_ray.algo.optimizers import build_outer_optimizer
from diloco_ray.algo.outer import OuterOptimizer, Rejected, Rejection, clip_coefficient, sync_advances
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data
from diloco_ray.errors import ConfigError
from diloco_ray.runtime import host_memory, transport
from diloco_ray.runtime.messages import AppliedRound, Contribution, Prepared, Reduced
from diloco_ray.runtime.server_slice import ServerSlice
from diloco_ray.runtime.transport import resolve


@dataclass
class PendingSync:
    """What one sync keeps between :meth:`ParameterServer.prepare`, ``reduce`` and
    ``commit``. The sum becomes the mean in place and the step consumes it, so each stage
    hands the big tensors on and leaves None behind: one reference to them at a time.

    Args:
        fragment: the fragment being synced.
        contributions: the replicas' contributions to this server.
        valid: ids of the replicas whose pieces this server summed.
        started: wall-clock time the first piece arrived.
        acc: name -> weighted sum of the valid pieces, until ``reduce``.
        mean: name -> the accepted mean, from ``reduce`` until ``commit``.
        divisor: decoupled mode: what the weighted sum is divided by (one round's worth
            of tokens) instead of the accepted weights.
    """

    fragment: int
    contributions: list
    valid: list[int]
    started: float
    acc: Optional[dict] = None
    mean: Optional[dict] = None
    divisor: Optional[float] = None


class ParameterServer(ServerSlice):
    """Holds one slice of the global model state and applies outer updates to it.

    Args:
        config: the job's TrainerConfig, as a dict.
        index: this server's position among the ``num_param_servers``.
    """

    def __init__(self, config: dict, index: int = 0):
        self.config = TrainerConfig.from_dict(config)
        self.index, self.count = index, self.config.num_param_servers
        # Decoding, summing, clipping and stepping are vectorised torch ops: give them
        # the cores this actor reserves.
        torch.set_num_threads(max(1, int(self.config.server_cpus)))
        host_memory.fix_mmap_threshold(host_memory.SERVER_THRESHOLD)
        self.optimizer: OuterOptimizer | None = None
        self.shapes: dict[str, tuple] = {}
        self.cursor = data.DataCursor()
        self.fragment = 0  # next fragment to sync within the round
        self.version = 0  # syncs committed: the version replicas hold
        self.held: dict[str, torch.Tensor] = {}  # what replicas hold, with weights_compression
        self.round_accepted: set[int] | None = None
        self._pending: PendingSync | None = None
        self._sum_space = torch.empty(0)  # where a sync's sum is built (see _zeroed_sum)
        self.last_message = np.zeros(0, dtype=np.uint8)  # the latest sync's weights message
        self.message_version = 0  # the version last_message carries
        self.decoupled = self.config.sync_mode == "decoupled"
        self.in_flight: dict[int, list] = {}  # decoupled: replica id -> its reserved plan
        self.work = 0.0  # decoupled: rounds' worth of tokens merged (drives the lr schedule and the momentum cycle)
        self._import_optimizer_machinery()

    def _import_optimizer_machinery(self) -> None:
        """torch imports its optimizer machinery (``torch._dynamo``, ~1 s) when the first
        optimizer is built: pay that here, while the replicas set up, rather than in
        :meth:`initialize` once they are done. A bad ``outer_opt`` is the preflight's to
        report (and :meth:`initialize`'s, which builds the real one): an actor that
        fails in ``__init__`` would only say that it died."""
        try:
            build_outer_optimizer([torch.zeros(1, requires_grad=True)], self.config.sections().outer_optim)
        except ConfigError:
            pass

    # ---- state ---------------------------------------------------------------------------
    def initialize(self, buffer_refs: list, shapes: dict[str, tuple]) -> None:
        """Seed this slice of the global weights from one replica's rank buffers (fp32
        pieces, as :meth:`~diloco_ray.runtime.rank.RankWorker.seed_pieces` packs them)."""
        self.layout(shapes)
        params = self._receive(resolve(buffer_refs), self.owned)
        self.optimizer = OuterOptimizer(self.split(params), self.config.sections().outer_optim)
        self.reset_held()

    def reset_held(self) -> None:
        if self.config.weights_compression != "none":
            self.held = {n: t.clone() for n, t in self.optimizer.params.items()}

    def round_index(self) -> int:
        """The index of the next round to apply."""
        return self.optimizer.round

    def merged_work(self) -> float:
        """Decoupled mode: rounds' worth of tokens merged so far."""
        return self.work

    def sync_version(self) -> int:
        """Syncs committed so far: the version of the weights replicas should hold."""
        return self.version

    def last_weights(self) -> np.ndarray:
        """The latest sync's weights message again (a resumed run's replicas merge it);
        before any sync, the full weights.

        Uncompressed, the message is the current weights of the last synced fragment, so
        it is rebuilt rather than kept (a full copy of the slice); a delta message
        depends on what replicas held before it, so that one is kept."""
        if self.version == 0:
            return self.full_weights()
        if self.config.weights_compression == "none":
            fragment = (self.fragment - 1) % self.config.sync_fragments
            return self._pack(
                self.optimizer.params, self._target(fragment), "none", {"version": self.version, "fragment": fragment}
            )
        return self.last_message

    def data_plan(self, replica_ids: list[int]) -> list[list[tuple[int, int]]]:
        """The stream ranges each replica of ``replica_ids`` trains on next, in order (no
        state change); a replica with more ranks gets more (``ranks_per_replica`` list)."""
        return data.plan_round(self.cursor, [self.config.sequences_for(i) for i in replica_ids])

    def reserve_plan(self, replica_id: int) -> list[tuple[int, int]]:
        """Decoupled mode: take the next plan for ``replica_id`` off the cursor; it is in
        flight until a merge trains it or :meth:`release_plan` gives it back."""
        if replica_id in self.in_flight:
            raise RuntimeError(f"server {self.index}: replica {replica_id} already has a plan in flight")
        plan, self.cursor = data.reserve(self.cursor, self.config.sequences_for(replica_id))
        self.in_flight[replica_id] = plan
        return plan

    def release_plan(self, replica_id: int) -> None:
        """Decoupled mode: the replica's plan was never trained (it died): hand it out again."""
        plan = self.in_flight.pop(replica_id, None)
        if plan:
            self.cursor = data.give_back(self.cursor, plan)

    def resume_cursor(self) -> data.DataCursor:
        """The cursor a resumed run starts from: in-flight plans are given back, because
        the work on them is not in the weights (and in-flight work is not checkpointed)."""
        return data.give_back(self.cursor, [r for plan in self.in_flight.values() for r in plan])

    # ---- what goes down to replicas ----------------------------------------------------
    def global_weights(self) -> np.ndarray:
        """This slice of the exact fp32 global weights, packed (for eval and final/)."""
        return self._pack(self.optimizer.params, self.owned, "none", {"version": self.version})

    def rows_of(self, name: str) -> tuple[int, np.ndarray] | None:
        """(first row, fp32 rows) of the global weights of ``name`` that this server
        holds, or None: what the final save streams, one tensor at a time. The rows are
        a view of the weights, not a copy: Ray copies them into its object store."""
        iv = self.owned.get(name)
        if iv is None:
            return None
        return iv[0], self.rows(self.optimizer.params, name, iv).numpy()

    def full_weights(self) -> np.ndarray:
        """Every parameter of this slice as replicas hold it, packed fp32 (for a replica
        that starts from scratch or missed a sync). Changes nothing."""
        return self._pack(self.held or self.optimizer.params, self.owned, "none", {"version": self.version})

    def new_weights_message(self, fragment: int) -> np.ndarray:
        """The message every replica applies after the sync of ``fragment``, packed; built
        once per committed version, and from then on it is what replicas hold.

        With ``weights_compression`` it is the compressed change since the last one
        (``delta``, from ``base`` to ``version``), and the server tracks what replicas
        then hold, so quantisation error never accumulates.
        """
        codec = self.config.weights_compression
        if self.version == self.message_version:
            # The sync committed nothing (a round to run again): there is no new version,
            # so no new message, and `held` must not move (it tracks what replicas hold).
            return self.last_weights()
        self.message_version = self.version
        if codec == "none":
            meta = {"version": self.version, "fragment": fragment}
            return self._pack(self.optimizer.params, self._target(fragment), "none", meta)
        target = self._target(fragment)
        params = self.optimizer.params
        delta = {n: self.rows(params, n, iv) - self.rows(self.held, n, iv) for n, iv in target.items()}
        meta = {"delta": True, "fragment": fragment, "version": self.version, "sent_at": time.time()}
        starts, cfg = {n: iv[0] for n, iv in target.items()}, self.config
        buf, _ = compression.pack_pieces(
            delta, starts, self.names, codec, meta, block=cfg.compression_block, fraction=cfg.topk_fraction
        )
        decoded, _ = compression.unpack_pieces(buf, self.names)
        for n, iv in target.items():
            self.rows(self.held, n, iv).add_(decoded[n][1])
        self.last_message = buf
        return buf

    # ---- one sync: prepare -> reduce -> commit -------------------------------------------
    def prepare(self, fragment: int, contributions: list[Contribution], divisor: Optional[float] = None) -> Prepared:
        """Fetch, decode and check every contribution; accumulate the valid ones' weighted
        sum in fp32, one replica at a time (never more than one decoded copy held).
        ``divisor`` (decoupled mode) replaces the accepted weights as the sum's divisor."""
        import ray

        if fragment != self.fragment:
            raise RuntimeError(f"server {self.index}: asked to sync fragment {fragment}, expected {self.fragment}")
        started = time.time()
        target = self._target(fragment)
        acc = self._zeroed_sum(target)
        reasons, valid = {}, []
        for c in contributions:
            try:
                self._accumulate(acc, transport.receive(c.refs), target, float(c.weight), self._reference(c))
            except NonFiniteError as e:
                reasons[c.replica_id] = Rejected(Rejection.NON_FINITE, str(e))
                acc = self._sum(contributions, set(valid), target)  # added part-way: sum the valid ones again
                continue
            except ValueError as e:
                reasons[c.replica_id] = Rejected(Rejection.MALFORMED, str(e))
                continue
            except ray.exceptions.RayError as e:  # its node went down after it reported
                detail = f"pseudo-gradient lost in transit: {type(e).__name__}"
                reasons[c.replica_id] = Rejected(Rejection.LOST_IN_TRANSIT, detail)
                continue
            valid.append(c.replica_id)
        self._pending = PendingSync(fragment, contributions, valid, started, acc=acc, divisor=divisor)
        return Prepared(
            order=[c.replica_id for c in contributions],
            weights={c.replica_id: float(c.weight) for c in contributions},
            reasons=reasons,
            arrived=time.time(),
        )

    def _sum(self, contributions: list[Contribution], ids: set[int], target: partition.Rows) -> dict:
        """The weighted sum of the contributions of replicas ``ids`` (checked before)."""
        acc = self._zeroed_sum(target)
        for c in contributions:
            if c.replica_id in ids:
                self._accumulate(acc, resolve(c.refs), target, float(c.weight), self._reference(c))
        return acc

    def _reference(self, c: Contribution):
        """What a stale contribution is corrected against (``stale_correction: momentum``):
        name -> the outer momentum of its slice; None for a fresh one, or with no correction."""
        if c.staleness <= 0 or self.config.stale_correction != "momentum":
            return None
        return lambda name: self.optimizer.momentum(self.pieces[(name, 0)])

    def reduce(self, *prepared: Prepared) -> Reduced:
        """Agree on the accepted replicas (rejected anywhere means rejected everywhere),
        form this slice's mean, and return its squared norms."""
        pending = self._pending
        reasons = {rid: why for p in prepared for rid, why in p.reasons.items()}
        accepted = [rid for rid in prepared[0].order if rid not in reasons]
        weights = prepared[0].weights
        total = sum(weights[rid] for rid in accepted)
        if pending.divisor is not None and total > 0:
            total = pending.divisor
        if accepted != pending.valid:  # another server rejected one this server summed
            # Built again, in the same space.
            pending.acc = self._sum(pending.contributions, set(accepted), self._target(pending.fragment))
        acc, pending.acc = pending.acc, None  # becomes the mean, in place: one reference, which commit consumes
        pending.mean = mean_in_place(acc, total)
        del acc
        target = self._target(pending.fragment)
        mean = pending.mean
        sumsq = squares_by_part(mean, self.position, {n: target[n][0] for n in mean})
        return Reduced(accepted=accepted if total > 0 else [], sumsq=sumsq, reasons=reasons, started=pending.started)

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
        if self.decoupled:
            return self._merge(plans, reduced, unused or {}, shares or {})
        pending, self._pending = self._pending, None
        opt, cfg = self.optimizer, self.config
        accepted = reduced[0].accepted
        # In one global order, so every server (and any server count) gets the same norm.
        norm = norm_of_parts(t for r in reduced for t in r.sumsq) if accepted else None
        lr = opt.lr_at(opt.round)
        round_index, fragment = opt.round, self.fragment
        streaming = cfg.sync_fragments > 1
        if accepted:
            named, pending.mean = pending.mean, None
            mean = {self.pieces[(n, fragment)]: g for n, g in named.items()}
            del named
            opt.apply(mean, lr, clip_coefficient(norm, opt.max_norm), in_place=True)  # consumes mean
        elif not streaming:
            # Plain DiLoCo: nothing usable arrived, so the round is run again.
            return AppliedRound(
                applied=False,
                round=round_index,
                fragment=0,
                outer_lr=lr,
                pseudo_grad_norm=None,
                rejected=reduced[0].reasons,
            )
        if sync_advances(applied=bool(accepted), streaming=streaming):
            self.version += 1
        # A replica's round of data counts as trained once any of its fragments was
        # applied: its work reached the global weights, and handing the data out again
        # would train it into those fragments twice. Fragments it missed lose that part
        # of its work, as a dropped replica's round is lost in plain DiLoCo.
        got = set(accepted)
        self.round_accepted = got if self.round_accepted is None else self.round_accepted | got
        done = fragment == cfg.sync_fragments - 1
        consumed: dict[int, list] = {}
        if done:
            ids = list(plans)
            trained = self.round_accepted
            unused = unused or {}
            rest = [unused.get(i, []) for i in ids]
            self.cursor = data.commit_round(self.cursor, [plans[i] for i in ids], [i in trained for i in ids], rest)
            consumed = {i: data.trained_part(plans[i], unused.get(i, [])) for i in ids if i in trained}
            opt.round += 1
            self.fragment, self.round_accepted = 0, None
        else:
            self.fragment += 1
        return AppliedRound(
            applied=bool(accepted),
            round=round_index,
            fragment=fragment,
            outer_lr=lr,
            pseudo_grad_norm=norm,
            accepted=list(accepted),
            rejected=reduced[0].reasons,
            data_ranges=consumed,
            round_done=done,
            seconds=time.time() - reduced[0].started,
        )

    def _merge(self, plans: dict, reduced: tuple, unused: dict, shares: dict) -> AppliedRound:
        """Decoupled mode's commit: one outer step from the contributions that arrived.

        The accepted ones' plans are trained (less what they had no time for, which goes
        back with the rejected ones' plans). ``work`` grows by their shares of a round;
        the lr follows the schedule by ``work``, and delayed Nesterov applies its
        momentum each time ``work`` passes a whole round (:mod:`diloco_ray.algo.decoupled`).
        """
        pending, self._pending = self._pending, None
        opt = self.optimizer
        accepted = reduced[0].accepted
        norm = norm_of_parts(t for r in reduced for t in r.sumsq) if accepted else None
        lr = opt.lr_at(int(self.work + decoupled.CYCLE_EPS))
        step = opt.round
        consumed: dict[int, list] = {}
        for rid, plan in plans.items():
            self.in_flight.pop(rid, None)
            if rid in accepted:
                consumed[rid] = data.trained_part(plan, unused.get(rid, []))
                self.cursor = data.give_back(self.cursor, unused.get(rid, []))
            else:
                self.cursor = data.give_back(self.cursor, plan)
        if accepted:
            named, pending.mean = pending.mean, None
            mean = {self.pieces[(n, 0)]: g for n, g in named.items()}
            del named
            before, self.work = self.work, self.work + sum(shares.get(rid, 0.0) for rid in accepted)
            clip = clip_coefficient(norm, opt.max_norm)
            if self.config.decoupled_momentum == "delayed":
                opt.apply_delayed(mean, lr, clip, decoupled.cycle_ends(before, self.work))
            else:
                opt.apply(mean, lr, clip, in_place=True)
            opt.round += 1
            self.version += 1
        return AppliedRound(
            applied=bool(accepted),
            round=step,
            fragment=0,
            outer_lr=lr,
            pseudo_grad_norm=norm,
            accepted=list(accepted),
            rejected=reduced[0].reasons,
            data_ranges=consumed,
            round_done=bool(accepted),
            seconds=time.time() - reduced[0].started,
            work=self.work,
        )

    # ---- checkpoints: each server writes and reads its own state ------------------------
    def save(self, where: str) -> dict:
        """Write this server's state into checkpoint ``where`` (see :mod:`diloco_ray.persist.server_state`)."""
        from diloco_ray.persist import server_state

        return server_state.save(self, where)

    def load(self, where: str) -> None:
        """Restore the state :meth:`save` wrote (a folder or a bucket URI)."""
        from diloco_ray.persist import server_state

        server_state.load(self, where)
