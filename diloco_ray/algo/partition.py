"""Who holds and who sends which rows of which parameter, as pure functions over names and shapes.

Three partitions of the same parameters meet here:

* inside a replica, each FSDP rank holds a row shard of every parameter
  (:func:`diloco_ray.algo.sharding.shard_rows`, chunked along dim 0 the way ``torch.chunk`` does);
* the parameter server is split over ``S`` actors ("server shards"), each owning a contiguous,
  byte-balanced run of the model's parameters in model order (:func:`server_shards`);
* Streaming DiLoCo syncs ``F`` "fragments" at different times; fragment ``f`` holds the decoder
  layers ``i % F == f`` whole, plus a share of the parameters outside the layers that evens out
  the fragments' bytes (:func:`fragments`).

A rank sends, for fragment ``f``, to server shard ``s``, exactly
``intersect(rank_rows(...), fragments(...)[f], server_shards(...)[s])``; over all triples these
pieces tile the model exactly once.

Representation: ``Rows = dict[str, tuple[int, int]]`` maps a parameter name to a half-open row
interval ``[start, stop)`` along dim 0 of the FULL tensor. A 0-d tensor counts as one row, a 1-d
tensor of ``n`` elements has ``n`` rows, and a row holds ``prod(shape[1:])`` elements (1 for 0-d
and 1-d tensors). Empty intervals are never stored: a name whose interval would be empty is left
out. Dict order follows the order of the ``shapes`` mapping passed in (the model's parameter
order) unless a function says otherwise. Nothing here touches Ray or torch.distributed.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from typing import Mapping, Sequence

import numpy as np
import torch

from diloco_ray.algo.sharding import shard_rows

Rows = dict[str, tuple[int, int]]

_LAYER_CONTAINERS = frozenset({"layers", "layer", "h", "blocks", "block"})
_INT = re.compile(r"[0-9]+")


def num_rows(shape: Sequence[int]) -> int:
    """Rows of a tensor of ``shape``: 1 for a 0-d tensor, ``shape[0]`` otherwise."""
    return 1 if len(shape) == 0 else int(shape[0])


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one row of a tensor of ``shape``: ``prod(shape[1:])`` (1 for 0-d and 1-d)."""
    return int(math.prod(int(d) for d in tuple(shape)[1:]))


def whole(shapes: Mapping[str, Sequence[int]]) -> Rows:
    """Every parameter, all rows.

    Args:
        shapes: name -> full shape, in model order. Tensors with 0 rows are skipped.
    """
    return {name: (0, num_rows(shape)) for name, shape in shapes.items() if num_rows(shape) > 0}


def cut(
    shapes: Mapping[str, Sequence[int]], order: Sequence[str], parts: int, weights: Sequence[float] | None = None
) -> list[Rows]:
    """Cut the parameters, laid end to end, into ``parts`` contiguous pieces of about equal size
    (or of sizes in proportion to ``weights``).

    The parameters are laid out in ``order`` (each tensor's rows in order) and the sequence is cut
    into ``parts`` contiguous pieces of as-equal-as-possible element counts (so bytes, all being
    fp32), cutting only at row boundaries, so a tensor may be split across pieces. Piece ``k``'s
    target end is ``round((k + 1) * total / parts)`` elements; the cut goes at the row boundary
    nearest to it (ties to the lower one), never before the previous cut. While there are at least
    ``parts`` rows every piece keeps at least one row; pieces are empty only with fewer rows than
    parts.

    Args:
        shapes: name -> full shape; the order of each returned ``Rows``.
        order: a permutation of ``shapes``' names: the layout order.
        parts: number of pieces, at least 1.
        weights: the pieces' relative sizes (non-negative, not all zero); a piece of weight 0
            stays empty, and no piece is guaranteed a row.

    Returns:
        ``parts`` Rows, each ordered by ``shapes`` order (not ``order``).

    Raises:
        ValueError: ``parts < 1`` or ``order`` is not a permutation of ``shapes``' names.
    """
    if parts < 1:
        raise ValueError(f"cannot cut into {parts} parts")
    order = list(order)
    if len(order) != len(shapes) or set(order) != set(shapes) or len(set(order)) != len(order):
        raise ValueError("order is not a permutation of the parameter names")
    line = _Line.lay_out(shapes, order)
    if line.rows_total == 0:
        return [{} for _ in range(parts)]
    bounds = _cut_bounds(line, parts, weights)
    pieces = [line.rows_between(bounds[k], bounds[k + 1]) for k in range(parts)]
    return [{name: piece[name] for name in shapes if name in piece} for piece in pieces]


@dataclasses.dataclass(frozen=True)
class _Line:
    """The tensors with rows laid end to end: for each, its name, first global row, first
    element, rows and elements per row (row boundaries are global row indices on this line).

    Args:
        names: the tensors with rows, in layout order.
        row_start: each tensor's first global row.
        elem_start: the elements laid before each tensor.
        rows: each tensor's rows.
        per_row: each tensor's elements per row.
    """

    names: list[str]
    row_start: list[int]
    elem_start: list[int]
    rows: list[int]
    per_row: list[int]

    @classmethod
    def lay_out(cls, shapes: Mapping[str, Sequence[int]], order: Sequence[str]) -> _Line:
        """The tensors of ``shapes`` with rows, in ``order``."""
        line = cls([], [], [], [], [])
        rows_total = elems_total = 0
        for name in order:
            rows = num_rows(shapes[name])
            if rows <= 0:
                continue
            line.names.append(name)
            line.row_start.append(rows_total)
            line.elem_start.append(elems_total)
            line.rows.append(rows)
            line.per_row.append(row_numel(shapes[name]))
            rows_total += rows
            elems_total += rows * line.per_row[-1]
        return line

    @property
    def rows_total(self) -> int:
        return self.row_start[-1] + self.rows[-1] if self.names else 0

    @property
    def elems_total(self) -> int:
        return self.position(self.rows_total) if self.names else 0

    def position(self, g: int) -> int:
        """Elements before global row boundary ``g`` (monotone non-decreasing in ``g``)."""
        i = bisect.bisect_right(self.row_start, g) - 1  # the tensor holding row g (the last at the end)
        return self.elem_start[i] + (g - self.row_start[i]) * self.per_row[i]

    def nearest_boundary(self, target: int) -> int:
        """The row boundary whose position is nearest ``target`` elements (ties to the lower)."""
        lo, hi = 0, self.rows_total  # smallest boundary g with position(g) >= target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.position(mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        if lo > 0 and target - self.position(lo - 1) <= self.position(lo) - target:
            return lo - 1
        return lo

    def rows_between(self, a: int, b: int) -> Rows:
        """Each tensor's local rows between global boundaries ``a`` and ``b``, in layout order."""
        piece = {}
        for name, start, rows in zip(self.names, self.row_start, self.rows):
            lo = max(a, start) - start
            hi = min(b, start + rows) - start
            if hi > lo:
                piece[name] = (lo, hi)
        return piece


def _cut_bounds(line: _Line, parts: int, weights: Sequence[float] | None) -> list[int]:
    """The ``parts + 1`` row boundaries of :func:`cut`, from 0 to the line's last row."""
    share = np.cumsum(weights if weights is not None else [1.0] * parts, dtype=np.float64)
    rows_total, elems_total = line.rows_total, line.elems_total
    bounds = [0]
    for k in range(parts - 1):
        best = line.nearest_boundary(round(share[k] / share[-1] * elems_total))
        if weights is None and rows_total >= parts:  # at least one row to this piece and each after
            first, last = bounds[-1] + 1, rows_total - (parts - 1 - k)
        else:
            first, last = bounds[-1], rows_total
        bounds.append(min(max(best, first), last))
    bounds.append(rows_total)
    return bounds


def layer_index(name: str) -> int | None:
    """The decoder-layer index in a parameter name, or None for non-layer parameters.

    The index is the first path component that is an integer following a component named
    ``layers``, ``layer``, ``h``, ``blocks`` or ``block``: HF Llama ``model.layers.3.mlp...``,
    GPT-2 ``transformer.h.3...``, peft ``base_model.model.model.layers.3.self_attn...``.

    Args:
        name: a dotted parameter name.
    """
    parts = name.split(".")
    for prev, comp in zip(parts, parts[1:]):
        if prev in _LAYER_CONTAINERS and _INT.fullmatch(comp):
            return int(comp)
    return None


def fragments(shapes: Mapping[str, Sequence[int]], count: int) -> list[Rows]:
    """The ``count`` Streaming DiLoCo sync fragments: decoder layer ``i`` whole in fragment
    ``i % count``, and the parameters outside the layers (embeddings, final norm, lm_head)
    spread over the fragments to even out their bytes.

    The non-layer parameters, laid end to end in model order, are cut (at row boundaries,
    so a large embedding may be split) into pieces that fill the lightest fragments up to
    one common level (water-filling). A cut in byte order instead would put the whole
    embedding in fragment 0 (at vocab 32k, d 512, 8 layers and 4 fragments, most of
    fragment 0), and move layers out of their ``i % count`` group to balance it. A model with no
    recognisable layers, or fewer layers than fragments (whole layers cannot fill them
    all), is cut into ``count`` byte-balanced runs in model order.

    Args:
        shapes: name -> full shape, in model order.
        count: number of fragments, at least 1.
    """
    if count < 1:
        raise ValueError(f"cannot cut into {count} fragments")
    layer_of = {name: layer_index(name) for name in shapes}
    if count == 1 or len({i for i in layer_of.values() if i is not None}) < count:
        return cut(shapes, list(shapes), count)
    out: list[Rows] = [{} for _ in range(count)]
    load = [0.0] * count
    others = {}
    for name, shape in shapes.items():
        if num_rows(shape) <= 0:
            continue
        if layer_of[name] is None:
            others[name] = shape
            continue
        f = layer_of[name] % count
        out[f][name] = (0, num_rows(shape))
        load[f] += num_rows(shape) * row_numel(shape)
    extra = sum(num_rows(s) * row_numel(s) for s in others.values())
    if extra:
        for f, piece in enumerate(cut(others, list(others), count, weights=fill_to_level(load, extra))):
            out[f].update(piece)
    return [{name: frag[name] for name in shapes if name in frag} for frag in out]


def fill_to_level(load: Sequence[float], extra: float) -> list[float]:
    """How much of ``extra`` each bin gets so that the lightest bins rise to one common
    level (water-filling): ``max(0, level - load[i])``, summing to ``extra``."""
    ordered = sorted(load)
    level = ordered[-1]
    for k in range(1, len(ordered) + 1):
        level = (extra + sum(ordered[:k])) / k
        if k == len(ordered) or level <= ordered[k]:
            break
    return [max(0.0, level - x) for x in load]


def server_shards(shapes: Mapping[str, Sequence[int]], count: int) -> list[Rows]:
    """What each of ``count`` parameter-server actors owns: ``cut(shapes, model order, count)``.

    Args:
        shapes: name -> full shape, in model order.
        count: number of server actors, at least 1.
    """
    return cut(shapes, list(shapes), count)


def rank_rows(shapes: Mapping[str, Sequence[int]], world_size: int, rank: int) -> Rows:
    """The rows a replica's FSDP ``rank`` holds and sends (``sharding.shard_rows`` per tensor).

    0-d tensors are held by every rank but only rank 0 owns them for sending: they map to
    ``(0, 1)`` on rank 0 and are left out on other ranks. A 1-rank world owns everything.

    Args:
        shapes: name -> full shape, in model order.
        world_size: ranks in the replica.
        rank: this rank, ``0 <= rank < world_size``.

    Raises:
        ValueError: ``rank`` is outside the world.
    """
    shard_rows(1, world_size, rank)  # validates rank
    out: Rows = {}
    for name, shape in shapes.items():
        if len(shape) == 0:
            if rank == 0:
                out[name] = (0, 1)
            continue
        s = shard_rows(int(shape[0]), world_size, rank)
        if s.stop > s.start:
            out[name] = (s.start, s.stop)
    return out


def intersect(*parts: Rows) -> Rows:
    """The rows present in every one of ``parts``.

    Args:
        parts: Rows to intersect (none gives an empty result).

    Returns:
        Names present in all, with the intersected interval, empty results dropped, in the order
        of the first.
    """
    if not parts:
        return {}
    out: Rows = {}
    for name, (start, stop) in parts[0].items():
        for other in parts[1:]:
            if name not in other:
                break
            start, stop = max(start, other[name][0]), min(stop, other[name][1])
        else:
            if stop > start:
                out[name] = (start, stop)
    return out


def numel(rows: Rows, shapes: Mapping[str, Sequence[int]]) -> int:
    """Elements covered by ``rows``.

    Args:
        rows: the rows.
        shapes: name -> full shape (at least every name in ``rows``).
    """
    return sum((stop - start) * row_numel(shapes[name]) for name, (start, stop) in rows.items())


def nbytes(rows: Rows, shapes: Mapping[str, Sequence[int]], bytes_per_value: int = 4) -> int:
    """Bytes covered by ``rows``.

    Args:
        rows: the rows.
        shapes: name -> full shape (at least every name in ``rows``).
        bytes_per_value: size of one element (4 for fp32).
    """
    return numel(rows, shapes) * bytes_per_value


def _local(tensor, interval: tuple[int, int], offset: int) -> tuple[int, int] | None:
    """Local row bounds of global ``interval`` in ``tensor`` (None for 0-d), checked."""
    start, stop = int(interval[0]), int(interval[1])
    if tensor.ndim == 0:
        if (start, stop) != (0, 1) or offset != 0:
            raise ValueError(f"a 0-d tensor has only row (0, 1) at offset 0, not {interval} at {offset}")
        return None
    a, b = start - offset, stop - offset
    if not 0 <= a <= b <= tensor.shape[0]:
        raise ValueError(f"rows {interval} are not inside rows [{offset}, {offset + tensor.shape[0]})")
    return a, b


def take(tensor, interval: tuple[int, int], offset: int = 0):
    """Rows ``[start, stop)`` of a tensor whose first row is global row ``offset``, as a view.

    Args:
        tensor: a torch tensor or numpy array (a full tensor, or a rank's shard with ``offset``).
        interval: global half-open row interval; ``(0, 1)`` for a 0-d tensor, which is returned as is.
        offset: global index of ``tensor``'s first row.

    Raises:
        ValueError: the interval is not inside the tensor's rows.
    """
    local = _local(tensor, interval, offset)
    return tensor if local is None else tensor[local[0] : local[1]]


def put(dst, interval: tuple[int, int], src, offset: int = 0) -> None:
    """Copy ``src`` into rows ``[start, stop)`` of ``dst`` whose first row is global row ``offset``.

    Args:
        dst: the torch tensor (or numpy array) written in place; 0-d is fine.
        interval: global half-open row interval; ``(0, 1)`` for a 0-d ``dst``.
        src: the rows to write (torch or numpy), with as many elements as the interval covers.
        offset: global index of ``dst``'s first row.

    Raises:
        ValueError: the interval is not inside ``dst``'s rows or ``src`` has the wrong size.
    """
    view = take(dst, interval, offset)
    size = int(np.prod(view.shape))
    src_size = int(np.prod(tuple(src.shape))) if hasattr(src, "shape") else 1
    if src_size != size:
        raise ValueError(f"{src_size} values do not fill rows {interval} ({size} values)")
    if isinstance(view, torch.Tensor):
        view.copy_(torch.as_tensor(src).reshape(view.shape))
    else:
        np.copyto(view, np.asarray(src).reshape(view.shape), casting="unsafe")
