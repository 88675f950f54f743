"""bench/wanlab/capture.py sorts frames: TCP payload bytes, pure acknowledgements, the rest."""

import os
import struct
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
from wanlab import capture  # noqa: E402

ACK, PSH, SYN, FIN = 0x10, 0x08, 0x02, 0x01


def frame(payload: int, flags: int, tcp_options: int = 12, ip_proto: int = 6, ethertype: bytes = b"\x08\x00") -> bytes:
    """An Ethernet + IPv4 + TCP frame (headers only, as a 128-byte snap would hold)."""
    tcp_len = 20 + tcp_options
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + tcp_len + payload, 0, 0, 64, ip_proto, 0, bytes(4), bytes(4))
    tcp = struct.pack("!HHIIBBHHH", 1, 2, 0, 0, (tcp_len // 4) << 4, flags, 0, 0, 0) + bytes(tcp_options)
    return (bytes(12) + ethertype + ip + tcp)[:128]


@pytest.mark.parametrize(
    "raw, want",
    [
        (frame(0, ACK), (0, True)),  # a pure acknowledgement, with timestamps
        (frame(0, ACK, tcp_options=0), (0, True)),
        (frame(1448, ACK | PSH), (1448, False)),  # a data segment, however it is flagged
        (frame(0, SYN | ACK), (0, False)),  # the handshake is not an acknowledgement of data
        (frame(0, FIN | ACK), (0, False)),
        (frame(100, 0, ip_proto=17), (0, False)),  # UDP
        (frame(0, ACK, ethertype=b"\x08\x06"), (0, False)),  # ARP
        (b"\x00" * 20, (0, False)),  # too short to be anything
    ],
)
def test_classify_sorts_payload_and_pure_acknowledgements(raw, want):
    payload, ack = capture.classify(raw)
    assert (payload, ack) == want


def test_tcp_ports_name_the_connection_a_frame_belongs_to():
    # frame() sends from port 1 to port 2; anything but TCP over IPv4 has no ports.
    assert capture.tcp_ports(frame(0, ACK)) == (1, 2)
    assert capture.tcp_ports(frame(100, 0, ip_proto=17)) is None
    assert capture.tcp_ports(frame(0, ACK, ethertype=b"\x08\x06")) is None
    labelled = capture.Capture({}, {2: "gcs"})
    assert labelled._label(frame(0, ACK)) == "gcs"
    assert capture.Capture({}, {3: "gcs"})._label(frame(0, ACK)) is None
