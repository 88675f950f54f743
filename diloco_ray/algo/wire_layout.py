"""The layout of a message on the wire: where each tensor's sections lie, and the header
that says so. :mod:`diloco_ray.algo.compression` builds every message on it and reads it
with it, on whatever device.

Wire format (all integers little-endian)::

    offset 0   4 bytes   magic b"DLZ1" (a new layout gets a new magic)
    offset 4   u32       H = length of the JSON header in bytes
    offset 8   H bytes   UTF-8 JSON: {"codec": str, "block": int, ["fraction": float,] "meta": {...},
                          "tensors": [[name, shape, scales_off, scales_len,
                                       payload_off, payload_len], ...]}
    D = 8 + H rounded up to a multiple of 8: the data area, holding every section.

Section offsets are relative to D and are multiples of 8, so each section can be viewed
zero-copy as fp32 / int16 / int8. No padding follows the last section: ``len(buffer)``
is exactly the bytes that travel. What a section holds is the codec's business
(:mod:`diloco_ray.algo.codecs`). Pure functions over bytes and numpy arrays.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Mapping, Optional, Sequence

import numpy as np

from diloco_ray.algo.codecs import DEFAULT_FRACTION, Codec

MAGIC = b"DLZ1"
PREFIX_BYTES = 8  # magic + u32 header length
ALIGN = 8


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def layout(shapes: Mapping[str, Sequence[int]], codec: Codec) -> list[list]:
    """Each tensor's header entry ``[name, shape, scales_off, scales_len, payload_off,
    payload_len]``: its sections laid one after the other, each at a multiple of 8."""
    entries, offset = [], 0
    for name, shape in shapes.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, got {name!r}")
        numel = math.prod(shape)
        scales_len, payload_len = codec.sections(numel)
        payload_off = align(offset + scales_len)
        entries.append([name, list(shape), offset, scales_len, payload_off, payload_len])
        offset = align(payload_off + payload_len)
    return entries


def data_bytes(entries: list[list]) -> int:
    """The length of the data area that holds ``entries``' sections."""
    return max((e[4] + e[5] for e in entries), default=0)


def header(entries: list[list], codec: Codec, meta: Optional[dict]) -> bytes:
    """The JSON header, UTF-8 and compact."""
    head = {"codec": codec.name, "block": codec.block, "meta": dict(meta or {}), "tensors": entries}
    if codec.name == "topk":
        head["fraction"] = float(codec.fraction)
    return json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def prefix(header_bytes: bytes) -> np.ndarray:
    """A message's bytes before its data area: the magic, the header's length, the header,
    and zeros to the next multiple of 8 (its length is where the data area starts)."""
    out = np.zeros(align(PREFIX_BYTES + len(header_bytes)), dtype=np.uint8)
    out[:PREFIX_BYTES] = np.frombuffer(MAGIC + struct.pack("<I", len(header_bytes)), dtype=np.uint8)
    out[PREFIX_BYTES : PREFIX_BYTES + len(header_bytes)] = np.frombuffer(header_bytes, dtype=np.uint8)
    return out


def as_array(buf) -> np.ndarray:
    """A message's bytes as a flat uint8 array, without a copy (Ray's read-only buffers too)."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8:
            raise ValueError(f"packed buffer must be np.uint8, got {buf.dtype}")
        return buf.reshape(-1)
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except TypeError as exc:
        raise ValueError(f"not a packed buffer: {type(buf).__name__}") from exc


def parse_header(buf) -> tuple[np.ndarray, dict, int]:
    """(the buffer as uint8 array, header dict, start of the data area); ValueError if bad."""
    data = as_array(buf)
    head = data[:4].tobytes()
    if len(head) < 4 or head != MAGIC:
        raise ValueError(f"not a pack() buffer: bad magic {head!r} (expected {MAGIC!r}, {len(data)} bytes)")
    if len(data) < PREFIX_BYTES:
        raise ValueError(f"truncated pack() buffer: {len(data)} bytes, shorter than its {PREFIX_BYTES}-byte prefix")
    length = struct.unpack("<I", data[4:PREFIX_BYTES].tobytes())[0]
    if PREFIX_BYTES + length > len(data):
        raise ValueError(f"truncated pack() buffer: header needs {PREFIX_BYTES + length} bytes, have {len(data)}")
    try:
        header = json.loads(data[PREFIX_BYTES : PREFIX_BYTES + length].tobytes().decode("utf-8"))
        if not isinstance(header["meta"], dict) or not isinstance(header["tensors"], list):
            raise ValueError("bad field types")
        fraction = header.get("fraction", DEFAULT_FRACTION)
        if not isinstance(fraction, float):
            raise ValueError(f"bad fraction {fraction!r}")
        codec_of(header)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"corrupt pack() header: {exc}") from exc
    return data, header, align(PREFIX_BYTES + length)


def codec_of(header: dict) -> Codec:
    """The codec a parsed header names (ValueError: an unknown one, or bad settings)."""
    return Codec(header["codec"], header["block"], header.get("fraction", DEFAULT_FRACTION))


def check_entry(entry, codec: Codec, body_bytes: int) -> None:
    """Raise ValueError unless a header's tensor ``entry`` is well formed: its shape, its
    sections' lengths what ``codec`` writes for that shape, on 8 bytes, and within the
    ``body_bytes`` of the data area."""
    try:
        name, shape, scales_off, scales_len, payload_off, payload_len = entry
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad shape {shape!r}")
        expected = codec.nbytes(math.prod(shape))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"corrupt pack() header entry {entry!r}: {exc}") from exc
    if scales_len + payload_len != expected or scales_off % ALIGN or payload_off % ALIGN:
        raise ValueError(f"corrupt pack() header: tensor {name!r} sections do not match its shape")
    if max(scales_off + scales_len, payload_off + payload_len) > body_bytes:
        raise ValueError(f"truncated pack() buffer: tensor {name!r} ends past its {body_bytes}-byte data area")


def packed_meta(buf) -> dict:
    """The meta dict of a packed buffer, parsing only the header.

    Args:
        buf: a message (np.uint8 array, possibly read-only, or bytes-like).
    """
    return parse_header(buf)[1]["meta"]
