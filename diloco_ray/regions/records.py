"""What a region needs to take one of the home's syncs itself: the sync's record.

A parameter server's sync is a function of what it held before and of the sync's inputs:
the contributions it summed (each replica's or region's packed pieces, its weight and
staleness, in the order the servers took them), the replicas every server accepted, and in
decoupled mode the divisor and the shares of a round. A :class:`SyncRecord` holds exactly
those inputs, the accepted contributions' pieces as the home received them (compressed as
they crossed: with ``topk`` a few percent of the weights' bytes), the version the sync
moved from and to, and a digest of every server's rows after it. A region that holds what
the home's servers held before (:mod:`~diloco_ray.regions.mirror`) runs the servers' own
calls on it and lands on the same bits, which the digests confirm.

The contributions the home rejected travel only as their weights: the servers divide every
weight by the power of two above the total of all of them
(:func:`~diloco_ray.runtime.server_aggregator.contribution_scale`), and the sum a region
forms from the accepted ones alone must be divided the same way.

A region that holds nothing yet, or not what the home held before a sync (it joined, was
cut off, or the home restored its servers), or whose digest disagrees, starts again from one
server's whole state (:func:`state_payload`: the rows, the outer optimizer's state, what
replicas hold and the server's position, as a checkpoint holds them).

Pure functions over plain values; no Ray, no sockets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from diloco_ray.channel import frames
from diloco_ray.persist.server_state import SavedServer
from diloco_ray.persist.state_files import flatten_state, unflatten_state
from diloco_ray.runtime.messages import AppliedRound, Contribution
from diloco_ray.runtime.server_aggregator import contribution_scale

Buffers = tuple[np.ndarray, ...]  # one contribution's pieces for one server: a buffer per rank


@dataclass(frozen=True)
class SyncRecord:
    """One sync of the home's servers, as a region repeats it.

    Args:
        fragment: the fragment synced.
        from_version: the servers' version before the sync (a copy must hold it).
        version: their version after it.
        weights: every contribution's ``(replica id, weight, staleness)``, in the servers'
            order, the rejected ones' too.
        accepted: the replica ids every server accepted, in that order.
        pieces: per server, the accepted contributions' buffers, in ``accepted``'s order.
        digests: per server, :meth:`~diloco_ray.runtime.server.ParameterServer.weights_digest`
            after the sync.
        divisor: decoupled mode: what the sum was divided by (None: the accepted weights).
        shares: decoupled mode: replica id -> its share of a round (None in sync mode).
    """

    fragment: int
    from_version: int
    version: int
    weights: tuple[tuple[int, float, int], ...]
    accepted: tuple[int, ...]
    pieces: tuple[tuple[Buffers, ...], ...]
    digests: tuple[str, ...]
    divisor: Optional[float] = None
    shares: Optional[Mapping[int, float]] = None

    @property
    def scale(self) -> float:
        """What the servers divided every weight by: that of all the contributions."""
        return contribution_scale([Contribution(rid, [], w) for rid, w, _ in self.weights])

    @property
    def merge(self) -> Optional[tuple]:
        """Decoupled mode's ``(divisor, shares)`` of the sync (None in sync mode)."""
        return None if self.shares is None else (self.divisor, dict(self.shares))

    def contributions(self) -> list[list[Contribution]]:
        """Per server, the accepted contributions as the servers summed them."""
        by_id = {rid: (w, stale) for rid, w, stale in self.weights}
        return [
            [Contribution(rid, list(bufs), by_id[rid][0], by_id[rid][1]) for rid, bufs in zip(self.accepted, server)]
            for server in self.pieces
        ]


def record_of(
    fragment: int,
    contributions: Sequence[Sequence[Contribution]],
    applied: AppliedRound,
    digests: Sequence[str],
    resolve: Callable[[list], list],
    merge: Optional[tuple] = None,
) -> SyncRecord:
    """The record of a sync the home's servers took: ``contributions`` per server (as the
    sync was handed them), what server 0's commit reported (its versions among it), every
    server's digest, and ``merge`` (decoupled: ``(divisor, shares)``). ``resolve`` turns a
    contribution's refs into its buffers (``ray.get`` where they are refs)."""
    accepted = tuple(applied.accepted)
    first = contributions[0] if contributions else []
    weights = tuple((c.replica_id, float(c.weight), int(c.staleness)) for c in first)
    pieces = []
    for server in contributions:
        by_id = {c.replica_id: c for c in server}
        pieces.append(tuple(tuple(np.asarray(b, dtype=np.uint8) for b in resolve(by_id[rid].refs)) for rid in accepted))
    divisor, shares = merge if merge is not None else (None, None)
    shares = None if shares is None else {rid: float(shares[rid]) for rid in accepted if rid in shares}
    return SyncRecord(fragment, *applied.versions, weights, accepted, tuple(pieces), tuple(digests), divisor, shares)


def record_payload(record: SyncRecord) -> bytes:
    """The record as one checked frame: its numbers and the buffers' sizes in the header,
    the buffers one after another as its payload."""
    header = {
        "fragment": record.fragment,
        "versions": [record.from_version, record.version],
        "weights": [list(w) for w in record.weights],
        "accepted": list(record.accepted),
        "digests": list(record.digests),
        "divisor": record.divisor,
        "shares": None if record.shares is None else [[rid, s] for rid, s in record.shares.items()],
        "sizes": [[[int(b.nbytes) for b in bufs] for bufs in server] for server in record.pieces],
    }
    payload = b"".join(b.tobytes() for server in record.pieces for bufs in server for b in bufs)
    return frames.encode(header, payload)


def record_from(payload: bytes, max_bytes: int) -> SyncRecord:
    """The record in a frame of :func:`record_payload`, checked: its fields of their types,
    one digest and one buffer list per server, and buffers that fill the payload exactly.

    Raises:
        frames.BadFrame: anything else.
    """
    frame = frames.decode(payload, max_bytes)
    h = frame.header
    try:
        weights = tuple((int(rid), float(w), int(stale)) for rid, w, stale in h["weights"])
        accepted = tuple(int(rid) for rid in h["accepted"])
        sizes = [[[int(n) for n in bufs] for bufs in server] for server in h["sizes"]]
        digests = tuple(str(d) for d in h["digests"])
        from_version, version = (int(v) for v in h["versions"])
        shares = None if h["shares"] is None else {int(rid): float(s) for rid, s in h["shares"]}
        divisor = None if h["divisor"] is None else float(h["divisor"])
        fragment = int(h["fragment"])
    except (KeyError, TypeError, ValueError):
        raise frames.BadFrame("malformed: not a sync's record") from None
    known = {rid for rid, _, _ in weights}
    matched = len(digests) == len(sizes) and all(len(server) == len(accepted) for server in sizes)
    if not matched or not known >= set(accepted):
        raise frames.BadFrame("malformed: a record's digests, buffers and accepted replicas do not match")
    pieces, at, data = [], 0, frame.payload
    for server in sizes:
        bufs_of = []
        for bufs in server:
            got = []
            for n in bufs:
                if n < 0 or at + n > len(data):
                    raise frames.BadFrame("malformed: a record's buffers run past its payload")
                got.append(np.frombuffer(data, dtype=np.uint8, count=n, offset=at).copy())
                at += n
            bufs_of.append(tuple(got))
        pieces.append(tuple(bufs_of))
    if at != len(data):
        raise frames.BadFrame(f"malformed: a record's buffers do not fill its {len(data)} bytes")
    return SyncRecord(fragment, from_version, version, weights, accepted, tuple(pieces), digests, divisor, shares)


def state_payload(saved: SavedServer) -> bytes:
    """One server's whole state as one checked frame: its position and the state's layout in
    the header, its tensors as one safetensors blob (no pickles cross the channel)."""
    from safetensors.torch import save

    tensors, skeleton = flatten_state({"weights": saved.weights, "outer": saved.outer})
    blob = save({k: t.detach().cpu().contiguous() for k, t in tensors.items()})
    # As JSON text inside the header, whose own keys are sorted: the shapes' order is the layout's.
    return frames.encode({"meta": json.dumps(saved.meta), "skeleton": json.dumps(skeleton)}, blob)


def state_from(payload: bytes, max_bytes: int) -> SavedServer:
    """The server state in a frame of :func:`state_payload`.

    Raises:
        frames.BadFrame: a frame that is not one.
    """
    from safetensors.torch import load

    frame = frames.decode(payload, max_bytes)
    try:
        state = unflatten_state(load(frame.payload), json.loads(frame.header["skeleton"]))
        meta = json.loads(frame.header["meta"])
        return SavedServer(meta=dict(meta), weights=dict(state["weights"]), outer=dict(state["outer"]))
    except Exception as e:  # a frame that is not a server's state, whatever part of it is not
        raise frames.BadFrame(f"malformed: not a server's state ({type(e).__name__}: {e})") from None
