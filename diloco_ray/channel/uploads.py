"""The home's uploads: what each region may send, what it has sent so far, and what arrived whole.

A region uploads only under keys the home asked it for (:meth:`Uploads.expect`: a period's
reply key, a checkpoint's save key), so it can neither write another region's key nor fill
the home with uploads nobody waits for, and a message replayed under an old key is refused
by its key. Each upload is bounded: its declared size by the channel's limit (a reply is
read as one frame), its bytes by its declared size, its age by ``stale_s`` without a chunk
(its bytes are then let go and the region starts it again from nothing). What arrives
whole and matches its SHA-256 waits in :meth:`take`'s reach; a late chunk of a key the home
took or stopped waiting for (:meth:`discard`) is answered as complete and not kept.

Not thread-safe on its own: :class:`~diloco_ray.channel.server.ChannelServer` calls it under
its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from diloco_ray.channel import frames

MAX_CLOSED = 4096  # closed keys remembered, so that a late chunk of one is let go quietly


class UploadRefused(Exception):
    """An upload chunk the home does not take; the message is the one line why."""


class UploadUnexpected(UploadRefused):
    """An upload under a key the home does not wait for from this region (never asked for,
    or asked by a home that has since restarted): nobody will take it."""


@dataclass
class Upload:
    """An upload in progress: the bytes so far, the whole's size and digest, and when it
    last grew."""

    total: int
    digest: str
    touched: float
    data: bytearray = field(default_factory=bytearray)


class Uploads:
    """Every region's uploads at the home (see the module docstring).

    Args:
        max_bytes: the largest upload taken.
        stale_s: an upload with no chunk for this long is let go.
    """

    def __init__(self, max_bytes: int, stale_s: float):
        self.max_bytes, self.stale_s = max_bytes, stale_s
        self._expected: dict[str, str] = {}  # key -> the region that may upload it
        self._closed: dict[str, str] = {}  # keys taken or given up on -> their region: a late chunk is let go
        self._partial: dict[str, Upload] = {}
        self._received: dict[str, bytes] = {}

    def expect(self, region: str, key: str) -> None:
        """``region`` may upload ``key`` (once)."""
        self._expected[key] = region
        self._closed.pop(key, None)

    def discard(self, key: str) -> None:
        """The home no longer waits for ``key``: drop it, now or when it arrives."""
        region = self._expected.pop(key, None)
        self._partial.pop(key, None)
        self._received.pop(key, None)
        if region is not None:
            self._close(key, region)

    def take(self, key: str) -> Optional[bytes]:
        """Upload ``key`` if it arrived whole (it is then the home's, not the channel's)."""
        payload = self._received.pop(key, None)
        if payload is not None:
            self._close(key, self._expected.pop(key))
        return payload

    def has(self, key: str) -> bool:
        return key in self._received

    def put(self, region: str, key: str, offset: int, total: int, digest: str, chunk: bytes) -> tuple[int, bool]:
        """Add ``chunk`` at ``offset`` of ``region``'s upload ``key`` (offset -1, no data: a
        probe of where the home's copy ends). Returns (the bytes the home holds, whether
        the upload just arrived whole).

        Raises:
            UploadRefused: a key not this region's to upload, a size over the limit, a
                chunk past the declared size, or a whole that does not match its digest.
        """
        if self._closed.get(key) == region or (key in self._received and self._expected[key] == region):
            return total, False  # taken, given up on or whole (the reply to its last chunk was lost)
        if self._expected.get(key) != region:
            raise UploadUnexpected(f"upload {key!r} is not one the home waits for from this region")
        if total > self.max_bytes:
            raise UploadRefused(f"upload {key!r} declares {total} bytes, over the limit of {self.max_bytes}")
        self._let_go_stale()
        upload = self._partial.get(key)
        now = time.monotonic()
        if upload is None or (upload.total, upload.digest) != (total, digest):
            upload = self._partial[key] = Upload(total, digest, now)
        if offset == len(upload.data) and chunk:
            if len(upload.data) + len(chunk) > total:
                raise UploadRefused(f"upload {key!r}: a chunk runs past the declared {total} bytes")
            upload.data += chunk
            upload.touched = now
        if len(upload.data) < total:
            return len(upload.data), False
        del self._partial[key]
        if frames.digest_of(bytes(upload.data)) != digest:
            raise UploadRefused(f"corrupt: upload {key!r} does not match its digest")
        self._received[key] = bytes(upload.data)
        return total, True

    def held_bytes(self) -> int:
        """The bytes of every upload in progress and every one not yet taken."""
        return sum(len(u.data) for u in self._partial.values()) + sum(len(b) for b in self._received.values())

    def _close(self, key: str, region: str) -> None:
        self._closed[key] = region
        while len(self._closed) > MAX_CLOSED:  # the oldest: its region has long moved on
            del self._closed[next(iter(self._closed))]

    def _let_go_stale(self) -> None:
        cutoff = time.monotonic() - self.stale_s
        for key in [k for k, u in self._partial.items() if u.touched < cutoff]:
            del self._partial[key]
