"""A region's merge of its replicas: many pseudo-gradients in, one message per home server out.

Across regions (issue 42's layout) a region sends the home one message per sync, not one
per replica. :class:`RegionalMerge` builds it the way the home's servers build their mean,
with their own parts: for each home server's slice an
:class:`~diloco_ray.runtime.server_aggregator.Aggregator` decodes and checks every replica's
pieces (a NaN or a wrong shape rejects that replica, in every slice), sums the accepted
ones weighted by their tokens and divides by their total; a
:class:`~diloco_ray.runtime.server_codec.SliceCodec` then packs that mean exactly as a
one-rank replica packs its pseudo-gradient for that server. The home takes the message as
one contribution weighted by the region's accepted tokens, so its mean over regions is the
mean over every replica: a sum of sums, to fp32 round-off.

The codec of the WAN leg is the run's ``pseudo_grad_compression``. With ``error_feedback``
the region keeps the residual (what its messages did not carry yet, decayed by
``error_feedback_decay``), as a rank does for its own sends, and settles each message by
the home's verdict on it (:meth:`RegionalMerge.settle`); the leg inside the region
stays uncompressed or not, as the replicas' own codec says. Plain tensors and buffers, no
Ray: the regional server actor is a thin adapter over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.config.sections import SyncCodecSection
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server_aggregator import Aggregator
from diloco_ray.runtime.server_codec import SliceCodec


@dataclass
class RegionalMessage:
    """What a region sends the home for one sync.

    Args:
        buffers: one packed pseudo-gradient per home server (empty when no replica was
            accepted: the region then sends nothing).
        weight: the accepted replicas' tokens, the region's weight in the home's mean.
        accepted: the replicas merged, in the order they were given.
        rejected: replica id -> why it was left out.
    """

    buffers: list = field(default_factory=list)
    weight: float = 0.0
    accepted: list = field(default_factory=list)
    rejected: dict = field(default_factory=dict)


class RegionalMerge:
    """One region's merge, for every home server's slice.

    Args:
        shapes: parameter name -> shape, in model order.
        sync_codec: the run's sync section (fragments, the WAN codec, error feedback).
        num_servers: the home's ``num_param_servers``.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], sync_codec: SyncCodecSection, num_servers: int):
        self.codec_name = sync_codec.pseudo_grad_compression
        self.error_feedback = sync_codec.error_feedback or self.codec_name == "topk"
        self.decay = sync_codec.error_feedback_decay
        self.block, self.fraction = sync_codec.compression_block, sync_codec.topk_fraction
        self.layouts = [SliceLayout(shapes, s, num_servers, sync_codec.sync_fragments) for s in range(num_servers)]
        self.codecs = [SliceCodec(layout, self.block, self.fraction) for layout in self.layouts]
        self.aggregators = [Aggregator(layout, codec) for layout, codec in zip(self.layouts, self.codecs)]
        self.residual: list[dict[str, torch.Tensor]] = [{} for _ in self.layouts]  # per slice, by name
        self.piece_shapes: list[dict[str, torch.Size]] = [{} for _ in self.layouts]
        self.unsettled: dict[int, list] = {}  # launch attempt -> the message sent then, awaiting its verdict

    def merge(
        self, fragment: int, contributions: Sequence[Sequence[Contribution]], attempt: Optional[int] = None
    ) -> RegionalMessage:
        """The region's message for ``fragment``'s sync from its replicas' contributions
        (``contributions[s]``: every replica's pieces for home server ``s``, as the home's
        servers are handed them). With error feedback the message is kept under
        ``attempt`` (the home's launch counter) until :meth:`settle` hears its verdict."""
        prepared = [agg.prepare(fragment, list(cs)) for agg, cs in zip(self.aggregators, contributions)]
        reduced = [agg.reduce(*prepared) for agg in self.aggregators]
        accepted, reasons = reduced[0].accepted, dict(reduced[0].reasons)
        means = [agg.take_mean() for agg in self.aggregators]  # every slice's sync ends here
        if not accepted:
            return RegionalMessage(rejected=reasons)
        weights = prepared[0].weights
        buffers = [self._pack(s, fragment, mean) for s, mean in enumerate(means)]
        if self.error_feedback and attempt is not None:
            self.unsettled[attempt] = buffers
        return RegionalMessage(buffers, float(sum(weights[r] for r in accepted)), list(accepted), reasons)

    def settle(self, verdicts: Mapping[int, bool]) -> None:
        """Close the messages the home has a verdict on (launch attempt -> applied), as a
        rank settles its own sends: what a message carried was taken out of the residual
        when it was packed, so a message the home did not apply (the region was late, cut
        off, rejected) puts it back, to be sent again. A kept message older than the newest
        verdict and without one of its own was lost to the home, and is dropped."""
        if not verdicts:
            return
        for attempt, applied in sorted(verdicts.items()):
            buffers = self.unsettled.pop(attempt, None)
            if buffers is not None and not applied:
                for server, buf in enumerate(buffers):
                    self._add_to_residual(server, buf)
        newest = max(verdicts)
        self.unsettled = {a: b for a, b in self.unsettled.items() if a > newest}

    def forget_residual(self) -> None:
        """Drop what the region's messages have not carried yet, and the messages awaiting
        a verdict (the home restored its servers from a checkpoint: that work is undone
        another way)."""
        self.residual = [{} for _ in self.layouts]
        self.unsettled = {}

    def state(self) -> dict:
        """What the region keeps between syncs (the residual, and the messages awaiting a
        verdict), to save with the region's state."""
        return {"residual": self.residual, "piece_shapes": self.piece_shapes, "unsettled": self.unsettled}

    def load_state(self, state: Mapping) -> None:
        """Take up a :meth:`state` saved by this region's agent before it restarted."""
        if len(state["residual"]) != len(self.layouts):
            raise ValueError(f"a saved residual of {len(state['residual'])} slices for {len(self.layouts)} servers")
        self.residual, self.piece_shapes = list(state["residual"]), list(state["piece_shapes"])
        self.unsettled = dict(state["unsettled"])

    def _add_to_residual(self, server: int, buf: np.ndarray) -> None:
        pieces, _ = compression.unpack_pieces(buf, self.layouts[server].names)
        held = self.residual[server]
        for name, (_, values) in pieces.items():
            shape = self.piece_shapes[server][name]
            values = values.reshape(shape)
            held[name] = held[name] + values if name in held and held[name].shape == shape else values.clone()

    def _pack(self, server: int, fragment: int, mean: dict[str, torch.Tensor]) -> np.ndarray:
        target = self.layouts[server].target(fragment)
        self.piece_shapes[server].update({n: piece.shape for n, piece in mean.items()})
        residual = self._residual_of(server, mean) if self.error_feedback else None
        buf, left = compression.pack_pieces(
            mean,
            {n: iv[0] for n, iv in target.items()},
            self.layouts[server].names,
            self.codec_name,
            {},
            residual,
            block=self.block,
            fraction=self.fraction,
        )
        if left is not None and residual is not None:
            self.residual[server].update(left)  # what this message did not carry
        return buf

    def _residual_of(self, server: int, mean: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This slice's residual of the names in ``mean`` (a name not seen yet counts as
        zeros), decayed before it is fed back."""
        held = self.residual[server]
        return {n: held[n] * self.decay for n in mean if n in held and held[n].shape == mean[n].shape}
