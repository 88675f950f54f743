"""Where a rank's sync does its work, and the two places it can: a rank's rows of the
pseudo-gradient into a message, and a message into rows.

A rank's rows, anchor and error-feedback residual live on its device. On a GPU the work runs
there (:mod:`diloco_ray.algo.device_message`): ``anchor - local`` is written into device
scratch, encoded and fed back on the device, and only the finished messages come down, in
one pinned buffer. Elsewhere it runs on the host (:mod:`diloco_ray.algo.compression`): a CPU
rank, or a GPU rank whose anchor is kept in host memory (``anchor_on_host``, which trades the
GPU's speed here for 4 bytes per parameter of GPU memory). Both write the same bytes. On
the device a server's message is built whole before it comes down: its size (4 bytes per
parameter sent with ``none``, 1 with ``int8``) is GPU memory the sync holds while it runs.
:class:`~diloco_ray.algo.rank_sync.RankSync` decides what to send and apply; this module
only does it.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from diloco_ray.algo import compression, device_message


def device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """Where ``tensors`` live (the host when there are none)."""
    return next((t.device for t in tensors.values()), torch.device("cpu"))


def works_on_device(device: torch.device, anchor_on_host: bool, on_device: Optional[bool]) -> bool:
    """Whether the sync of rows on ``device`` runs there: on a GPU unless the anchor is
    kept on the host; ``on_device`` (not None) decides instead (tests and benchmarks).

    Raises:
        ValueError: ``on_device`` with ``anchor_on_host``: the work is where the anchor is.
    """
    if on_device and anchor_on_host:
        raise ValueError("on_device and anchor_on_host exclude each other: the sync works where the anchor is")
    return (device.type == "cuda" and not anchor_on_host) if on_device is None else on_device


def decode(buf, names: Sequence[str], device: torch.device, on_device: bool) -> tuple[dict, dict]:
    """A message's pieces (name -> (first row, fp32 rows)) and meta: decoded on ``device``
    when the work is there (``on_device``), else on the host."""
    if on_device:
        return device_message.unpack_pieces(buf, names, device)
    return compression.unpack_pieces(buf, names)


def pack_difference(
    anchor: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    starts: Mapping[str, int],
    names: Sequence[str],
    codec: str,
    meta: dict,
    residual: Optional[Mapping[str, torch.Tensor]],
    block: int,
    fraction: float,
    device: Optional[torch.device] = None,
):
    """``anchor - local`` of some rows, packed as one message of pieces.

    Args:
        anchor, local: name -> the rows sent of each parameter (views; same shapes).
        starts: name -> the first row's index in the full parameter.
        names: every parameter name in model order.
        codec, meta, block, fraction: the message's codec settings and meta.
        residual: error feedback: name -> the residual of those rows, updated in place.
        device: build the message there (a uint8 tensor); None: on the host (a numpy array).
    """

    def fill(name: str, into: torch.Tensor) -> None:
        _difference_into(anchor[name], local[name], into.view(anchor[name].shape))

    shapes = {n: a.shape for n, a in anchor.items()}
    args = (shapes, starts, names, fill, codec, meta, residual, block)
    if device is not None:
        return device_message.pack_pieces_filled(*args, fraction=fraction, device=device)
    return compression.pack_pieces_filled(*args, fraction=fraction)


def start_to_host(messages: list) -> device_message.DownCopy:
    """:func:`pack_difference`'s messages on their way to the host: device ones by one
    pinned, asynchronous copy; host ones are there already (their own memory)."""
    return device_message.DownCopy([m if isinstance(m, torch.Tensor) else torch.from_numpy(m) for m in messages])


def _difference_into(anchor: torch.Tensor, local_rows: torch.Tensor, into: torch.Tensor) -> None:
    """Write ``anchor - local_rows`` into ``into`` (of the anchor's shape), straight into the
    message: no full-size temporary, wherever the three tensors live."""
    if local_rows.device == into.device:
        torch.sub(anchor, local_rows, out=into)
    elif anchor.device == into.device:  # anchor on the host: the rows come down first
        into.copy_(local_rows)
        torch.sub(anchor, into, out=into)
    else:  # rows on a GPU: one tensor's difference there, then to the host
        into.copy_(anchor - local_rows.float())
