"""Error feedback keeps what was sent until it is applied (no Ray): a message that reached no
update -- late past the deadline, rejected, a fragment of a replica that sat out -- goes back
into the residual, so over a run what the servers applied plus the residual is every
pseudo-gradient the rank computed."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo import compression
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import RankSync

SHAPES = {"embed": (40, 24), "norm": (24,), "head": (40, 24)}


def start(codec: str, fragments: int = 1, servers: int = 1) -> tuple[RankSync, dict]:
    sync = RankSync(SHAPES, 1, 0, servers, fragments, Codec(codec, 128, 1 / 16), error_feedback=True)
    g = torch.Generator().manual_seed(0)
    local = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    sync.apply(sync.seed(local), local)  # version 0: the anchor is the model built
    return sync, local


def decoded(buffers, names) -> dict[str, torch.Tensor]:
    """name -> the full-shape values a set of messages carries (as the servers decode them)."""
    out = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for buf in buffers:
        for name, (first, rows) in compression.unpack_pieces(buf, names)[0].items():
            out[name].view(-1, *SHAPES[name][1:])[first : first + rows.shape[0] if rows.dim() else None] += rows
    return out


@pytest.mark.parametrize("codec,fragments,servers", [("topk", 1, 1), ("topk", 2, 2), ("int4", 2, 1)])
def test_applied_plus_residual_is_every_pseudo_gradient_when_a_send_is_dropped(codec, fragments, servers):
    sync, local = start(codec, fragments, servers)
    g = torch.Generator().manual_seed(1)
    computed = {n: torch.zeros(s) for n, s in SHAPES.items()}
    applied = {n: torch.zeros(s) for n, s in SHAPES.items()}
    dropped = {3, 4}  # a late send, then (fragments: the other fragment of) a replica sitting out
    verdicts = {}
    for attempt in range(8):
        sync.settle(verdicts)
        step = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
        for name, t in local.items():  # the inner steps: the local weights move off the anchor
            t.sub_(step[name])
        fragment = attempt % fragments
        buffers = sync.outgoing(fragment, local, attempt=attempt)
        # anchor - local of this fragment's rows: what this send is the pseudo-gradient of
        rows = sync.fragment_rows[fragment]
        for name, (lo, hi) in rows.items():
            anchor, now = sync.anchor[name], local[name]
            if anchor.dim():
                computed[name][lo:hi] += anchor[lo:hi] - now[lo:hi]
                now[lo:hi] = anchor[lo:hi]  # the fragment's rows start again from the anchor
            else:
                computed[name] += anchor - now
                now.copy_(anchor)
        verdicts = {attempt: attempt not in dropped}
        if attempt not in dropped:
            for name, t in decoded(buffers, sync.names).items():
                applied[name] += t
    sync.settle(verdicts)
    for name in SHAPES:
        residual = sync.ledger.residual[name]
        torch.testing.assert_close(applied[name] + residual, computed[name], rtol=0, atol=1e-5, msg=name)


def test_a_send_the_driver_never_rules_on_is_dropped_once_a_later_one_is_settled():
    sync, local = start("topk")
    for attempt in (5, 6, 7):
        sync.outgoing(0, local, attempt=attempt)
    sync.settle({6: True})  # 5 was lost to the driver (a resumed run): verdicts come in launch order
    assert list(sync.ledger.unsettled) == [7]


def test_a_reset_or_a_rewind_forgets_what_was_sent():
    sync, local = start("topk")
    sync.outgoing(0, local, attempt=1)
    residual = {n: t.clone() for n, t in sync.ledger.residual.items()}
    sync.ledger.forget_sent()
    sync.settle({1: False})  # a re-run's rewind restores the residual itself: nothing goes back twice
    for name, t in residual.items():
        assert torch.equal(sync.ledger.residual[name], t)


@pytest.mark.parametrize("codec", ["topk", "int4"])
def test_a_checkpoint_written_with_a_send_unsettled_holds_what_it_carried(codec):
    """A decoupled replica's period has sent but not been merged when a checkpoint is written
    (told to stop): no weights the checkpoint holds carry that send, and a loaded state has no
    unsettled sends, so the saved residual holds it; the live books keep it for its verdict."""
    sync, local = start(codec)
    g = torch.Generator().manual_seed(2)
    for name, t in local.items():
        t.sub_(0.1 * torch.randn(t.shape, generator=g))
    buffers = sync.outgoing(0, local, attempt=4)
    carried = decoded(buffers, sync.names)
    saved = sync.state_dict(with_anchor=False)
    other = RankSync(SHAPES, 1, 0, 1, 1, Codec(codec, 128, 1 / 16), error_feedback=True)
    other.load_state_dict(saved)
    for name in SHAPES:
        want = sync.ledger.residual[name] + carried[name]
        torch.testing.assert_close(other.ledger.residual[name], want, rtol=0, atol=1e-6, msg=name)
    assert list(sync.ledger.unsettled) == [4] and other.ledger.unsettled == {}
