"""The door of the home's channel: who is calling, checked before anything else is done for the call.

:class:`CallGuard` is the gRPC server's one handler. gRPC asks it for a call's handler with
the call's metadata only, before a byte of the request is read and before a worker thread
is given to it; the guard reads the bearer token there and answers a call with a wrong or
missing token with a handler that refuses it without reading its body, so a caller with no
token holds no thread and no memory. A known token names the region that is calling (a
region is what its token says, not what it claims); each region may have
:data:`CALLS_PER_REGION` calls in flight, so one region stalling its calls cannot take the
threads the others need.

Every handler reads its request itself (as a stream: the body is read only once the call
is admitted) and runs the channel's function for it. A :class:`Refused` becomes the call's
status with one line; any other exception becomes "internal error" to the peer (its text
stays in the home's log). Refusals are logged through :class:`RefusalLog`, one line per
caller and reason per interval, so a flood of bad calls cannot flood the log.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

import grpc

from diloco_ray.channel.credentials import RegionTokens

CALLS_PER_REGION = 16  # a region's Wait, Beat, uploads and parallel downloads, with room to spare
LOG_EVERY_S = 10.0


class Refused(Exception):
    """A call the home refuses: ``code`` is its gRPC status, ``why`` the one line."""

    def __init__(self, code: grpc.StatusCode, why: str):
        super().__init__(why)
        self.code, self.why = code, why


class RefusalLog:
    """One line per (caller, reason) per ``every_s``; what was held back is counted in the next."""

    def __init__(self, log: Callable[[str], None], every_s: float = LOG_EVERY_S):
        self.log, self.every_s = log, every_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}  # -> (when said, held back since)

    def say(self, who: str, why: str, line: str) -> None:
        now = time.monotonic()
        with self._lock:
            said, held = self._last.get((who, why), (float("-inf"), 0))
            if now - said < self.every_s:
                self._last[(who, why)] = (said, held + 1)
                return
            if len(self._last) > 4096:  # callers long gone
                self._last.clear()
            self._last[(who, why)] = (now, 0)
        self.log(line + (f" ({held} more like it held back)" if held else ""))


def _peer_host(context) -> str:
    peer = context.peer() or "?"
    return peer.rsplit(":", 1)[0]


class CallGuard(grpc.GenericRpcHandler):
    """The channel's handler of every call (see the module docstring).

    Args:
        service: the service's name (calls are ``/service/Name``).
        calls: call name -> (function of (request bytes, region), whether it streams replies).
        tokens: who may call.
        region_key: the metadata key a region puts its claimed name under (for the log).
        log: where refusals and internal errors are said.
    """

    def __init__(self, service: str, calls: dict, tokens: RegionTokens, region_key: str, log: Callable[[str], None]):
        self.prefix, self.calls, self.tokens, self.region_key = f"/{service}/", calls, tokens, region_key
        self.refusals, self.log = RefusalLog(log), log
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def service(self, handler_call_details) -> Optional[grpc.RpcMethodHandler]:
        method = handler_call_details.method or ""
        name = method[len(self.prefix) :] if method.startswith(self.prefix) else None
        if name not in self.calls:
            return None  # gRPC answers UNIMPLEMENTED
        meta = {k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)}
        auth = meta.get("authorization", "")
        region = self.tokens.region_of(auth[len("Bearer ") :] if auth.startswith("Bearer ") else None)
        function, streams = self.calls[name]
        if region is None:
            claimed = meta.get(self.region_key, "?")[:64]
            refusal = Refused(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token")
            return self._handler(streams, lambda requests, context: self._refuse(context, claimed, refusal, True))
        if streams:

            def stream(requests, context):
                with self._slot(region, context):
                    request = _one(requests, context)
                    try:
                        yield from function(request, region)
                    except Exception as e:  # noqa: BLE001 - every failure is answered, none leaks its text
                        self._fail(context, region, name, e)

            return self._handler(True, stream)

        def unary(requests, context):
            with self._slot(region, context):
                request = _one(requests, context)
                try:
                    return function(request, region)
                except Exception as e:  # noqa: BLE001 - every failure is answered, none leaks its text
                    self._fail(context, region, name, e)

        return self._handler(False, unary)

    @staticmethod
    def _handler(streams: bool, behaviour) -> grpc.RpcMethodHandler:
        """A handler that reads its request as a stream (so a refused call's body is never
        read), answering one reply or a stream of them."""
        if streams:
            return grpc.stream_stream_rpc_method_handler(behaviour)
        return grpc.stream_unary_rpc_method_handler(behaviour)

    @contextmanager
    def _slot(self, region: str, context):
        with self._lock:
            busy = self._in_flight.get(region, 0)
            if busy < CALLS_PER_REGION:
                self._in_flight[region] = busy + 1
        if busy >= CALLS_PER_REGION:
            why = f"more than {CALLS_PER_REGION} calls at once"
            self._refuse(context, region, Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, why), False)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[region] -= 1

    def _fail(self, context, region: str, call: str, error: Exception) -> None:
        if isinstance(error, Refused):
            self._refuse(context, region, error, False)
        self.refusals.say(
            region, f"internal {type(error).__name__}", f"channel: {call} of region {region!r} failed: {error!r}"
        )
        context.abort(grpc.StatusCode.INTERNAL, f"region {region!r}: the home could not serve this {call}")

    def _refuse(self, context, region: str, refused: Refused, unauthenticated: bool) -> None:
        who = f"a caller claiming {region!r}" if unauthenticated else f"region {region!r}"
        line = f"{who} refused: {refused.why}"
        host = _peer_host(context)
        self.refusals.say(f"{host} {region}", refused.why.split(":")[0], f"channel: {line} (from {host})")
        context.abort(refused.code, line)


def _one(requests, context) -> bytes:
    """The call's one request (a unary call sends exactly one)."""
    request = next(requests, None)
    if request is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed: the call carried no request")
    return request
