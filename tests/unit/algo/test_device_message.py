"""The device path of the sync (diloco_ray.algo.device_message, device_codec, device_topk)
against the host path, on CPU tensors: the same bytes, the same residuals, the same decoded
values, for every codec, with and without error feedback, on shapes that are not a multiple
of the block, 0-d and empty ones, and values that are NaN or Inf. tests/gpu runs the same
comparisons on CUDA tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression, device_codec, device_message, device_topk
from diloco_ray.algo.codecs import CODECS

CPU = torch.device("cpu")
SHAPES = {"a": (2049,), "b": (33, 65), "c": (), "d": (0,), "e": (4097,), "f": (7,), "g": (3, 0)}
BLOCK, FRACTION = 64, 0.1


def tensors(seed: int, bad: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) * (1 + i) for i, (n, s) in enumerate(SHAPES.items())}
    out["b"][3, 4] = 0.0
    out["e"][BLOCK : 2 * BLOCK] = 0.0  # an all-zero block
    if bad is not None:
        out["e"][5] = float(bad)
        out["a"][-1] = -float(bad)
    return out


def host_and_device(codec: str, values: dict, residual: dict | None, meta=None):
    """(host message, host residual, device message, device residual) of the same values."""
    res_host = {n: r.clone() for n, r in residual.items()} if residual is not None else None
    res_dev = {n: r.clone() for n, r in residual.items()} if residual is not None else None

    def fill(name, out):
        out.copy_(values[name])

    host, _ = compression.pack_filled(SHAPES, fill, codec, meta, BLOCK, res_host, fraction=FRACTION)
    dev = device_message.pack_filled(SHAPES, fill, codec, meta, CPU, BLOCK, res_dev, FRACTION)
    return host, res_host, dev, res_dev


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN, -0.0 told from 0.0 (bitwise, fp32)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_same_bytes_and_residual_as_the_host(codec, feedback, bad):
    values = tensors(1, bad)
    g = torch.Generator().manual_seed(2)
    residual = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()} if feedback else None
    host, res_host, dev, res_dev = host_and_device(codec, values, residual, {"version": 3, "rows": [0]})
    assert isinstance(dev, torch.Tensor) and dev.dtype == torch.uint8
    assert np.array_equal(host, dev.numpy())
    if feedback:
        assert all(same(res_host[n], res_dev[n]) for n in SHAPES)
        if bad is not None and codec != "none":  # a non-finite tensor carries nothing forward
            assert not res_dev["e"].any() and not res_dev["a"].any()


@pytest.mark.parametrize("codec", ["int8", "int4", "topk", "fp16"])
def test_chunked_encoding_and_decoding_write_the_same_bytes(codec, monkeypatch):
    """Whole tensors cut into several device chunks (a small chunk forced here) give the
    bytes of one pass, and decode a chunk at a time to the host's values."""
    values, residual = tensors(3), {n: torch.full(s, 0.01) for n, s in SHAPES.items()}
    whole, _, one_pass, _ = host_and_device(codec, values, residual)
    monkeypatch.setattr(device_codec, "DEVICE_CHUNK", 4 * BLOCK)
    _, res_host, chunked, res_dev = host_and_device(codec, values, residual)
    assert np.array_equal(whole, chunked.numpy()) and np.array_equal(whole, one_pass.numpy())
    assert all(same(res_host[n], res_dev[n]) for n in SHAPES)
    names = list(SHAPES)
    buf, _ = compression.pack_pieces(values, dict.fromkeys(names, 0), names, codec, {}, block=BLOCK, fraction=FRACTION)
    host, _ = compression.unpack_pieces(buf, names)
    lazy, _ = device_message.unpack_pieces(buf, names, CPU, lazy=True)
    for name, (_, piece) in lazy.items():
        parts = [v for _, v in piece.chunks()]
        flat = torch.cat(parts) if parts else torch.zeros(0)
        assert same(flat, host[name][1].reshape(-1)), name


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [None, "nan"])
def test_decodes_on_the_device_to_the_hosts_values(codec, bad):
    names = list(SHAPES)
    values = tensors(4, bad)
    buf, _ = compression.pack_pieces(
        values, {n: i for i, n in enumerate(names)}, names, codec, {"v": 1}, block=BLOCK, fraction=FRACTION
    )
    buf.setflags(write=False)  # as Ray hands it out
    host, host_meta = compression.unpack_pieces(buf, names)
    dev, dev_meta = device_message.unpack_pieces(buf, names, CPU)
    assert dev_meta == host_meta and list(dev) == list(host)
    for name, (first, rows) in host.items():
        assert dev[name][0] == first and same(dev[name][1], rows), name


def test_a_bad_message_is_refused_as_on_the_host():
    names = list(SHAPES)
    buf, _ = compression.pack_pieces(tensors(5), dict.fromkeys(names, 0), names, "int8", {})
    with pytest.raises(ValueError, match="truncated"):
        device_message.unpack_pieces(buf[: len(buf) // 2], names, CPU)
    with pytest.raises(ValueError, match="bad magic"):
        device_message.unpack_pieces(np.zeros(64, dtype=np.uint8), names, CPU)


def test_messages_on_the_host_come_back_without_a_copy():
    a, b = torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)
    out = device_message.to_host([a, b])
    assert [o.tolist() for o in out] == [a.tolist(), b.tolist()]
    assert np.shares_memory(out[0], a.numpy())
    buf = np.arange(9, dtype=np.uint8)
    assert np.shares_memory(device_message.to_device(buf, CPU).numpy(), buf)


@pytest.mark.parametrize("nbits", [1, 3, 8, 13])
def test_bit_packing_is_numpys(nbits):
    g = torch.Generator().manual_seed(nbits)
    bits = torch.randint(0, 2, (8 * nbits + 5,), generator=g, dtype=torch.uint8)
    packed = device_topk.packbits(bits)
    assert np.array_equal(packed.numpy(), np.packbits(bits.numpy(), bitorder="little"))
    assert torch.equal(device_topk.unpackbits(packed)[: bits.numel()], bits)
