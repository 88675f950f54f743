"""Which rows a parameter server holds, and how they come in and go out: its slice's layout,
the decoding and checking of the replicas' pieces, the weighted sum they are added into,
and the packing of weights messages.

:class:`ServerSlice` is the part of :class:`~diloco_ray.runtime.server.ParameterServer` that
knows rows and bytes, not rounds: the server's sync (prepare, reduce, commit) and state
build on it. Memory matters here: pieces are decoded as views where the codec allows,
added into one sum space kept from sync to sync, and an uncompressed weights message is
written into that same space once the sum is consumed.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from diloco_ray.algo import compression, decoupled, partition
from diloco_ray.algo.aggregate import add_weighted, check_finite


class ServerSlice:
    """Rows, pieces and buffers of one server's slice.

    The server sets ``config``, ``index``, ``count``, ``_sum_space`` and ``_pending`` before
    :meth:`layout` is called with the model's shapes.
    """

    # ---- layout ------------------------------------------------------------------------
    def layout(self, shapes: dict) -> None:
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

    def split(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Owned rows by name -> optimizer pieces by key (copies)."""
        return {
            key: partition.take(full[name], iv, self.owned[name][0]).clone()
            for key, (name, iv) in self.piece_rows.items()
        }

    def rows(self, pieces: dict[str, torch.Tensor], name: str, iv: tuple[int, int]) -> torch.Tensor:
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
        copied)."""
        found = []
        covered = dict.fromkeys(target, 0)
        for r, buf in enumerate(buffers):
            pieces, _ = compression.unpack_pieces(buf, self.names, lazy=True)
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
        return found

    @staticmethod
    def _values(name: str, piece: compression.Encoded) -> torch.Tensor:
        """A piece decoded (a view into the message when uncompressed) and checked finite."""
        return check_finite(piece.decode(), name)

    def _receive(self, buffers: list, target: partition.Rows) -> dict[str, torch.Tensor]:
        """Like :meth:`_decode`, assembled into tensors covering ``target`` exactly."""
        found = self._decode(buffers, target)
        out = {n: torch.empty(self._piece_shape(n, iv)) for n, iv in target.items()}
        for name, span, piece in found:
            partition.put(out[name], span, self._values(name, piece), offset=target[name][0])
        return out

    def _accumulate(self, acc: dict, buffers: list, target: partition.Rows, weight: float, reference=None) -> None:
        """Add one replica's checked pieces, times ``weight``, straight into ``acc``, a
        piece at a time (never a decoded copy of the whole message). Raises ValueError
        when a check fails: a non-finite piece found part-way leaves ``acc`` holding the
        pieces before it (the caller rebuilds it).

        ``reference`` (a stale contribution under ``stale_correction``): name -> the outer
        momentum of that slice, or None; each tensor is then assembled whole (one tensor's
        copy at a time) and corrected against it (:func:`~diloco_ray.algo.decoupled.correct_stale_`)
        before it is added."""
        found = self._decode(buffers, target)
        if reference is not None:
            self._accumulate_corrected(acc, found, target, weight, reference)
            return
        for name, span, piece in found:
            flat = partition.take(acc[name], span, target[name][0]).view(-1)  # rows are contiguous
            for lo, values in piece.chunks():
                add_weighted(flat[lo : lo + values.numel()], values, weight, name)

    def _accumulate_corrected(self, acc: dict, found: list, target: partition.Rows, weight: float, reference) -> None:
        by_name: dict[str, list] = {}
        for name, span, piece in found:
            by_name.setdefault(name, []).append((span, piece))
        for name, parts in by_name.items():
            whole = torch.empty(self._piece_shape(name, target[name]))
            for span, piece in parts:
                partition.put(whole, span, self._values(name, piece), offset=target[name][0])
            momentum = reference(name)
            if momentum is not None:
                decoupled.correct_stale_(whole, momentum.view(whole.shape))
            add_weighted(acc[name].view(-1), whole.view(-1), weight, name)

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
                lambda n, out: out.copy_(self.rows(tensors, n, target[n])),
                "none",
                meta,
                block=self.config.compression_block,
                allocate=self._message_space,
            )
        pieces = {n: self.rows(tensors, n, iv) for n, iv in target.items()}
        cfg = self.config
        buf, _ = compression.pack_pieces(
            pieces, starts, self.names, codec, meta, block=cfg.compression_block, fraction=cfg.topk_fraction
        )
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
