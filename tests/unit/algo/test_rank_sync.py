"""Unit tests for diloco_ray.algo.rank_sync.RankSync: messages in, pseudo-gradients out (no Ray)."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo import compression, partition, wire_layout
from diloco_ray.algo.codecs import Codec
from diloco_ray.algo.rank_sync import NeedsFullLoad, RankSync
from diloco_ray.algo.sharding import shard_rows

SHAPES = {
    "model.embed_tokens.weight": (10, 4),
    "model.layers.0.mlp.up_proj.weight": (6, 4),
    "model.layers.0.input_layernorm.weight": (4,),
    "model.layers.1.mlp.up_proj.weight": (6, 4),
    "model.layers.1.input_layernorm.weight": (4,),
    "lm_head.weight": (10, 4),
}
WITH_SCALAR = {"scale": (), **SHAPES}


def full(seed: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def rows(shape, world_size: int, rank: int):
    return () if len(shape) == 0 else shard_rows(shape[0], world_size, rank)


def local_of(tensors: dict, world_size: int, rank: int) -> dict[str, torch.Tensor]:
    return {n: t[rows(t.shape, world_size, rank)].clone() for n, t in tensors.items()}


def decode(buf, names) -> tuple[dict[str, tuple[int, torch.Tensor]], dict]:
    """name -> (first row, rows) and the meta of a message (the wire format's piece view)."""
    return compression.unpack_pieces(buf, list(names))


def message(tensors: dict, version: int, fragment=None, target=None, delta=False):
    """A server message holding rows ``target`` (default: all) of full ``tensors``."""
    names = list(tensors)
    target = target if target is not None else partition.whole({n: t.shape for n, t in tensors.items()})
    meta = {"version": version}
    if fragment is not None:
        meta["fragment"] = fragment
    if delta:
        meta["delta"] = True
    pieces = {n: partition.take(tensors[n], iv) for n, iv in target.items()}
    buf, _ = compression.pack_pieces(pieces, {n: iv[0] for n, iv in target.items()}, names, Codec("none"), meta)
    return buf


def fragment_rows(f: int, count: int = 2, shapes=SHAPES):
    return partition.fragments(shapes, count)[f]


# ----------------------------------------------------------------------- applying messages


def test_full_then_fragment_message():
    sync = RankSync(SHAPES, world_size=2, rank=1)
    a, b = full(1), full(2)
    local = local_of(full(3), 2, 1)
    assert sync.decide_load(0, fragment_message=False) == "apply"
    sync.apply([message(a, 0)], local)
    assert sync.versions == [0]
    for n in SHAPES:
        assert torch.equal(local[n], a[n][rows(SHAPES[n], 2, 1)])
        assert torch.equal(sync.anchor[n], local[n])
        assert sync.anchor[n].data_ptr() != local[n].data_ptr()

    target = fragment_rows(0)
    assert sync.decide_load(1, fragment_message=True) == "apply"
    sync.apply([message(b, 1, fragment=0, target=target)], local)
    assert sync.versions == [1]
    for n, shape in SHAPES.items():
        r = rows(shape, 2, 1)
        expect = a[n].clone()
        if n in target:
            lo, hi = target[n]
            expect[lo:hi] = b[n][lo:hi]
        assert torch.equal(local[n], expect[r]), n
        assert torch.equal(sync.anchor[n], expect[r]), n


def test_message_rows_outside_the_rank_are_ignored():
    # Rank 0 of 2 holds rows 0..4 of the embedding; a message of rows 5..9 leaves it alone.
    sync = RankSync(SHAPES, world_size=2, rank=0)
    a = full(1)
    local = local_of(a, 2, 0)
    sync.apply([message(a, 0)], local)
    target = {"model.embed_tokens.weight": (5, 10)}
    sync.apply([message(full(2), 1, fragment=0, target=target)], local)
    assert torch.equal(local["model.embed_tokens.weight"], a["model.embed_tokens.weight"][:5])
    assert sync.versions == [1]


def test_already_held_version_is_skipped():
    sync = RankSync(SHAPES, world_size=1, rank=0)
    a = full(1)
    local = local_of(full(3), 1, 0)
    sync.apply([message(a, 0)], local)
    sync.apply([message(a, 1, fragment=0)], local)
    assert sync.decide_load(1, fragment_message=True) == "skip"
    assert sync.decide_load(0, fragment_message=False) == "skip"
    sync.apply([message(full(2), 1, fragment=0)], local)  # same version again, other values
    sync.apply([message(full(2), 0)], local)  # an older full message
    for n in SHAPES:
        assert torch.equal(local[n], a[n])
        assert torch.equal(sync.anchor[n], a[n])
    assert sync.versions == [1]


@pytest.mark.parametrize("world_size, servers", [(1, 1), (2, 2)])
def test_a_rank_that_built_the_seeded_weights_adopts_them_as_version_0(world_size, servers):
    """Equal digests, rank by rank: the rank holds exactly what the round-0 full load would
    bring (anchor and versions), so it skips it; other weights, or no digests, change nothing."""
    weights = full(1, WITH_SCALAR)
    for rank in range(world_size):
        seeder = RankSync(WITH_SCALAR, world_size=world_size, rank=rank, servers=servers)
        expected, held = seeder.adopt(local_of(weights, world_size, rank), None)
        assert not held and seeder.versions == [-1] * servers and seeder.anchor == {}
        same = RankSync(WITH_SCALAR, world_size=world_size, rank=rank, servers=servers)
        local = local_of(weights, world_size, rank)
        assert same.adopt(local, expected) == (expected, True)
        assert same.decide_load(0, fragment_message=False) == "skip" and same.versions == [0] * servers
        loaded = RankSync(WITH_SCALAR, world_size=world_size, rank=rank, servers=servers)
        loaded.apply([message(weights, 0)] * servers, local_of(full(3, WITH_SCALAR), world_size, rank))
        for n in WITH_SCALAR:  # what a full load of the seeded weights would have left
            assert torch.equal(same.anchor[n], loaded.anchor[n])
            assert same.anchor[n].data_ptr() != local[n].data_ptr()  # a copy: training moves local
        other = RankSync(WITH_SCALAR, world_size=world_size, rank=rank, servers=servers)
        assert other.adopt(local_of(full(2, WITH_SCALAR), world_size, rank), expected)[1] is False
        assert other.versions == [-1] * servers


def test_gap_needs_a_full_load():
    sync = RankSync(SHAPES, world_size=1, rank=0)
    local = local_of(full(3), 1, 0)
    # A fresh rank cannot take a fragment message at all.
    assert sync.decide_load(1, fragment_message=True) == "full"
    assert sync.decide_load(0, fragment_message=True) == "apply"
    sync.apply([message(full(1), 0)], local)
    assert sync.decide_load(1, fragment_message=True) == "apply"
    assert sync.decide_load(2, fragment_message=True) == "full"
    with pytest.raises(NeedsFullLoad):
        sync.apply([message(full(2), 2, fragment=0)], local)
    assert sync.versions == [0]
    # A full message may jump ahead; then the next fragment message applies.
    assert sync.decide_load(2, fragment_message=False) == "apply"
    sync.apply([message(full(2), 2)], local)
    assert sync.versions == [2]
    assert sync.decide_load(3, fragment_message=True) == "apply"


def test_plan_looks_at_every_server():
    sync = RankSync(SHAPES, world_size=1, rank=0, servers=2)
    sync.versions = [3, 2]
    assert sync.decide_load(2, True) == "skip"
    assert sync.decide_load(3, True) == "apply"  # server 1 is one behind
    assert sync.decide_load(4, True) == "full"  # server 1 would skip one
    sync.versions = [3, 3]
    assert sync.decide_load(3, True) == "skip"
    assert sync.decide_load(4, True) == "apply"
    assert sync.decide_load(5, True) == "full"
    assert sync.decide_load(5, False) == "apply"


def test_a_rank_that_forgets_its_versions_loads_everything_before_the_next_fragment():
    """After a restored server or a rejected pseudo-gradient a rank holds no version: the next
    fragment message needs a full load first, while the anchor and what was sent stay."""
    sync = RankSync(SHAPES, codec=Codec("int8", 16), world_size=1, rank=0, servers=2, error_feedback=True)
    local = local_of(full(3), 1, 0)
    sync.apply([message(full(1), 0)] * 2, local)
    sync.apply([message(full(2), 1, fragment=0, target=fragment_rows(0))] * 2, local)
    sync.outgoing(0, local, attempt=4)
    anchor = {n: t.clone() for n, t in sync.anchor.items()}
    sync.forget_versions()
    assert sync.versions == [-1, -1]
    assert sync.decide_load(2, fragment_message=True) == "full"
    assert sync.decide_load(1, fragment_message=False) == "apply"  # even the version it held
    assert all(torch.equal(sync.anchor[n], anchor[n]) for n in SHAPES) and list(sync.ledger.unsettled) == [4]


def test_one_message_per_server():
    sync = RankSync(SHAPES, world_size=2, rank=1, servers=2)
    a = full(1)
    local = local_of(full(3), 2, 1)
    shards = partition.server_shards(SHAPES, 2)
    sync.apply([message(a, 0, target=shards[0]), message(a, 0, target=shards[1])], local)
    assert sync.versions == [0, 0]
    for n in SHAPES:
        assert torch.equal(local[n], a[n][rows(SHAPES[n], 2, 1)])


def test_delta_message_adds_to_the_anchor():
    sync = RankSync(SHAPES, world_size=2, rank=0)
    a, d = full(1), full(2)
    local = local_of(a, 2, 0)
    sync.apply([message(a, 0)], local)
    local["lm_head.weight"].add_(5.0)  # local drift is replaced, not added to
    sync.apply([message(d, 1, fragment=0, delta=True)], local)
    for n in SHAPES:
        expect = (a[n] + d[n])[rows(SHAPES[n], 2, 0)]
        torch.testing.assert_close(sync.anchor[n], expect, rtol=0, atol=0)
        torch.testing.assert_close(local[n], expect, rtol=0, atol=0)


def test_scalar_parameters_are_held_by_every_rank():
    a = full(1, WITH_SCALAR)
    for rank in range(2):
        sync = RankSync(WITH_SCALAR, world_size=2, rank=rank)
        local = local_of(full(3, WITH_SCALAR), 2, rank)
        sync.apply([message(a, 0)], local)
        assert torch.equal(local["scale"], a["scale"])


# ------------------------------------------------------------------------------ merging


@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_merge_blends_fragment_messages(alpha):
    sync = RankSync(SHAPES, world_size=2, rank=1, fragments=2, alpha=alpha)
    a, g = full(1), full(2)
    local = local_of(full(4), 2, 1)
    sync.apply([message(a, 0)], local, merge=True)  # a full message replaces, merge or not
    for n in SHAPES:
        assert torch.equal(local[n], a[n][rows(SHAPES[n], 2, 1)])
    drifted = local_of(full(3), 2, 1)
    for n in SHAPES:
        local[n].copy_(drifted[n])
    target = fragment_rows(1)
    sync.apply([message(g, 1, fragment=1, target=target)], local, merge=True)
    for n, shape in SHAPES.items():
        r = rows(shape, 2, 1)
        new_global = a[n].clone()
        blended = drifted[n].clone()
        if n in target:
            lo, hi = target[n]
            new_global[lo:hi] = g[n][lo:hi]
            mine = shard_rows(shape[0], 2, 1)
            for row in range(max(lo, mine.start), min(hi, mine.stop)):
                i = row - mine.start
                blended[i] = alpha * drifted[n][i] + (1 - alpha) * g[n][row]
        torch.testing.assert_close(local[n], blended, rtol=0, atol=1e-6)
        assert torch.equal(sync.anchor[n], new_global[r]), n


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 1)])
def test_with_error_feedback_a_returning_fragment_keeps_only_the_steps_since_its_send(world_size, rank):
    """Overlap + topk: the rows become the new global rows plus the steps run while the
    fragment travelled; what topk left out is in the residual alone, so the next
    pseudo-gradient plus the residual counts it once (the alpha blend kept half of it in
    the rows as well: counted 1.5 times)."""
    shapes = WITH_SCALAR
    sync = RankSync(shapes, world_size, rank, codec=Codec("topk", fraction=1 / 8), fragments=2, overlap=True)
    a, g = full(1, shapes), full(2, shapes)
    local = local_of(full(4, shapes), world_size, rank)
    sync.apply([message(a, 0)], local)
    as_sent = {n: t.clone() for n, t in local_of(full(3, shapes), world_size, rank).items()}
    for n in shapes:
        local[n].copy_(as_sent[n])
    sync.outgoing(0, local)  # fragment 0 leaves; what topk kept out goes to the residual
    steps = {n: 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(5)) for n, t in local.items()}
    for n in shapes:
        local[n].add_(steps[n])  # the next period's steps, while fragment 0 travels
    target = fragment_rows(0, shapes=shapes)
    sync.apply([message(g, 1, fragment=0, target=target)], local, merge=True)
    for n, shape in shapes.items():
        expect = as_sent[n] + steps[n]  # rows of the other fragment: untouched
        if n in target and not shape:  # a 0-d tensor: every rank holds it
            expect = g[n] + steps[n]
        elif n in target:
            lo, hi = target[n]
            mine = shard_rows(shape[0], world_size, rank)
            for row in range(max(lo, mine.start), min(hi, mine.stop)):
                expect[row - mine.start] = g[n][row] + steps[n][row - mine.start]
        torch.testing.assert_close(local[n], expect, rtol=0, atol=1e-6)
    assert sync.sent_local == {}  # used once
    # A full load replaces everything: a snapshot left in flight is not merged later.
    sync.outgoing(1, local)
    sync.apply([message(a, 2)], local)
    assert sync.sent_local == {}


def test_without_error_feedback_overlap_keeps_the_alpha_blend():
    sync = RankSync(SHAPES, 1, 0, codec=Codec("int8"), fragments=2, overlap=True)
    assert not sync.keeps_sent  # int8 without error_feedback: nothing left out to count twice
    sync.apply([message(full(1), 0)], local := local_of(full(4), 1, 0))
    sync.outgoing(0, local)
    assert sync.sent_local == {}


# ------------------------------------------------------------------------------ outgoing


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("servers", [1, 2, 3])
@pytest.mark.parametrize("fragments", [1, 2])
def test_outgoing_tiles_the_pseudo_gradient(world_size, servers, fragments):
    shapes = WITH_SCALAR
    anchor, local_full = full(1, shapes), full(2, shapes)
    expect = {n: anchor[n] - local_full[n] for n in shapes}
    shards = partition.server_shards(shapes, servers)
    frags = partition.fragments(shapes, fragments)
    count = {n: torch.zeros(partition.num_rows(s), dtype=torch.int64) for n, s in shapes.items()}
    for f in range(fragments):
        seen = {n: torch.zeros(partition.num_rows(s), dtype=torch.int64) for n, s in shapes.items()}
        for rank in range(world_size):
            sync = RankSync(shapes, world_size, rank, servers=servers, fragments=fragments)
            local = local_of(anchor, world_size, rank)
            sync.apply([message(anchor, 0, target=shards[s]) for s in range(servers)], local)
            for n in shapes:
                local[n].copy_(local_of(local_full, world_size, rank)[n])
            bufs = sync.outgoing(f, local)
            assert len(bufs) == servers
            for s, buf in enumerate(bufs):
                for n, (lo, piece) in decode(buf, shapes)[0].items():
                    hi = lo + (piece.shape[0] if piece.dim() else 1)
                    # Only this rank's rows, of this fragment, owned by this server.
                    assert partition.intersect({n: (lo, hi)}, frags[f], shards[s]) == {n: (lo, hi)}
                    mine = (
                        (0, 1)
                        if not shapes[n]
                        else (
                            shard_rows(shapes[n][0], world_size, rank).start,
                            shard_rows(shapes[n][0], world_size, rank).stop,
                        )
                    )
                    assert mine[0] <= lo and hi <= mine[1]
                    assert torch.equal(piece, partition.take(expect[n], (lo, hi)))
                    seen[n][lo:hi] += 1
        # Every row of the fragment exactly once, nothing else.
        for n in shapes:
            a, b = frags[f].get(n, (0, 0))
            want = torch.zeros_like(seen[n])
            want[a:b] = 1
            assert torch.equal(seen[n], want), (f, n)
            count[n] += seen[n]
    for n in shapes:
        assert torch.equal(count[n], torch.ones_like(count[n])), n


def test_outgoing_stamps_the_link():
    from diloco_ray.algo.links import Link

    sync = RankSync(SHAPES, world_size=2, rank=0, servers=2)
    a = full(1)
    local = local_of(a, 2, 0)
    sync.apply([message(a, 0)] * 2, local)
    bufs = sync.outgoing(0, local, Link(mbps=10.0, latency_ms=5.0))
    metas = [wire_layout.packed_meta(b) for b in bufs]
    # Every rank of the replica shares the link: its bytes (both servers) times the ranks.
    total = 2 * 4 * partition.numel(partition.rank_rows(SHAPES, 2, 0), SHAPES)
    for meta in metas:
        assert meta["link_bytes"] == total
        assert meta["mbps"] == 10.0 and meta["latency_ms"] == 5.0 and "sent_at" in meta
    assert "sent_at" not in wire_layout.packed_meta(sync.outgoing(0, local)[0])


# ------------------------------------------------------------------------- error feedback


def run_constant(codec: str, error_feedback: bool, rounds: int = 40):
    """Send the same pseudo-gradient ``rounds`` times; returns (decoded mean, sync, g)."""
    shapes = {"w": (8, 16)}
    g = full(7, shapes)["w"] * 0.1
    anchor = {"w": full(8, shapes)["w"]}
    sync = RankSync(shapes, 1, 0, codec=Codec(codec, 16), error_feedback=error_feedback)
    total = torch.zeros_like(g)
    for version in range(rounds):
        local = {"w": torch.zeros(8, 16)}
        sync.apply([message(anchor, version)], local)  # full message: anchor and local = anchor
        local["w"].sub_(g)
        (buf,) = sync.outgoing(0, local)
        total += decode(buf, shapes)[0]["w"][1]
    return total / rounds, sync, g


@pytest.mark.parametrize("decay", [1.0, 0.5, 0.0])
def test_error_feedback_decay_weighs_the_residual_in_each_sync(decay):
    """Each sync sends the codec's share of ``pseudo-gradient + decay x residual`` and keeps
    the rest: sent + new residual == g + decay x old residual (SparseLoCo's e = b e + g)."""
    shapes = {"w": (8, 16)}
    g = full(7, shapes)["w"] * 0.1
    anchor = {"w": full(8, shapes)["w"]}
    sync = RankSync(shapes, 1, 0, codec=Codec("topk", 16, 1 / 8), decay=decay)
    old = torch.zeros_like(g)
    for version in range(3):
        local = {"w": torch.zeros(8, 16)}
        sync.apply([message(anchor, version)], local)
        local["w"].sub_(g)
        (buf,) = sync.outgoing(0, local)
        sent = decode(buf, shapes)[0]["w"][1]
        torch.testing.assert_close(sent + sync.ledger.residual["w"], g + decay * old, rtol=0, atol=1e-6)
        old = sync.ledger.residual["w"].clone()
    assert float(old.abs().max()) > 0  # topk left most of it out


@pytest.mark.parametrize("codec", ["int4", "int8"])
def test_error_feedback_removes_the_bias(codec):
    mean_ef, sync_ef, g = run_constant(codec, True)
    mean_plain, sync_plain, _ = run_constant(codec, False)
    bias_plain = float((mean_plain - g).abs().max())
    bias_ef = float((mean_ef - g).abs().max())
    assert bias_plain > 1e-4  # the codec alone keeps the same error every round
    assert bias_ef < bias_plain / 10
    assert float(sync_ef.ledger.residual["w"].abs().max()) > 0
    assert sync_plain.ledger.residual == {}


def test_topk_always_carries_a_residual():
    # topk drops most values: without feedback they would never be sent, so it is always on.
    mean, sync, g = run_constant("topk", False, rounds=200)
    assert sync.error_feedback is True and float(sync.ledger.residual["w"].abs().max()) > 0
    once, _, _ = run_constant("topk", False, rounds=1)
    assert float((once - g).abs().max()) > 0.5 * float(g.abs().max())  # one message sends little
    assert float((mean - g).abs().max()) < 0.1 * float(g.abs().max())  # in the long run, all of it


def test_error_feedback_is_off_for_a_lossless_codec():
    mean, sync, g = run_constant("none", True, rounds=3)
    assert sync.error_feedback is False and sync.ledger.residual == {}
    torch.testing.assert_close(mean, g, rtol=0, atol=1e-6)


@pytest.mark.parametrize("servers", [2, 3])
def test_error_feedback_carries_the_residual_by_rows(servers):
    # Two ranks and several servers: each rank keeps a residual of exactly its own rows.
    for rank in range(2):
        sync = RankSync(SHAPES, 2, rank, codec=Codec("int4", 16), servers=servers, error_feedback=True)
        a = full(1)
        local = local_of(a, 2, rank)
        sync.apply([message(a, 0)] * servers, local)
        g = full(2)
        for n in SHAPES:
            local[n].sub_(0.1 * g[n][rows(SHAPES[n], 2, rank)])
        sent = {n: torch.full_like(t, float("nan")) for n, t in local.items()}
        for buf in sync.outgoing(0, local):
            for n, (start, piece) in decode(buf, SHAPES)[0].items():
                offset = sync.held[n][0]
                partition.put(sent[n], (start, start + piece.shape[0]), piece, offset)
        for n in SHAPES:
            r = rows(SHAPES[n], 2, rank)
            torch.testing.assert_close(sync.ledger.residual[n], 0.1 * g[n][r] - sent[n], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- state dict


def trained_sync(codec="int8"):
    sync = RankSync(SHAPES, 2, 1, codec=Codec(codec, 16), servers=2, fragments=2, error_feedback=True)
    a = full(1)
    local = local_of(a, 2, 1)
    sync.apply([message(a, 0)] * 2, local)
    for n in SHAPES:
        local[n].sub_(0.1 * local_of(full(2), 2, 1)[n])
    sync.outgoing(0, local)
    sync.outgoing(1, local)
    sync.apply([message(full(3), 1, fragment=0, target=fragment_rows(0))] * 2, local)
    return sync, local


def test_state_dict_round_trip_with_anchor():
    sync, local = trained_sync()
    state = sync.state_dict(with_anchor=True)
    other = RankSync(SHAPES, 2, 1, codec=Codec("int8", 16), servers=2, fragments=2, error_feedback=True)
    other.load_state_dict(state)
    assert other.versions == sync.versions == [1, 1]
    assert set(other.anchor) == set(SHAPES) and set(other.ledger.residual) == set(SHAPES)
    for n in SHAPES:
        assert torch.equal(other.anchor[n], sync.anchor[n])
        assert torch.equal(other.ledger.residual[n], sync.ledger.residual[n])
    # Copies, not aliases: the loaded state does not move with the original.
    sync.anchor["lm_head.weight"].add_(1.0)
    sync.ledger.residual["lm_head.weight"].add_(1.0)
    assert not torch.equal(other.anchor["lm_head.weight"], sync.anchor["lm_head.weight"])
    assert not torch.equal(other.ledger.residual["lm_head.weight"], sync.ledger.residual["lm_head.weight"])
    # And the next pseudo-gradient is the same from both.
    sync, local = trained_sync()
    other = RankSync(SHAPES, 2, 1, codec=Codec("int8", 16), servers=2, fragments=2, error_feedback=True)
    other.load_state_dict(sync.state_dict(with_anchor=True))
    for mine, theirs in zip(sync.outgoing(1, local), other.outgoing(1, local)):
        assert mine.tobytes() == theirs.tobytes()


def test_state_dict_keeps_the_fragment_in_flight():
    """A checkpoint taken while a fragment travels (overlap + error feedback) keeps its rows as
    sent, so a resumed rank merges it by the same rule."""
    sync = RankSync(SHAPES, 1, 0, codec=Codec("topk"), fragments=2, overlap=True)
    local = local_of(full(4), 1, 0)
    sync.apply([message(full(1), 0)], local)
    sync.outgoing(1, local)
    other = RankSync(SHAPES, 1, 0, codec=Codec("topk"), fragments=2, overlap=True)
    other.load_state_dict(sync.state_dict(with_anchor=True))
    assert set(other.sent_local) == {1}
    for n, (first, rows_as_sent) in sync.sent_local[1].items():
        assert other.sent_local[1][n][0] == first and torch.equal(other.sent_local[1][n][1], rows_as_sent)


def test_state_dict_without_anchor_keeps_residuals_only():
    sync, _ = trained_sync()
    state = sync.state_dict(with_anchor=False)
    assert set(state) == {"residual"}
    other = RankSync(SHAPES, 2, 1, codec=Codec("int8", 16), servers=2, fragments=2, error_feedback=True)
    other.load_state_dict(state)
    assert other.anchor == {} and other.versions == [-1, -1]
    for n in SHAPES:
        assert torch.equal(other.ledger.residual[n], sync.ledger.residual[n])
    assert other.decide_load(1, fragment_message=True) == "full"


def test_load_empty_state():
    sync, _ = trained_sync()
    sync.load_state_dict({})
    assert sync.ledger.residual == {}
    assert sync.versions == [1, 1]  # no anchors in the state: what it holds stays


# ----------------------------------------------------------------------- memory of a sync
BIG = {f"layer{i}": (1024, 1024) for i in range(16)}  # 16M parameters, 64 MB in fp32
MEMORY_CASES = [("none", False), ("int8", False), ("int8", True)]


def measure_outgoing_memory() -> None:
    """Prints, as JSON, how much each case of :data:`MEMORY_CASES` grew this process's
    peak memory in one ``outgoing`` call, its message's size, and whether the message
    holds ``anchor - local``. Run in a fresh process: what earlier tests left in the
    allocator's free lists moves a peak by megabytes."""
    import gc
    import json

    from conftest import peak_rss, reset_peak_rss

    results = []
    for codec, feedback in MEMORY_CASES:

        def ready(shapes):
            sync = RankSync(shapes, codec=Codec(codec), world_size=1, rank=0, error_feedback=feedback)
            local = {n: torch.randn(s) for n, s in shapes.items()}
            sync.anchor = {n: t + 0.01 for n, t in local.items()}
            return sync, local

        warm, warm_local = ready({"w": (64, 4096)})
        warm.outgoing(0, warm_local)  # the kernels' code pages count as resident on first use
        sync, local = ready(BIG)
        gc.collect()
        before = reset_peak_rss()
        (buf,) = sync.outgoing(0, local)
        grew = peak_rss() - before
        pieces, _ = decode(buf, BIG)
        expected = sync.anchor["layer3"] - local["layer3"]
        tolerance = 0 if codec == "none" else 0.02 / 127 * 2
        right = bool(torch.allclose(pieces["layer3"][1], expected, atol=tolerance, rtol=0))
        results.append(
            {"grew": grew, "message": int(buf.nbytes), "right": right, "residual": bool(sync.ledger.residual)}
        )
    print(json.dumps(results))


@pytest.fixture(scope="module")
def outgoing_memory() -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(os.path.dirname(here))  # conftest lives there
    path = os.pathsep.join([here, tests, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", "import test_rank_sync; test_rank_sync.measure_outgoing_memory()"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(MEMORY_CASES)), ids=[f"{c}-{f}" for c, f in MEMORY_CASES])
def test_outgoing_allocates_the_message_and_one_tensor(outgoing_memory, case):
    """anchor - local goes straight into the message: its bytes, one tensor of scratch
    for a lossy codec, and a residual only with error feedback (kept: it is state)."""
    codec, feedback = MEMORY_CASES[case]
    grew, message, right, residual = (outgoing_memory[case][k] for k in ("grew", "message", "right", "residual"))
    one_tensor = 4 * 1024 * 1024
    state = 16 * one_tensor if feedback else 0  # the residual itself
    assert grew < message + state + 3 * one_tensor, f"{grew / 1e6:.0f} MB for a {message / 1e6:.0f} MB message"
    assert right, "the message does not hold anchor - local"
    assert residual == feedback
