"""The value codecs as torch ops on the values' own device: one flat fp32 tensor into its
sections of a message held as a uint8 tensor, and back.

The host path (:mod:`diloco_ray.algo.codecs`) encodes with torch on the CPU and writes the
bytes with numpy; this module writes the same bytes with torch alone, so a rank's
pseudo-gradient on a GPU is encoded there and only the message comes down (see
:mod:`diloco_ray.algo.device_message`). The arithmetic is the host's, op for op (the same
absmax, division, round-half-to-even and casts), so on the host both write identical
bytes, and on a GPU every finite value encodes to the same bytes too. Two things may differ
on a GPU, neither in what a message decodes to: the bits of a NaN (CUDA writes its own
canonical NaN; a non-finite value still decodes non-finite, and a block holding one still
gets a NaN scale), and the order of ``topk``'s entries within a block
(:mod:`diloco_ray.algo.device_topk`).

Bytes are little-endian on the wire and native in a torch view: every CUDA device and the
hosts torch runs on are little-endian, and :func:`check_byte_order` says so where not.
"""

from __future__ import annotations

import math
import sys

import torch

from diloco_ray.algo import device_topk
from diloco_ray.algo.codecs import _BF16_MAX, _FP16_MAX, _QMAX, _VALUE_BYTES, chunk_step

# Values encoded or decoded at a time on a device: large enough that a chunk's kernels, not
# their launches, take the time; small enough that its temporaries (a few fp32 and int64
# copies of the chunk) stay far below a rank's memory.
DEVICE_CHUNK = 1 << 24


def check_byte_order() -> None:
    """Raise where torch's native byte order is not the wire's (little-endian)."""
    if sys.byteorder != "little":
        raise RuntimeError("the device codec writes native bytes; this host is big-endian: use the host codec")


def device_step(numel: int, codec: str, block: int, fraction: float) -> int:
    """Values a device encodes or decodes at a time (whole blocks, byte-aligned)."""
    return chunk_step(numel, codec, block, fraction, DEVICE_CHUNK)


def _quantise(flat: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantisation, :func:`diloco_ray.algo.codecs._quantise` with its
    constants made on ``flat``'s device: (q as int8 of len(flat), fp32 scale per block).
    Every division is by a tensor, correctly rounded as the host's is."""
    n, qmax = flat.numel(), _QMAX[codec]
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    finite = torch.isfinite(padded)
    clean = torch.where(finite, padded, torch.zeros((), device=flat.device))
    # Divided by a tensor, not a Python number: CUDA divides by a host scalar as a multiply
    # by its reciprocal, a bit off the host's division now and then.
    scale = clean.abs().amax(dim=1) / torch.full((), float(qmax), device=flat.device)
    scale = torch.where(finite.all(dim=1), scale, torch.full((), math.nan, device=flat.device))
    divisor = torch.where(scale > 0, scale, torch.ones((), device=flat.device))
    q = torch.round(clean / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(-1)[:n], scale


def _encode_part(part: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales bytes, payload bytes) of whole blocks of one flat fp32 tensor, as uint8
    tensors on its device (:func:`diloco_ray.algo.codecs._encode`)."""
    empty = torch.zeros(0, dtype=torch.uint8, device=part.device)
    if codec == "none":
        return empty, part.contiguous().view(torch.uint8)
    if codec in ("fp16", "bf16"):
        limit = _FP16_MAX if codec == "fp16" else _BF16_MAX
        saturated = torch.where(torch.isinf(part), part, part.clamp(-limit, limit))
        return empty, saturated.to(torch.float16 if codec == "fp16" else torch.bfloat16).view(torch.uint8)
    q, scale = _quantise(part, codec, block)
    if codec == "int4":
        nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        payload = nibbles[0::2] | (nibbles[1::2] << 4)
    else:
        payload = q.view(torch.uint8)
    return scale.view(torch.uint8), payload


def encode_into(
    flat: torch.Tensor, codec: str, block: int, fraction: float, scales: torch.Tensor, payload: torch.Tensor
) -> None:
    """Encode the flat fp32 ``flat`` into its sections ``scales`` and ``payload`` (uint8
    tensors on its device), a chunk of whole blocks at a time (:func:`device_step`)."""
    n = flat.numel()
    step = device_step(n, codec, block, fraction)
    for lo in range(0, n, step):
        part = flat[lo : lo + step]
        if codec == "topk":
            device_topk.encode_into(part, lo, n, block, fraction, scales, payload)
            continue
        s, p = _encode_part(part, codec, block)
        if codec in _QMAX:
            first = lo // block
            scales[4 * first : 4 * first + s.numel()] = s
        start = lo // 2 if codec == "int4" else lo * _VALUE_BYTES[codec]
        payload[start : start + p.numel()] = p


def _as(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 section viewed as ``dtype`` (copied first when its offset does not suit
    the view: sections start on 8 bytes in a message, but a caller's slice may not)."""
    size = torch.empty((), dtype=dtype).element_size()
    if section.storage_offset() % size:
        section = section.clone()
    return section.view(dtype)


def decode_range(
    scales: torch.Tensor, payload: torch.Tensor, numel: int, codec: str, block: int, fraction: float, lo: int, hi: int
) -> torch.Tensor:
    """Values ``[lo, hi)`` of one flattened tensor of ``numel`` values, fp32 on the
    sections' device (a view for codec ``none``): :func:`diloco_ray.algo.codecs._decode_range`
    over uint8 tensors. For int8/int4/topk, ``lo`` must start a chunk (:func:`device_step`)."""
    if codec == "topk":
        if hi <= lo:
            return torch.zeros(0, device=payload.device)
        return device_topk.decode(scales, payload, numel, block, fraction, lo, hi)
    if codec == "none":
        return _as(payload, torch.float32)[lo:hi]
    if codec in ("fp16", "bf16"):
        return _as(payload, torch.float16 if codec == "fp16" else torch.bfloat16)[lo:hi].float()
    n = hi - lo
    scale = _as(scales, torch.float32)[lo // block : -(-hi // block)]
    out = torch.empty(scale.numel() * block, device=payload.device)
    if codec == "int4":
        raw = payload[lo // 2 : -(-hi // 2)]
        pairs = torch.stack([raw & 0x0F, raw >> 4], dim=1).view(-1)[:n]
        out[:n] = pairs.to(torch.int16) - 8
    else:
        out[:n] = payload[lo:hi].view(torch.int8)
    out[n:] = 0
    out.view(-1, block).mul_(scale[:, None])  # a NaN scale makes its whole block NaN
    return out[:n]
