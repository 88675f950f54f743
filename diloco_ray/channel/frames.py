"""The one message format of the channel between regions: a checksummed, size-limited frame.

Every request and every reply that crosses the channel is one frame: a fixed preamble, a
small JSON header (what the message is: the region, the session, a transfer's key and
offset, a notice) and an opaque payload (a chunk of a weights message or of a regional
pseudo-gradient). The preamble states both lengths and the SHA-256 of header and payload,
so a truncated, corrupted or oversized message is recognised before anything acts on it,
and refused with one line that says which of those it was (:class:`BadFrame`).

Layout (big-endian)::

    magic b"DLRC" | version u8 | header length u32 | payload length u64 | sha256 32 bytes
    | header (UTF-8 JSON object) | payload

This module is pure: bytes in, bytes out, no sockets, no gRPC.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

MAGIC = b"DLRC"
VERSION = 1
_PREAMBLE = struct.Struct(">4sBIQ32s")
PREAMBLE_BYTES = _PREAMBLE.size
MAX_HEADER_BYTES = 64 * 1024  # a header names things; it never carries data


class BadFrame(ValueError):
    """A message that is not a well-formed frame: ``why`` says how, in a few words."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


@dataclass(frozen=True)
class Frame:
    """One decoded message.

    Args:
        header: what the message is (a JSON object).
        payload: its data, possibly empty.
    """

    header: dict = field(default_factory=dict)
    payload: bytes = b""


def encode(header: dict, payload: bytes = b"") -> bytes:
    """``header`` and ``payload`` as one frame."""
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"a frame header of {len(head)} bytes is over {MAX_HEADER_BYTES}")
    digest = hashlib.sha256(head + payload).digest()
    return _PREAMBLE.pack(MAGIC, VERSION, len(head), len(payload), digest) + head + payload


def decode(data: bytes, max_bytes: int) -> Frame:
    """The frame in ``data``, checked: at most ``max_bytes`` long, whole (its lengths match
    what arrived), and intact (its checksum matches). Raises :class:`BadFrame` otherwise."""
    if len(data) > max_bytes:
        raise BadFrame(f"oversized: {len(data)} bytes, over the limit of {max_bytes}")
    if len(data) < PREAMBLE_BYTES:
        raise BadFrame(f"truncated: {len(data)} bytes, shorter than a frame's preamble")
    magic, version, head_len, payload_len, digest = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise BadFrame("malformed: not a diloco-ray channel frame")
    if version != VERSION:
        raise BadFrame(f"malformed: frame version {version}, this side speaks {VERSION}")
    expected = PREAMBLE_BYTES + head_len + payload_len
    if len(data) < expected:
        raise BadFrame(f"truncated: {len(data)} of {expected} bytes arrived")
    if len(data) > expected or head_len > MAX_HEADER_BYTES:
        raise BadFrame(f"malformed: {len(data)} bytes where the preamble says {expected}")
    body = memoryview(data)[PREAMBLE_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise BadFrame("corrupt: its checksum does not match its bytes")
    try:
        header = json.loads(bytes(body[:head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadFrame("malformed: its header is not JSON") from None
    except RecursionError:  # nested past what a header ever needs
        raise BadFrame("malformed: its header is nested too deep") from None
    if not isinstance(header, dict):
        raise BadFrame("malformed: its header is not a JSON object")
    return Frame(header, bytes(body[head_len:]))


def digest_of(payload: bytes) -> str:
    """The hex SHA-256 a whole transfer is checked against once all its chunks arrived."""
    return hashlib.sha256(payload).hexdigest()
