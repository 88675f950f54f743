"""One codec path for every device (diloco_ray.algo.codecs, compression, device_copy), held
on CPU tensors: the bytes every codec writes are the wire format's (frozen digests of the
messages the host path wrote before the device path and it became one), chunked encoding and
decoding agree with one pass, a message read on a named device is the one read by default,
and the bit packing is numpy's. tests/gpu holds a GPU's messages to the host's."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from diloco_ray.algo import codecs, compression, device_copy, topk
from diloco_ray.algo.codecs import CODECS, Codec

CPU = torch.device("cpu")
SHAPES = {"a": (2049,), "b": (33, 65), "c": (), "d": (0,), "e": (4097,), "f": (7,), "g": (3, 0)}
BLOCK, FRACTION = 64, 0.1
# blake2b-16 of (message, residual) for tensors(1) + residual(2), per codec and feedback.
DIGESTS = {
    ("none", False): "ccdfa5f6744da68ac3c66573de2681f3",
    ("none", True): "d089f5b0739e84729ac756d06964152d",
    ("fp16", False): "04fb8290fc36d9502bf0afaf7ac6b2d3",
    ("fp16", True): "41a754812ce607ae3be4789ea80bd0f0",
    ("bf16", False): "f863510ba2651203734e367b61cd6949",
    ("bf16", True): "f6855dfea18d8c07006fcf5ab1aab989",
    ("int8", False): "f2cb3bc6f647db1046d6b08fcad1480c",
    ("int8", True): "b5b4d6dd275d3c5346c55a5916ce5b54",
    ("int4", False): "e914f5dba79ef71c5d1e42ea152cb922",
    ("int4", True): "8c35612aa961317752f02be5dc6cdad4",
    ("topk", False): "c49c4c2808430c9d2055a9e89c12d3e1",
    ("topk", True): "1b09453927d94297466caa4ceae160e7",
}


def tensors(seed: int, bad: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) * (1 + i) for i, (n, s) in enumerate(SHAPES.items())}
    out["b"][3, 4] = 0.0
    out["e"][BLOCK : 2 * BLOCK] = 0.0  # an all-zero block
    if bad is not None:
        out["e"][5] = float(bad)
        out["a"][-1] = -float(bad)
    return out


def build(codec: str, values: dict, feedback: bool, meta=None, device=CPU):
    """(message as a uint8 tensor, residual after it) of ``values``."""
    g = torch.Generator().manual_seed(2)
    residual = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()} if feedback else None
    message = compression.pack_filled(
        SHAPES, lambda n, out: out.copy_(values[n]), Codec(codec, BLOCK, FRACTION), meta, residual, device=device
    )
    return message, residual


def digest(message: torch.Tensor, residual) -> str:
    h = hashlib.blake2b(message.numpy().tobytes(), digest_size=16)
    for r in (residual or {}).values():
        h.update(r.numpy().tobytes())
    return h.hexdigest()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN, -0.0 told from 0.0 (bitwise, fp32)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("feedback", [False, True])
def test_every_codec_writes_the_wire_formats_bytes(codec, feedback):
    message, residual = build(codec, tensors(1), feedback, {"version": 3, "rows": [0]})
    assert message.dtype == torch.uint8 and message.device == CPU
    assert digest(message, residual) == DIGESTS[codec, feedback]


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_tensor_decodes_non_finite_and_carries_nothing(codec, bad):
    message, residual = build(codec, tensors(1, bad), feedback=True)
    assert not residual["e"].any() and not residual["a"].any()
    assert residual["b"].any()  # the finite tensors keep theirs
    decoded, _ = compression.unpack(message.numpy())
    assert not torch.isfinite(decoded["e"]).all() and not torch.isfinite(decoded["a"]).all()


@pytest.mark.parametrize("codec", ["int8", "int4", "topk", "fp16"])
def test_chunked_encoding_and_decoding_agree_with_one_pass(codec, monkeypatch):
    """Tensors cut into several chunks (a small chunk forced here) give the bytes and the
    residual of one pass, and decode a chunk at a time to the values of one pass."""
    values = tensors(3)
    whole, res_whole = build(codec, values, feedback=True)
    monkeypatch.setattr(codecs, "HOST_CHUNK", 4 * BLOCK)
    chunked, res_chunked = build(codec, values, feedback=True)
    assert torch.equal(whole, chunked)
    assert all(same(res_whole[n], res_chunked[n]) for n in SHAPES)
    lazy, _ = compression.unpack(whole.numpy(), lazy=True)
    parts = {name: [v for _, v in piece.chunks()] for name, piece in lazy.items()}
    monkeypatch.setattr(codecs, "HOST_CHUNK", codecs.DEVICE_CHUNK)
    one, _ = compression.unpack(whole.numpy())
    for name, chunks in parts.items():
        assert len(chunks) > 1 or one[name].numel() <= 8 * BLOCK
        flat = torch.cat(chunks) if chunks else torch.zeros(0)
        assert same(flat, one[name].reshape(-1)), name


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_read_on_a_named_device_is_the_default_read(codec):
    names = list(SHAPES)
    buf, _ = compression.pack_pieces(
        tensors(4, "nan"), {n: i for i, n in enumerate(names)}, names, Codec(codec), {"v": 1}
    )
    buf.setflags(write=False)  # as Ray hands it out
    plain, plain_meta = compression.unpack_pieces(buf, names)
    named, named_meta = compression.unpack_pieces(buf, names, device=CPU)
    assert named_meta == plain_meta == {"v": 1, "rows": list(range(len(names)))}
    for name, (first, rows) in plain.items():
        assert named[name][0] == first and same(named[name][1], rows), name


def test_a_bad_message_is_refused_before_it_goes_up():
    names = list(SHAPES)
    buf, _ = compression.pack_pieces(tensors(5), dict.fromkeys(names, 0), names, Codec("int8"), {})
    with pytest.raises(ValueError, match="truncated"):
        compression.unpack_pieces(buf[: len(buf) // 2], names, device=CPU)
    with pytest.raises(ValueError, match="bad magic"):
        compression.unpack_pieces(np.zeros(64, dtype=np.uint8), names, device=CPU)


def test_messages_on_the_host_come_back_without_a_copy():
    a, b = torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)
    out = device_copy.to_host([a, b])
    assert [o.tolist() for o in out] == [a.tolist(), b.tolist()]
    assert np.shares_memory(out[0], a.numpy())
    buf = np.arange(9, dtype=np.uint8)
    assert np.shares_memory(device_copy.to_device(buf, CPU).numpy(), buf)


@pytest.mark.parametrize("nbits", [1, 3, 8, 13])
@pytest.mark.parametrize("offset", [0, 3])
def test_bit_packing_is_numpys(nbits, offset):
    g = torch.Generator().manual_seed(nbits)
    stream = torch.randint(0, 2, (offset + 8 * nbits + 5,), generator=g, dtype=torch.uint8)
    bits = stream[offset:]  # a view that does not start on 8 bytes
    packed = topk.packbits(bits)
    assert np.array_equal(packed.numpy(), np.packbits(bits.numpy(), bitorder="little"))
    assert torch.equal(topk.unpackbits(packed)[: bits.numel()], bits)
    assert np.array_equal(topk.unpackbits(packed[1:]).numpy(), np.unpackbits(packed[1:].numpy(), bitorder="little"))


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_whose_bytes_do_not_start_on_8_decodes_as_one_that_does(codec):
    buf = compression.pack(tensors(6), Codec(codec, BLOCK, FRACTION))
    raw = np.zeros(len(buf) + 1, dtype=np.uint8)
    raw[1:] = buf
    odd = raw[1:]  # as a bytes object or a slice of another buffer may start
    assert odd.ctypes.data % 8
    read, aligned = compression.unpack(odd)[0], compression.unpack(buf)[0]
    assert all(same(read[n], aligned[n]) for n in SHAPES)
