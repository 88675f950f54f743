"""The value codecs: how one flat fp32 tensor becomes bytes and back (fp16, bf16, int8,
int4, and the sparse ``topk`` of :mod:`diloco_ray.algo.topk`).

int8/int4 scale each block of ``block`` consecutive values by its absmax; ``topk`` keeps a
``fraction`` of each block. NaN/Inf never decode finite (a block holding one gets a NaN
scale), so the server can reject them.
Bytes are little-endian and viewed zero-copy where the dtype allows. The buffer layout
that holds many encoded tensors is :mod:`diloco_ray.algo.compression`'s.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np
import torch

from diloco_ray.algo import topk

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")
DEFAULT_BLOCK = 2048  # values per absmax scale for int8/int4: one 4-byte scale per 2048 values
# topk: values kept per block where no config says otherwise (weights_compression: topk, and
# callers of these functions): 0.828 bits per value at block 2048, headers not counted. The
# config's default for topk pseudo-gradients is 1/64 with SparseLoCo's outer step
# (diloco_ray.config.fields.CODEC_DEFAULTS; docs/slow-links.md's codec frontier says why).
DEFAULT_FRACTION = 1 / 16
_QMAX = {"int8": 127, "int4": 7}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; allowed: {', '.join(CODECS)}")


def sections(numel: int, codec: str, block: int = DEFAULT_BLOCK, fraction: float = DEFAULT_FRACTION) -> tuple[int, int]:
    """``(scales bytes, payload bytes)`` of one tensor (no header, no alignment padding).

    Args:
        numel: number of values in the tensor (0 for an empty tensor, 1 for a 0-d one).
        codec: one of :data:`CODECS`.
        block: values per scale for int8/int4/topk (ignored by the other codecs).
        fraction: values kept per block by topk (ignored by the other codecs).
    """
    _check_codec(codec)
    if codec == "topk":
        return topk.sections(numel, block, fraction)
    scales = 4 * -(-numel // block) if codec in _QMAX else 0
    payload = {"none": 4 * numel, "fp16": 2 * numel, "bf16": 2 * numel, "int8": numel, "int4": -(-numel // 2)}[codec]
    return scales, payload


def codec_nbytes(numel: int, codec: str, block: int = DEFAULT_BLOCK, fraction: float = DEFAULT_FRACTION) -> int:
    """Bytes of payload plus scales for one tensor (see :func:`sections`)."""
    return sum(sections(numel, codec, block, fraction))


def chunk_step(numel: int, codec: str, block: int, fraction: float, chunk: Optional[int] = None) -> int:
    """Values encoded or decoded at a time: whole blocks whose bytes start on a byte
    boundary (an even count of int4 blocks; a multiple of 8 topk blocks), about ``chunk``
    values (default: the host's bound on the codec's scratch memory)."""
    chunk = _CHUNK if chunk is None else chunk
    if codec == "topk":
        return topk.chunk_values(numel, block, fraction, chunk)
    if codec in _QMAX:
        return max(2, (chunk // block) // 2 * 2) * block
    return chunk


def _as_le_bytes(array: np.ndarray, le_dtype: str) -> np.ndarray:
    # A no-op view on little-endian hosts; a byte swap elsewhere keeps the wire format fixed.
    return np.ascontiguousarray(array.astype(le_dtype, copy=False)).reshape(-1).view(np.uint8)


def _quantise(flat: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantisation: (q as int8 of len(flat), fp32 scale per block)."""
    n, qmax = flat.numel(), _QMAX[codec]
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    finite = torch.isfinite(padded)
    # q is computed on a sanitised copy (casting NaN to int is undefined behaviour); the
    # NaN scale set below is what makes a non-finite block decode non-finite.
    clean = torch.where(finite, padded, torch.zeros((), dtype=padded.dtype))
    scale = clean.abs().amax(dim=1) / qmax
    scale = torch.where(finite.all(dim=1), scale, torch.full((), math.nan))
    divisor = torch.where(scale > 0, scale, torch.ones(()))  # all-zero block: 0/1 = 0, no 0/0
    q = torch.round(clean / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(-1)[:n], scale


def _encode(flat: torch.Tensor, codec: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales bytes, payload bytes) of one flattened fp32 tensor."""
    empty = np.zeros(0, dtype=np.uint8)
    if codec == "none":
        return empty, _as_le_bytes(flat.numpy(), "<f4")
    if codec in ("fp16", "bf16"):
        # Saturate finite values so a large-but-finite update does not turn into inf;
        # torch.clamp keeps NaN, and where() keeps +-inf as they are.
        limit = _FP16_MAX if codec == "fp16" else _BF16_MAX
        flat = torch.where(torch.isinf(flat), flat, flat.clamp(-limit, limit))
        half = flat.to(torch.float16 if codec == "fp16" else torch.bfloat16)
        return empty, _as_le_bytes(half.view(torch.int16).numpy(), "<i2")
    q, scale = _quantise(flat, codec, block)
    if codec == "int4":
        nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
        payload = (nibbles[0::2] | (nibbles[1::2] << 4)).numpy()
    else:
        payload = q.numpy().view(np.uint8)
    return _as_le_bytes(scale.numpy(), "<f4"), payload


_VALUE_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}
_CHUNK = 1 << 17  # values encoded at a time: bounds the codec's scratch memory (~3 MB)


def _encode_into(
    flat: torch.Tensor, codec: str, block: int, scales: np.ndarray, payload: np.ndarray, fraction: float
) -> None:
    """:func:`_encode` written into the sections ``scales`` and ``payload``, a chunk of
    whole blocks at a time (see :func:`chunk_step`)."""
    n = flat.numel()
    step = chunk_step(n, codec, block, fraction)
    for lo in range(0, n, step):
        part = flat[lo : lo + step]
        if codec == "topk":
            topk.encode_into(part, lo, n, block, fraction, scales, payload)
            continue
        s, p = _encode(part, codec, block)
        if codec in _QMAX:
            first = lo // block
            scales[4 * first : 4 * first + s.nbytes] = s
        start = lo // 2 if codec == "int4" else lo * _VALUE_BYTES[codec]
        payload[start : start + p.nbytes] = p


def _view(data: np.ndarray, offset: int, length: int, le_dtype: str) -> torch.Tensor:
    """Zero-copy torch view of a section (copied only if misaligned or foreign-endian)."""
    array = data[offset : offset + length].view(np.dtype(le_dtype))
    if not array.dtype.isnative or not array.flags.aligned:
        array = array.astype(array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # Ray hands out read-only buffers; callers only read the resulting tensors.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.from_numpy(array)


def _decode(data: np.ndarray, entry: list, codec: str, block: int, fraction: float) -> torch.Tensor:
    """One tensor, fp32, in its original shape, from its header entry."""
    shape = entry[1]
    return _decode_range(data, entry, codec, block, 0, math.prod(shape), fraction).view(shape)


def _decode_range(
    data: np.ndarray, entry: list, codec: str, block: int, lo: int, hi: int, fraction: float
) -> torch.Tensor:
    """Values ``[lo, hi)`` of one flattened tensor, fp32 (a view for codec ``none``).
    For int8/int4/topk, ``lo`` must start a chunk (see :func:`chunk_step`)."""
    _, shape, scales_off, scales_len, payload_off, payload_len = entry
    if codec == "topk":
        if hi <= lo:
            return torch.zeros(0)
        scales, payload = data[scales_off : scales_off + scales_len], data[payload_off : payload_off + payload_len]
        return topk.decode(scales, payload, math.prod(shape), block, fraction, lo, hi)
    if codec == "none":
        return _view(data, payload_off, payload_len, "<f4")[lo:hi]
    if codec in ("fp16", "bf16"):
        raw = _view(data, payload_off, payload_len, "<i2")[lo:hi]
        return raw.view(torch.float16 if codec == "fp16" else torch.bfloat16).float()
    n = hi - lo
    scale = _view(data, scales_off, scales_len, "<f4")[lo // block : -(-hi // block)]
    raw = _view(data, payload_off, payload_len, "|u1")
    out = torch.empty(scale.numel() * block)
    if codec == "int4":
        raw = raw[lo // 2 : -(-hi // 2)]
        pairs = torch.stack([raw & 0x0F, raw >> 4], dim=1).view(-1)[:n]
        out[:n] = pairs.to(torch.int16) - 8
    else:
        out[:n] = raw[lo:hi].view(torch.int8)
    out[n:] = 0
    out.view(-1, block).mul_(scale[:, None])  # a NaN scale makes its whole block NaN
    return out[:n]
