"""The ``topk`` codec as torch ops on the values' own device: the bytes of
:mod:`diloco_ray.algo.topk` (same layout, same selection, same 2-bit levels), with the bit
packing that :mod:`~diloco_ray.algo.topk` does with numpy done by shifts and sums here, so a
tensor on a GPU is encoded and decoded without leaving it.

The selection and the levels are :mod:`~diloco_ray.algo.topk`'s own functions (they keep
their constants on the values' device), so on the host the two write the same bytes. On a
GPU the kept entries are the same (ties in magnitude aside), but ``torch.topk(sorted=False)``
lists them in another order within a block: the bytes may differ in where each entry
stands, never in what a block decodes to.
"""

from __future__ import annotations

import torch

from diloco_ray.algo.topk import _SCALE_BYTES, decode_with, encoded_rows, shape_of


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """A flat 0/1 uint8 stream as bytes, first bit in the least significant place, the last
    byte padded with zeros (``np.packbits(bitorder="little")``)."""
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.int32, device=bits.device)
    return (bits.view(-1, 8).to(torch.int32) << shifts).sum(1).to(torch.uint8)


def unpackbits(data: torch.Tensor) -> torch.Tensor:
    """Bytes as a flat 0/1 uint8 stream, least significant bit first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    return ((data[:, None] >> shifts) & 1).view(-1)


def encode(flat: torch.Tensor, numel: int, block: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales bytes, payload bytes) of whole blocks of a tensor of ``numel`` values, as
    uint8 tensors on ``flat``'s device (:func:`diloco_ray.algo.topk.encode`)."""
    parts = encoded_rows(flat, numel, block, fraction)
    if not parts:
        empty = torch.zeros(0, dtype=torch.uint8, device=flat.device)
        return empty, empty
    scales = torch.cat([s for s, _ in parts]).reshape(-1).view(torch.uint8)
    return scales, packbits(torch.cat([b for _, b in parts]))


def encode_into(
    part: torch.Tensor, lo: int, numel: int, block: int, fraction: float, scales: torch.Tensor, payload: torch.Tensor
) -> None:
    """:func:`encode` of the chunk ``part`` (values ``lo...``; ``lo`` from
    :func:`~diloco_ray.algo.topk.chunk_values`' steps), written where it belongs in the
    tensor's sections (uint8 tensors)."""
    width, k, bits = shape_of(numel, block, fraction)
    first = lo // width
    s, p = encode(part, numel, block, fraction)
    scales[_SCALE_BYTES * first : _SCALE_BYTES * first + s.numel()] = s
    start = first * k * (bits + 2) // 8
    payload[start : start + p.numel()] = p


def decode(
    scales: torch.Tensor, payload: torch.Tensor, numel: int, block: int, fraction: float, lo: int, hi: int
) -> torch.Tensor:
    """Values ``[lo, hi)`` of the flattened tensor, fp32 on the sections' device; ``lo``
    must start a block (:func:`diloco_ray.algo.topk.decode`).

    Args:
        scales: the tensor's whole scales section (uint8, fp16 pairs).
        payload: the tensor's whole payload section (uint8 bits).
        numel, block, fraction: as for :func:`encode`.
    """

    def pairs_of(first: int, last: int) -> torch.Tensor:
        # A copy: the section's offset in its message need not suit a view as fp16.
        return scales[4 * first : 4 * last].clone().view(torch.float16).view(-1, 2)

    return decode_with(pairs_of, payload, unpackbits, numel, block, fraction, lo, hi)
