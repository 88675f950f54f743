"""A region's end of the channel: it dials out to the home, so no region needs an open port.

:class:`ChannelClient` joins the home (:class:`~diloco_ray.channel.server.ChannelServer`)
over TLS with the bearer token, then long-polls for notices, downloads what the home
published and uploads its own messages, every request and reply one checked frame. When the
link breaks it retries with exponential backoff (a link that is down is a late region, not
a dead one) and joins again if the home no longer knows its session; a transfer that broke
resumes from where the other side's copy ends, so no chunk crosses twice. A refusal by the
home (wrong token, a region name already connected, a bad frame) is not retried: it raises
:class:`ChannelRefused` with the home's one line, which the region logs.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Optional

import grpc

from diloco_ray.channel import frames
from diloco_ray.channel.credentials import Token
from diloco_ray.channel.headers import MAX_WAIT_S
from diloco_ray.channel.server import CHUNK_BYTES, REGION_KEY, SERVICE, grpc_options

# A broken link or a home that is restarting: worth trying again after a pause.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# A home whose certificate this region refuses is tried again this long (it may be replacing
# its certificate), then the agent stops: a wrong CA, name or date does not mend itself.
TLS_GIVE_UP_S = 30.0
# What gRPC's status details say when the TLS handshake failed, and the one line for each.
TLS_REFUSALS = (
    ("Hostname Verification", "its certificate is not for the name dialled (--server-name)"),
    ("expired", "its certificate has expired"),
    ("not yet valid", "its certificate is not valid yet"),
    ("signature failure", "its certificate is not signed by --ca-cert"),
    ("CERTIFICATE_VERIFY_FAILED", "its certificate is not signed by --ca-cert"),
    ("andshake failed", "the TLS handshake failed"),
)


def tls_refusal(details: str) -> Optional[str]:
    """Why this region refused the home's certificate, from a call's status details (None:
    the call did not fail on TLS)."""
    return next((why for text, why in TLS_REFUSALS if text in details), None)


class ChannelRefused(Exception):
    """The home refused a call; the message is its one line (it names the region and why)."""


class ChannelDown(Exception):
    """The home could not be reached within the time allowed (the link is down)."""


class ChannelClient:
    """A region's connection to the home.

    Args:
        address: the home's ``host:port``.
        region: this region's name.
        token: the bearer token.
        ca_cert: the CA certificate (PEM bytes) the home's certificate is checked against.
        server_name: the name the home's certificate is checked for, when it is not the
            host in ``address`` (e.g. dialling an IP address).
        max_frame_bytes: the largest frame accepted (as the home's).
        backoff_s: (first, most) seconds between retries of a broken call.
        log: where this region's one-line notes (reconnects, refusals) go.
    """

    def __init__(
        self,
        address: str,
        region: str,
        token: Token,
        ca_cert: bytes,
        *,
        server_name: Optional[str] = None,
        max_frame_bytes: int = 8 << 20,
        backoff_s: tuple[float, float] = (0.5, 1.0),
        log: Callable[[str], None] = print,
    ):
        self.address, self.region, self.token = address, region, token
        self.max_frame_bytes, self.backoff_s, self.log = max_frame_bytes, backoff_s, log
        self.instance = uuid.uuid4().hex  # this agent process: a reconnect is told apart from a second agent
        self.session: Optional[str] = None
        self._joining = threading.Lock()
        self.ready = False  # this region's replicas are up: the home may hand it jobs (sent with every call)
        self.info: dict = {}
        self._still_down: set[str] = set()  # calls retrying at the longest pause, already said
        self._tls_refused_since: Optional[float] = None
        options = grpc_options(max_frame_bytes) + [
            ("grpc.http2.max_pings_without_data", 0),
            # A link back from an outage is dialled again within the backoff's longest pause.
            ("grpc.initial_reconnect_backoff_ms", int(backoff_s[0] * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(backoff_s[0] * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(backoff_s[1] * 1000)),
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_cert), options)
        self._meta = (("authorization", f"Bearer {token.secret}"), (REGION_KEY, region))

    def close(self) -> None:
        self._channel.close()

    # ---- the calls --------------------------------------------------------------------
    def join(self, give_up_after_s: Optional[float] = None) -> dict:
        """Join the home (retrying while it cannot be reached); what it hands this region."""
        reply = self._call("Join", {"instance": self.instance}, give_up_after_s=give_up_after_s, joined=False)
        self.session, self.info = reply.header["session"], reply.header.get("info") or {}
        return self.info

    def wait(self, after: int, wait_s: float = MAX_WAIT_S, give_up_after_s: Optional[float] = None):
        """(seq, notice) of the next notice after ``after``, or (after, None) when none came
        within ``wait_s``."""
        reply = self._call("Wait", {"after": after, "wait_s": wait_s}, give_up_after_s, timeout_s=wait_s + 30)
        return int(reply.header["seq"]), reply.header.get("notice")

    def beat(self, timeout_s: float) -> bool:
        """Tell the home this region is alive; False when the home could not be reached
        within ``timeout_s`` (one try: the next beat is the retry)."""
        if self.session is None:
            return False  # the call that finds the session gone joins again
        try:
            self._call_once("Beat", {}, timeout_s=timeout_s, joined=False)
            return True
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self.session = None  # the home forgot this session: the next call joins again
            return False

    def upload(self, key: str, payload: bytes, give_up_after_s: Optional[float] = None) -> None:
        """Send ``payload`` to the home as ``key``, chunk by chunk; after a break, from
        where the home's copy ends. An upload the home does not wait for (it moved past
        it, or restarted) is let go with one line: nobody would take it."""
        total, digest, have, probe = len(payload), frames.digest_of(payload), 0, False
        started, pause = time.monotonic(), self.backoff_s[0]
        while True:
            # After a break, first ask where the home's copy ends (offset -1, no data): the
            # chunk in flight may have arrived, and is then not sent again.
            chunk = b"" if probe else payload[have : have + CHUNK_BYTES]
            header = {"key": key, "offset": -1 if probe else have, "total": total, "digest": digest}
            try:
                have = int(self._call_once("Put", header, payload=chunk).header["have"])
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.NOT_FOUND:  # the home waits for no such upload (any more)
                    self.log(f"channel: {error.details()}; not sent")
                    return
                pause, probe = self._retry_or_raise(error, "Put", started, give_up_after_s, pause), True
                continue
            probe = False
            if have >= total:
                return

    def download(self, key: str, give_up_after_s: Optional[float] = None, wait_s: float = 0.0) -> bytes:
        """The message ``key`` the home published (waiting up to ``wait_s`` for it to be),
        checked against its digest; after a break, the rest from where this copy ends."""
        data, total, digest = bytearray(), None, None
        started = time.monotonic()
        pause = self.backoff_s[0]
        while total is None or len(data) < total:
            try:
                for reply in self._stream("Get", {"key": key, "offset": len(data), "wait_s": wait_s}):
                    h = reply.header
                    total, digest = int(h["total"]), str(h["digest"])
                    if int(h["offset"]) == len(data):
                        data += reply.payload
            except grpc.RpcError as error:
                pause = self._retry_or_raise(error, "Get", started, give_up_after_s, pause)
            if total == 0:
                break
        if frames.digest_of(bytes(data)) != digest:
            raise ChannelRefused(f"region {self.region!r}: message {key!r} arrived corrupt (digest mismatch)")
        return bytes(data)

    # ---- retries ----------------------------------------------------------------------
    def _call(
        self,
        method: str,
        header: dict,
        give_up_after_s: Optional[float],
        *,
        payload: bytes = b"",
        timeout_s: float = 120.0,
        joined: bool = True,
    ) -> frames.Frame:
        started, pause = time.monotonic(), self.backoff_s[0]
        while True:
            try:
                return self._call_once(method, header, payload=payload, timeout_s=timeout_s, joined=joined)
            except grpc.RpcError as error:
                pause = self._retry_or_raise(error, method, started, give_up_after_s, pause)

    def _call_once(
        self, method: str, header: dict, *, payload: bytes = b"", timeout_s: float = 120.0, joined: bool = True
    ) -> frames.Frame:
        """One try of a call (joining first when there is no session); raises what gRPC raised."""
        request = self._request(header, payload, joined)
        reply = self._channel.unary_unary(f"/{SERVICE}/{method}")(request, metadata=self._meta, timeout=timeout_s)
        return self._decode(reply)

    def _stream(self, method: str, header: dict):
        request = self._request(header, b"", joined=True)
        for reply in self._channel.unary_stream(f"/{SERVICE}/{method}")(request, metadata=self._meta, timeout=600):
            yield self._decode(reply)

    def _request(self, header: dict, payload: bytes, joined: bool) -> bytes:
        """A call's frame: its header with who is calling, and whether this region is ready
        (joining first when there is no session and the call needs one)."""
        if joined and self.session is None:
            with self._joining:  # one join at a time (the agent beats from a thread of its own)
                if self.session is None:
                    self.join()
        return frames.encode({**header, "region": self.region, "session": self.session, "ready": self.ready}, payload)

    def _decode(self, reply: bytes) -> frames.Frame:
        self._still_down.clear()  # the home answered: a later break is said again
        self._tls_refused_since = None
        try:
            return frames.decode(reply, self.max_frame_bytes)
        except frames.BadFrame as bad:
            line = f"region {self.region!r}: the home's reply was refused: {bad.why}"
            self.log(line)
            raise ChannelRefused(line) from None

    def _retry_or_raise(
        self, error: grpc.RpcError, method: str, started: float, give_up_after_s: Optional[float], pause: float
    ) -> float:
        """Sleep before the next try of a call that broke (the next pause), or raise."""
        code = error.code()
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            self.log(f"region {self.region!r}: the home no longer knows this session; joining again")
            self.session = None  # the next try joins first
            return pause
        if code not in RETRYABLE:
            line = error.details() or f"{method}: {code.name}"
            self.log(f"channel: {line}")
            raise ChannelRefused(line) from None
        tls = tls_refusal(error.details() or "")
        if tls is not None:
            return self._tls_retry(tls, pause)
        if give_up_after_s is not None and time.monotonic() - started + pause > give_up_after_s:
            unreachable = f"the home at {self.address} unreachable for {give_up_after_s:g}s"
            raise ChannelDown(f"region {self.region!r}: {unreachable}")
        broke = f"region {self.region!r}: {method} to {self.address} broke ({code.name})"
        if pause < self.backoff_s[1]:
            self.log(f"{broke}; retrying in {pause:.1f}s")
        elif method not in self._still_down:  # one line, not one a second, for a long outage
            self._still_down.add(method)
            self.log(f"{broke}; retrying every {pause:.1f}s")
        time.sleep(pause)
        return min(pause * 2, self.backoff_s[1])

    def _tls_retry(self, why: str, pause: float) -> float:
        """Sleep before trying a home whose certificate was refused again, or raise once it
        has been refused for :data:`TLS_GIVE_UP_S`."""
        line = f"region {self.region!r}: the home at {self.address} was refused: {why}"
        now = time.monotonic()
        if self._tls_refused_since is None:
            self._tls_refused_since = now
            self.log(f"{line}; trying again for {TLS_GIVE_UP_S:g}s")
        elif now - self._tls_refused_since >= TLS_GIVE_UP_S:
            raise ChannelRefused(line)
        time.sleep(pause)
        return min(pause * 2, self.backoff_s[1])
