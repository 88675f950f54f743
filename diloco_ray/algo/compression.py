"""Message buffers for DiLoCo pseudo-gradients and weights sent between replicas and parameter servers.

This module owns the encoding of a named set of tensors into one contiguous byte buffer
(:func:`pack` / :func:`unpack`), with a :class:`~diloco_ray.algo.codecs.Codec`, and error
feedback (:func:`compress`), which carries what a lossy codec dropped into the next round so
the quantisation error does not accumulate as a bias. Pure functions over torch tensors: no
Ray, no I/O.

A message is built where its values live (:func:`pack_filled`'s ``device``): on the host, as
a uint8 tensor over numpy memory that Ray is handed as it is; on a GPU, as a uint8 tensor
there, so the values never leave it and only the message comes down
(:mod:`diloco_ray.algo.device_copy`). It is read the same way (:func:`unpack`'s ``device``):
the header is checked on the host, the message goes up once and is decoded there. The same
code runs on every device, with the same bytes (:mod:`~diloco_ray.algo.codecs` says what a
GPU may write otherwise).

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

from diloco_ray.algo import device_copy, wire_layout
from diloco_ray.algo.codecs import Codec, check_byte_order

HOST = torch.device("cpu")


def pack(tensors: Mapping[str, torch.Tensor], codec: Codec, meta: Optional[dict] = None) -> np.ndarray:
    """Encode every tensor with ``codec`` into one contiguous ``np.uint8`` buffer.

    Args:
        tensors: name -> tensor; any float dtype, any shape (0-d and empty included),
            any device. Values are cast to fp32 first.
        codec: the codec and its settings.
        meta: JSON-serialisable dict carried in the header (round, replica, ...).

    Returns:
        The buffer (see the module docstring); ``len`` is exactly the bytes that travel.
    """
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return pack_filled(shapes, _copy_from(tensors), codec, meta).numpy()


def pack_filled(
    shapes: Mapping[str, Sequence[int]],
    fill: Callable[[str, torch.Tensor], object],
    codec: Codec,
    meta: Optional[dict] = None,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    allocate: Optional[Callable[[int], np.ndarray]] = None,
    device: torch.device = HOST,
) -> torch.Tensor:
    """:func:`pack` whose values are written by ``fill``, with the message the only
    full-size allocation: the layout follows from the shapes alone, so the message is
    allocated first and ``fill(name, out)`` writes each tensor's fp32 values into ``out``
    -- its section of the message itself for codec ``none``, else one scratch tensor at a
    time, encoded into its section before the next is filled.

    Args:
        shapes: name -> shape of each tensor, in message order.
        fill: ``fill(name, out)`` writes that tensor's values into the fp32 tensor ``out``
            (on ``device``).
        codec, meta: as for :func:`pack`.
        residual: error feedback (lossy codecs only): name -> fp32 tensor of that shape on
            ``device``, added to the values before encoding and overwritten in place with
            what the codec dropped (zeros for a non-finite tensor, so NaN/Inf is never
            carried). Names not in it get no feedback.
        allocate: host only: ``allocate(nbytes)`` returns the uint8 array the message is
            written into (any contents: every byte is written), so a caller can place it in
            memory it already holds. Default: a new array.
        device: where the message is built, and the values and the residual are expected.

    Returns:
        The message, a uint8 tensor on ``device`` (on the host, ``.numpy()`` is its memory).
    """
    check_byte_order()
    entries = wire_layout.layout(shapes, codec)
    head = torch.from_numpy(wire_layout.prefix(wire_layout.header(entries, codec, meta)))
    message = _allocate(len(head), entries, allocate, torch.device(device))
    message[: len(head)].copy_(head)
    body = message[len(head) :]
    if codec.lossless:  # straight into the message: its sections start on 8 bytes
        for name, shape, _, _, offset, length in entries:
            fill(name, body[offset : offset + length].view(torch.float32).view(tuple(shape)))
        return message
    # One scratch tensor, reused: allocating one per tensor costs more, as freed blocks
    # are not always handed back to the OS.
    scratch = torch.empty(max((math.prod(e[1]) for e in entries), default=0), device=message.device)
    for entry in entries:
        flat = scratch[: math.prod(entry[1])]
        fill(entry[0], flat.view(tuple(entry[1])))
        feedback = residual.get(entry[0]) if residual is not None else None
        _encode_entry(Encoded(body, entry, codec), flat, feedback)
    return message


def _allocate(
    start: int, entries: list[list], allocate: Optional[Callable[[int], np.ndarray]], device: torch.device
) -> torch.Tensor:
    """A message of ``start`` bytes of prefix and ``entries``' data area, zero wherever no
    section will write."""
    nbytes = start + wire_layout.data_bytes(entries)
    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)  # a device memset, cheap
    if allocate is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))  # zero pages cost nothing until written
    message = torch.from_numpy(allocate(nbytes))  # memory in use before: zero the gaps between sections
    written = sorted((e[2], e[3]) for e in entries) + sorted((e[4], e[5]) for e in entries)
    _zero_gaps(message[start:], written)
    return message


def _encode_entry(encoded: Encoded, flat: torch.Tensor, feedback: Optional[torch.Tensor]) -> None:
    """Encode the fp32 values ``flat`` into ``encoded``'s sections; with ``feedback``, add
    it first and overwrite it with what the codec dropped (zeros if that is not finite,
    judged on the values' device without waiting for it). ``flat`` is scratch: it is left
    holding the dropped values."""
    if feedback is not None:
        flat.add_(feedback.reshape(-1))
    encoded.codec.encode_into(flat, encoded.scales, encoded.payload)
    if feedback is None:
        return
    finite = torch.ones((), dtype=torch.bool, device=flat.device)
    for lo, values in encoded.chunks():  # a chunk at a time
        dropped = flat[lo : lo + values.numel()].sub_(values)
        finite &= torch.isfinite(dropped).all()
    feedback.copy_(flat.view(feedback.shape))
    if flat.device.type == "cpu":  # known at once on the host; a GPU is not waited for
        if not finite:
            feedback.zero_()
    else:
        feedback.masked_fill_(~finite, 0.0)


def _zero_gaps(body: torch.Tensor, sections: list[tuple[int, int]]) -> None:
    """Zero the bytes of ``body`` that no ``(offset, length)`` section covers."""
    at = 0
    for offset, length in sorted(sections):
        if offset > at:
            body[at:offset] = 0
        at = max(at, offset + length)
    body[at:] = 0


class Encoded:
    """One tensor of a message, not yet decoded: its ``shape`` now, its fp32 values on the
    message's device from :meth:`decode` or :meth:`chunks` (so a reader can check a
    message's layout first and then decode one tensor at a time, never holding the whole
    message decoded).

    Args:
        body: the message's data area (a uint8 tensor).
        entry: the tensor's header entry.
        codec: the message's codec.
    """

    def __init__(self, body: torch.Tensor, entry: list, codec: Codec):
        _, shape, scales_off, scales_len, payload_off, payload_len = entry
        self.shape = torch.Size(shape)
        self.numel = math.prod(shape)
        self.scales = body[scales_off : scales_off + scales_len]
        self.payload = body[payload_off : payload_off + payload_len]
        self.codec = codec

    def _range(self, lo: int, hi: int) -> torch.Tensor:
        return self.codec.decode_range(self.scales, self.payload, self.numel, lo, hi)

    def decode(self) -> torch.Tensor:
        return self._range(0, self.numel).view(self.shape)

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first value, fp32 values)`` of the flattened tensor, a bounded chunk at a
        time (:meth:`Codec.step <diloco_ray.algo.codecs.Codec.step>`): a reader never holds
        the tensor decoded."""
        step = self.codec.step(self.numel, self.payload.device)
        for lo in range(0, self.numel, step):
            yield lo, self._range(lo, min(self.numel, lo + step))


def unpack(buf, lazy: bool = False, device: torch.device = HOST) -> tuple[dict, dict]:
    """Decode a :func:`pack` buffer into (name -> fp32 tensor of the original shape, meta).

    Args:
        buf: np.uint8 array (read-only is fine, as Ray's object store hands out) or
            bytes-like. On the host with codec ``none`` the returned tensors share memory
            with ``buf``: treat them as read-only (``.clone()`` before editing in place).
        lazy: return :class:`Encoded` tensors, decoded on demand.
        device: where the values are decoded: the header and every section's bounds are
            checked on the host first, then the message goes up once.

    Raises:
        ValueError: ``buf`` is not a pack() buffer (bad magic, corrupt header, truncated).
    """
    data, header, start = wire_layout.parse_header(buf)
    codec = wire_layout.codec_of(header)
    for entry in header["tensors"]:
        wire_layout.check_entry(entry, codec, len(data) - start)
    if data.ctypes.data % wire_layout.ALIGN:  # bytes that do not start on 8: sections view as fp32 from a copy
        data = data.copy()
    check_byte_order()
    body = device_copy.to_device(data, torch.device(device))[start:]  # on the host: its own memory
    out = {}
    for entry in header["tensors"]:
        encoded = Encoded(body, entry, codec)
        out[entry[0]] = encoded if lazy else encoded.decode()
    return out, header["meta"]


def compress(
    tensors: Mapping[str, torch.Tensor],
    codec: Codec,
    residual: Optional[dict[str, torch.Tensor]],
    meta: Optional[dict] = None,
) -> tuple[np.ndarray, Optional[dict[str, torch.Tensor]]]:
    """Pack with error feedback: what the codec drops this round is sent in the next one.

    Args:
        tensors: name -> tensor to send (any float dtype; see :func:`pack`).
        codec: the codec and its settings.
        residual: the previous call's new residual, or None (a missing name counts as zeros).
        meta: as for :func:`pack`.

    Returns:
        ``(buf, new_residual)`` where ``buf = pack(tensors + residual)`` and
        ``new_residual = (tensors + residual) - unpack(buf)`` in fp32, one entry per name in
        ``tensors``. With codec ``none`` nothing is lost and the residual is None. A tensor
        whose sum is not finite gets a zero residual, so NaN/Inf is never carried forward.
    """
    residual = residual or {}
    for name, tensor in tensors.items():
        if name in residual and residual[name].shape != tensor.shape:
            raise ValueError(
                f"residual {name!r} has shape {tuple(residual[name].shape)}, tensor has {tuple(tensor.shape)}"
            )
    new = None  # codec none is lossless: no residual to build
    if not codec.lossless:
        new = {
            n: residual[n].detach().to(torch.float32, copy=True) if n in residual else torch.zeros(t.shape)
            for n, t in tensors.items()
        }
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    return pack_filled(shapes, _copy_from(tensors), codec, meta, new).numpy(), new


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
    codec: Codec,
    meta: Optional[dict] = None,
    residual: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[np.ndarray, Optional[dict[str, torch.Tensor]]]:
    """:func:`compress` of parameter row pieces: ``(buffer, new residual by name)``.

    Args:
        pieces: name -> rows of that parameter.
        starts: name -> the first row's index in the full parameter.
        names: every parameter name in model order (both ends use the same list).
        codec, meta, residual: as for :func:`compress` (residual keyed by name).
    """
    index = {n: i for i, n in enumerate(names)}
    keyed = {str(index[n]): t for n, t in pieces.items()}
    res = {str(index[n]): r for n, r in residual.items() if n in pieces} if residual is not None else None
    buf, left = compress(keyed, codec, res, _with_rows(meta, starts, pieces))
    by_name = {names[int(k)]: v for k, v in left.items()} if left is not None else None
    return buf, by_name


def pack_pieces_filled(
    shapes: Mapping[str, Sequence[int]],
    starts: Mapping[str, int],
    names: Sequence[str],
    fill: Callable[[str, torch.Tensor], object],
    codec: Codec,
    meta: Optional[dict] = None,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    allocate: Optional[Callable[[int], np.ndarray]] = None,
    device: torch.device = HOST,
) -> torch.Tensor:
    """:func:`pack_filled` of parameter row pieces (the message :func:`unpack_pieces` reads).

    Args:
        shapes: name -> shape of the rows sent of that parameter.
        starts: name -> the first row's index in the full parameter.
        names: every parameter name in model order.
        fill: ``fill(name, out)`` writes those rows, fp32, into ``out``.
        codec, meta, allocate, device: as for :func:`pack_filled`.
        residual: name -> error-feedback residual of those rows, updated in place.
    """
    index = {n: i for i, n in enumerate(names)}
    keyed = {str(index[n]): tuple(s) for n, s in shapes.items()}
    res = {str(index[n]): r for n, r in residual.items() if n in shapes} if residual is not None else None
    full_meta = _with_rows(meta, starts, shapes)
    return pack_filled(keyed, lambda key, out: fill(names[int(key)], out), codec, full_meta, res, allocate, device)


def _with_rows(meta: Optional[dict], starts: Mapping[str, int], order: Mapping) -> dict:
    """``meta`` with ``rows``, the first row of each piece in message order."""
    return {**(meta or {}), "rows": [int(starts[n]) for n in order]}


def unpack_pieces(
    buf, names: Sequence[str], lazy: bool = False, device: torch.device = HOST
) -> tuple[dict[str, tuple[int, torch.Tensor]], dict]:
    """Inverse of :func:`pack_pieces`: (name -> (first row, fp32 rows), meta), decoded on
    ``device`` (see :func:`unpack`); with ``lazy`` the rows are :class:`Encoded`, decoded
    on demand."""
    tensors, meta = unpack(buf, lazy, device)
    starts = meta.get("rows", [])
    if len(starts) != len(tensors):
        raise ValueError(f"message lists {len(starts)} row offsets for {len(tensors)} pieces")
    out = {}
    for (key, tensor), start in zip(tensors.items(), starts):
        if not key.isdigit() or int(key) >= len(names):
            raise ValueError(f"message names parameter #{key}, but the model has {len(names)}")
        out[names[int(key)]] = (int(start), tensor)
    return out, meta
