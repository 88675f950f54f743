"""The home's end of the channel: one TLS port that the regions dial out to.

:class:`ChannelServer` is a gRPC server (gRPC comes with Ray) with one service of five
calls, each request and reply one checked frame (:mod:`diloco_ray.channel.frames`):

* ``Join``: a region joins with its agent's instance; it gets a session and what the home
  hands it (the job's config). An agent that reconnects (same instance) takes its session
  back; another agent of a region that is still connected is refused.
* ``Wait``: a long poll for the region's next notice (a small JSON object: a job, a stop).
* ``Put``: one chunk of an upload (a region's message to the home), at an offset, under a
  key the home asked this region for (:mod:`diloco_ray.channel.uploads`). A transfer that
  breaks is resumed where the home's copy ends, so no chunk crosses twice, and the whole is
  checked against its SHA-256 once it is complete.
* ``Get``: a download (a message the home published, or is about to: the call may wait
  for it), streamed in chunks from an offset.
* ``Beat``: the region is alive (its agent beats while its replicas train, so a region
  whose link went down is told apart from one that is busy).

Who calls is settled first, from the call's bearer token alone, before its body is read
(:mod:`diloco_ray.channel.guard`): a region is the region its token is listed under
(:class:`~diloco_ray.channel.credentials.RegionTokens`). Then the frame is checked, and
every header field typed and bounded (:mod:`diloco_ray.channel.headers`). A wrong token,
an unknown or busy region, a malformed, truncated, corrupt or oversized frame, a key not
the region's own is refused with one line at both ends naming the region and why, and the
channel goes on serving everyone else. The home's side of the traffic is the methods
:meth:`publish`, :meth:`notify`, :meth:`expect` and :meth:`take`.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import grpc

from diloco_ray.channel import frames, headers
from diloco_ray.channel.credentials import RegionTokens
from diloco_ray.channel.guard import CALLS_PER_REGION, CallGuard, Refused
from diloco_ray.channel.uploads import UploadRefused, Uploads, UploadUnexpected

SERVICE = "diloco.Channel"
REGION_KEY = "x-diloco-region"  # metadata: who is calling, so that even a bad frame is attributed
CHUNK_BYTES = 1 << 20  # a transfer's chunk: what one Put or one streamed Get reply carries
# HTTP/2 pings on an idle connection: a link that went down breaks the calls on it within
# about two of them, instead of after TCP's retransmissions give up (minutes).
KEEPALIVE_MS = 4000


def grpc_options(max_frame_bytes: int) -> list[tuple[str, int]]:
    """What both ends of the channel set: the message size limits (gRPC itself refuses a
    message over the frame limit), and keepalive pings."""
    limit = max_frame_bytes + frames.PREAMBLE_BYTES + frames.MAX_HEADER_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


@dataclass
class Session:
    """A connected region: its agent's instance, when it was last heard from, and whether
    its agent said it is ready (its replicas are up)."""

    region: str
    instance: str
    token: str
    seen: float
    ready: bool = False


class ChannelServer:
    """The home's end of the channel.

    Args:
        regions: the names of the regions that may join.
        tokens: every region's tokens: a call's token says which region is calling.
        cert, key: the home's TLS certificate and key (PEM bytes).
        host, port: where to listen (port 0: any free port; :meth:`start` returns it).
        max_frame_bytes: the largest frame accepted (a chunk and its header fit well under it).
        join_info: what a joining region is handed (region name -> JSON object).
        session_timeout_s: a region not heard from for this long is no longer connected
            (another agent of it may then join); an upload with no chunk for this long
            is let go.
        log: where the home's one-line refusals and joins go.
    """

    def __init__(
        self,
        *,
        regions: Iterable[str],
        tokens: RegionTokens,
        cert: bytes,
        key: bytes,
        host: str = "0.0.0.0",
        port: int = 0,
        max_frame_bytes: int = 8 << 20,
        join_info: Callable[[str], dict] = lambda region: {},
        session_timeout_s: float = 60.0,
        log: Callable[[str], None] = print,
    ):
        self.regions, self.tokens, self.max_frame_bytes = set(regions), tokens, max_frame_bytes
        self.join_info, self.session_timeout_s, self.log = join_info, session_timeout_s, log
        self._cert, self._key, self._address = cert, key, f"{host}:{port}"
        self._lock = threading.Condition()
        self._sessions: dict[str, Session] = {}  # region -> its live session
        self._published: dict[str, bytes] = {}
        self._void: set[str] = set()  # keys that will not be published: a Get of one ends at once
        self._uploads = Uploads(max_frame_bytes, stale_s=session_timeout_s)
        self._traffic: dict[str, list[int]] = {}  # region -> [frame bytes it sent, frame bytes it was sent]
        self._notices: dict[str, list] = {}
        # Notices are numbered from the clock: a home that restarts (from its checkpoint) numbers
        # on past what a region confirmed before, so the region still takes the new ones.
        self._seq = time.time_ns() // 1000
        self._server: Optional[grpc.Server] = None
        self.port: Optional[int] = None

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> int:
        """Listen; the bound port."""
        options = grpc_options(self.max_frame_bytes) + [
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 4),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.so_reuseport", 0),  # a second channel on the same port fails, rather than sharing its calls
        ]
        # Every region its own calls' worth of threads, and a few for refusing the others.
        workers = CALLS_PER_REGION * len(self.regions) + 8
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers), options=options, maximum_concurrent_rpcs=workers
        )
        calls = {
            "Join": (self._admitted("Join", self._join), False),
            "Wait": (self._admitted("Wait", self._wait), False),
            "Put": (self._admitted("Put", self._put), False),
            "Get": (self._admitted("Get", self._get), True),
            "Beat": (self._admitted("Beat", self._beat), False),
        }
        server.add_generic_rpc_handlers([CallGuard(SERVICE, calls, self.tokens, REGION_KEY, self.log)])
        credentials = grpc.ssl_server_credentials([(self._key, self._cert)])
        self.port = server.add_secure_port(self._address, credentials)
        server.start()
        self._server = server
        return self.port

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening; calls in flight get ``grace_s`` to finish."""
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        with self._lock:
            self._lock.notify_all()

    # ---- the home's side --------------------------------------------------------------
    def connected(self, ready: bool = False) -> set[str]:
        """The regions heard from within ``session_timeout_s`` (``ready``: those whose agent
        also said its replicas are up)."""
        now = time.monotonic()
        with self._lock:
            live = {r: s for r, s in self._sessions.items() if now - s.seen <= self.session_timeout_s}
            return {r for r, s in live.items() if s.ready or not ready}

    def publish(self, key: str, payload: bytes) -> None:
        """Make ``payload`` downloadable by any region as ``key``."""
        with self._lock:
            self._published[key] = bytes(payload)
            self._void.discard(key)
            self._lock.notify_all()

    def unpublish(self, key: str) -> None:
        with self._lock:
            self._published.pop(key, None)

    def void(self, key: str, void: bool = True) -> None:
        """``key`` will not be published (the weights it names died with a server): a
        region waiting for it hears so now, not when its Get's wait runs out. With
        ``void=False`` (the home makes it again) a Get waits for it again; publishing it
        does that too."""
        with self._lock:
            if void:
                self._void.add(key)
            else:
                self._void.discard(key)
            self._lock.notify_all()

    def is_void(self, key: str) -> bool:
        """Whether ``key`` was declared void (:meth:`void`) and not published since."""
        with self._lock:
            return key in self._void

    def notify(self, region: str, notice: dict) -> int:
        """Queue ``notice`` for ``region``'s next Wait (kept across its reconnects); its seq."""
        with self._lock:
            self._seq += 1
            self._pending(region).append((self._seq, notice))
            self._lock.notify_all()
            return self._seq

    def expect(self, region: str, key: str) -> None:
        """``region`` may upload ``key`` (its reply to a period, its answer to a save)."""
        with self._lock:
            self._uploads.expect(region, key)

    def take(self, key: str, timeout_s: Optional[float]) -> Optional[bytes]:
        """The upload ``key`` once it is complete and checked (removed from the channel),
        waiting up to ``timeout_s``; None if it has not arrived by then."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while not self._uploads.has(key):
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._server is None:
                    return None
                self._lock.wait(left)
            return self._uploads.take(key)

    def discard(self, key: str) -> None:
        """The home no longer waits for upload ``key``: drop it, now or when it arrives."""
        with self._lock:
            self._uploads.discard(key)

    def held_upload_bytes(self) -> int:
        """The bytes the channel holds of uploads in progress or not yet taken."""
        with self._lock:
            return self._uploads.held_bytes()

    def instance_of(self, region: str) -> Optional[str]:
        """The agent instance that holds ``region``'s session (None: it never joined)."""
        with self._lock:
            session = self._sessions.get(region)
            return session.instance if session is not None else None

    def traffic(self, region: str) -> tuple[int, int]:
        """The frame bytes ``region`` has sent the home and been sent by it so far (every
        call: requests and replies, retries included)."""
        with self._lock:
            up, down = self._traffic.get(region, (0, 0))
            return up, down

    def _count(self, region: str, up: int = 0, down: int = 0) -> None:
        with self._lock:
            if region in self.regions:
                counts = self._traffic.setdefault(region, [0, 0])
                counts[0] += up
                counts[1] += down

    def _pending(self, region: str) -> list:
        """``region``'s queued notices, (seq, notice) in order. They outlive its sessions: a
        region that reconnects gets what was sent while it was away."""
        return self._notices.setdefault(region, [])

    # ---- the calls --------------------------------------------------------------------
    def _join(self, h: dict, payload: bytes, region: str) -> bytes:
        instance, now = h["instance"], time.monotonic()
        with self._lock:
            held = self._sessions.get(region)
            live = held is not None and now - held.seen <= self.session_timeout_s
            if live and held.instance != instance:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"region {region!r} is already connected")
            session = Session(region, instance, secrets.token_hex(16), now, ready=h["ready"])
            self._sessions[region] = session
            if held is not None and held.instance != instance:
                self._notices[region] = []  # a new agent: what was queued for the old one is void
        self.log(f"channel: region {region!r} joined{' again' if held is not None else ''}")
        return frames.encode({"session": session.token, "info": self.join_info(region)})

    def _session(self, h: dict, region: str) -> Session:
        with self._lock:
            session = self._sessions.get(region)
            if session is None or session.token != h["session"]:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"region {region!r}: no such session (join again)")
            session.seen = time.monotonic()
            session.ready = h["ready"]
            return session

    def _wait(self, h: dict, payload: bytes, region: str) -> bytes:
        self._session(h, region)
        after, deadline = h["after"], time.monotonic() + h["wait_s"]
        with self._lock:
            while True:
                queue = self._pending(region)
                queue[:] = [(seq, n) for seq, n in queue if seq > after]  # what the region confirmed it has
                if queue or self._server is None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            seq, notice = queue[0] if queue else (after, None)
        return frames.encode({"seq": seq, "notice": notice})

    def _beat(self, h: dict, payload: bytes, region: str) -> bytes:
        self._session(h, region)
        return frames.encode({})

    def _put(self, h: dict, payload: bytes, region: str) -> bytes:
        self._session(h, region)
        with self._lock:
            try:
                have, whole = self._uploads.put(region, h["key"], h["offset"], h["total"], h["digest"], payload)
            except UploadUnexpected as unexpected:  # the region's agent lets it go (the home moved past it)
                raise Refused(grpc.StatusCode.NOT_FOUND, str(unexpected)) from None
            except UploadRefused as refused:
                code = grpc.StatusCode.DATA_LOSS if "corrupt" in str(refused) else grpc.StatusCode.PERMISSION_DENIED
                raise Refused(code, str(refused)) from None
            if whole:
                self._lock.notify_all()
        return frames.encode({"key": h["key"], "have": have})

    def _get(self, h: dict, payload: bytes, region: str):
        self._session(h, region)
        key, offset = h["key"], h["offset"]
        # A message may be asked for before it is published (a region starts its period while
        # the home still makes the weights it merges at the end): wait for it a while.
        deadline = time.monotonic() + h["wait_s"]
        with self._lock:
            while key not in self._published and key not in self._void and self._server is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            payload = self._published.get(key)
        if payload is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no message {key!r} is published")
        digest, total = frames.digest_of(payload), len(payload)
        for start in range(offset, max(total, 1), CHUNK_BYTES):
            chunk = payload[start : start + CHUNK_BYTES]
            yield frames.encode({"key": key, "offset": start, "total": total, "digest": digest}, chunk)

    # ---- checks every call passes -------------------------------------------------------
    def _admitted(self, call: str, function: Callable):
        """``function`` of (checked header, payload, region) as the guard calls it: with
        the request's frame decoded and its header checked, the frame naming the region the
        token says, and the call's bytes counted to that region."""

        def admit(request: bytes, region: str) -> tuple[dict, bytes]:
            try:
                frame = frames.decode(request, self.max_frame_bytes)
                h = headers.checked(call, frame.header, self.max_frame_bytes)
            except frames.BadFrame as bad:
                oversized = bad.why.startswith("oversized")
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if oversized else grpc.StatusCode.INVALID_ARGUMENT
                raise Refused(code, bad.why) from None
            except headers.BadHeader as bad:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, bad.why) from None
            if h["region"] != region:
                raise Refused(
                    grpc.StatusCode.PERMISSION_DENIED, f"the call claims {h['region']!r}, its token says {region!r}"
                )
            self._count(region, up=len(request))
            return h, frame.payload

        if call == "Get":

            def streamed(request: bytes, region: str):
                for reply in function(*admit(request, region), region):
                    self._count(region, down=len(reply))
                    yield reply

            return streamed

        def answered(request: bytes, region: str) -> bytes:
            reply = function(*admit(request, region), region)
            self._count(region, down=len(reply))
            return reply

        return answered
