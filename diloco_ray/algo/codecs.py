"""The value codecs: how one flat fp32 tensor becomes bytes and back (fp16, bf16, int8,
int4, and the sparse ``topk`` of :mod:`diloco_ray.algo.topk`), as one :class:`Codec` that
works on whatever device holds the values.

int8/int4 scale each block of ``block`` consecutive values by its absmax; ``topk`` keeps a
``fraction`` of each block. NaN/Inf never decode finite (a block holding one gets a NaN
scale), so the server can reject them. The buffer layout that holds many encoded tensors is
:mod:`diloco_ray.algo.wire_layout`'s; :mod:`diloco_ray.algo.compression` builds and reads it.

Every operation is a torch op on the values' own device, so the host and a GPU run the same
code: a rank's pseudo-gradient on a GPU is encoded there and only the message comes down.
On the host and on a GPU every finite value encodes to the same bytes (the same absmax,
division by a tensor, round-half-to-even and casts). Two things may differ on a GPU, neither
in what a message decodes to: the bits of a NaN (CUDA writes its own canonical NaN; a
non-finite value still decodes non-finite), and the order of ``topk``'s entries within a
block (:mod:`diloco_ray.algo.topk`). Bytes are little-endian on the wire and native in a
torch view: every CUDA device and the hosts torch runs on are little-endian, and
:func:`check_byte_order` says so where not.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from diloco_ray.algo import topk

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")
DEFAULT_BLOCK = 2048  # values per absmax scale for int8/int4: one 4-byte scale per 2048 values
# topk: values kept per block where no config says otherwise (weights_compression: topk, and
# callers that name no fraction): 0.828 bits per value at block 2048, headers not counted. The
# config's default for topk pseudo-gradients is 1/64 with topk's own outer step
# (diloco_ray.config.fields.CODEC_DEFAULTS; docs/slow-links.md's codec frontier says why).
DEFAULT_FRACTION = 1 / 16
# Values encoded or decoded at a time. On the host a chunk's scratch stays in cache (~3 MB);
# on a device it is large enough that its kernels, not their launches, take the time, and
# small enough that its temporaries (a few fp32 and int64 copies) stay far below its memory.
HOST_CHUNK = 1 << 17
DEVICE_CHUNK = 1 << 24
_QMAX = {"int8": 127, "int4": 7}
_VALUE_BYTES = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_codec(name: str) -> None:
    """Raise ValueError unless ``name`` is one of :data:`CODECS`."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; allowed: {', '.join(CODECS)}")


def check_byte_order() -> None:
    """Raise where torch's native byte order is not the wire's (little-endian)."""
    if sys.byteorder != "little":
        raise RuntimeError("the codecs write native bytes and the wire is little-endian; this host is big-endian")


@dataclass(frozen=True)
class Codec:
    """One codec and its settings: ``name`` (one of :data:`CODECS`), ``block`` (values per
    scale for int8/int4, per selection for topk) and ``fraction`` (topk only: the share of
    each block sent). The other codecs ignore ``fraction`` and hold the default, so two
    codecs that write the same bytes are equal."""

    name: str = "none"
    block: int = DEFAULT_BLOCK
    fraction: float = DEFAULT_FRACTION

    def __post_init__(self) -> None:
        check_codec(self.name)
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive int, got {self.block!r}")
        if self.name == "topk":
            topk.shape_of(1, self.block, self.fraction)  # raises for a fraction outside (0, 1]
        else:
            object.__setattr__(self, "fraction", DEFAULT_FRACTION)

    @classmethod
    def for_pseudo_grads(cls, sync_codec) -> Codec:
        """The codec a run's ``sync_codec`` section sets for pseudo-gradients
        (``pseudo_grad_compression``, ``compression_block``, ``topk_fraction``)."""
        return cls(sync_codec.pseudo_grad_compression, sync_codec.compression_block, sync_codec.topk_fraction)

    @classmethod
    def for_weights(cls, sync_codec) -> Codec:
        """The codec a run's ``sync_codec`` section sets for weights messages
        (``weights_compression``, ``compression_block``, ``topk_fraction``)."""
        return cls(sync_codec.weights_compression, sync_codec.compression_block, sync_codec.topk_fraction)

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    def sections(self, numel: int) -> tuple[int, int]:
        """``(scales bytes, payload bytes)`` of one tensor of ``numel`` values (0 for an
        empty tensor, 1 for a 0-d one), no header, no alignment padding."""
        if self.name == "topk":
            return topk.sections(numel, self.block, self.fraction)
        scales = 4 * -(-numel // self.block) if self.name in _QMAX else 0
        payload = -(-numel // 2) if self.name == "int4" else _VALUE_BYTES[self.name] * numel
        return scales, payload

    def nbytes(self, numel: int) -> int:
        """Bytes of payload plus scales for one tensor (see :meth:`sections`)."""
        return sum(self.sections(numel))

    def step(self, numel: int, device: torch.device) -> int:
        """Values encoded or decoded at a time on ``device``: whole blocks whose bytes start
        on a byte boundary (an even count of int4 blocks; a multiple of 8 topk blocks), about
        :data:`HOST_CHUNK` values on the host and :data:`DEVICE_CHUNK` elsewhere."""
        chunk = HOST_CHUNK if torch.device(device).type == "cpu" else DEVICE_CHUNK
        if self.name == "topk":
            return topk.chunk_values(numel, self.block, self.fraction, chunk)
        if self.name in _QMAX:
            return max(2, (chunk // self.block) // 2 * 2) * self.block
        return chunk

    def encode_into(self, flat: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        """Encode the flat fp32 ``flat`` into its sections ``scales`` and ``payload`` (uint8
        tensors on its device), a chunk of whole blocks at a time (:meth:`step`)."""
        n = flat.numel()
        step = self.step(n, flat.device)
        for lo in range(0, n, step):
            part = flat[lo : lo + step]
            if self.name == "topk":
                topk.encode_into(part, lo, n, self.block, self.fraction, scales, payload)
                continue
            s, p = self._encode_part(part)
            if self.name in _QMAX:
                first = lo // self.block
                scales[4 * first : 4 * first + s.numel()] = s
            start = lo // 2 if self.name == "int4" else lo * _VALUE_BYTES[self.name]
            payload[start : start + p.numel()] = p

    def decode_range(self, scales: torch.Tensor, payload: torch.Tensor, numel: int, lo: int, hi: int) -> torch.Tensor:
        """Values ``[lo, hi)`` of one flattened tensor of ``numel`` values, fp32 on the
        sections' device (a view for codec ``none``). For int8/int4/topk, ``lo`` must start a
        chunk (:meth:`step`)."""
        if self.name == "topk":
            if hi <= lo:
                return torch.zeros(0, device=payload.device)
            return topk.decode(scales, payload, numel, self.block, self.fraction, lo, hi)
        if self.name == "none":
            return _as(payload, torch.float32)[lo:hi]
        if self.name in _HALF:
            return _as(payload, _HALF[self.name])[lo:hi].float()
        n, block = hi - lo, self.block
        scale = _as(scales, torch.float32)[lo // block : -(-hi // block)]
        out = torch.empty(scale.numel() * block, device=payload.device)
        if self.name == "int4":
            raw = payload[lo // 2 : -(-hi // 2)]
            pairs = torch.stack([raw & 0x0F, raw >> 4], dim=1).view(-1)[:n]
            out[:n] = pairs.to(torch.int16) - 8
        else:
            out[:n] = payload[lo:hi].view(torch.int8)
        out[n:] = 0
        out.view(-1, block).mul_(scale[:, None])  # a NaN scale makes its whole block NaN
        return out[:n]

    def _encode_part(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales bytes, payload bytes) of whole blocks, as uint8 tensors on their device."""
        empty = torch.zeros(0, dtype=torch.uint8, device=part.device)
        if self.name == "none":
            return empty, part.contiguous().view(torch.uint8)
        if self.name in _HALF:
            # Saturate finite values so a large-but-finite update does not turn into inf;
            # clamp keeps NaN, and where() keeps +-inf as they are.
            limit = torch.finfo(_HALF[self.name]).max
            saturated = torch.where(torch.isinf(part), part, part.clamp(-limit, limit))
            return empty, saturated.to(_HALF[self.name]).view(torch.uint8)
        q, scale = _quantise(part, _QMAX[self.name], self.block)
        if self.name == "int4":
            nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
            if nibbles.numel() % 2:
                nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
            return scale.view(torch.uint8), nibbles[0::2] | (nibbles[1::2] << 4)
        return scale.view(torch.uint8), q.view(torch.uint8)


def _quantise(flat: torch.Tensor, qmax: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantisation: (q as int8 of len(flat), fp32 scale per block)."""
    n = flat.numel()
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    finite = torch.isfinite(padded)
    # q is computed on a sanitised copy (casting NaN to int is undefined behaviour); the
    # NaN scale set below is what makes a non-finite block decode non-finite.
    clean = torch.where(finite, padded, torch.zeros((), device=flat.device))
    # Divided by a tensor, not a Python number: CUDA divides by a host scalar as a multiply
    # by its reciprocal, a bit off the host's division now and then.
    scale = clean.abs().amax(dim=1) / torch.full((), float(qmax), device=flat.device)
    scale = torch.where(finite.all(dim=1), scale, torch.full((), math.nan, device=flat.device))
    divisor = torch.where(scale > 0, scale, torch.ones((), device=flat.device))  # all-zero block: 0/1
    q = torch.round(clean / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q.view(-1)[:n], scale


def _as(section: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 section viewed as ``dtype`` (copied first when its offset does not suit the
    view: sections start on 8 bytes in a message, but a caller's slice may not)."""
    if section.storage_offset() % torch.empty((), dtype=dtype).element_size():
        section = section.clone()
    return section.view(dtype)
