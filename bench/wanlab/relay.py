"""A userspace TCP relay that delays what crosses it: the one channel port between a region and the home.

``tc netem`` is not available here, so a long link's delay is added in userspace. A
:class:`Relay` listens on one address and, for every connection it accepts, opens one to
the home (``to``) and forwards both directions, each chunk it reads written onward
``delay_ms`` after it was read, in order. What it holds per direction is bounded
(``max_buffer_bytes``): past that it stops reading, so TCP's flow control pushes back on
the sender as a full link would.

:meth:`Relay.cut` is an outage: every open connection is dropped (reset) and new ones are
refused (accepted and reset at once) until :meth:`Relay.restore`; ``cut(blackhole=True)``
instead keeps every connection open and forwards nothing (a link that went silent: the
peers find out by their own keepalives), and resets them on restore.

What it does not model:

* each TCP leg (region to relay, relay to home) is a connection of its own with the short
  RTT of its own hop; the delay sits between them, so TCP's congestion control and window
  never see the long round trip (slow start, a window too small for the
  bandwidth-delay product). Throughput through it is the legs' rate, not what one TCP
  connection over a long RTT would reach;
* a chunk (what one ``recv`` returned, up to ``CHUNK_BYTES``) is delayed as a whole, not
  each packet; no loss, no reordering, no jitter.

Run as a process: ``python bench/wanlab/relay.py --listen IP:PORT --to IP:PORT --delay-ms N``
(SIGUSR1 cuts, SIGUSR2 restores, SIGINT/SIGTERM stop it).
"""

from __future__ import annotations

import argparse
import collections
import signal
import socket
import struct
import sys
import threading
import time

CHUNK_BYTES = 64 << 10
# A leg whose peer vanished (a blackholed link) gives up after this long unacknowledged:
# the relay then drops the connection rather than hold a thread for it.
USER_TIMEOUT_MS = 60_000


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (linger 0): the peer learns at once that it is gone."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Pipe:
    """One direction of one connection: a reader thread queues chunks, a writer thread
    sends each ``delay_s`` after it was read."""

    def __init__(self, conn: "_Connection", src: socket.socket, dst: socket.socket, count: str):
        self.conn, self.src, self.dst, self.count = conn, src, dst, count
        self.queue: collections.deque = collections.deque()  # (due, chunk); chunk None: the sender's EOF
        self.held = 0
        self.cond = threading.Condition()

    def start(self) -> None:
        for target in (self._read, self._write):
            threading.Thread(target=target, daemon=True).start()

    def _read(self) -> None:
        relay = self.conn.relay
        while not self.conn.closed:
            with self.cond:  # bounded: past the limit, stop reading until the writer drains
                while self.held >= relay.max_buffer_bytes and not self.conn.closed:
                    self.cond.wait(0.5)
            try:
                chunk = self.src.recv(CHUNK_BYTES)
            except OSError:
                self.conn.close()
                return
            if self.conn.closed:
                return
            if relay.silent:  # blackholed: what arrives is lost
                if not chunk:
                    return
                continue
            with self.cond:
                self.queue.append((time.monotonic() + relay.delay_s, chunk or None))
                self.held += len(chunk)
                self.cond.notify_all()
            if not chunk:
                return

    def _write(self) -> None:
        relay = self.conn.relay
        while True:
            with self.cond:
                while not self.queue and not self.conn.closed:
                    self.cond.wait(0.5)
                if self.conn.closed:
                    return
                due, chunk = self.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if relay.silent and chunk is not None:
                    pass  # blackholed while in flight: lost
                elif chunk is None:
                    self.dst.shutdown(socket.SHUT_WR)  # the sender's EOF, passed on in order
                else:
                    self.dst.sendall(chunk)
            except OSError:
                self.conn.close()
                return
            with self.cond:
                self.queue.popleft()
                self.held -= len(chunk or b"")
                self.cond.notify_all()
            if chunk is None:
                self.conn.half_closed()
                return
            relay.add(self.count, len(chunk))


class _Connection:
    """An accepted connection and the one the relay opened to the home for it."""

    def __init__(self, relay: "Relay", client: socket.socket, home: socket.socket):
        self.relay, self.client, self.home = relay, client, home
        self.closed = False
        self._ends = 0
        self._lock = threading.Lock()
        self.pipes = [_Pipe(self, client, home, "bytes_up"), _Pipe(self, home, client, "bytes_down")]

    def start(self) -> None:
        for pipe in self.pipes:
            pipe.start()

    def half_closed(self) -> None:
        """One direction ended cleanly; when both have, the connection is done."""
        with self._lock:
            self._ends += 1
            done = self._ends == 2
        if done:
            self.close(reset=False)

    def close(self, reset: bool = True) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.home):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in recv
            except OSError:
                pass
            if reset:
                _reset(sock)
            else:
                sock.close()
        for pipe in self.pipes:
            with pipe.cond:
                pipe.cond.notify_all()
        self.relay.forget(self)


class Relay:
    """A delaying TCP relay for one port.

    Args:
        listen: (host, port) to listen on; port 0 picks a free one (:meth:`start` returns it).
        to: (host, port) every accepted connection is relayed to.
        delay_ms: one-way delay added to every chunk, each direction.
        max_buffer_bytes: the most held per direction of a connection before it stops reading.
    """

    def __init__(self, listen=("127.0.0.1", 0), to=("127.0.0.1", 0), delay_ms: float = 0, max_buffer_bytes=16 << 20):
        self.listen, self.to = (listen[0], int(listen[1])), (to[0], int(to[1]))
        self.delay_s, self.max_buffer_bytes = delay_ms / 1000.0, max_buffer_bytes
        self.bytes_up = 0  # forwarded toward ``to``
        self.bytes_down = 0  # forwarded back to the connecting side
        self.is_cut = False
        self.silent = False  # blackholed: connections stay open and nothing is forwarded
        self._conns: set[_Connection] = set()
        self._held: list[socket.socket] = []  # connections accepted while blackholed
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._stopped = threading.Event()

    def start(self) -> int:
        """Listen, and relay in a thread; the port listened on."""
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(self.listen)
        self._server.listen(64)
        self._server.settimeout(0.2)
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self._server.getsockname()[1]

    def add(self, counter: str, n: int) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            self._conns.discard(conn)

    def cut(self, blackhole: bool = False) -> None:
        """An outage until :meth:`restore`: drop (reset) every connection and refuse new
        ones; ``blackhole``: keep them, and new ones, open and forward nothing."""
        with self._lock:
            self.is_cut, self.silent = True, blackhole
            conns = [] if blackhole else list(self._conns)
        for conn in conns:
            conn.close()

    def restore(self) -> None:
        """The link is back: connections are relayed again (blackholed ones are reset, as a
        peer that kept no state for them would)."""
        with self._lock:
            conns = list(self._conns) if self.silent else []
            held, self._held = self._held, []
            self.is_cut = self.silent = False
        for conn in conns:
            conn.close()
        for sock in held:
            _reset(sock)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._stopped.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            conns, held, self._held = list(self._conns), self._held, []
        for conn in conns:
            conn.close()
        for sock in held:
            _reset(sock)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            if self.is_cut:
                if self.silent:
                    with self._lock:
                        self._held.append(client)
                else:
                    _reset(client)  # refused
                continue
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        try:
            home = socket.create_connection(self.to, timeout=10)
        except OSError:
            _reset(client)
            return
        home.settimeout(None)
        for sock in (client, home):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
        conn = _Connection(self, client, home)
        with self._lock:
            if self.is_cut and not self.silent:  # cut while this one was being opened
                conn.closed = True
            else:
                self._conns.add(conn)
        if conn.closed:
            _reset(client)
            _reset(home)
            return
        conn.start()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, metavar="IP:PORT")
    parser.add_argument("--to", required=True, metavar="IP:PORT")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added each direction")
    args = parser.parse_args()
    relay = Relay(_address(args.listen), _address(args.to), args.delay_ms)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: relay.cut())
    signal.signal(signal.SIGUSR2, lambda *_: relay.restore())
    port = relay.start()
    print(f"relay: listening on {relay.listen[0]}:{port}, to {args.to}, {args.delay_ms:g} ms each way", flush=True)
    while not stop.wait(1.0):
        pass
    relay.close()
    print(f"relay: {relay.bytes_up} bytes up, {relay.bytes_down} down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
