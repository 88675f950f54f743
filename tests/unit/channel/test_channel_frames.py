"""The channel's frame: what is checked before anything acts on a message."""

import hashlib

import pytest

from diloco_ray.channel import frames


def test_a_frame_round_trips_its_header_and_payload():
    data = frames.encode({"key": "w/3", "offset": 0}, b"\x00\x01payload")
    frame = frames.decode(data, max_bytes=1 << 20)
    assert frame.header == {"key": "w/3", "offset": 0} and frame.payload == b"\x00\x01payload"


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: d[:-3], "truncated: "),
        (lambda d: d[:10], "truncated: 10 bytes, shorter than a frame's preamble"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "corrupt: its checksum does not match its bytes"),
        (lambda d: b"XXXX" + d[4:], "malformed: not a diloco-ray channel frame"),
        (lambda d: d + b"extra", "malformed: "),
        (lambda d: d[:4] + b"\x09" + d[5:], "malformed: frame version 9"),
    ],
)
def test_a_damaged_frame_is_refused_saying_how(damage, why):
    data = damage(frames.encode({"a": 1}, b"0123456789"))
    with pytest.raises(frames.BadFrame) as refused:
        frames.decode(data, max_bytes=1 << 20)
    assert refused.value.why.startswith(why)


def test_an_oversized_frame_is_refused_before_it_is_read():
    data = frames.encode({}, b"x" * 5000)
    with pytest.raises(frames.BadFrame, match=r"^oversized: \d+ bytes, over the limit of 4096$"):
        frames.decode(data, max_bytes=4096)


def test_a_header_that_is_not_a_json_object_is_malformed():
    body = b"[1, 2]"
    data = frames._PREAMBLE.pack(frames.MAGIC, frames.VERSION, len(body), 0, hashlib.sha256(body).digest()) + body
    with pytest.raises(frames.BadFrame, match="not a JSON object"):
        frames.decode(data, max_bytes=1 << 20)
