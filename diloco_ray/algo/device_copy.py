"""A message's one trip between the device that holds the values and the host: down in
one pinned buffer (:class:`DownCopy`, :func:`to_host`), up by one staged copy
(:func:`to_device`). On the host both are the message's own memory, with no copy.

Ray must be handed host bytes, and a rank or a server on a GPU builds and reads its messages
there (:mod:`diloco_ray.algo.compression`): a sync's messages come down together by
asynchronous copies on a stream of their own, waited on once, so the next inner steps can
run while they last; a message from the host goes up once and the decoding kernels queue
behind it.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import wire_layout


class DownCopy:
    """Messages on their way to the host: one pinned buffer for them all, filled by one
    asynchronous copy per message on a copy stream of their device, so kernels queued after
    it (the next inner steps) run while the bytes come down. On the host the messages' own
    memory, already there.

    Args:
        messages: uint8 tensors, all on one device, whose kernels are queued on its current
            stream (the copies wait for them, not for anything queued later).
    """

    def __init__(self, messages: Sequence[torch.Tensor]):
        self.nbytes = [m.numel() for m in messages]
        self._arrays: Optional[list[np.ndarray]] = None
        self._copied: Optional[torch.cuda.Event] = None
        if all(m.device.type == "cpu" for m in messages):
            self._arrays = [m.numpy() for m in messages]
            return
        host = torch.empty(sum(self.nbytes), dtype=torch.uint8, pin_memory=True)
        stream = _copy_stream(messages[0].device)
        stream.wait_stream(torch.cuda.current_stream(messages[0].device))
        spans, at = [], 0
        with torch.cuda.stream(stream):
            for m in messages:
                host[at : at + m.numel()].copy_(m, non_blocking=True)
                m.record_stream(stream)  # its memory is not handed out again before the copy ends
                spans.append((at, at + m.numel()))
                at += m.numel()
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        self._host, self._spans = host, spans

    def wait(self) -> list[np.ndarray]:
        """The messages as host arrays, once the copy has ended (it waits for it only)."""
        if self._arrays is None:
            self._copied.synchronize()
            array = self._host.numpy()  # keeps the pinned buffer alive while any message is held
            self._arrays = [array[a:b] for a, b in self._spans]
            self._host = None
        return self._arrays


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream messages come down on, one per device, beside the one the steps run on."""
    device = torch.device(device)
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


def to_host(messages: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The messages as host arrays, what Ray is handed: a :class:`DownCopy`, waited for."""
    return DownCopy(messages).wait()


def to_device(buf, device: torch.device) -> torch.Tensor:
    """A message's bytes as a uint8 tensor on ``device``: on the host its own memory
    (read-only buffers, as Ray hands them out, are only read); on a GPU one copy into
    pinned memory (Ray's buffers are not pinned) and one asynchronous copy up, which the
    decoding kernels queue behind."""
    array = wire_layout.as_array(buf)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    staged = torch.empty(host.numel(), dtype=torch.uint8, pin_memory=True).copy_(host)
    return staged.to(device, non_blocking=True)
