"""Which rows of the model one parameter server holds, and how its outer optimizer sees them.

A server owns a slice of every tensor's rows (:func:`~diloco_ray.algo.partition.server_shards`),
and a sync moves one fragment of the model at a time
(:func:`~diloco_ray.algo.partition.fragments`). The outer optimizer works on whole tensors,
and a fragment may cover part of a tensor's rows, so each owned tensor is held as one
*piece* per fragment it meets: :class:`SliceLayout` names those pieces and moves rows
between them and the by-name tensors messages carry. Plain bookkeeping: no Ray, no files.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from diloco_ray.algo import partition


class SliceLayout:
    """The rows server ``index`` of ``count`` holds, and its outer optimizer's pieces.

    Args:
        shapes: parameter name -> shape, in model order.
        index: this server's position among the ``count`` servers.
        count: ``num_param_servers``.
        sync_fragments: how many fragments a round syncs the model in.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], index: int, count: int, sync_fragments: int):
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.names = list(self.shapes)
        self.position = {n: i for i, n in enumerate(self.names)}
        self.owned = partition.server_shards(self.shapes, count)[index]
        self.fragments = partition.fragments(self.shapes, sync_fragments)
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

    def piece_shape(self, name: str, rows: tuple[int, int]) -> tuple:
        """The shape of rows ``rows`` of ``name`` (a 0-d parameter stays 0-d)."""
        shape = self.shapes[name]
        return shape if not shape else (rows[1] - rows[0], *shape[1:])

    def target(self, fragment: Optional[int]) -> partition.Rows:
        """The rows of ``fragment`` this server holds; every owned row for None."""
        return self.owned if fragment is None else partition.intersect(self.owned, self.fragments[fragment])

    def split(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Owned rows by name -> optimizer pieces by key (copies)."""
        return {
            key: partition.take(full[name], iv, self.owned[name][0]).clone()
            for key, (name, iv) in self.piece_rows.items()
        }

    def rows(self, pieces: Mapping[str, torch.Tensor], name: str, iv: tuple[int, int]) -> torch.Tensor:
        """Rows ``iv`` of ``name`` from optimizer pieces (a view when one piece holds them)."""
        parts = []
        for key, (n, (a, b)) in self.piece_rows.items():
            lo, hi = max(a, iv[0]), min(b, iv[1])
            if n == name and (lo < hi or (a, b) == iv):
                parts.append(partition.take(pieces[key], (lo, hi), a))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def keyed(self, named: Mapping[str, torch.Tensor], fragment: int) -> dict[str, torch.Tensor]:
        """Tensors of ``fragment`` by parameter name -> the same tensors by optimizer key."""
        return {self.pieces[(n, fragment)]: t for n, t in named.items()}
