"""What crossed each link, frame by frame (used by ``bench/wan.py``).

The interface counters give a link's bytes; they do not say what the bytes were. A
:class:`Capture` reads every frame crossing the root ends of the replicas' veth pairs (a
packet socket per interface, the first 128 bytes of each frame: the headers) and sorts
them, per direction:

* ``*_tcp_payload``: TCP payload bytes, what Ray's processes wrote to their sockets: the
  messages and everything Ray says around them (calls, replies, its object transfer
  protocol);
* ``*_acks`` / ``*_ack_bytes``: pure TCP acknowledgements (no payload, no SYN/FIN/RST),
  most of them acknowledging what flows the other way;
* the rest of a direction's bytes (``up`` from the counters, less the two above) is the
  Ethernet/IP/TCP headers of the payload frames, and other traffic (ARP, SYNs).

A frame the root end transmits flows into the region (down), one it receives flowed out
of it (up). Totals run from :meth:`Capture.start` and are read with :meth:`Capture.totals`
like the interface counters, so a time window's share is a difference of two reads.
Needs root (``AF_PACKET``); Linux only.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
KEYS = ("tcp_payload", "acks", "ack_bytes")
_SNAP = 128  # bytes read of a frame: Ethernet + IP + TCP headers with options fit


def label_keys(ports: dict[int, str]) -> tuple[str, ...]:
    """The per-service keys a :class:`Capture` with these ``ports`` counts in each direction."""
    return tuple(f"{label}_{k}" for label in sorted(set(ports.values())) for k in ("bytes", "ack_bytes"))


def tcp_ports(frame: bytes) -> tuple[int, int] | None:
    """(source port, destination port) of a TCP over IPv4 frame (its first bytes), else None."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return None
    tcp = 14 + (frame[14] & 0x0F) * 4
    if len(frame) < tcp + 4:
        return None
    return struct.unpack_from("!HH", frame, tcp)


def classify(frame: bytes) -> tuple[int, bool]:
    """(TCP payload bytes, whether it is a pure acknowledgement) of one Ethernet frame
    (its first bytes); (0, False) for anything but TCP over IPv4."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return 0, False
    ihl = (frame[14] & 0x0F) * 4
    if len(frame) < 14 + ihl + 14:
        return 0, False
    total = struct.unpack_from("!H", frame, 16)[0]
    tcp = 14 + ihl
    doff, flags = (frame[tcp + 12] >> 4) * 4, frame[tcp + 13]
    payload = max(0, total - ihl - doff)
    return payload, bool(payload == 0 and flags & 0x10 and not flags & 0x07)  # ACK set; no FIN/SYN/RST


class Capture:
    """Frames on the given interfaces, sorted into :data:`KEYS` per direction, in a thread.

    Args:
        interfaces: region name -> the root end of its veth pair.
        ports: TCP port -> a label: a frame to or from such a port (a listening one: which
            service the connection is to) is also counted, frame bytes and pure
            acknowledgements' bytes, under ``{way}_{label}_bytes`` / ``{way}_{label}_ack_bytes``.
    """

    def __init__(self, interfaces: dict[str, str], ports: dict[int, str] | None = None):
        self.interfaces, self.ports = interfaces, dict(ports or {})
        keys = KEYS + label_keys(self.ports)
        self._totals = {r: {f"{d}_{k}": 0 for d in ("up", "down") for k in keys} for r in interfaces}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sockets: dict[socket.socket, str] = {}

    def start(self) -> "Capture":
        for region, name in self.interfaces.items():
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.bind((name, 0))
            sock.setblocking(False)
            self._sockets[sock] = region
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sock in self._sockets:
            sock.close()
        self._sockets = {}

    def totals(self) -> dict[str, dict[str, int]]:
        """Region -> ``up_tcp_payload``, ``up_acks``, ``up_ack_bytes`` and the same ``down_*``,
        since :meth:`start`."""
        with self._lock:
            return {r: dict(t) for r, t in self._totals.items()}

    def _loop(self) -> None:
        buf = bytearray(_SNAP)
        while not self._stop.is_set():
            ready, _, _ = select.select(list(self._sockets), [], [], 0.1)
            for sock in ready:
                totals = self._totals[self._sockets[sock]]
                while True:
                    try:  # MSG_TRUNC: the frame's real length, though 128 bytes are read
                        size, addr = sock.recvfrom_into(buf, _SNAP, socket.MSG_TRUNC)
                    except BlockingIOError:
                        break
                    except OSError as e:  # the link was taken down (an outage): nothing to read until it is up
                        if e.errno != errno.ENETDOWN:
                            raise
                        break
                    frame = bytes(buf[: min(size, _SNAP)])
                    payload, ack = classify(frame)
                    way = "down" if addr[2] == PACKET_OUTGOING else "up"
                    label = self._label(frame)
                    with self._lock:
                        totals[f"{way}_tcp_payload"] += payload
                        if ack:
                            totals[f"{way}_acks"] += 1
                            totals[f"{way}_ack_bytes"] += size
                        if label:
                            totals[f"{way}_{label}_bytes"] += size
                            totals[f"{way}_{label}_ack_bytes"] += size if ack else 0

    def _label(self, frame: bytes) -> str | None:
        ports = tcp_ports(frame) if self.ports else None
        if ports is None:
            return None
        return self.ports.get(ports[0]) or self.ports.get(ports[1])
