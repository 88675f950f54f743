"""Where a rank's sync does its work, and how its pseudo-gradient gets into a message there.

A rank's rows, anchor and error-feedback residual live on its device. On a GPU the sync works
there: ``anchor - local`` is written into device scratch, encoded and fed back on the device
(:mod:`diloco_ray.algo.compression` builds messages wherever it is told), and only the
finished messages come down, in one pinned buffer. Elsewhere it works on the host: a CPU
rank, or a GPU rank whose anchor is kept in host memory (``anchor_on_host``, which trades
the GPU's speed here for 4 bytes per parameter of GPU memory). Both write the same bytes. On
the device a server's message is decoded whole before it is applied: its size (4 bytes per
parameter sent with ``none``, 1 with ``int8``) is GPU memory the sync holds while it runs.
:class:`~diloco_ray.algo.rank_sync.RankSync` decides what to send and apply.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch


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


def difference(
    anchor: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]
) -> Callable[[str, torch.Tensor], None]:
    """A message's ``fill`` that writes ``anchor - local`` of each named piece (views of
    the same shapes) into ``into``, straight into the message: no full-size temporary,
    wherever the three tensors live."""

    def fill(name: str, into: torch.Tensor) -> None:
        rows, out = local[name], into.view(anchor[name].shape)
        if rows.device == out.device:
            torch.sub(anchor[name], rows, out=out)
        elif anchor[name].device == out.device:  # anchor on the host: the rows come down first
            out.copy_(rows)
            torch.sub(anchor[name], out, out=out)
        else:  # rows on a GPU: one tensor's difference there, then to the host
            out.copy_(anchor[name] - rows.float())

    return fill
