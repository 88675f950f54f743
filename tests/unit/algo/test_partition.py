"""Unit tests for diloco_ray.algo.partition: row partitions over ranks, server shards and fragments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import partition as P
from diloco_ray.algo.sharding import shard_rows


def llama_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a tiny HF Llama (hidden 128, intermediate 256, vocab 100), in model order."""
    shapes = {"model.embed_tokens.weight": (100, 128)}
    for i in range(layers):
        pre = f"model.layers.{i}"
        shapes.update(
            {
                f"{pre}.self_attn.q_proj.weight": (128, 128),
                f"{pre}.self_attn.k_proj.weight": (128, 128),
                f"{pre}.self_attn.v_proj.weight": (128, 128),
                f"{pre}.self_attn.o_proj.weight": (128, 128),
                f"{pre}.mlp.gate_proj.weight": (256, 128),
                f"{pre}.mlp.up_proj.weight": (256, 128),
                f"{pre}.mlp.down_proj.weight": (128, 256),
                f"{pre}.input_layernorm.weight": (128,),
                f"{pre}.post_attention_layernorm.weight": (128,),
            }
        )
    shapes["model.norm.weight"] = (128,)
    shapes["lm_head.weight"] = (100, 128)
    return shapes


TINY = llama_shapes(2)
EIGHT = llama_shapes(8)
# Odd extras: a 0-d scalar, an empty tensor, a zero-width one, a 3-d one.
ODD = {"scale": (), **llama_shapes(2), "empty": (0, 4), "thin": (3, 0), "conv": (5, 2, 3)}
ALL = {"tiny": TINY, "eight": EIGHT, "odd": ODD}


def cells(rows: P.Rows) -> list[tuple[str, int]]:
    return [(name, r) for name, (a, b) in rows.items() for r in range(a, b)]


def assert_tiles(pieces, shapes):
    """Every row of every tensor with rows is covered exactly once."""
    got = sorted(c for piece in pieces for c in cells(piece))
    assert got == sorted(cells(P.whole(shapes)))
    for piece in pieces:
        for name, (a, b) in piece.items():
            assert 0 <= a < b <= P.num_rows(shapes[name])


def assert_model_order(rows: P.Rows, shapes):
    names = list(rows)
    assert names == [n for n in shapes if n in rows]


def test_shape_helpers():
    assert P.num_rows(()) == 1 and P.row_numel(()) == 1
    assert P.num_rows((7,)) == 7 and P.row_numel((7,)) == 1
    assert P.num_rows((5, 2, 3)) == 5 and P.row_numel((5, 2, 3)) == 6
    assert P.num_rows(torch.Size([4, 3])) == 4 and P.row_numel(torch.Size([4, 3])) == 3
    w = P.whole(ODD)
    assert "empty" not in w and w["scale"] == (0, 1) and w["thin"] == (0, 3)
    assert P.numel(w, ODD) == sum(int(np.prod(s)) for s in ODD.values())
    assert P.nbytes(w, ODD) == 4 * P.numel(w, ODD) and P.nbytes(w, ODD, 2) == 2 * P.numel(w, ODD)


@pytest.mark.parametrize("key", list(ALL))
@pytest.mark.parametrize("parts", range(1, 8))
def test_cut_tiles_model_and_shard_orders(key, parts):
    shapes = ALL[key]
    shuffled = [list(shapes)[i] for i in np.random.default_rng(parts).permutation(len(shapes))]
    for order in (list(shapes), list(reversed(shapes)), shuffled):
        pieces = P.cut(shapes, order, parts)
        assert len(pieces) == parts
        assert_tiles(pieces, shapes)
        for piece in pieces:
            assert piece, "a piece is empty although there are more rows than parts"
            assert_model_order(piece, shapes)


def test_cut_is_contiguous_in_layout_order():
    order = list(reversed(EIGHT))
    layout = [(n, r) for n in order for r in range(P.num_rows(EIGHT[n]))]
    position = {c: i for i, c in enumerate(layout)}
    pieces = P.cut(EIGHT, order, 4)
    flat = [c for piece in pieces for c in sorted(cells(piece), key=position.__getitem__)]
    assert flat == layout


@pytest.mark.parametrize("parts", [2, 3, 4, 5])
def test_cut_balance(parts):
    total = P.numel(P.whole(TINY), TINY)
    max_row = max(P.row_numel(s) for s in TINY.values())
    sizes = [P.numel(p, TINY) for p in P.cut(TINY, list(TINY), parts)]
    assert sum(sizes) == total
    assert max(sizes) / (total / parts) <= 1 + max_row / (total / parts)
    assert min(sizes) >= total / parts - max_row


def test_cut_fewer_rows_than_parts():
    shapes = {"a": (2, 3), "b": ()}
    pieces = P.cut(shapes, ["a", "b"], 5)
    assert len(pieces) == 5 and sum(1 for p in pieces if p) == 3
    assert_tiles(pieces, shapes)
    assert P.cut({}, [], 3) == [{}, {}, {}]
    assert P.cut({"e": (0, 5)}, ["e"], 2) == [{}, {}]


def test_cut_hand_values():
    shapes = {"a": (4, 2), "b": (4,)}  # 8 + 4 elements
    assert P.cut(shapes, ["a", "b"], 2) == [{"a": (0, 3)}, {"a": (3, 4), "b": (0, 4)}]
    assert P.cut(shapes, ["b", "a"], 2) == [{"a": (0, 1), "b": (0, 4)}, {"a": (1, 4)}]
    assert P.cut(shapes, ["a", "b"], 3) == [{"a": (0, 2)}, {"a": (2, 4)}, {"b": (0, 4)}]


def test_one_part_is_whole():
    for shapes in ALL.values():
        assert P.fragments(shapes, 1) == [P.whole(shapes)]
        assert P.server_shards(shapes, 1) == [P.whole(shapes)]
        assert P.cut(shapes, list(reversed(shapes)), 1) == [P.whole(shapes)]


def test_cut_errors():
    with pytest.raises(ValueError):
        P.cut(TINY, list(TINY), 0)
    with pytest.raises(ValueError):
        P.cut(TINY, list(TINY)[:-1], 2)
    with pytest.raises(ValueError):
        P.cut(TINY, list(TINY)[:-1] + ["nope"], 2)
    with pytest.raises(ValueError):
        P.cut(TINY, list(TINY) + [next(iter(TINY))], 2)
    with pytest.raises(ValueError):
        P.fragments(TINY, 0)
    with pytest.raises(ValueError):
        P.server_shards(TINY, 0)


def test_layer_index():
    assert P.layer_index("model.layers.3.mlp.down_proj.weight") == 3
    assert P.layer_index("model.layers.12.input_layernorm.weight") == 12
    assert P.layer_index("transformer.h.3.attn.c_attn.weight") == 3
    assert P.layer_index("base_model.model.model.layers.3.self_attn.q_proj.lora_A.default.weight") == 3
    assert P.layer_index("encoder.blocks.7.ff.weight") == 7
    assert P.layer_index("net.block.0.layer.5.w") == 0  # first match wins
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "transformer.wte.weight",
        "transformer.ln_f.weight",
        "h.x.weight",
        "layers",
        "model.3.weight",
    ):
        assert P.layer_index(name) is None, name


def layers_in_place(frags, shapes) -> bool:
    """Whether every decoder layer i lies whole in fragment i mod F (and nowhere else)."""
    count = len(frags)
    for name, shape in shapes.items():
        i = P.layer_index(name)
        if i is None or P.num_rows(shape) == 0:
            continue
        holders = [f for f, frag in enumerate(frags) if name in frag]
        if holders != [i % count] or frags[i % count][name] != (0, P.num_rows(shape)):
            return False
    return True


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_fragments_follow_strided_layers(count):
    frags = P.fragments(EIGHT, count)
    assert len(frags) == count
    assert_tiles(frags, EIGHT)
    assert layers_in_place(frags, EIGHT)
    for frag in frags:
        assert_model_order(frag, EIGHT)


def big_vocab_llama(vocab=32000, d=512, ffn=1376, layers=8, tied=False) -> dict:
    shapes = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        pre = f"model.layers.{i}"
        shapes.update(
            {
                f"{pre}.self_attn.q_proj.weight": (d, d),
                f"{pre}.self_attn.k_proj.weight": (d, d),
                f"{pre}.self_attn.v_proj.weight": (d, d),
                f"{pre}.self_attn.o_proj.weight": (d, d),
                f"{pre}.mlp.gate_proj.weight": (ffn, d),
                f"{pre}.mlp.up_proj.weight": (ffn, d),
                f"{pre}.mlp.down_proj.weight": (d, ffn),
                f"{pre}.input_layernorm.weight": (d,),
                f"{pre}.post_attention_layernorm.weight": (d,),
            }
        )
    shapes["model.norm.weight"] = (d,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, d)
    return shapes


@pytest.mark.parametrize("tied", [False, True])
def test_large_embeddings_and_head_do_not_crowd_out_the_strided_layers(tied):
    """Vocab 32k, d 512, 8 layers, F=4: the embedding and head are 2/3 of the bytes.
    Layer i stays in fragment i mod 4, and the rest is spread so the fragments carry
    equal bytes (to one embedding row), so each sync's peak is 1/4 of the model."""
    shapes = big_vocab_llama(tied=tied)
    frags = P.fragments(shapes, 4)
    assert_tiles(frags, shapes)
    assert layers_in_place(frags, shapes)
    sizes = [P.numel(f, shapes) for f in frags]
    assert max(sizes) - min(sizes) <= 512
    # The embedding is split over the fragments rather than filling fragment 0.
    assert sum("model.embed_tokens.weight" in f for f in frags) >= 2


def test_fragments_without_layers_are_byte_balanced_runs():
    shapes = {"a": (10, 4), "b": (30, 4), "c": (20, 4)}
    frags = P.fragments(shapes, 3)
    assert_tiles(frags, shapes)
    assert [P.numel(f, shapes) for f in frags] == [80, 80, 80]


def test_fill_to_level():
    assert P.fill_to_level([10, 0, 4], 6) == [0, 5, 1]
    assert P.fill_to_level([10, 0, 4], 34) == [6, 16, 12]
    assert P.fill_to_level([3, 3], 0) == [0, 0]


@pytest.mark.parametrize("key", list(ALL))
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_rank_rows_tile_and_match_shard_rows(key, ws):
    shapes = ALL[key]
    ranks = [P.rank_rows(shapes, ws, r) for r in range(ws)]
    assert_tiles(ranks, shapes)
    for r, rows in enumerate(ranks):
        assert_model_order(rows, shapes)
        for name, shape in shapes.items():
            if len(shape) == 0:
                assert (name in rows) == (r == 0)
                continue
            s = shard_rows(shape[0], ws, r)
            assert rows.get(name, (s.start, s.start)) == (s.start, s.stop) or s.start == s.stop
            assert (name in rows) == (s.stop > s.start)
    if ws == 1:
        assert ranks[0] == P.whole(shapes)
    with pytest.raises(ValueError):
        P.rank_rows(shapes, ws, ws)


def test_intersect():
    a = {"x": (0, 10), "y": (2, 5), "z": (0, 3)}
    b = {"z": (1, 9), "y": (5, 8), "x": (4, 6)}
    assert P.intersect(a, b) == {"x": (4, 6), "z": (1, 3)}
    assert list(P.intersect(b, a)) == ["z", "x"]
    assert P.intersect(a) == a
    assert P.intersect(a, {}) == {}
    assert P.intersect() == {}


@pytest.mark.parametrize("key", list(ALL))
@pytest.mark.parametrize("servers, frags, ws", [(1, 1, 1), (2, 4, 2), (3, 2, 4), (4, 4, 3), (5, 3, 2)])
def test_triple_intersection_tiles_model(key, servers, frags, ws):
    shapes = ALL[key]
    pieces = [
        P.intersect(rank, frag, shard)
        for shard in P.server_shards(shapes, servers)
        for frag in P.fragments(shapes, frags)
        for rank in (P.rank_rows(shapes, ws, r) for r in range(ws))
    ]
    assert_tiles(pieces, shapes)
    assert sum(P.numel(p, shapes) for p in pieces) == P.numel(P.whole(shapes), shapes)


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_take_put_round_trip(lib):
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    if lib == "numpy":
        full = full.numpy()
    shard = full[4:8]  # a rank holding global rows [4, 8)
    piece = P.take(shard, (5, 7), offset=4)
    assert tuple(piece.shape) == (2, 6)
    assert (piece == full[5:7]).all()
    assert P.take(full, (0, 0)).shape[0] == 0

    dst = torch.zeros(4, 6) if lib == "torch" else np.zeros((4, 6), np.float32)
    P.put(dst, (5, 7), piece, offset=4)
    assert (dst[1:3] == full[5:7]).all() and (dst[0] == 0).all() and (dst[3] == 0).all()
    back = torch.zeros(10, 6)
    P.put(back, (5, 7), piece)  # numpy or torch src into a torch dst
    assert torch.equal(back[5:7], torch.as_tensor(full[5:7]))
    # take is a view: writing through it changes the source
    view = P.take(dst, (4, 5), offset=4)
    view[0, 0] = 42
    assert dst[0, 0] == 42

    with pytest.raises(ValueError):
        P.take(shard, (3, 5), offset=4)
    with pytest.raises(ValueError):
        P.take(shard, (7, 9), offset=4)
    with pytest.raises(ValueError):
        P.put(dst, (4, 6), piece[:1], offset=4)


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_take_put_zero_dim(lib):
    x = torch.tensor(3.5) if lib == "torch" else np.array(3.5, np.float32)
    assert P.take(x, (0, 1)) is x
    y = torch.tensor(0.0) if lib == "torch" else np.array(0.0, np.float32)
    P.put(y, (0, 1), x)
    assert float(y) == 3.5
    P.put(y, (0, 1), torch.tensor([1.25]))  # one value, any shape
    assert float(y) == 1.25
    with pytest.raises(ValueError):
        P.take(x, (0, 2))
    with pytest.raises(ValueError):
        P.take(x, (1, 2), offset=1)


def test_more_fragments_than_layers_are_byte_balanced_runs():
    frags = P.fragments(TINY, 4)  # 2 layers, 4 fragments
    assert_tiles(frags, TINY)
    sizes = [P.numel(f, TINY) for f in frags]
    assert max(sizes) / (sum(sizes) / 4) < 1.05


def test_the_line_finds_the_nearest_row_boundary_ties_to_the_lower():
    # Rows of 4, then of 1, then of 6 elements: boundaries at elements 0 4 8 9 10 16 22.
    line = P._Line.lay_out({"a": (2, 4), "b": (2,), "c": (2, 6)}, ["a", "b", "c"])
    assert (line.rows_total, line.elems_total) == (6, 22)
    assert [line.position(g) for g in range(7)] == [0, 4, 8, 9, 10, 16, 22]
    assert line.nearest_boundary(6) == 1  # 4 and 8 tie: the lower
    assert line.nearest_boundary(13) == 4  # 10 and 16 tie: the lower
    assert line.nearest_boundary(14) == 5
    assert line.rows_between(1, 5) == {"a": (1, 2), "b": (0, 2), "c": (0, 1)}
