"""bench/wanlab/relay.py on real sockets: it adds its delay each way, keeps the bytes in order,
counts them, and an outage (cut) drops connections and refuses new ones until restored."""

import os
import socket
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
from wanlab.relay import Relay  # noqa: E402


class Echo:
    """A TCP server that sends back what it reads, one thread per connection."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def close(self):
        self.server.close()


@pytest.fixture
def echo():
    server = Echo()
    yield server
    server.close()


def round_trip(port: int, payload: bytes) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.monotonic()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            assert chunk, "closed early"
            got += chunk
        return time.monotonic() - started, got


def test_a_round_trip_takes_twice_the_delay_and_keeps_the_bytes(echo):
    relay = Relay(listen=("127.0.0.1", 0), to=("127.0.0.1", echo.port), delay_ms=60)
    port = relay.start()
    try:
        seconds, got = round_trip(port, b"x")
        assert 0.12 <= seconds < 0.5, seconds  # 60 ms up, 60 ms down
        payload = os.urandom(3 << 20)  # many chunks, in order
        _, got = round_trip(port, payload)
        assert got == payload
        time.sleep(0.2)  # the last chunk's count follows its send
        assert relay.bytes_up == relay.bytes_down == 1 + len(payload)
    finally:
        relay.close()


def test_no_delay_is_quick(echo):
    relay = Relay(listen=("127.0.0.1", 0), to=("127.0.0.1", echo.port))
    port = relay.start()
    try:
        seconds, _ = round_trip(port, b"ping")
        assert seconds < 0.1, seconds
    finally:
        relay.close()


def test_cut_drops_and_refuses_until_restored(echo):
    relay = Relay(listen=("127.0.0.1", 0), to=("127.0.0.1", echo.port), delay_ms=5)
    port = relay.start()
    try:
        open_one = socket.create_connection(("127.0.0.1", port), timeout=5)
        open_one.sendall(b"a")
        assert open_one.recv(10) == b"a"
        relay.cut()
        with pytest.raises((ConnectionError, OSError)):  # the open connection was dropped
            open_one.sendall(b"b")
            if not open_one.recv(10):
                raise ConnectionResetError("closed")
        open_one.close()
        with pytest.raises((ConnectionError, OSError)):  # a new one is refused
            round_trip(port, b"c")
        relay.restore()
        _, got = round_trip(port, b"d")
        assert got == b"d"
    finally:
        relay.close()


def test_blackhole_forwards_nothing_then_resets_on_restore(echo):
    relay = Relay(listen=("127.0.0.1", 0), to=("127.0.0.1", echo.port))
    port = relay.start()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        s.sendall(b"a")
        assert s.recv(10) == b"a"
        relay.cut(blackhole=True)
        s.sendall(b"b")
        with pytest.raises(socket.timeout):  # silence: no reply, no reset
            s.recv(10)
        relay.restore()
        s.settimeout(5)
        with pytest.raises((ConnectionError, OSError)):
            if not s.recv(10):
                raise ConnectionResetError("closed")
        s.close()
        _, got = round_trip(port, b"c")
        assert got == b"c"
    finally:
        relay.close()
