"""Pseudo-gradient codecs: round trips, error bounds, exact sizes, NaN/Inf, error feedback."""

import json
import math
import struct
import warnings

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression as cz
from diloco_ray.algo import wire_layout
from diloco_ray.algo.codecs import CODECS, DEFAULT_BLOCK, Codec
from diloco_ray.algo.compression import compress, pack, unpack
from diloco_ray.algo.wire_layout import packed_meta

SHAPES = [(1,), (7,), (2047,), (2049,), (4097,), (33, 65), (3, 5, 7), (), (0,), (3, 0)]
EPS32 = 2.0**-24


def random_tensors(seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.w": torch.randn(shape, generator=gen) * (1 + i) for i, shape in enumerate(shapes)}


def layout(buf):
    """Parse the wire format by hand: (header dict, start of the data area)."""
    raw = bytes(buf)
    assert raw[:4] == wire_layout.MAGIC
    (length,) = struct.unpack("<I", raw[4:8])
    header = json.loads(raw[8 : 8 + length].decode("utf-8"))
    return header, -(-(8 + length) // 8) * 8


def block_scales(x, qmax, block=DEFAULT_BLOCK):
    """Per-element scale = absmax of its block / qmax (fp64, from the fp32 values)."""
    flat = x.reshape(-1).double()
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -(-n // block) * block - n)).view(-1, block)
    return (padded.abs().amax(dim=1) / qmax).repeat_interleave(block)[:n]


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_preserves_names_shapes_meta(codec):
    tensors = random_tensors()
    meta = {"round": 3, "replica": "r1", "loss": 2.5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings, even for empty/0-d tensors
        decoded, got_meta = unpack(pack(tensors, Codec(codec), meta))
    assert got_meta == meta and list(decoded) == list(tensors)
    for name, x in tensors.items():
        assert decoded[name].shape == x.shape and decoded[name].dtype == torch.float32
        if x.numel():
            assert torch.isfinite(decoded[name]).all()
    if codec == "none":
        assert all(torch.equal(decoded[n], x) for n, x in tensors.items())
    assert packed_meta(pack(tensors, Codec(codec), meta)) == meta


@pytest.mark.parametrize("codec,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block", [DEFAULT_BLOCK, 64])
def test_integer_codecs_error_within_half_a_step_per_block(codec, qmax, block):
    tensors = random_tensors(seed=1)
    tensors["outlier"] = torch.randn(5000)
    tensors["outlier"][2100] = 1e3  # one block with a huge scale, the others unaffected
    decoded, _ = unpack(pack(tensors, Codec(codec, block)))
    for name, x in tensors.items():
        if not x.numel():
            continue
        err = (x.reshape(-1).double() - decoded[name].reshape(-1).double()).abs()
        scale = block_scales(x, qmax, block)
        # half a quantisation step, plus the fp32 rounding of the decoded product
        bound = scale / 2 * (1 + 1e-6) + 2 * EPS32 * x.reshape(-1).double().abs()
        assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item()}"
    if block == DEFAULT_BLOCK:
        # blocks away from the outlier keep their own, small scale
        far = (tensors["outlier"][:2048] - decoded["outlier"][:2048]).abs().max()
        assert far < 5.0 / qmax


@pytest.mark.parametrize("codec,rel", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_codecs_relative_error(codec, rel):
    tensors = random_tensors(seed=2)
    decoded, _ = unpack(pack(tensors, Codec(codec)))
    for name, x in tensors.items():
        x64, y64 = x.double(), decoded[name].double()
        normal = x64.abs() >= 2.0**-14  # fp16's smallest normal; bf16's is far smaller
        assert ((x64 - y64).abs()[normal] <= rel * x64.abs()[normal]).all(), name


def test_bf16_matches_torch_rounding():
    x = torch.randn(10_001)
    decoded, _ = unpack(pack({"x": x}, Codec("bf16")))
    assert torch.equal(decoded["x"], x.to(torch.bfloat16).float())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("block", [DEFAULT_BLOCK, 100])
def test_exact_sizes(codec, block):
    tensors = random_tensors(seed=3)
    buf = pack(tensors, Codec(codec, block), {"round": 1})
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1
    header, start = layout(buf)
    assert header["codec"] == codec and header["block"] == block
    total = 0
    for (name, shape, s_off, s_len, p_off, p_len), x in zip(header["tensors"], tensors.values()):
        assert name in tensors and shape == list(x.shape)
        assert s_len + p_len == Codec(codec, block).nbytes(x.numel())
        assert s_off % 8 == 0 and p_off % 8 == 0
        total += s_len + p_len
    sections = 2 * len(tensors)
    assert total <= len(buf) - start < total + 8 * sections


def test_codec_nbytes_formulas():
    assert Codec("int4").nbytes(0) == 0 and Codec("int4").nbytes(1) == 1 + 4
    assert Codec("int8").nbytes(4097) == 4097 + 4 * 3
    assert Codec("int4").nbytes(4097) == 2049 + 4 * 3
    assert Codec("none").nbytes(5) == 20 and Codec("fp16").nbytes(5) == Codec("bf16").nbytes(5) == 10


def test_ratio_for_a_million_values():
    x = {"w": torch.randn(1 << 20)}
    fp32 = 4 * (1 << 20)
    header = layout(pack(x, Codec("none")))[1]
    assert len(pack(x, Codec("none"))) == fp32 + header
    assert len(pack(x, Codec("int8"))) <= 0.2505 * fp32 + header
    assert len(pack(x, Codec("int4"))) <= 0.1255 * fp32 + header
    assert len(pack(x, Codec("fp16"))) == len(pack(x, Codec("bf16"))) == fp32 // 2 + header


def test_header_is_small():
    tensors = {f"model.layers.{i}.mlp.down_proj.weight": torch.zeros(64, 128) for i in range(20)}
    _, start = layout(pack(tensors, Codec("int8"), {"round": 12, "replica": 3}))
    assert start < 2048


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_equal_their_fp32_cast(codec, dtype):
    x = (torch.randn(3000) * 4).to(dtype)
    assert np.array_equal(pack({"x": x}, Codec(codec)), pack({"x": x.float()}, Codec(codec)))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_stays_non_finite(codec, bad):
    x = torch.randn(5000)
    x[4321] = bad
    decoded, _ = unpack(pack({"x": x, "scalar": torch.tensor(bad)}, Codec(codec)))
    assert not torch.isfinite(decoded["x"]).all() and not torch.isfinite(decoded["scalar"]).all()
    if codec in ("int8", "int4"):  # the whole block is NaN, the other blocks decode normally
        assert torch.isnan(decoded["x"][4096:]).all() and torch.isfinite(decoded["x"][:4096]).all()


def test_fp16_saturates_large_finite_values():
    x = torch.tensor([1e6, -1e6, 65519.0, math.inf, 1.0])
    y = unpack(pack({"x": x}, Codec("fp16")))[0]["x"]
    assert y.tolist() == [65504.0, -65504.0, 65504.0, math.inf, 1.0]
    big = unpack(pack({"x": torch.tensor([3.4e38])}, Codec("bf16")))[0]["x"]
    assert torch.isfinite(big).all()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_all_zero_blocks_decode_to_exact_zeros(codec):
    x = torch.zeros(5000)
    x[4500] = 3.0  # last block non-zero, the first two all zero
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = unpack(pack({"x": x, "z": torch.zeros(7, 3)}, Codec(codec)))[0]
    assert torch.equal(y["z"], torch.zeros(7, 3)) and torch.equal(y["x"][:4096], torch.zeros(4096))
    assert y["x"][4500] == 3.0


@pytest.mark.parametrize("codec,tolerance", [("int4", 0.01), ("int8", 0.001)])
def test_error_feedback_removes_the_bias(codec, tolerance):
    g = {"w": torch.randn(3000, generator=torch.Generator().manual_seed(4)), "s": torch.tensor(0.3)}
    absmax = g["w"].abs().max()
    rounds, residual = 200, None
    total = {n: torch.zeros_like(t) for n, t in g.items()}
    for step in range(1, rounds + 1):
        buf, residual = compress(g, Codec(codec), residual, meta={"round": step})
        decoded, meta = unpack(buf)
        assert meta == {"round": step}
        for n in g:
            total[n] += decoded[n]
        # the accumulated error is the current residual: bounded, not growing with rounds
        drift = (total["w"] - step * g["w"]).abs().max()
        assert drift <= absmax / (_qmax(codec) - 1) * 1.01
    with_feedback = (total["w"] / rounds - g["w"]).abs().max()
    without = (unpack(pack(g, Codec(codec)))[0]["w"] - g["w"]).abs().max()  # the same every round
    assert with_feedback < tolerance * absmax
    assert without > 10 * with_feedback and without > tolerance * absmax  # so the test can fail
    assert torch.allclose(total["s"] / rounds, g["s"], rtol=1e-4)


def _qmax(codec):
    return {"int8": 127, "int4": 7}[codec]


def test_residual_none_for_lossless_and_never_non_finite():
    g = {"w": torch.randn(100)}
    buf, residual = compress(g, Codec("none"), None)
    assert residual is None and torch.equal(unpack(buf)[0]["w"], g["w"])
    _, residual = compress(g, Codec("int4"), None)
    bad = {"w": g["w"].clone()}
    bad["w"][3] = math.nan
    for codec in ("int4", "int8", "fp16", "bf16"):
        buf, new = compress(bad, Codec(codec), residual)
        assert torch.equal(new["w"], torch.zeros(100))  # NaN is sent, never carried forward
        assert not torch.isfinite(unpack(buf)[0]["w"]).all()
    _, new = compress({"w": torch.tensor([1000000.0, 1.0])}, Codec("fp16"), None)
    assert new["w"].tolist() == [1e6 - 65504.0, 0.0]  # saturation is made up next round


def test_compress_residual_adds_and_missing_names_are_zero():
    g = {"a": torch.ones(4), "b": torch.full((2, 2), 2.0)}
    residual = {"a": torch.full((4,), 0.5)}
    buf, new = compress(g, Codec("fp16"), residual)
    decoded, _ = unpack(buf)
    assert torch.equal(decoded["a"], torch.full((4,), 1.5)) and torch.equal(decoded["b"], g["b"])
    assert set(new) == {"a", "b"}
    with pytest.raises(ValueError, match="shape"):
        compress(g, Codec("int8"), {"a": torch.zeros(5)})


@pytest.mark.parametrize("garbage", [b"", b"DLZ", b"hello world, not a buffer", bytes(64)])
def test_garbage_raises_value_error(garbage):
    with pytest.raises(ValueError, match="magic"):
        unpack(garbage)
    with pytest.raises(ValueError):
        packed_meta(np.frombuffer(garbage, dtype=np.uint8))


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_corrupt_buffers_raise_value_error(codec):
    buf = bytes(pack(random_tensors(seed=5), Codec(codec)))
    _, start = layout(buf)
    for cut in (6, 12, start - 1, start + 3, len(buf) - 1):
        with pytest.raises(ValueError, match="truncated|corrupt"):
            unpack(buf[:cut])
    corrupt = bytearray(buf)
    corrupt[9] = ord("#")  # inside the JSON
    with pytest.raises(ValueError, match="corrupt"):
        unpack(bytes(corrupt))


def test_unknown_codec_is_named():
    with pytest.raises(ValueError, match=r"'zstd'.*none, fp16, bf16, int8, int4"):
        pack({"x": torch.ones(2)}, Codec("zstd"))
    with pytest.raises(ValueError, match="'int2'"):
        compress({"x": torch.ones(2)}, Codec("int2"), None)
    with pytest.raises(ValueError, match="'fp8'"):
        Codec("fp8").nbytes(10)


@pytest.mark.parametrize("codec", CODECS)
def test_read_only_buffer(codec):
    tensors = random_tensors(seed=6)
    buf = pack(tensors, Codec(codec), {"k": [1, 2]})
    frozen = np.frombuffer(bytes(buf), dtype=np.uint8)
    assert not frozen.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the not-writable warning is suppressed locally
        decoded, meta = unpack(frozen)
        assert packed_meta(frozen) == {"k": [1, 2]}
    reference, _ = unpack(buf)
    assert meta == {"k": [1, 2]}
    assert all(torch.equal(decoded[n], reference[n]) for n in tensors)


def test_none_decodes_zero_copy():
    buf = pack({"x": torch.arange(10.0)}, Codec("none"))
    y = unpack(buf)[0]["x"]
    assert y.data_ptr() >= buf.ctypes.data and y.data_ptr() < buf.ctypes.data + len(buf)


@pytest.mark.parametrize("codec", CODECS)
def test_a_message_written_into_used_memory_equals_a_fresh_one(codec):
    # pack_filled zeroes what no section writes (header padding, gaps between sections),
    # so a buffer handed in by ``allocate`` full of old bytes gives the very same message.
    tensors = random_tensors(3)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}

    def fill(name, out):
        out.copy_(tensors[name].reshape(out.shape))

    fresh = cz.pack_filled(shapes, fill, Codec(codec, 64), {"round": 1}).numpy()
    used = cz.pack_filled(shapes, fill, Codec(codec, 64), {"round": 1}, allocate=lambda n: np.full(n, 0xAB, np.uint8))
    used = used.numpy()
    assert used.tobytes() == fresh.tobytes() == pack(tensors, Codec(codec, 64), {"round": 1}).tobytes()
