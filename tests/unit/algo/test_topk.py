"""The topk codec: which values it keeps, what they decode to, the bits it costs, odd
sizes, non-finite blocks, chunked decoding and the error-feedback algebra."""

import json
import math
import struct

import numpy as np
import pytest
import torch

from diloco_ray.algo import topk
from diloco_ray.algo.codecs import codec_nbytes
from diloco_ray.algo.compression import compress, pack, unpack


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("numel,block,fraction", [(4096, 2048, 1 / 64), (5000, 2048, 1 / 64), (300, 64, 0.1)])
def test_keeps_each_blocks_largest_values_with_their_signs(numel, block, fraction):
    x = torch.randn(numel, generator=gen(1))
    y = unpack(pack({"x": x}, "topk", block=block, fraction=fraction))[0]["x"]
    width, k, _ = topk.shape_of(numel, block, fraction)
    for lo in range(0, numel, width):
        part, got = x[lo : lo + width], y[lo : lo + width]
        keep = min(k, part.numel())
        expected = set(part.abs().topk(keep).indices.tolist())
        assert set(got.nonzero().view(-1).tolist()) == expected
        idx = torch.tensor(sorted(expected))
        assert torch.equal(torch.sign(got[idx]), torch.sign(part[idx]))
        # each kept value decodes to the nearer of two levels inside [lo, hi] of its block
        small, big = part[idx].abs().min(), part[idx].abs().max()
        assert (got[idx].abs() >= small * (1 - 1e-3)).all() and (got[idx].abs() <= big * (1 + 1e-3)).all()
        assert ((got[idx] - part[idx]).abs() <= (big - small) / 4 * 1.01 + 1e-3 * big).all()


@pytest.mark.parametrize("fraction,k,most", [(1 / 64, 32, 0.22), (1 / 16, 128, 0.845)])
def test_bits_per_value(fraction, k, most):
    assert topk.shape_of(1 << 20, 2048, fraction)[1:] == (k, 11)
    assert codec_nbytes(1 << 20, "topk", fraction=fraction) == 512 * 4 + 512 * k * 13 // 8
    buf = pack({"w": torch.randn(1 << 20)}, "topk", fraction=fraction)
    assert len(buf) * 8 / (1 << 20) <= most  # header and scales included


def test_the_default_fraction_is_the_configs():
    import dataclasses

    from diloco_ray.algo.codecs import DEFAULT_FRACTION
    from diloco_ray.config.schema import TrainerConfig

    field = {f.name: f for f in dataclasses.fields(TrainerConfig)}["topk_fraction"]
    assert field.default == DEFAULT_FRACTION == 1 / 16


@pytest.mark.parametrize("shape", [(1,), (3,), (7, 5), (2049,), (4097,), (), (0,)])
def test_odd_sizes_round_trip(shape):
    x = torch.randn(shape, generator=gen(2))
    y = unpack(pack({"x": x}, "topk", fraction=0.25))[0]["x"]
    assert y.shape == x.shape
    if x.numel() == 1:  # a single value is kept, and decodes to its fp16 scale (lo == hi)
        assert torch.equal(y, x.half().float())
    width, k, _ = topk.shape_of(x.numel(), 2048, 0.25)
    n = x.numel()
    assert (y != 0).sum() == sum(min(k, n - lo) for lo in range(0, n, width or 1))  # the last block may be short


def test_constant_and_zero_blocks():
    x = torch.full((4096,), 0.5)
    x[2048:] = 0
    y = unpack(pack({"x": x}, "topk"))[0]["x"]
    assert torch.equal(y[2048:], torch.zeros(2048))  # a zero block sends zeros
    kept = y[:2048][y[:2048] != 0]
    assert kept.numel() == 128 and torch.equal(kept, torch.full((128,), 0.5))  # lo == hi: exact


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_block_never_decodes_finite(bad):
    x = torch.randn(6144, generator=gen(3))
    x[2050] = bad
    y = unpack(pack({"x": x}, "topk"))[0]["x"]
    assert not torch.isfinite(y[2048:4096]).all()
    assert torch.isfinite(y[:2048]).all() and torch.isfinite(y[4096:]).all()


def test_chunked_decoding_equals_whole_decoding():
    x = torch.randn(300_001, generator=gen(4))
    lazy = unpack(pack({"x": x}, "topk"), lazy=True)[0]["x"]
    whole = lazy.decode()
    pieces = list(lazy.chunks())
    assert len(pieces) > 1
    assert torch.equal(torch.cat([v for _, v in pieces]), whole)


def test_residual_is_exactly_what_was_not_sent():
    g = {"w": torch.randn(10_000, generator=gen(5)), "b": torch.randn(17, generator=gen(6))}
    old = {"w": torch.randn(10_000, generator=gen(7)) * 0.1}
    buf, new = compress(g, "topk", {n: t.clone() for n, t in old.items()})
    sent = unpack(buf)[0]
    assert torch.allclose(new["w"], g["w"] + old["w"] - sent["w"], atol=1e-6)
    assert torch.allclose(new["b"], g["b"] - sent["b"], atol=1e-6)


def test_error_feedback_sends_everything_in_the_end():
    g = {"w": torch.randn(4096, generator=gen(8)) * 0.01}
    residual, total = None, torch.zeros(4096)
    for step in range(1, 401):
        buf, residual = compress(g, "topk", residual)
        total += unpack(buf)[0]["w"]
    # The drift is the residual: bounded while the sum grows linearly, so the mean converges.
    assert torch.allclose(total, 400 * g["w"] - residual["w"], atol=1e-4)
    assert (total / 400 - g["w"]).abs().max() < 0.05 * g["w"].abs().max()
    single = unpack(pack(g, "topk"))[0]["w"]
    assert (single - g["w"]).abs().max() > 0.5 * g["w"].abs().max()  # so the check above can fail


def test_a_corrupt_fraction_is_refused():
    buf = bytes(pack({"x": torch.randn(100)}, "topk"))
    (length,) = struct.unpack("<I", buf[4:8])
    header = json.loads(buf[8 : 8 + length])
    header["fraction"] = 2.0
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (length - len(raw))
    with pytest.raises(ValueError, match="fraction"):
        unpack(np.frombuffer(buf[:8] + raw + buf[8 + length :], dtype=np.uint8))


def test_shape_of_refuses_a_bad_fraction():
    with pytest.raises(ValueError, match="fraction"):
        topk.shape_of(10, 2048, 0.0)
