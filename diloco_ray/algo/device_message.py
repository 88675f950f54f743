"""Messages built and read on the device that holds the values: the messages of
:mod:`diloco_ray.algo.compression`, byte for byte, as one uint8 tensor where the tensors
live, and the one copy that moves a message between that device and the host.

:func:`pack_filled` is :func:`compression.pack_filled
<diloco_ray.algo.compression.pack_filled>` with the buffer on ``device``, in the same
:mod:`~diloco_ray.algo.wire_layout`: the header is laid out on the host (it follows from the
shapes alone) and copied up, each tensor is written by ``fill`` into device scratch and
encoded there by :mod:`diloco_ray.algo.device_codec`, and error feedback's residual is
updated in place on the device, so the pseudo-gradient never leaves it. :func:`to_host`
then brings a sync's messages down in one pinned buffer by asynchronous copies on a stream
of their own, waited on once (Ray must be handed host bytes); :class:`DownCopy` is that copy
not yet waited for, so the next inner steps can run while it lasts. The way up is :func:`to_device` (one staged,
asynchronous copy) and :func:`unpack_pieces`, which decodes on the device.

On the host (a CPU ``device``) the same code runs with torch's CPU kernels and writes exactly
the bytes and residuals of the host path: the tests hold the two together there. On a GPU the
finite values' bytes are the same too; :mod:`diloco_ray.algo.device_codec` says what may not be.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import compression, device_codec, wire_layout
from diloco_ray.algo.codecs import DEFAULT_BLOCK, DEFAULT_FRACTION, _check_codec


def pack_filled(
    shapes: Mapping[str, Sequence[int]],
    fill: Callable[[str, torch.Tensor], object],
    codec: str,
    meta: Optional[dict],
    device: torch.device,
    block: int = DEFAULT_BLOCK,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    fraction: float = DEFAULT_FRACTION,
) -> torch.Tensor:
    """The message of :func:`compression.pack_filled <diloco_ray.algo.compression.pack_filled>`
    as a uint8 tensor on ``device``.

    Args:
        shapes, fill, codec, meta, block, fraction: as for the host's ``pack_filled``;
            ``fill(name, out)`` writes fp32 values into ``out``, a tensor on ``device``
            (for codec ``none`` the message's own section).
        device: where the message is built (and the values are expected).
        residual: error feedback: name -> fp32 tensor on ``device``, added before encoding
            and overwritten with what the codec dropped (zeros when that is not finite).
    """
    _check_codec(codec)
    device_codec.check_byte_order()
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    entries = wire_layout.layout(shapes, codec, block, fraction)
    prefix = wire_layout.prefix(wire_layout.header(entries, codec, block, meta, fraction))
    start = len(prefix)
    # Zeros where no section writes (the gaps between sections): a device memset, cheap
    # beside the encoding.
    message = torch.zeros(start + wire_layout.data_bytes(entries), dtype=torch.uint8, device=device)
    message[:start].copy_(torch.from_numpy(prefix))
    body = message[start:]
    if codec == "none":  # straight into the message: its sections start on 8 bytes
        for name, shape, _, _, offset, length in entries:
            fill(name, body[offset : offset + length].view(torch.float32).view(tuple(shape)))
        return message
    scratch = torch.empty(max((math.prod(e[1]) for e in entries), default=0), device=device)
    for entry in entries:
        flat = scratch[: math.prod(entry[1])]
        fill(entry[0], flat.view(tuple(entry[1])))
        feedback = residual.get(entry[0]) if residual is not None else None
        _encode_entry(body, entry, flat, feedback, codec, block, fraction)
    return message


def _encode_entry(
    body: torch.Tensor,
    entry: list,
    flat: torch.Tensor,
    feedback: Optional[torch.Tensor],
    codec: str,
    block: int,
    fraction: float,
) -> None:
    """Encode ``flat`` into ``entry``'s sections of ``body``; with ``feedback``, add it
    first and overwrite it with what the codec dropped, zeros if that is not finite (the
    host's rule, judged on the device without waiting for it)."""
    name, shape, scales_off, scales_len, payload_off, payload_len = entry
    if feedback is not None:
        flat.add_(feedback.reshape(-1))
    scales, payload = body[scales_off : scales_off + scales_len], body[payload_off : payload_off + payload_len]
    device_codec.encode_into(flat, codec, block, fraction, scales, payload)
    if feedback is None:
        return
    finite = torch.ones((), dtype=torch.bool, device=flat.device)
    for lo, values in DeviceEncoded(body, entry, codec, block, fraction).chunks():
        dropped = flat[lo : lo + values.numel()].sub_(values)
        finite &= torch.isfinite(dropped).all()
    feedback.copy_(torch.where(finite, flat, torch.zeros((), device=flat.device)).view(feedback.shape))


def pack_pieces_filled(
    shapes: Mapping[str, Sequence[int]],
    starts: Mapping[str, int],
    names: Sequence[str],
    fill: Callable[[str, torch.Tensor], object],
    codec: str,
    meta: Optional[dict] = None,
    residual: Optional[Mapping[str, torch.Tensor]] = None,
    block: int = DEFAULT_BLOCK,
    fraction: float = DEFAULT_FRACTION,
    device: torch.device = torch.device("cpu"),
) -> torch.Tensor:
    """:func:`compression.pack_pieces_filled <diloco_ray.algo.compression.pack_pieces_filled>`
    on ``device``: the same message of parameter row pieces, as a uint8 tensor there."""
    index = {n: i for i, n in enumerate(names)}
    keyed = {str(index[n]): tuple(s) for n, s in shapes.items()}
    res = {str(index[n]): r for n, r in residual.items() if n in shapes} if residual is not None else None
    full_meta = {**(meta or {}), "rows": [int(starts[n]) for n in shapes]}
    return pack_filled(
        keyed, lambda key, out: fill(names[int(key)], out), codec, full_meta, device, block, res, fraction
    )


# ---- between the device and the host --------------------------------------------------------


class DownCopy:
    """Messages on their way to the host: one pinned buffer for them all, filled by one
    asynchronous copy per message on a copy stream of their device, so kernels queued after
    it (the next inner steps) run while the bytes come down. On the host the messages' own
    memory, already there.

    Args:
        messages: uint8 tensors, all on one device, whose kernels are queued on its current
            stream (the copies wait for them, not for anything queued later).
    """

    def __init__(self, messages: Sequence[torch.Tensor]):
        self.nbytes = [m.numel() for m in messages]
        self._arrays: Optional[list[np.ndarray]] = None
        self._copied: Optional[torch.cuda.Event] = None
        if all(m.device.type == "cpu" for m in messages):
            self._arrays = [m.numpy() for m in messages]
            return
        host = torch.empty(sum(self.nbytes), dtype=torch.uint8, pin_memory=True)
        stream = _copy_stream(messages[0].device)
        stream.wait_stream(torch.cuda.current_stream(messages[0].device))
        spans, at = [], 0
        with torch.cuda.stream(stream):
            for m in messages:
                host[at : at + m.numel()].copy_(m, non_blocking=True)
                m.record_stream(stream)  # its memory is not handed out again before the copy ends
                spans.append((at, at + m.numel()))
                at += m.numel()
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        self._host, self._spans = host, spans

    def wait(self) -> list[np.ndarray]:
        """The messages as host arrays, once the copy has ended (it waits for it only)."""
        if self._arrays is None:
            self._copied.synchronize()
            array = self._host.numpy()  # keeps the pinned buffer alive while any message is held
            self._arrays = [array[a:b] for a, b in self._spans]
            self._host = None
        return self._arrays


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream messages come down on, one per device, beside the one the steps run on."""
    device = torch.device(device)
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


def to_host(messages: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The messages as host arrays, what Ray is handed: a :class:`DownCopy`, waited for."""
    return DownCopy(messages).wait()


def to_device(buf, device: torch.device) -> torch.Tensor:
    """A message's bytes as a uint8 tensor on ``device``: on the host its own memory
    (read-only buffers, as Ray hands them out, are only read); on a GPU one copy into
    pinned memory (Ray's buffers are not pinned) and one asynchronous copy up, which the
    decoding kernels queue behind."""
    array = wire_layout.as_array(buf)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    staged = torch.empty(host.numel(), dtype=torch.uint8, pin_memory=True).copy_(host)
    return staged.to(device, non_blocking=True)


# ---- reading on the device ---------------------------------------------------------------


class DeviceEncoded:
    """One tensor of a message held on a device, not yet decoded: its ``shape`` now, its
    fp32 values on that device from :meth:`decode` or :meth:`chunks` (as
    :class:`~diloco_ray.algo.compression.Encoded` reads a host buffer)."""

    def __init__(self, body: torch.Tensor, entry: list, codec: str, block: int, fraction: float = DEFAULT_FRACTION):
        _, shape, scales_off, scales_len, payload_off, payload_len = entry
        self.shape = torch.Size(shape)
        self._numel = math.prod(shape)
        self._scales = body[scales_off : scales_off + scales_len]
        self._payload = body[payload_off : payload_off + payload_len]
        self._codec = (codec, block, fraction)

    def _range(self, lo: int, hi: int) -> torch.Tensor:
        codec, block, fraction = self._codec
        return device_codec.decode_range(self._scales, self._payload, self._numel, codec, block, fraction, lo, hi)

    def decode(self) -> torch.Tensor:
        return self._range(0, self._numel).view(self.shape)

    def chunks(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first value, fp32 values)`` of the flattened tensor, a bounded chunk at a time."""
        codec, block, fraction = self._codec
        step = device_codec.device_step(self._numel, codec, block, fraction)
        for lo in range(0, self._numel, step):
            yield lo, self._range(lo, min(self._numel, lo + step))


def unpack_pieces(
    buf, names: Sequence[str], device: torch.device, lazy: bool = False
) -> tuple[dict[str, tuple[int, torch.Tensor]], dict]:
    """:func:`compression.unpack_pieces <diloco_ray.algo.compression.unpack_pieces>` decoded
    on ``device``: the message is checked on the host (its header, every section's bounds),
    goes up once (:func:`to_device`) and is decoded there. With ``lazy`` the rows are
    :class:`DeviceEncoded`.

    Raises:
        ValueError: as the host's ``unpack_pieces`` (a bad or truncated message).
    """
    device_codec.check_byte_order()
    _, meta = compression.unpack_pieces(buf, names, lazy=True)  # checks the header and every section's bounds
    _, header, start = wire_layout.parse_header(buf)
    codec, block = header["codec"], header["block"]
    fraction = header.get("fraction", DEFAULT_FRACTION)
    body = to_device(buf, device)[start:]
    out = {}
    for entry, first in zip(header["tensors"], meta["rows"]):
        piece = DeviceEncoded(body, entry, codec, block, fraction)
        out[names[int(entry[0])]] = (int(first), piece if lazy else piece.decode())
    return out, meta
