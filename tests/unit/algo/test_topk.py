"""The topk codec: which values it keeps, what they decode to, the bits it costs, odd
sizes, non-finite blocks, chunked decoding and the error-feedback algebra."""

import json
import math
import struct

import numpy as np
import pytest
import torch

from diloco_ray.algo import topk
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.compression import compress, pack, unpack


def gen(seed):
    return torch.Generator().manual_seed(seed)


def kept_per_block(numel, block, fraction):
    """Slots of each block: ``ceil(fraction * its length)``, at least 1 (the last block
    may be short)."""
    width = min(block, numel)
    lengths = [min(width, numel - lo) for lo in range(0, numel, width or 1)]
    return [min(n, max(1, math.ceil(fraction * n - 1e-9))) for n in lengths]


def levels(lo, hi):
    """The two decoded magnitudes of a block whose kept magnitudes span ``[lo, hi]``."""
    lo, hi = torch.tensor(lo).half().float(), torch.tensor(hi).half().float()
    return lo + 0.25 * (hi - lo), lo + 0.75 * (hi - lo)


@pytest.mark.parametrize("numel,block,fraction", [(4096, 2048, 1 / 64), (5000, 2048, 1 / 64), (300, 64, 0.1)])
def test_keeps_each_blocks_largest_values_with_their_signs(numel, block, fraction):
    x = torch.randn(numel, generator=gen(1))
    y = unpack(pack({"x": x}, Codec("topk", block, fraction)))[0]["x"]
    width = topk.shape_of(numel, block, fraction)[0]
    for lo, keep in zip(range(0, numel, width), kept_per_block(numel, block, fraction)):
        part, got = x[lo : lo + width], y[lo : lo + width]
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
    assert Codec("topk", fraction=fraction).nbytes(1 << 20) == 512 * 4 + 512 * k * 13 // 8
    buf = pack({"w": torch.randn(1 << 20)}, Codec("topk", fraction=fraction))
    assert len(buf) * 8 / (1 << 20) <= most  # header and scales included


def test_the_default_fraction_is_the_configs():
    import dataclasses

    from diloco_ray.algo.codecs import DEFAULT_FRACTION
    from diloco_ray.config.schema import TrainerConfig

    field = {f.name: f for f in dataclasses.fields(TrainerConfig)}["topk_fraction"]
    assert field.default is None  # the codec's: 1/64 with topk pseudo-gradients, else the codecs' 1/16
    base = dict(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic")
    assert TrainerConfig(**base, weights_compression="topk").topk_fraction == DEFAULT_FRACTION == 1 / 16
    assert TrainerConfig(**base, pseudo_grad_compression="topk").topk_fraction == 1 / 64


@pytest.mark.parametrize("shape", [(1,), (3,), (7, 5), (2049,), (4097,), (), (0,)])
def test_odd_sizes_round_trip(shape):
    x = torch.randn(shape, generator=gen(2))
    y = unpack(pack({"x": x}, Codec("topk", fraction=0.25)))[0]["x"]
    assert y.shape == x.shape
    if x.numel() == 1:  # a single value is kept, and decodes to its fp16 scale (lo == hi)
        assert torch.equal(y, x.half().float())
    assert (y != 0).sum() == sum(kept_per_block(x.numel(), 2048, 0.25))  # the last block may be short


def test_constant_and_zero_blocks():
    x = torch.full((4096,), 0.5)
    x[2048:] = 0
    y = unpack(pack({"x": x}, Codec("topk")))[0]["x"]
    assert torch.equal(y[2048:], torch.zeros(2048))  # a zero block sends zeros
    kept = y[:2048][y[:2048] != 0]
    assert kept.numel() == 128 and torch.equal(kept, torch.full((128,), 0.5))  # lo == hi: exact


@pytest.mark.parametrize("block,fraction", [(2048, 1 / 16), (64, 0.25)])
def test_a_kept_zero_decodes_to_zero(block, fraction):
    # Fewer non-zeros than slots: the zeros kept must not decode as a level, and the
    # levels span the non-zero magnitudes only.
    x = torch.zeros(2 * block)
    x[:2] = torch.tensor([1.0, 0.01])
    x[block + 5] = -3.0
    y = unpack(pack({"x": x}, Codec("topk", block, fraction)))[0]["x"]
    assert (y[2:block] != 0).sum() == 0
    assert (y[block : block + 5] != 0).sum() == (y[block + 6 :] != 0).sum() == 0
    low, high = levels(0.01, 1.0)
    assert y[0] == high and y[1] == low
    assert y[block + 5] == torch.tensor(-3.0).half().float()  # one non-zero: lo == hi, exact


@pytest.mark.parametrize("numel", [2048 + 1, 2048 * 3 + 5, 5])
def test_an_all_zero_tensor_decodes_to_zeros(numel):
    scales, payload = topk.encode(torch.zeros(numel), numel, 2048, 1 / 16)
    assert not scales.any()
    y = topk.decode(scales, payload, numel, 2048, 1 / 16, 0, numel)
    assert torch.equal(y, torch.zeros(numel))


@pytest.mark.parametrize("value", [9.0, -0.3])
def test_a_one_value_tail_block_decodes_exactly(value):
    x = torch.randn(2048 + 1, generator=gen(9))
    x[-1] = value
    y = unpack(pack({"x": x}, Codec("topk")))[0]["x"]
    assert y[-1] == torch.tensor(value).half().float()  # its only slot: lo == hi == |value|


TAILS = [(2048 * 10 + 5, 2048, 1 / 16), (2048 + 1, 2048, 1 / 64), (300, 64, 0.1), (4096, 2048, 1 / 16)]


@pytest.mark.parametrize("numel,block,fraction", TAILS)
def test_the_tail_block_pays_for_its_own_length(numel, block, fraction):
    width, k, bits = topk.shape_of(numel, block, fraction)
    slots = kept_per_block(numel, block, fraction)
    assert slots[:-1] == [k] * (len(slots) - 1)
    scales_len, payload_len = topk.sections(numel, block, fraction)
    assert (scales_len, payload_len) == (4 * len(slots), -(-sum(slots) * (bits + 2) // 8))
    assert Codec("topk", block, fraction=fraction).nbytes(numel) == scales_len + payload_len
    s, p = topk.encode(torch.randn(numel, generator=gen(10)), numel, block, fraction)
    assert (s.nbytes, p.nbytes) == (scales_len, payload_len)


def test_a_short_tail_block_costs_its_own_slots():
    # 10 full blocks of 128 slots of 13 bits, and a tail of 5 values: 1 slot, not 128.
    assert Codec("topk", fraction=1 / 16).nbytes(2048 * 10 + 5) == 11 * 4 + -(-(10 * 128 + 1) * 13 // 8)


def test_decoding_any_block_aligned_range_that_reaches_the_tail():
    numel, block, fraction = 64 * 20 + 7, 64, 0.25
    x = torch.randn(numel, generator=gen(11))
    s, p = topk.encode(x, numel, block, fraction)
    whole = topk.decode(s, p, numel, block, fraction, 0, numel)
    for lo in (0, 64, 64 * 19, 64 * 20):
        for hi in (numel, numel - 3, 64 * 20 + 1):
            if hi > lo:
                assert torch.equal(topk.decode(s, p, numel, block, fraction, lo, hi), whole[lo:hi])
    # Encoding a chunk at a time (whole blocks, 8 at a time) writes the same bytes.
    scales, payload = np.zeros_like(s), np.zeros_like(p)
    step = topk.chunk_values(numel, block, fraction, 0)
    for lo in range(0, numel, step):
        topk.encode_into(x[lo : lo + step], lo, numel, block, fraction, scales, payload)
    assert np.array_equal(scales, s) and np.array_equal(payload, p)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_block_never_decodes_finite(bad):
    x = torch.randn(6144, generator=gen(3))
    x[2050] = bad
    y = unpack(pack({"x": x}, Codec("topk")))[0]["x"]
    assert not torch.isfinite(y[2048:4096]).all()
    assert torch.isfinite(y[:2048]).all() and torch.isfinite(y[4096:]).all()


def test_chunked_decoding_equals_whole_decoding():
    x = torch.randn(300_001, generator=gen(4))
    lazy = unpack(pack({"x": x}, Codec("topk")), lazy=True)[0]["x"]
    whole = lazy.decode()
    pieces = list(lazy.chunks())
    assert len(pieces) > 1
    assert torch.equal(torch.cat([v for _, v in pieces]), whole)


def test_residual_is_exactly_what_was_not_sent():
    g = {"w": torch.randn(10_000, generator=gen(5)), "b": torch.randn(17, generator=gen(6))}
    old = {"w": torch.randn(10_000, generator=gen(7)) * 0.1}
    buf, new = compress(g, Codec("topk"), {n: t.clone() for n, t in old.items()})
    sent = unpack(buf)[0]
    assert torch.allclose(new["w"], g["w"] + old["w"] - sent["w"], atol=1e-6)
    assert torch.allclose(new["b"], g["b"] - sent["b"], atol=1e-6)


def test_error_feedback_sends_everything_in_the_end():
    g = {"w": torch.randn(4096, generator=gen(8)) * 0.01}
    residual, total = None, torch.zeros(4096)
    for step in range(1, 401):
        buf, residual = compress(g, Codec("topk"), residual)
        total += unpack(buf)[0]["w"]
    # The drift is the residual: bounded while the sum grows linearly, so the mean converges.
    assert torch.allclose(total, 400 * g["w"] - residual["w"], atol=1e-4)
    assert (total / 400 - g["w"]).abs().max() < 0.05 * g["w"].abs().max()
    single = unpack(pack(g, Codec("topk")))[0]["w"]
    assert (single - g["w"]).abs().max() > 0.5 * g["w"].abs().max()  # so the check above can fail


def test_a_corrupt_fraction_is_refused():
    buf = bytes(pack({"x": torch.randn(100)}, Codec("topk")))
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
