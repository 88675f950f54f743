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

The codec of the WAN leg is the run's ``pseudo_grad_compression``. With error feedback
the region keeps its books as a rank keeps its own, with the same code
(:class:`~diloco_ray.algo.error_feedback.FeedbackLedger`): one residual per parameter over
every row (the region sends every server's slice of every fragment), each message's pieces
taking from and putting back into their own rows, and each message kept under the home's
launch attempt until the home's verdict on it settles it. The leg inside the region stays
uncompressed or not, as the replicas' own codec says. Plain tensors and buffers, no Ray:
the region's agent is a thin adapter over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import compression, partition
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.device_copy import DownCopy
from diloco_ray.algo.error_feedback import FeedbackLedger, keeps_residual
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
        self.codec = Codec.for_pseudo_grads(sync_codec)
        self.error_feedback = keeps_residual(self.codec.name, sync_codec.error_feedback)
        self.layouts = [SliceLayout(shapes, s, num_servers, sync_codec.sync_fragments) for s in range(num_servers)]
        self.names = self.layouts[0].names
        self.codecs = [SliceCodec(layout) for layout in self.layouts]
        self.aggregators = [Aggregator(layout, codec) for layout, codec in zip(self.layouts, self.codecs)]
        every_row = {n: (0, partition.num_rows(s)) for n, s in self.layouts[0].shapes.items()}
        self.ledger = FeedbackLedger(every_row, self.layouts[0].shapes, sync_codec.error_feedback_decay)

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
        if self.error_feedback:
            self.ledger.keep(attempt, DownCopy([torch.from_numpy(b) for b in buffers]))
        return RegionalMessage(buffers, float(sum(weights[r] for r in accepted)), list(accepted), reasons)

    def read(self, buf) -> dict:
        """A message's pieces as the home's servers read it (name -> (first row, rows))."""
        return compression.unpack_pieces(buf, self.names)[0]

    def _pack(self, server: int, fragment: int, mean: dict[str, torch.Tensor]) -> np.ndarray:
        """The mean of ``server``'s rows of ``fragment`` packed for it, with the residual of
        those rows decayed and fed back (the codec leaves in it what it did not carry)."""
        target = self.layouts[server].target(fragment)
        residual = self.ledger.feed(target) if self.error_feedback else None
        shapes = {n: tuple(piece.shape) for n, piece in mean.items()}
        return compression.pack_pieces_filled(
            shapes,
            {n: target[n][0] for n in shapes},
            self.names,
            lambda name, out: out.copy_(mean[name].reshape(out.shape)),
            self.codec,
            {},
            residual,
        ).numpy()
