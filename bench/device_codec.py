"""The codecs' encode + decode on a GPU, in ns per parameter: ``bench/run.py``'s GPU figure.

``compression.pack_pieces`` / ``unpack_pieces`` do not run on the device: they accept CUDA
tensors, but copy each one into a host scratch tensor and encode it there into a numpy
message (``unpack_pieces`` decodes into host tensors). What a codec could do on the device
is its arithmetic, so that is what this times, on one flat fp32 tensor where it lives:

* ``none``: the values are the message: one copy.
* ``fp16`` / ``bf16``: saturate finite values, cast down, cast back to fp32.
* ``int8`` / ``int4``: blockwise absmax quantise (a NaN scale for a block holding NaN/Inf),
  int4's nibble packing and unpacking, dequantise.

The arithmetic mirrors ``diloco_ray.algo.codecs`` (``_quantise``, ``_encode``,
``_decode_range``) with constants made on the tensor's device (``_quantise`` makes them
on the host, which CUDA ops do not all accept); :func:`check_against_pack` holds the two
to the same values. Timed with CUDA events around ``repeats`` round trips after warm-up.
"""

from __future__ import annotations

import math

import torch

from diloco_ray.algo import codecs, compression


def _quantise(flat: torch.Tensor, qmax: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``codecs._quantise`` on ``flat``'s device: (q as int8, fp32 scale per block)."""
    n = flat.numel()
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    finite = torch.isfinite(padded)
    clean = torch.where(finite, padded, torch.zeros((), device=flat.device))
    scale = clean.abs().amax(dim=1) / qmax
    scale = torch.where(finite.all(dim=1), scale, torch.full((), math.nan, device=flat.device))
    divisor = torch.where(scale > 0, scale, torch.ones((), device=flat.device))
    q = torch.round(clean / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(-1)[:n], scale


def _int4_round_trip(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values two to a byte (first in the low nibble) and unpack them again."""
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8, device=q.device)])
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)[: q.numel()]
    return pairs.to(torch.int16) - 8


def round_trip(flat: torch.Tensor, codec: str, block: int = codecs.DEFAULT_BLOCK) -> torch.Tensor:
    """Encode and decode one flat fp32 tensor with ``codec`` on its own device."""
    if codec == "none":
        return flat.clone()
    if codec in ("fp16", "bf16"):
        limit = codecs._FP16_MAX if codec == "fp16" else codecs._BF16_MAX
        saturated = torch.where(torch.isinf(flat), flat, flat.clamp(-limit, limit))
        return saturated.to(torch.float16 if codec == "fp16" else torch.bfloat16).float()
    q, scale = _quantise(flat, codecs._QMAX[codec], block)
    values = _int4_round_trip(q) if codec == "int4" else q
    out = torch.zeros(scale.numel() * block, device=flat.device)
    out[: flat.numel()] = values
    out.view(-1, block).mul_(scale[:, None])  # a NaN scale makes its whole block NaN
    return out[: flat.numel()]


def check_against_pack(codec: str, block: int = codecs.DEFAULT_BLOCK) -> None:
    """Raise if :func:`round_trip` decodes other values than ``compression.pack`` + ``unpack``
    (on the host, a few blocks with a zero block and an odd length)."""
    flat = torch.randn(3 * block + 1, generator=torch.Generator().manual_seed(0))
    flat[block : 2 * block] = 0
    expected = compression.unpack(compression.pack({"x": flat}, codec, block=block))[0]["x"]
    if not torch.equal(round_trip(flat, codec, block), expected):
        raise AssertionError(f"bench/device_codec.py's {codec} round trip differs from compression.pack/unpack")


def ns_per_param(codec: str, numel: int = 1 << 26, repeats: int = 10, device: str = "cuda") -> float:
    """Mean ns per value over ``repeats`` encode + decode round trips of ``numel``
    fp32 values on ``device`` (CUDA events; two warm-up trips first)."""
    check_against_pack(codec)
    flat = torch.randn(numel, device=device)
    for _ in range(2):
        round_trip(flat, codec)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        round_trip(flat, codec)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e6 / (repeats * numel)  # ms -> ns
