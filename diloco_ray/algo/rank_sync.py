"""A rank's side of the sync: what it holds of the global model and what it sends.

:class:`RankSync` is plain tensor code (no Ray): the rank actor feeds it the server's
messages and its local parameters, and gets back the buffers to send. It owns

* the **anchor** -- this rank's rows of the global weights as the replica last received
  them; a pseudo-gradient is ``anchor - local``;
* the **versions** -- per server, how many syncs the anchor reflects, so a message is
  applied once, in order, and a gap (a replica that missed a sync, or a new one) is
  detected and answered with a full load;
* the **residuals** of error feedback and the sends awaiting the driver's verdict, one
  residual per trained parameter over this rank's rows, zero when a replica joins (a fresh
  replica has sent nothing yet, so it owes no correction): a
  :class:`~diloco_ray.algo.error_feedback.FeedbackLedger`, the books a region keeps by the
  same code;
* the row layout: which rows of which fragment go to which server (:mod:`partition`).

Messages are :func:`compression.pack` buffers whose meta carries ``rows`` (the first row
of each piece), ``version`` and, for fragment messages, ``fragment``; with
``weights_compression`` they hold a ``delta`` against the previous version instead of
values.

Where the work happens (:mod:`diloco_ray.algo.rank_device`): on a GPU rank, unless
``anchor_on_host``, the anchor and the residuals live on the GPU, the pseudo-gradient is
taken, encoded and fed back there, only the encoded messages come down, and a weights
message goes up once and is decoded there; elsewhere all of it runs on the host.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import compression, links, partition, rank_device
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.device_copy import DownCopy
from diloco_ray.algo.error_feedback import FeedbackLedger, keeps_residual
from diloco_ray.algo.sharding import shard_rows
from diloco_ray.config.sections import SyncCodecSection


class NeedsFullLoad(Exception):
    """A message cannot be applied on top of what this rank holds (it missed a sync)."""


class RankSync:
    """One rank's anchor, versions, residuals and row layout.

    Args:
        shapes: name -> full shape of every trained parameter, in model order.
        world_size: ranks in the replica.
        rank: this rank.
        servers: ``num_param_servers``.
        fragments: ``sync_fragments``.
        codec: the pseudo-gradients' codec (:meth:`Codec.for_pseudo_grads
            <diloco_ray.algo.codecs.Codec.for_pseudo_grads>`).
        error_feedback: keep residuals (always with ``topk``, which drops most values).
        alpha: ``fragment_alpha``, used by :meth:`apply` with ``merge=True``.
        anchor_on_host: keep the anchor in (pinned, when a GPU is there) host memory.
        overlap: ``overlap_communication``.
        decay: ``error_feedback_decay``.

    A rank builds it from its :class:`~diloco_ray.config.sections.SyncCodecSection` with
    :meth:`of`; the plain arguments are for tests and benchmarks, and so is the attribute
    ``on_device``: None (the default) works on a GPU rank's device unless ``anchor_on_host``
    (see the module docstring); True runs the device code even on the host, with CPU
    kernels, and False the host code even for a GPU's rows, to compare the two.
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        world_size: int,
        rank: int,
        servers: int = 1,
        fragments: int = 1,
        codec: Codec = Codec(),
        error_feedback: bool = False,
        alpha: float = 0.5,
        anchor_on_host: bool = False,
        overlap: bool = False,
        decay: float = 1.0,
    ):
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.names = list(self.shapes)
        self.world_size, self.rank = world_size, rank
        self.codec, self.alpha = codec, alpha
        self.anchor_on_host = anchor_on_host
        self.on_device: Optional[bool] = None
        self.error_feedback = keeps_residual(codec.name, error_feedback)
        # Rows this rank holds (0-d tensors: every rank) and the rows it sends (0-d: rank 0).
        self.held = {n: (0, 1) if not s else _span(shard_rows(s[0], world_size, rank)) for n, s in self.shapes.items()}
        mine = partition.rank_rows(self.shapes, world_size, rank)
        owned = partition.server_shards(self.shapes, servers)
        self.sends = [
            [partition.intersect(mine, frag, own) for own in owned]
            for frag in partition.fragments(self.shapes, fragments)
        ]
        self.anchor: dict[str, torch.Tensor] = {}
        # Error feedback's residual over the rows held, and the sends awaiting their verdict.
        self.ledger = FeedbackLedger(self.held, self.shapes, decay)
        self.versions = [-1] * servers
        # Overlap with error feedback: per fragment in flight, this rank's local rows of it
        # as they were sent (name -> (first row, rows)), for the merge (see apply).
        self.fragment_rows = partition.fragments(self.shapes, fragments)
        self.keeps_sent = overlap and self.error_feedback
        self.sent_local: dict[int, dict[str, tuple[int, torch.Tensor]]] = {}

    @classmethod
    def of(
        cls, sync_codec: SyncCodecSection, shapes: Mapping[str, Sequence[int]], world_size: int, rank: int, servers: int
    ) -> RankSync:
        """A rank's sync as the job's ``sync_codec`` section sets it up, for ``servers``
        (``num_param_servers``) servers."""
        return cls(
            *(shapes, world_size, rank, servers, sync_codec.sync_fragments),
            codec=Codec.for_pseudo_grads(sync_codec),
            error_feedback=sync_codec.error_feedback,
            alpha=sync_codec.fragment_alpha,
            anchor_on_host=sync_codec.anchor_on_host,
            overlap=sync_codec.overlap_communication,
            decay=sync_codec.error_feedback_decay,
        )

    # ---- what comes down ---------------------------------------------------------------
    def decide_load(self, version: int, fragment_message: bool) -> str:
        """What to do with the messages of sync ``version``: ``"skip"`` (already held),
        ``"apply"``, or ``"full"`` (this rank missed a sync, or never had the weights:
        load everything first, then see again)."""
        if all(version <= v for v in self.versions):
            return "skip"
        if fragment_message and any(version > v + 1 for v in self.versions):
            return "full"
        return "apply"

    def forget_versions(self) -> None:
        """Hold no sync version any more, so the next message loads everything: the servers
        were restored from a checkpoint, or a rejected pseudo-gradient may have left NaN in
        rows that a fragment message (which replaces its own rows only) would not reach."""
        self.versions = [-1] * len(self.versions)

    @torch.no_grad()
    def apply(self, buffers: Sequence, local: Mapping[str, torch.Tensor], merge: bool = False) -> None:
        """Apply one message per server to the anchor and the local rows.

        A full message (no ``fragment``) replaces both. A fragment message moves the
        anchor to the new global rows and either replaces the local rows too or, with
        ``merge`` (overlapping communication), blends them:
        ``local = alpha * local + (1 - alpha) * global``. With error feedback the blend would
        count twice what the codec left out (``alpha`` of it stays in ``local``, all of it in
        the residual: with ``topk`` most of the update), so the rows become the new global
        rows plus only the steps run since the fragment was sent:
        ``local = global + (local - local as sent)``.

        Args:
            buffers: one packed message per server, in server order.
            local: name -> this rank's local rows of each parameter (written in place).
            merge: blend instead of replace (fragment messages only).

        Raises:
            NeedsFullLoad: a fragment message does not follow the version held.
        """
        sent: dict = {}
        device = rank_device.device_of(local)
        for s, buf in enumerate(buffers):
            pieces, meta = self._decode(buf, device)
            full = meta.get("fragment") is None
            if full:
                self.sent_local = {}  # replaced: nothing in flight is merged any more
            elif merge:
                sent = self.sent_local.get(meta["fragment"], {})
            if not self._is_next(s, meta["version"], full):
                continue
            blend = sent if merge and not full else None
            for name, (start, piece) in pieces.items():
                self._apply_piece(name, start, piece, local[name], bool(meta.get("delta")), blend)
            self.versions[s] = meta["version"]
        if merge and not full:
            self.sent_local.pop(meta["fragment"], None)

    def _is_next(self, server: int, version: int, full: bool) -> bool:
        """Whether ``server``'s message of ``version`` is to be applied (False: held already).

        Raises:
            NeedsFullLoad: a fragment message skips a version.
        """
        if version <= self.versions[server]:
            return False
        if not full and version != self.versions[server] + 1:
            raise NeedsFullLoad(f"server {server} sent version {version} on top of {self.versions[server]}")
        return True

    def _apply_piece(
        self,
        name: str,
        start: int,
        piece: torch.Tensor,
        local: torch.Tensor,
        delta: bool,
        blend: Optional[Mapping[str, tuple[int, torch.Tensor]]],
    ) -> None:
        """Apply the rows of ``name`` from ``start`` that this rank holds to the anchor
        (``delta``: added, else copied) and to ``local``: copied when ``blend`` is None;
        else the new rows plus the steps since the send when ``blend`` holds the rows as
        sent, and the ``alpha`` blend when it does not (see :meth:`apply`)."""
        span = (start, start + partition.num_rows(piece.shape))
        mine = partition.intersect({name: span}, {name: self.held[name]}).get(name)
        if mine is None:
            return
        new = partition.take(piece, mine, start).float()
        offset = self.held[name][0]
        if name not in self.anchor:
            self.anchor[name] = self._new_anchor(local)
        anchor = partition.take(self.anchor[name], mine, offset)
        if delta:
            anchor.add_(new)
        else:
            anchor.copy_(new)
        rows = partition.take(local, mine, offset)
        if blend is None:
            rows.copy_(anchor)
        elif name in blend:
            first, as_sent = blend[name]
            rows.add_((anchor - partition.take(as_sent, mine, first)).to(rows.device, rows.dtype))
        else:
            rows.mul_(self.alpha).add_(anchor.to(rows.device, rows.dtype), alpha=1.0 - self.alpha)

    def _works_on_device(self, device: torch.device) -> bool:
        return rank_device.works_on_device(device, self.anchor_on_host, self.on_device)

    def _decode(self, buf, device: torch.device) -> tuple[dict, dict]:
        """A message's pieces, decoded where the sync of rows on ``device`` works."""
        where = device if self._works_on_device(device) else torch.device("cpu")
        return compression.unpack_pieces(buf, self.names, device=where)

    def _new_anchor(self, local: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``local`` where the anchor lives: beside it, or on the host."""
        if not (self.anchor_on_host and local.device.type == "cuda"):
            return local.detach().float().clone()
        return torch.empty(local.shape, dtype=torch.float32, pin_memory=True).copy_(local.detach())

    # ---- what goes up ------------------------------------------------------------------
    def outgoing(
        self,
        fragment: int,
        local: Mapping[str, torch.Tensor],
        link: links.Link | None = None,
        attempt: Optional[int] = None,
    ) -> list[np.ndarray]:
        """:meth:`start_outgoing`'s buffers, once they are on the host."""
        return self.start_outgoing(fragment, local, link, attempt).wait()

    @torch.no_grad()
    def start_outgoing(
        self,
        fragment: int,
        local: Mapping[str, torch.Tensor],
        link: links.Link | None = None,
        attempt: Optional[int] = None,
    ) -> DownCopy:
        """This rank's pseudo-gradient ``anchor - local`` of ``fragment``, one packed
        buffer per server, through the codec (with error feedback when enabled), on its way
        to the host. With error feedback the buffers are kept under ``attempt`` (the driver's
        launch counter) until :meth:`settle` hears whether the servers applied them.

        On a GPU the messages are built there and come down together through one pinned
        buffer by a copy on a stream of its own
        (:class:`~diloco_ray.algo.device_copy.DownCopy`): what is queued after this call
        (the next period's steps, with ``overlap_communication``) runs while the bytes come
        down; ``wait()`` gives them. On the host they are there when this returns. Either way
        ``local`` may change as soon as this returns: the difference is already taken."""
        plan = self.sends[fragment]
        # Every rank of the replica shares its link; assume they send equal shares.
        link_bytes = self.world_size * sum(self.codec.nbytes(partition.numel(rows, self.shapes)) for rows in plan)
        stamp = links.stamp(link, link_bytes)
        if self.keeps_sent:
            held = partition.intersect(self.fragment_rows[fragment], self.held)
            self.sent_local[fragment] = {
                n: (iv[0], partition.take(local[n], iv, self.held[n][0]).detach().float().clone())
                for n, iv in held.items()
            }
        device = rank_device.device_of(local)
        where = device if self._works_on_device(device) else torch.device("cpu")
        copy = DownCopy([self._pack_difference(rows, local, stamp, where) for rows in plan])
        if self.error_feedback:
            self.ledger.keep(attempt, copy)
        return copy

    @torch.no_grad()
    def start_period(self, reset_inner: bool, reset: bool, restart: bool, verdicts: Mapping[int, bool]) -> None:
        """The ledger's books as a period starts (:meth:`FeedbackLedger.start_period
        <diloco_ray.algo.error_feedback.FeedbackLedger.start_period>`): what a send the
        driver says was not applied (late past the deadline, rejected, lost in transit, or
        a fragment of a replica that sat out the rest of its round) carried goes back into
        the residual, read here as the servers read it."""
        device = self._residual_device()
        self.ledger.start_period(
            reset_inner=reset_inner, reset=reset, restart=restart, verdicts=verdicts, read=self._reader(), device=device
        )

    @torch.no_grad()
    def settle(self, verdicts: Mapping[int, bool]) -> None:
        """Settle the verdicts alone (a checkpoint's save settles them before it writes)."""
        self.ledger.settle(verdicts, self._reader(), self._residual_device())

    def _reader(self):
        """This rank's messages read as the servers read them, where its sync works."""
        device = rank_device.device_of(self.anchor)
        return lambda buf: self._decode(buf, device)[0]

    def _residual_device(self) -> torch.device:
        """Where the residual lives: beside the anchor when the sync works there, else on
        the host (a checkpoint's moves there when used)."""
        device = rank_device.device_of(self.anchor)
        return device if self._works_on_device(device) else torch.device("cpu")

    def _pack_difference(
        self, rows: partition.Rows, local: Mapping[str, torch.Tensor], meta: dict, device: torch.device
    ) -> torch.Tensor:
        """``anchor - local`` of ``rows`` packed for one server (a message built on
        ``device``), with its residual decayed and fed back when error feedback is on."""
        residual = self.ledger.feed(rows, self._residual_device()) if self.error_feedback else None
        anchor = {n: partition.take(self.anchor[n], iv, self.held[n][0]) for n, iv in rows.items()}
        mine = {n: partition.take(local[n], iv, self.held[n][0]) for n, iv in rows.items()}
        shapes, starts = {n: a.shape for n, a in anchor.items()}, {n: iv[0] for n, iv in rows.items()}
        fill = rank_device.difference(anchor, mine)
        return compression.pack_pieces_filled(
            shapes, starts, self.names, fill, self.codec, meta, residual, device=device
        )

    def seed(self, local: Mapping[str, torch.Tensor]) -> list[np.ndarray]:
        """This rank's rows of its current weights for each server, fp32 (to start the
        servers from the model every rank built)."""
        mine = partition.rank_rows(self.shapes, self.world_size, self.rank)
        out = []
        for rows in partition.server_shards(self.shapes, len(self.versions)):
            send = partition.intersect(rows, mine)
            pieces = {n: partition.take(local[n].detach().float(), iv, self.held[n][0]) for n, iv in send.items()}
            buf, _ = compression.pack_pieces(
                pieces, {n: iv[0] for n, iv in send.items()}, self.names, Codec("none"), {"version": 0}
            )
            out.append(buf)
        return out

    def adopt(self, local: Mapping[str, torch.Tensor], expected: Optional[list]) -> tuple[list[str], bool]:
        """Take the freshly built ``local`` as the servers' version 0 when its digests are
        ``expected`` (the seeding rank's of the same rank index and world size): equal
        digests mean the same fp32 bytes, so the round-0 full load would bring nothing and
        is skipped. Returns (this rank's digest of what :meth:`seed` packs, per server;
        whether it was adopted)."""
        digests = [hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest() for buf in self.seed(local)]
        held = digests == expected
        if held:
            self.anchor = {n: self._new_anchor(t) for n, t in local.items()}
            self.versions, self.sent_local = [0] * len(self.versions), {}
        return digests, held

    # ---- state that a checkpoint keeps ---------------------------------------------------
    def state_dict(self, with_anchor: bool) -> dict:
        """Residuals always (with every send still unsettled put back: what no verdict
        reached is not in the checkpoint's weights); anchors and versions when the local rows
        are kept too (when they may differ from the global weights at a round boundary)."""
        state = {"residual": self.ledger.saved_residual(self._reader(), self._residual_device())}
        if with_anchor:
            state.update(anchor=dict(self.anchor), versions=list(self.versions), sent_local=dict(self.sent_local))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.ledger.load_state_dict({"residual": state.get("residual")})  # (saved with every send settled)
        if "anchor" in state:
            self.anchor = {n: t.clone() for n, t in state["anchor"].items()}
            self.versions = list(state["versions"])
            sent = state.get("sent_local") or {}
            self.sent_local = {f: {n: (r, t.clone()) for n, (r, t) in rows.items()} for f, rows in sent.items()}


def _span(s: slice) -> tuple[int, int]:
    return s.start, s.stop
