"""The ``topk`` codec: per block, the largest values by magnitude, 2 bits each.

A flattened tensor is cut into blocks of ``width = min(block, numel)`` values; the last
one holds what is left, ``tail`` values (``width`` when ``numel`` is a multiple of it).
A block of ``n`` values keeps its ``k = ceil(fraction * n)`` (at least 1) entries of
largest magnitude (SparseLoCo's recipe: top-k, 2-bit values, error feedback), so a short
tail block pays for its own length, not a whole block's. A block sends:

* two fp16 scales (in the tensor's scales section): ``lo`` and ``hi``, the smallest and
  largest non-zero magnitude it keeps ((0, 0) when it keeps none);
* ``k`` indices of ``index_bits = ceil(log2(width))`` bits each (the tail block's too),
  then ``k`` 2-bit codes: the sign, and whether the magnitude is nearer ``hi`` (decoded
  ``lo + 0.75 (hi - lo)``) or ``lo`` (decoded ``lo + 0.25 (hi - lo)``).

The levels have no zero, so a kept zero (a block with fewer than ``k`` non-zeros) is sent
as a copy of the block's largest kept entry, index and code: the decoder writes that
value twice and leaves the zero a zero.

Bits, least significant first, run on across blocks with no padding, so a block costs
``k * (index_bits + 2) + 32`` bits: at ``block`` 2048 that is ``32 * 13 + 32`` bits, 0.219
bits per value, with ``fraction`` 1/64 (the config's default for pseudo-gradients), and
``128 * 13 + 32``, 0.828, with 1/16. A message's header and its sections' alignment add a
little on top. What a block does not send is what error feedback carries to the next round
(:func:`diloco_ray.algo.compression.pack_filled`), which is why ``topk`` always runs with
it. A block holding NaN/Inf gets NaN scales, so it never decodes finite.

All of it is torch ops on the values' own device, so a tensor on a GPU is encoded and decoded
without leaving it. There the kept entries are the host's (ties in magnitude aside), but
``torch.topk(sorted=False)`` may list them in another order within a block: the bytes may
differ in where each entry stands, never in what a block decodes to.
"""

from __future__ import annotations

import math

import torch

_FP16_MAX = float(torch.finfo(torch.float16).max)
_SCALE_BYTES = 4  # two fp16 scales per block


def _kept(n: int, fraction: float) -> int:
    """Entries a block of ``n`` values keeps."""
    return min(n, max(1, math.ceil(fraction * n - 1e-9)))


def shape_of(numel: int, block: int, fraction: float) -> tuple[int, int, int]:
    """``(width, k, index_bits)`` of a tensor of ``numel`` values (width 0: empty); ``k``
    is a whole block's (see :func:`_tail` for the last block's)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"topk fraction must be in (0, 1], got {fraction!r}")
    width = min(block, numel)
    if width == 0:
        return 0, 0, 0
    return width, _kept(width, fraction), max(1, math.ceil(math.log2(width)))


def _tail(numel: int, width: int, fraction: float) -> tuple[int, int, int]:
    """``(blocks, tail, k_tail)``: the block count, and the last block's length and k."""
    blocks = -(-numel // width)
    tail = numel - (blocks - 1) * width
    return blocks, tail, _kept(tail, fraction)


def sections(numel: int, block: int, fraction: float) -> tuple[int, int]:
    """``(scales bytes, payload bytes)`` of one tensor."""
    width, k, bits = shape_of(numel, block, fraction)
    if width == 0:
        return 0, 0
    blocks, _, k_tail = _tail(numel, width, fraction)
    return _SCALE_BYTES * blocks, -(-((blocks - 1) * k + k_tail) * (bits + 2) // 8)


def chunk_values(numel: int, block: int, fraction: float, chunk: int) -> int:
    """Values encoded at a time: whole blocks, a multiple of 8 of them, so every chunk's
    bits start on a byte (about ``chunk`` values, at least 8 blocks). Only the last chunk
    holds the tail block, so every chunk starts after whole blocks of ``k`` entries."""
    width = shape_of(numel, block, fraction)[0] or 1
    return max(8, chunk // width // 8 * 8) * width


def encode_into(
    part: torch.Tensor, lo: int, numel: int, block: int, fraction: float, scales: torch.Tensor, payload: torch.Tensor
) -> None:
    """:func:`encode` of the chunk ``part`` (values ``lo...`` of the tensor; ``lo`` from
    :func:`chunk_values`' steps), written where it belongs in the tensor's sections (uint8
    tensors on ``part``'s device)."""
    width, k, bits = shape_of(numel, block, fraction)
    first = lo // width
    s, p = encode(part, numel, block, fraction)
    scales[_SCALE_BYTES * first : _SCALE_BYTES * first + s.numel()] = s
    start = first * k * (bits + 2) // 8
    payload[start : start + p.numel()] = p


def _bits(values: torch.Tensor, nbits: int) -> torch.Tensor:
    """(..., n) ints -> (..., n * nbits) bits, least significant first."""
    shifts = torch.arange(nbits, dtype=torch.int64, device=values.device)
    return ((values.to(torch.int64)[..., None] >> shifts) & 1).flatten(-2).to(torch.uint8)


def _ints(bits: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of :func:`_bits` over the last dimension."""
    weights = torch.tensor([1 << i for i in range(nbits)], dtype=torch.int64, device=bits.device)
    return (bits.to(torch.int64).unflatten(-1, (-1, nbits)) * weights).sum(-1)


def _levels(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) decoded magnitudes per block from its fp16 ``(lo, hi)`` pair."""
    lo, hi = scales[:, 0].float(), scales[:, 1].float()
    return lo + 0.25 * (hi - lo), lo + 0.75 * (hi - lo)


def _encode_rows(rows: torch.Tensor, k: int, nbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 ``(lo, hi)`` per row, the rows' bits) of blocks of equal length, ``k`` kept,
    on the rows' device."""
    finite = torch.isfinite(rows).all(dim=1)
    clean = torch.where(torch.isfinite(rows), rows, torch.zeros((), device=rows.device))
    index = clean.abs().topk(k, dim=1, sorted=False).indices
    kept = clean.gather(1, index)
    # A kept zero becomes a copy of the row's largest entry (see the module docstring), so
    # the levels below span the non-zero magnitudes; an all-zero row keeps (0, 0).
    zero = kept == 0
    top = kept.abs().argmax(1, keepdim=True)
    index = torch.where(zero, index.gather(1, top), index)
    kept = torch.where(zero, kept.gather(1, top), kept)
    size = kept.abs()
    scales = torch.stack([size.amin(1), size.amax(1)], dim=1).clamp(max=_FP16_MAX)
    scales = torch.where(finite[:, None], scales, torch.full((), math.nan, device=rows.device)).to(torch.float16)
    low, high = _levels(scales)
    # Nearer hi or lo, judged against the midpoint of the two decoded levels.
    code = (kept < 0).to(torch.int64) * 2 + (size >= (low + high)[:, None] / 2).to(torch.int64)
    return scales, torch.cat([_bits(index, nbits), _bits(code, 2)], dim=1).reshape(-1)


def encoded_rows(
    flat: torch.Tensor, numel: int, block: int, fraction: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp16 ``(lo, hi)`` per block, the blocks' bits) of whole blocks of a tensor of
    ``numel`` values, on ``flat``'s device: the whole blocks in one part, the tensor's
    short tail block in another."""
    width, k, nbits = shape_of(numel, block, fraction)
    whole = flat.numel() // width if width else 0
    parts = [_encode_rows(flat[: whole * width].reshape(whole, width), k, nbits)] if whole else []
    if flat.numel() > whole * width:  # the tensor's short tail block
        rest = flat[whole * width :].reshape(1, -1)
        parts.append(_encode_rows(rest, _kept(rest.numel(), fraction), nbits))
    return parts


def encode(flat: torch.Tensor, numel: int, block: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales bytes, payload bytes) of whole blocks of a tensor of ``numel`` values, as
    uint8 tensors on ``flat``'s device.

    Args:
        flat: fp32 values of some whole blocks (the tensor's last block may be short).
        numel: the whole tensor's size (it fixes the block width and k).
        block, fraction: ``compression_block`` and ``topk_fraction``.
    """
    parts = encoded_rows(flat, numel, block, fraction)
    if not parts:
        empty = torch.zeros(0, dtype=torch.uint8, device=flat.device)
        return empty, empty
    scales = torch.cat([s for s, _ in parts]).reshape(-1).view(torch.uint8)
    return scales, packbits(torch.cat([b for _, b in parts]))


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """A flat 0/1 uint8 stream as bytes, first bit in the least significant place, the last
    byte padded with zeros (``np.packbits(bitorder="little")``)."""
    pad = -bits.numel() % 8
    if pad or bits.storage_offset() % 8 or not bits.is_contiguous():
        bits = torch.cat([bits.reshape(-1), bits.new_zeros(pad)])
    # Eight 0/1 bytes read as one little-endian int64 (byte i holds bit i): one multiply
    # gathers them into its top byte, byte 7 (bit 8i lands on bit 56 + i, without carries).
    return (bits.view(torch.int64) * _GATHER).view(torch.uint8)[7::8].contiguous()


_GATHER = 0x0102040810204080


def unpackbits(data: torch.Tensor) -> torch.Tensor:
    """Bytes as a flat 0/1 uint8 stream, least significant bit first."""
    # Each byte looks up its eight bits as one int64 of a 256-row table.
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    table = ((torch.arange(256, dtype=torch.uint8, device=data.device)[:, None] >> shifts) & 1).view(torch.int64)
    return table.view(-1)[data.long()].view(torch.uint8)


def _decode_rows(payload: torch.Tensor, start: int, pairs: torch.Tensor, k: int, nbits: int, n: int) -> torch.Tensor:
    """``len(pairs)`` rows of ``n`` values, ``k`` entries each, whose bits start at bit
    ``start`` of ``payload``."""
    rows, per_row = pairs.shape[0], k * (nbits + 2)
    length = rows * per_row
    raw = unpackbits(payload[start // 8 : -(-(start + length) // 8)])
    bits = raw[start % 8 : start % 8 + length].view(rows, per_row)
    index, code = _ints(bits[:, : k * nbits], nbits), _ints(bits[:, k * nbits :], 2)
    low, high = _levels(pairs)
    size = torch.where(code % 2 == 1, high[:, None], low[:, None])
    values = torch.where(code >= 2, -size, size)
    out = torch.zeros(rows, n, device=pairs.device)
    # An index >= n cannot come from encode(); clamp so a corrupt message decodes to
    # garbage values, not an out-of-range write.
    return out.scatter_(1, index.clamp_(0, n - 1), values).view(-1)


def decode(
    scales: torch.Tensor, payload: torch.Tensor, numel: int, block: int, fraction: float, lo: int, hi: int
) -> torch.Tensor:
    """Values ``[lo, hi)`` of the flattened tensor, fp32 on the sections' device; ``lo``
    must start a block.

    Args:
        scales: the tensor's whole scales section (uint8, fp16 pairs).
        payload: the tensor's whole payload section (uint8 bits).
        numel, block, fraction: as for :func:`encode`.
    """
    width, k, nbits = shape_of(numel, block, fraction)
    blocks, tail, k_tail = _tail(numel, width, fraction)
    first, last = lo // width, -(-hi // width)
    # A copy: the section's offset in its message need not suit a view as fp16.
    pairs = scales[4 * first : 4 * last].clone().view(torch.float16).view(-1, 2)
    whole = max(0, min(last, blocks - 1) - first)  # blocks before the tensor's last one
    per_block = k * (nbits + 2)
    parts = [_decode_rows(payload, first * per_block, pairs[:whole], k, nbits, width)]
    if last == blocks:
        parts.append(_decode_rows(payload, (blocks - 1) * per_block, pairs[whole:], k_tail, nbits, tail))
    return torch.cat(parts)[lo - first * width : hi - first * width]
