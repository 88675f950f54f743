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
:mod:`diloco_ray.algo.outer`, :mod:`diloco_ray.algo.compression` and :mod:`diloco_ray.algo.partition`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from diloco_ray.algo import compression, links, partition
from diloco_ray.algo.optimizers import build_outer_optimizer
from diloco_ray.algo.outer import OuterOptimizer, clip_coefficient
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data
from diloco_ray.errors import ConfigError
from diloco_ray.runtime import host_memory

# How a rejection for NaN/Inf reads: the driver resets such a replica's inner state.
NON_FINITE = "non-finite values"


@dataclass
class Contribution:
    """One replica's pieces for one server in one sync.

    Args:
        replica_id: the replica.
        refs: one object ref per rank, each resolving to a :func:`compression.pack`
            buffer of that rank's rows for this server. Wrapped in a list so Ray hands
            the refs over unresolved and the server fetches them itself.
        weight: its weight in the mean (tokens it trained on).
    """

    replica_id: int
    refs: list
    weight: float


@dataclass
class Prepared:
    """A server's verdict on one sync's contributions (small; goes server -> server)."""

    order: list[int]  # replica ids in contribution order
    weights: dict[int, float]
    reasons: dict[int, str]  # replica id -> why rejected here
    arrived: float  # wall-clock time the last piece arrived


@dataclass
class Reduced:
    """A server's part of the accepted mean: squared norms by (param position, row start)."""

    accepted: list[int]
    sumsq: list[tuple[int, int, float]]
    reasons: dict[int, str]
    started: float


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
    """

    fragment: int
    contributions: list
    valid: list[int]
    started: float
    acc: Optional[dict] = None
    mean: Optional[dict] = None


@dataclass
class AppliedRound:
    """What a commit reports (small; goes to the driver)."""

    applied: bool
    round: int  # the round this sync belongs to
    fragment: int
    outer_lr: float
    pseudo_grad_norm: float | None
    accepted: list[int] = field(default_factory=list)  # replica ids
    rejected: dict[int, str] = field(default_factory=dict)  # replica id -> reason
    data_ranges: dict[int, list] = field(default_factory=dict)  # replica id -> consumed stream ranges
    round_done: bool = False  # this sync completed its round
    seconds: float = 0.0  # from the first piece received to the step taken


class ParameterServer:
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
        self._round_accepted: set[int] | None = None
        self._pending: PendingSync | None = None
        self._sum_space = torch.empty(0)  # where a sync's sum is built (see _zeroed_sum)
        self.last_message = np.zeros(0, dtype=np.uint8)  # the latest sync's weights message
        self._message_version = 0  # the version last_message carries
        self._import_optimizer_machinery()

    def _import_optimizer_machinery(self) -> None:
        """torch imports its optimizer machinery (``torch._dynamo``, ~1 s) when the first
        optimizer is built: pay that here, while the replicas set up, rather than in
        :meth:`initialize` once they are done. A bad ``outer_opt`` is the preflight's to
        report (and :meth:`initialize`'s, which builds the real one): an actor that
        fails in ``__init__`` would only say that it died."""
        try:
            build_outer_optimizer([torch.zeros(1, requires_grad=True)], self.config)
        except ConfigError:
            pass

    # ---- layout ------------------------------------------------------------------------
    def _layout(self, shapes: dict) -> None:
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.names = list(self.shapes)
        self.position = {n: i for i, n in enumerate(self.names)}
        self.owned = partition.server_shards(self.shapes, self.count)[self.index]
        self.fragments = partition.fragments(self.shapes, self.config.sync_fragments)

        # The outer optimizer works on whole tensors, and a fragment may cover part of a
        # tensor's rows: each owned tensor is held as one piece per fragment it meets.
        self.pieces: dict[tuple[str, int], str] = {}  # (name, fragment) -> optimizer key
        self.piece_rows: dict[str, tuple[str, tuple[int, int]]] = {}  # key -> (name, rows)
        spans = sorted(
            (self.position[n], iv[0], f, n, iv)
            for f in range(len(self.fragments))
            for n, iv in partition.intersect(self.owned, self.fragments[f]).items()
        )
        for _, _, f, name, iv in spans:
            key = name if iv == self.owned[name] else f"{name}@{iv[0]}"
            self.pieces[(name, f)] = key
            self.piece_rows[key] = (name, iv)

    def _piece_shape(self, name: str, rows: tuple[int, int]) -> tuple:
        shape = self.shapes[name]
        return shape if not shape else (rows[1] - rows[0], *shape[1:])  # a 0-d parameter stays 0-d

    def _target(self, fragment: int | None) -> partition.Rows:
        return self.owned if fragment is None else partition.intersect(self.owned, self.fragments[fragment])

    def _split(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Owned rows by name -> optimizer pieces by key (copies)."""
        return {
            key: partition.take(full[name], iv, self.owned[name][0]).clone()
            for key, (name, iv) in self.piece_rows.items()
        }

    def _rows(self, pieces: dict[str, torch.Tensor], name: str, iv: tuple[int, int]) -> torch.Tensor:
        """Rows ``iv`` of ``name`` from optimizer pieces (a view when one piece holds them)."""
        parts = []
        for key, (n, (a, b)) in self.piece_rows.items():
            lo, hi = max(a, iv[0]), min(b, iv[1])
            if n == name and (lo < hi or (a, b) == iv):
                parts.append(partition.take(pieces[key], (lo, hi), a))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(self, buffers: list, target: partition.Rows) -> tuple[list, float]:
        """Decode one replica's per-rank buffers and check them against ``target``:
        every row covered once, shapes right, every value finite. Returns ``[(name,
        rows, piece)]`` (views into the buffers where the codec allows: nothing is
        copied) and when the last of them arrived over its (simulated) link."""
        found, arrived = [], 0.0
        covered = dict.fromkeys(target, 0)
        for r, buf in enumerate(buffers):
            pieces, meta = compression.unpack_pieces(buf, self.names, lazy=True)
            arrived = max(arrived, links.arrival(meta) or 0.0)
            for name, (start, piece) in pieces.items():
                span = (start, start + partition.num_rows(piece.shape))
                if name not in target or partition.intersect({name: span}, target) != {name: span}:
                    raise ValueError(f"rank {r} sent rows {span} of '{name}' outside this sync's slice")
                if tuple(piece.shape[1:]) != self.shapes[name][1:]:
                    raise ValueError(
                        f"rank {r} sent '{name}' rows of shape {tuple(piece.shape)}, "
                        f"want (*, {', '.join(map(str, self.shapes[name][1:]))})"
                    )
                found.append((name, span, piece))
                covered[name] += span[1] - span[0]
        for name, (a, b) in target.items():
            if covered[name] != b - a:
                raise ValueError(f"pieces of '{name}' cover {covered[name]} of its {b - a} rows")
        return found, arrived

    @staticmethod
    def _values(name: str, piece: compression.Encoded) -> torch.Tensor:
        """A piece decoded (a view into the message when uncompressed) and checked finite."""
        values = piece.decode()
        # A vectorised fp32 sum is finite when every value is; only when it is not
        # (NaN/Inf, or finite values large enough to overflow) is each value checked.
        if not math.isfinite(float(values.sum())) and not bool(torch.isfinite(values).all()):
            raise ValueError(f"{NON_FINITE} in '{name}'")
        return values

    def _receive(self, buffers: list, target: partition.Rows) -> tuple[dict[str, torch.Tensor], float]:
        """Like :meth:`_decode`, assembled into tensors covering ``target`` exactly."""
        found, arrived = self._decode(buffers, target)
        out = {n: torch.empty(self._piece_shape(n, iv)) for n, iv in target.items()}
        for name, span, piece in found:
            partition.put(out[name], span, self._values(name, piece), offset=target[name][0])
        return out, arrived

    def _accumulate(self, acc: dict, buffers: list, target: partition.Rows, weight: float) -> float:
        """Add one replica's checked pieces, times ``weight``, straight into ``acc``, a
        piece at a time (never a decoded copy of the whole message); returns its arrival
        time. Raises ValueError when a check fails: a non-finite piece found part-way
        leaves ``acc`` holding the pieces before it (the caller rebuilds it)."""
        found, arrived = self._decode(buffers, target)
        for name, span, piece in found:
            flat = partition.take(acc[name], span, target[name][0]).view(-1)  # rows are contiguous
            for lo, values in piece.chunks():
                # A vectorised fp32 sum is finite when every value is; only when it is not
                # (NaN/Inf, or finite values large enough to overflow) is each value checked.
                if not math.isfinite(float(values.sum())) and not bool(torch.isfinite(values).all()):
                    raise ValueError(f"{NON_FINITE} in '{name}'")
                flat[lo : lo + values.numel()].add_(values, alpha=weight)
        return arrived

    # ---- state ---------------------------------------------------------------------------
    def initialize(self, buffer_refs: list, shapes: dict[str, tuple]) -> None:
        """Seed this slice of the global weights from one replica's rank buffers (fp32
        pieces, as :meth:`~diloco_ray.runtime.rank.RankWorker.seed_pieces` packs them)."""
        self._layout(shapes)
        params, _ = self._receive(resolve(buffer_refs), self.owned)
        self.optimizer = OuterOptimizer(self._split(params), self.config)
        self._reset_held()

    def _reset_held(self) -> None:
        if self.config.weights_compression != "none":
            self.held = {n: t.clone() for n, t in self.optimizer.params.items()}

    def round_index(self) -> int:
        """The index of the next round to apply."""
        return self.optimizer.round

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

    def plan(self, slots: int) -> list[list[tuple[int, int]]]:
        """The stream ranges each of ``slots`` replicas trains on next (no state change)."""
        return data.plan_round(self.cursor, slots, self.config.sequences_per_replica_round)

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
        return iv[0], self._rows(self.optimizer.params, name, iv).numpy()

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
        if self.version == self._message_version:
            # The sync committed nothing (a round to run again): there is no new version,
            # so no new message, and `held` must not move (it tracks what replicas hold).
            return self.last_weights()
        self._message_version = self.version
        if codec == "none":
            meta = {"version": self.version, "fragment": fragment}
            return self._pack(self.optimizer.params, self._target(fragment), "none", meta)
        target = self._target(fragment)
        params = self.optimizer.params
        delta = {n: self._rows(params, n, iv) - self._rows(self.held, n, iv) for n, iv in target.items()}
        meta = {"delta": True, "fragment": fragment, "version": self.version, "sent_at": time.time()}
        buf, _ = compression.pack_pieces(
            delta, {n: iv[0] for n, iv in target.items()}, self.names, codec, meta, block=self.config.compression_block
        )
        decoded, _ = compression.unpack_pieces(buf, self.names)
        for n, iv in target.items():
            self._rows(self.held, n, iv).add_(decoded[n][1])
        self.last_message = buf
        return buf

    def _pack(self, tensors: dict, target: partition.Rows, codec: str, meta: dict) -> np.ndarray:
        """Rows ``target`` of ``tensors`` as a message. Uncompressed, it is written into
        the sum space when no sum is in it (see :meth:`_message_space`)."""
        meta = {**meta, "sent_at": time.time()}
        starts = {n: iv[0] for n, iv in target.items()}
        if codec == "none":
            return compression.pack_pieces_filled(
                {n: self._piece_shape(n, iv) for n, iv in target.items()},
                starts,
                self.names,
                lambda n, out: out.copy_(self._rows(tensors, n, target[n])),
                "none",
                meta,
                block=self.config.compression_block,
                allocate=self._message_space,
            )
        pieces = {n: self._rows(tensors, n, iv) for n, iv in target.items()}
        buf, _ = compression.pack_pieces(pieces, starts, self.names, codec, meta, block=self.config.compression_block)
        return buf

    def _message_space(self, nbytes: int) -> np.ndarray:
        """``nbytes`` for a message: the sum space's memory when no sync holds a sum in
        it. The weights message of a sync is built after its sum was consumed, so the
        two share one buffer and the server's peak stays weights + momentum + one
        buffer. Such a message is valid until the next :meth:`prepare`: through Ray it
        was copied into the object store when the call returned."""
        if self._pending is not None:
            return np.empty(nbytes, dtype=np.uint8)
        floats = -(-nbytes // 4)
        if self._sum_space.numel() < floats:
            self._sum_space = torch.empty(0)
            self._sum_space = torch.empty(floats)
        return self._sum_space.numpy().view(np.uint8)[:nbytes]

    # ---- one sync: prepare -> reduce -> commit -------------------------------------------
    def prepare(self, fragment: int, contributions: list[Contribution]) -> Prepared:
        """Fetch, decode and check every contribution; accumulate the valid ones' weighted
        sum in fp32, one replica at a time (never more than one decoded copy held)."""
        import ray

        if fragment != self.fragment:
            raise RuntimeError(f"server {self.index}: asked to sync fragment {fragment}, expected {self.fragment}")
        started = time.time()
        target = self._target(fragment)
        acc = self._zeroed_sum(target)
        reasons, valid, arrivals = {}, [], []
        for c in contributions:
            try:
                arrived = self._accumulate(acc, resolve(c.refs), target, float(c.weight))
            except ValueError as e:
                reasons[c.replica_id] = str(e)
                if e.args[0].startswith(NON_FINITE):  # added part-way: sum the valid ones again
                    acc = self._sum(contributions, set(valid), target)
                continue
            except ray.exceptions.RayError as e:  # its node went down after it reported
                reasons[c.replica_id] = f"pseudo-gradient lost in transit: {type(e).__name__}"
                continue
            arrivals.append(arrived)
            valid.append(c.replica_id)
        links.wait_for(arrivals)  # a simulated slow uplink delivers the pieces only now
        self._pending = PendingSync(fragment, contributions, valid, started, acc=acc)
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
                self._accumulate(acc, resolve(c.refs), target, float(c.weight))
        return acc

    def _zeroed_sum(self, target: partition.Rows) -> dict[str, torch.Tensor]:
        """Zeroed fp32 tensors covering ``target``: views of one buffer kept from sync
        to sync (4 bytes per parameter of the slice; the server's peak holds a sum
        anyway). A fresh sum each sync cost more than the adds into it: every page of
        it faulted in again (0.13 s of a 0.45 s sync at 27M parameters on this VM).
        A new sum replaces the last one, whose views must no longer be in use."""
        shapes = {n: self._piece_shape(n, iv) for n, iv in target.items()}
        need = sum(math.prod(shape) for shape in shapes.values())
        if self._sum_space.numel() < need:
            self._sum_space = torch.empty(0)  # the old one goes before the new one comes
            self._sum_space = torch.empty(need)
        out, offset = {}, 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out[name] = self._sum_space[offset : offset + size].view(shape).zero_()
            offset += size
        return out

    def reduce(self, *prepared: Prepared) -> Reduced:
        """Agree on the accepted replicas (rejected anywhere means rejected everywhere),
        form this slice's mean, and return its squared norms."""
        pending = self._pending
        reasons = {rid: why for p in prepared for rid, why in p.reasons.items()}
        accepted = [rid for rid in prepared[0].order if rid not in reasons]
        weights = prepared[0].weights
        total = sum(weights[rid] for rid in accepted)
        if accepted != pending.valid:  # another server rejected one this server summed
            # Built again, in the same space.
            pending.acc = self._sum(pending.contributions, set(accepted), self._target(pending.fragment))
        acc, pending.acc = pending.acc, None  # becomes the mean, in place: one reference, which commit consumes
        pending.mean = {n: t.div_(total) for n, t in acc.items()} if total > 0 else {}
        del acc
        target = self._target(pending.fragment)
        mean = pending.mean
        sumsq = [(self.position[n], target[n][0], _sum_of_squares(g)) for n, g in mean.items()]
        return Reduced(accepted=accepted if total > 0 else [], sumsq=sumsq, reasons=reasons, started=pending.started)

    def commit(self, plans: dict, *reduced: Reduced) -> AppliedRound:
        """Take the outer step for this sync with the norm over every server's slice, and
        advance the fragment, round and (at a round's end) the data cursor as one unit.

        Args:
            plans: replica id -> stream ranges it was handed this round.
            reduced: every server's :meth:`reduce` result, in server order.
        """
        pending, self._pending = self._pending, None
        opt, cfg = self.optimizer, self.config
        accepted = reduced[0].accepted
        # Sum in one global order so every server (and any server count) gets the same norm.
        terms = sorted(t for r in reduced for t in r.sumsq)
        norm = math.sqrt(sum(t[2] for t in terms)) if accepted else None
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
        self.version += 1
        # A replica's round of data counts as trained once any of its fragments was
        # applied: its work reached the global weights, and handing the data out again
        # would train it into those fragments twice. Fragments it missed lose that part
        # of its work, as a dropped replica's round is lost in plain DiLoCo.
        got = set(accepted)
        self._round_accepted = got if self._round_accepted is None else self._round_accepted | got
        done = fragment == cfg.sync_fragments - 1
        consumed: dict[int, list] = {}
        if done:
            ids = list(plans)
            trained = self._round_accepted
            self.cursor = data.commit_round(self.cursor, [plans[i] for i in ids], [i in trained for i in ids])
            consumed = {i: plans[i] for i in ids if i in trained}
            opt.round += 1
            self.fragment, self._round_accepted = 0, None
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

    # ---- checkpoints: each server writes and reads its own state ------------------------
    def _names(self) -> tuple[str, str, str]:
        if self.count == 1:
            return "global.safetensors", "outer", "server.json"
        tag = f"{self.index}-of-{self.count}"
        return f"global-{tag}.safetensors", f"outer-{tag}", f"server-{tag}.json"

    def save(self, where: str) -> dict:
        """Write this server's state into ``where`` (a checkpoint being assembled: a
        folder or a bucket URI): its slice of the weights (``global*.safetensors``,
        loadable on their own), the outer optimizer, and ``server*.json`` (round,
        fragment, cursor, shapes). Returns :func:`staging.publish`'s hashes."""
        from diloco_ray.persist import checkpoint, staging

        folder = staging.scratch(where)
        weights_file, outer_name, meta_file = self._names()
        sd = self.optimizer.state_dict()
        whole = {n: self._rows(sd["params"], n, iv).contiguous() for n, iv in self.owned.items()}
        checkpoint.save_tensors(os.path.join(folder, weights_file), whole)
        outer_files = checkpoint.save_state(
            folder,
            outer_name,
            {
                "optimizer": sd["optimizer"],
                "round": sd["round"],
                "names": sd["names"],
                "held": self.held,
                "last_message": torch.from_numpy(np.array(self.last_message)),
            },
        )
        with open(os.path.join(folder, meta_file), "w") as f:
            json.dump(
                {
                    "round": sd["round"],
                    "fragment": self.fragment,
                    "version": self.version,
                    "round_accepted": None if self._round_accepted is None else sorted(self._round_accepted),
                    "cursor": self.cursor.to_dict(),
                    "count": self.count,
                    "sync_fragments": self.config.sync_fragments,
                    "shapes": {n: list(s) for n, s in self.shapes.items()},
                },
                f,
            )
        return staging.publish(where, [weights_file, *outer_files, meta_file])

    def load(self, where: str) -> None:
        """Restore the state :meth:`save` wrote (a folder or a bucket URI)."""
        from diloco_ray.persist import checkpoint, staging

        weights_file, outer_name, meta_file = self._names()
        folder = staging.localize(where, [meta_file, weights_file, f"{outer_name}.safetensors", f"{outer_name}.json"])
        if not os.path.isfile(os.path.join(folder, meta_file)):
            raise ConfigError(
                f"resume_from: checkpoint {folder} was not written with num_param_servers="
                f"{self.count} (no {meta_file}); resume with the server count it was saved with"
            )
        with open(os.path.join(folder, meta_file)) as f:
            meta = json.load(f)
        saved_fragments = meta.get("sync_fragments", 1)
        if saved_fragments != self.config.sync_fragments:
            raise ConfigError(
                f"sync_fragments: {self.config.sync_fragments}, but checkpoint {folder} was written "
                f"with {saved_fragments}; resume with the value it was saved with"
            )
        self._layout(meta["shapes"])
        loaded = checkpoint.load_tensors(os.path.join(folder, weights_file))
        params = self._split(loaded)
        outer = checkpoint.load_state(folder, outer_name)
        self.optimizer = OuterOptimizer(params, self.config)
        self.optimizer.load_state_dict({"params": params, **outer})
        # `held` tracks what replicas hold only while weights go down compressed.
        self.held = dict(outer.get("held") or {}) if self.config.weights_compression != "none" else {}
        self.last_message = outer["last_message"].numpy() if "last_message" in outer else np.zeros(0, dtype=np.uint8)
        if self.config.weights_compression != "none" and not self.held:
            self._reset_held()
        self.fragment, self.version = meta.get("fragment", 0), meta.get("version", 0)
        self._message_version = self.version
        accepted = meta.get("round_accepted")
        self._round_accepted = None if accepted is None else set(accepted)
        self.cursor = data.DataCursor.from_dict(meta["cursor"])


def _sum_of_squares(t: torch.Tensor, chunk: int = 1 << 16) -> float:
    """Sum of squares accumulated in float64, a chunk at a time through one reused
    float64 scratch: float64 precision without a float64 copy of the whole tensor, and
    no allocation per chunk (fresh pages per chunk made this the server's largest cost)."""
    flat = t.reshape(-1)
    if not flat.numel():
        return 0.0
    scratch = torch.empty(min(chunk, flat.numel()), dtype=torch.float64)
    total = 0.0
    for part in flat.split(chunk):
        wide = scratch[: part.numel()].copy_(part)
        total += float(torch.dot(wide, wide))
    return total


def resolve(items: list) -> list:
    """Buffers from object refs (fetched in one call) or buffers (tests drive the server
    in-process)."""
    import ray

    refs = [i for i in items if isinstance(i, ray.ObjectRef)]
    got = iter(ray.get(refs)) if refs else iter(())
    return [next(got) if isinstance(i, ray.ObjectRef) else i for i in items]
