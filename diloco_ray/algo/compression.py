"""Message buffers for DiLoCo pseudo-gradients and weights sent between replicas and parameter servers.

This module owns the encoding of a named set of tensors into one contiguous byte buffer
(:func:`pack` / :func:`unpack`), with the codecs of :mod:`diloco_ray.algo.codecs`, and error feedback
(:func:`compress`), which carries what a lossy codec dropped into the next round so the
quantisation error does not accumulate as a bias. Pure functions over torch tensors and
numpy arrays: no Ray, no I/O.

The wire format (a prefix, a JSON header, 8-byte-aligned sections) is
:mod:`diloco_ray.algo.wire_layout`'s; per tensor, ``scales`` holds fp32 absmax scales (int8
and int4 only, else empty) and ``payload`` the encoded values:

* ``none``  fp32 (4 B/value)           * ``fp16``  IEEE half, finite values saturated
* ``bf16``  bfloat16 bits, RNE         * ``int8``  q in [-127, 127], scale = absmax/127
* ``int4``  q in [-7, 7] stored as q+8 in nibbles, first value in the low nibble

int8/int4 scale each block of ``block`` consecutive values (of the flattened tensor);
* ``topk``  per block, the ``fraction`` of values largest in magnitude, 2 bits each, with
  their indices (layout: :mod:`diloco_ray.algo.topk`); ``fraction`` is in the header.

NaN/Inf never decode finite: the server rejects non-finite pseudo-gradients, so the codec
must not hide them (a block holding one gets a NaN scale).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import wire_layout
from diloco_ray.algo.codecs import (
    DEFAULT_BLOCK,
    DEFAULT_FRACTION,
    _check_codec,
    _decode,
    _decode_range,
    _encode_into,
    chunk_step,
    sections,
)


def pack(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    meta: Optional[dict] = None,
    block: int = DEFAULT_BLOCK,
    fraction: float = DEFAULT_FRACTION,
) -> np.ndarray:
    """Encode every tensor with ``codec`` into one contiguous ``np.uint8`` buffer.

    Args:
        tensors: name -> tensor; any float dtype, any shape (0-d and empty included),
            any device. Values are cast to fp32 first.
        codec: one of :data:`CODECS`.
        meta: JSON-serialisable dict carried in the header (round, replica, ...).
        block: values per absmax scale for int8/int4, per top-k selection for topk.
        fraction: topk only: the share of each block's values sent.

    Returns:
        The buffer (see the module docstring); ``len`` is exactly the bytes that travel.
    """
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    buf, _ = pack_filled(shapes, _copy_from(tensors), codec, meta, block, fraction=fraction)
    return buf


def pack_filled(
    shapes: Mapping[str, Sequence[int]],
    fill: Callable[[str, torch.Tensor], object],
    codec: str,
    meta: Optional[dict] = None,
    block: int = DEFAULT_BLOCK,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    allocate: Optional[Callable[[int], np.ndarray]] = None,
    fraction: float = DEFAULT_FRACTION,
) -> tuple[np.ndarray, Optional[dict[str, torch.Tensor]]]:
    """:func:`pack` whose values are written by ``fill``, with the buffer the only
    full-size allocation: the layout follows from the shapes alone, so the buffer is
    allocated first and ``fill(name, out)`` writes each tensor's fp32 values into ``out``
    -- its section of the buffer itself for codec ``none``, else one scratch tensor at a
    time, encoded into its section before the next is filled.

    Args:
        shapes: name -> shape of each tensor, in message order.
        fill: ``fill(name, out)`` writes that tensor's values into the fp32 tensor ``out``.
        codec, meta, block, fraction: as for :func:`pack`.
        residual: error feedback (lossy codecs only): name -> fp32 tensor of that shape,
            added to the values before encoding and overwritten in place with what the
            codec dropped (zeros for a non-finite tensor, so NaN/Inf is never carried).
            Names not in it get no feedback. None: no feedback, and no residual built.
        allocate: ``allocate(nbytes)`` returns the uint8 array the message is written
            into (any contents: every byte is written), so a caller can place it in
            memory it already holds. Default: a new array.

    Returns:
        ``(buffer, residual)``: the residual mapping given (updated), or None.
    """
    _check_codec(codec)
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    entries = wire_layout.layout(shapes, codec, block, fraction)
    buf, start = _start_message(entries, wire_layout.header(entries, codec, block, meta, fraction), allocate)
    body = buf[start:]
    if codec == "none":  # straight into the message, as fp32 (native little-endian)
        for name, shape, _, _, offset, length in entries:
            fill(name, torch.from_numpy(body[offset : offset + length].view("<f4")).view(tuple(shape)))
        return buf, None
    # One scratch tensor, reused: allocating one per tensor costs more, as freed blocks
    # are not always handed back to the OS.
    scratch = torch.empty(max((math.prod(e[1]) for e in entries), default=0))
    for entry in entries:
        flat = scratch[: math.prod(entry[1])]
        fill(entry[0], flat.view(tuple(entry[1])))
        feedback = residual.get(entry[0]) if residual is not None else None
        _encode_entry(body, entry, flat, feedback, codec, block, fraction)
    return buf, residual


def _start_message(
    entries: list[list], header: bytes, allocate: Optional[Callable[[int], np.ndarray]]
) -> tuple[np.ndarray, int]:
    """``(buffer, start of its data area)``: the buffer holds the prefix and ``header``, and
    zeros wherever no section of ``entries`` will write."""
    head = wire_layout.prefix(header)
    start, end = len(head), wire_layout.data_bytes(entries)
    if allocate is None:
        buf = np.zeros(start + end, dtype=np.uint8)  # zero pages cost nothing until written
    else:  # memory in use before: zero what no section writes (the gaps between sections)
        buf = allocate(start + end)
        written = sorted((e[2], e[3]) for e in entries) + sorted((e[4], e[5]) for e in entries)
        _zero_gaps(buf[start:], written)
    buf[:start] = head
    return buf, start


def _encode_entry(
    body: np.ndarray,
    entry: list,
    flat: torch.Tensor,
    feedback: Optional[torch.Tensor],
    codec: str,
    block: int,
    fraction: float,
) -> None:
    """Encode the fp32 values ``flat`` into ``entry``'s sections of ``body``; with
    ``feedback``, add it first and overwrite it with what the codec dropped (zeros if
    that is not finite). ``flat`` is scratch: it is left holding the dropped values."""
    _, shape, scales_off, scales_len, payload_off, payload_len = entry
    if feedback is not None:
        flat.add_(feedback.reshape(-1))
    scales, payload = body[scales_off : scales_off + scales_len], body[payload_off : payload_off + payload_len]
    _encode_into(flat, codec, block, scales, payload, fraction)
    if feedback is None:
        return
    finite = True
    for lo, values in Encoded(body, entry, codec, block, fraction).chunks():  # a chunk at a time
        dropped = flat[lo : lo + values.numel()].sub_(values)
        finite = finite and bool(torch.isfinite(dropped).all())
    feedback.copy_(flat.view(feedback.shape) if finite else torch.zeros(()))


def _zero_gaps(body: np.ndarray, sections: list[tuple[int, int]]) -> None:
    """Zero the bytes of ``body`` that no ``(offset, length)`` section covers."""
    at = 0
    for offset, length in sorted(sections):
        if offset > at:
            body[at:offset] = 0
        at = max(at, offset + length)
    body[at:] = 0


class Encoded:
    """One tensor of a packed buffer, not yet decoded: its ``shape`` now, its fp32
    values from :meth:`decode` (so a reader can check a message's layout first and
    then decode one tensor at a time, never holding the whole message decoded)."""

    def __init__(self, body: np.ndarray, entry: list, codec: str, block: int, fraction: float = DEFAULT_FRACTION):
        self._args = (body, entry, codec, block, fraction)
        self.shape = torch.Size(entry[1])

    def decode(self) -> torch.Tensor:
        return _decode(*self._args)

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first value, fp32 values)`` of the flattened tensor, a bounded chunk at a
        time (whole blocks, an even count): a reader never holds the tensor decoded."""
        body, entry, codec, block, fraction = self._args
        n = math.prod(entry[1])
        step = chunk_step(n, codec, block, fraction)
        for lo in range(0, n, step):
            yield lo, _decode_range(body, entry, codec, block, lo, min(n, lo + step), fraction)


def unpack(buf, lazy: bool = False) -> tuple[dict, dict]:
    """Decode a :func:`pack` buffer into (name -> fp32 tensor of the original shape, meta).

    Args:
        buf: np.uint8 array (read-only is fine, as Ray's object store hands out) or
            bytes-like. With codec ``none`` the returned tensors share memory with
            ``buf``: treat them as read-only (``.clone()`` before editing in place).
        lazy: return :class:`Encoded` tensors, decoded on demand.

    Raises:
        ValueError: ``buf`` is not a pack() buffer (bad magic, corrupt header, truncated).
    """
    data, header, start = wire_layout.parse_header(buf)
    codec, block, fraction = header["codec"], header["block"], header.get("fraction", DEFAULT_FRACTION)
    body = data[start:]
    out = {}
    for entry in header["tensors"]:
        try:
            name, shape, scales_off, scales_len, payload_off, payload_len = entry
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"bad shape {shape!r}")
            numel = math.prod(shape)
            expected = sum(sections(numel, codec, block, fraction))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"corrupt pack() header entry {entry!r}: {exc}") from exc
        if scales_len + payload_len != expected or scales_off % wire_layout.ALIGN or payload_off % wire_layout.ALIGN:
            raise ValueError(f"corrupt pack() header: tensor {name!r} sections do not match its shape")
        if max(scales_off + scales_len, payload_off + payload_len) > len(body):
            raise ValueError(f"truncated pack() buffer: tensor {name!r} ends past {len(data)} bytes")
        encoded = Encoded(body, entry, codec, block, fraction)
        out[name] = encoded if lazy else encoded.decode()
    return out, header["meta"]


def compress(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    residual: Optional[dict[str, torch.Tensor]],
    meta: Optional[dict] = None,
    block: int = DEFAULT_BLOCK,
    fraction: float = DEFAULT_FRACTION,
) -> tuple[np.ndarray, Optional[dict[str, torch.Tensor]]]:
    """Pack with error feedback: what the codec drops this round is sent in the next one.

    Args:
        tensors: name -> tensor to send (any float dtype; see :func:`pack`).
        codec: one of :data:`CODECS`.
        residual: the previous call's new residual, or None (a missing name counts as zeros).
        meta, block, fraction: as for :func:`pack`.

    Returns:
        ``(buf, new_residual)`` where ``buf = pack(tensors + residual)`` and
        ``new_residual = (tensors + residual) - unpack(buf)`` in fp32, one entry per name in
        ``tensors``. With codec ``none`` nothing is lost and the residual is None. A tensor
        whose sum is not finite gets a zero residual, so NaN/Inf is never carried forward.
    """
    _check_codec(codec)
    residual = residual or {}
    for name, tensor in tensors.items():
        if name in residual and residual[name].shape != tensor.shape:
            raise ValueError(
                f"residual {name!r} has shape {tuple(residual[name].shape)}, tensor has {tuple(tensor.shape)}"
            )
    new = None  # codec none is lossless: no residual to build
    if codec != "none":
        new = {
            n: residual[n].detach().to(torch.float32, copy=True) if n in residual else torch.zeros(t.shape)
            for n, t in tensors.items()
        }
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return pack_filled(shapes, _copy_from(tensors), codec, meta, block, new, fraction=fraction)


def _copy_from(tensors: Mapping[str, torch.Tensor]) -> Callable[[str, torch.Tensor], object]:
    """A :func:`pack_filled` ``fill`` that copies each named tensor's values."""
    return lambda name, out: out.copy_(tensors[name].detach().reshape(out.shape))


# ---- row pieces of named parameters -------------------------------------------------------
# Senders and receivers know the model's parameter order, so a message names a piece by
# its position, not its (often long) name: the header stays small even for many small
# tensors, e.g. LoRA adapters.


def pack_pieces(
    pieces: Mapping[str, torch.Tensor],
    starts: Mapping[str, int],
    names: Sequence[str],
    codec: str,
    meta: Optional[dict] = None,
    residual: Optional[dict[str, torch.Tensor]] = None,
    block: int = DEFAULT_BLOCK,
    fraction: float = DEFAULT_FRACTION,
) -> tuple[np.ndarray, Optional[dict[str, torch.Tensor]]]:
    """:func:`compress` of parameter row pieces: ``(buffer, new residual by name)``.

    Args:
        pieces: name -> rows of that parameter.
        starts: name -> the first row's index in the full parameter.
        names: every parameter name in model order (both ends use the same list).
        codec, meta, residual, block, fraction: as for :func:`compress` (residual keyed by name).
    """
    index = {n: i for i, n in enumerate(names)}
    keyed = {str(index[n]): t for n, t in pieces.items()}
    res = {str(index[n]): r for n, r in residual.items() if n in pieces} if residual is not None else None
    full_meta = {**(meta or {}), "rows": [int(starts[n]) for n in pieces]}
    buf, left = compress(keyed, codec, res, full_meta, block=block, fraction=fraction)
    by_name = {names[int(k)]: v for k, v in left.items()} if left is not None else None
    return buf, by_name


def pack_pieces_filled(
    shapes: Mapping[str, Sequence[int]],
    starts: Mapping[str, int],
    names: Sequence[str],
    fill: Callable[[str, torch.Tensor], object],
    codec: str,
    meta: Optional[dict] = None,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    block: int = DEFAULT_BLOCK,
    allocate: Optional[Callable[[int], np.ndarray]] = None,
    fraction: float = DEFAULT_FRACTION,
) -> np.ndarray:
    """:func:`pack_filled` of parameter row pieces (the message :func:`unpack_pieces` reads).

    Args:
        shapes: name -> shape of the rows sent of that parameter.
        starts: name -> the first row's index in the full parameter.
        names: every parameter name in model order.
        fill: ``fill(name, out)`` writes those rows, fp32, into ``out``.
        codec, meta, block, fraction: as for :func:`pack`.
        residual: name -> error-feedback residual of those rows, updated in place.
        allocate: as for :func:`pack_filled`.
    """
    index = {n: i for i, n in enumerate(names)}
    keyed = {str(index[n]): tuple(s) for n, s in shapes.items()}
    res = {str(index[n]): r for n, r in residual.items() if n in shapes} if residual is not None else None
    full_meta = {**(meta or {}), "rows": [int(starts[n]) for n in shapes]}
    buf, _ = pack_filled(
        keyed, lambda key, out: fill(names[int(key)], out), codec, full_meta, block, res, allocate, fraction
    )
    return buf


def unpack_pieces(buf, names: Sequence[str], lazy: bool = False) -> tuple[dict[str, tuple[int, torch.Tensor]], dict]:
    """Inverse of :func:`pack_pieces`: (name -> (first row, fp32 rows), meta); with
    ``lazy`` the rows are :class:`Encoded`, decoded on demand."""
    tensors, meta = unpack(buf, lazy)
    starts = meta.get("rows", [])
    if len(starts) != len(tensors):
        raise ValueError(f"message lists {len(starts)} row offsets for {len(tensors)} pieces")
    out = {}
    for (key, tensor), start in zip(tensors.items(), starts):
        if not key.isdigit() or int(key) >= len(names):
            raise ValueError(f"message names parameter #{key}, but the model has {len(names)}")
        out[names[int(key)]] = (int(start), tensor)
    return out, meta
