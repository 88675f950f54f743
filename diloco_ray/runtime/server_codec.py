"""How bytes come into and go out of a parameter server: the replicas' buffers decoded and
checked against the rows a sync expects, and the server's rows packed into messages.

:class:`SliceCodec` knows one server's :class:`~diloco_ray.algo.slice_layout.SliceLayout`
and the codec settings; it keeps no state between calls. On the host, pieces are decoded as
views into the buffers where the codec allows (nothing is copied), and an uncompressed
message is written into memory its caller lends (the server's sum space, once no sum is in
it). On a server's GPU (``server_gpus``) each buffer goes up once and is decoded there, and
a message is built there and comes down through pinned memory
(:mod:`diloco_ray.algo.device_copy`): the same code and the same bytes either way.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from diloco_ray.algo import compression, device_copy, partition
from diloco_ray.algo.aggregate import check_finite
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.slice_layout import SliceLayout


class SliceCodec:
    """Decodes what replicas send one server and packs what it sends back.

    Args:
        layout: the rows this server holds.
        allocate: ``nbytes -> np.uint8 array`` for an uncompressed message on the host
            (None: a fresh array).
        device: where the server's tensors live: pieces are decoded there and messages
            built there.
    """

    def __init__(
        self,
        layout: SliceLayout,
        allocate: Optional[Callable[[int], np.ndarray]] = None,
        device: torch.device = torch.device("cpu"),
    ):
        self.layout = layout
        self.allocate = allocate if device.type == "cpu" else None
        self.device = device

    def unpack(self, buf, lazy: bool = False) -> tuple[dict, dict]:
        """A message's pieces (name -> (first row, rows)) and meta, decoded where the
        server's tensors live (with ``lazy``, still encoded)."""
        return compression.unpack_pieces(buf, self.layout.names, lazy, self.device)

    # ---- coming in ---------------------------------------------------------------------
    def decode(self, buffers: list, target: partition.Rows) -> list:
        """Decode one replica's per-rank buffers and check them against ``target``: every
        row covered once, shapes right. Returns ``[(name, rows, piece)]``, each piece still
        encoded (:class:`~diloco_ray.algo.compression.Encoded`: views into the buffers
        where the codec allows). Finiteness is checked as the values are read.

        Raises:
            ValueError: naming the rank, the tensor and what is wrong with it.
        """
        shapes = self.layout.shapes
        found = []
        covered = dict.fromkeys(target, 0)
        for r, buf in enumerate(buffers):
            pieces, _ = self.unpack(buf, lazy=True)
            for name, (start, piece) in pieces.items():
                span = (start, start + partition.num_rows(piece.shape))
                if name not in target or partition.intersect({name: span}, target) != {name: span}:
                    raise ValueError(f"rank {r} sent rows {span} of '{name}' outside this sync's slice")
                if tuple(piece.shape[1:]) != shapes[name][1:]:
                    raise ValueError(
                        f"rank {r} sent '{name}' rows of shape {tuple(piece.shape)}, "
                        f"want (*, {', '.join(map(str, shapes[name][1:]))})"
                    )
                found.append((name, span, piece))
                covered[name] += span[1] - span[0]
        for name, (a, b) in target.items():
            if covered[name] != b - a:
                raise ValueError(f"pieces of '{name}' cover {covered[name]} of its {b - a} rows")
        return found

    def receive(self, buffers: list, target: partition.Rows) -> dict[str, torch.Tensor]:
        """Like :meth:`decode`, assembled into fp32 tensors covering ``target`` exactly,
        every value checked finite."""
        out = {n: torch.empty(self.layout.piece_shape(n, iv), device=self.device) for n, iv in target.items()}
        for name, span, piece in self.decode(buffers, target):
            partition.put(out[name], span, check_finite(piece.decode(), name), offset=target[name][0])
        return out

    # ---- going out ---------------------------------------------------------------------
    def pack(self, pieces: Mapping[str, torch.Tensor], target: partition.Rows, meta: dict) -> np.ndarray:
        """Rows ``target`` of the optimizer ``pieces`` (by key), exact fp32, as a message
        stamped with its send time: on the host, written straight into :attr:`allocate`'s
        memory."""
        layout = self.layout
        message = compression.pack_pieces_filled(
            {n: layout.piece_shape(n, iv) for n, iv in target.items()},
            {n: iv[0] for n, iv in target.items()},
            layout.names,
            lambda n, out: out.copy_(layout.rows(pieces, n, target[n])),
            Codec("none"),
            {**meta, "sent_at": time.time()},
            allocate=self.allocate,
            device=self.device,
        )
        return device_copy.to_host([message])[0]

    def encode(self, named: Mapping[str, torch.Tensor], target: partition.Rows, codec: Codec, meta: dict) -> np.ndarray:
        """Tensors by name, each exactly rows ``target[name]``, as a ``codec`` message
        stamped with its send time."""
        message = compression.pack_pieces_filled(
            {n: t.shape for n, t in named.items()},
            {n: iv[0] for n, iv in target.items()},
            self.layout.names,
            lambda n, out: out.copy_(named[n]),
            codec,
            {**meta, "sent_at": time.time()},
            device=self.device,
        )
        return device_copy.to_host([message])[0]
