"""SliceLayout: which rows a server holds, its outer optimizer's pieces, and moving rows between them."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo import partition
from diloco_ray.algo.slice_layout import SliceLayout

SHAPES = {
    "model.embed_tokens.weight": (10, 4),
    "model.layers.0.mlp.up_proj.weight": (6, 4),
    "model.layers.0.input_layernorm.weight": (4,),
    "model.layers.1.mlp.up_proj.weight": (6, 4),
    "model.layers.1.input_layernorm.weight": (4,),
    "model.norm.weight": (),
    "lm_head.weight": (10, 4),
}


def full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("count,fragments", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_pieces_cover_the_owned_rows_once_fragment_by_fragment(count, fragments):
    for index in range(count):
        layout = SliceLayout(SHAPES, index, count, fragments)
        assert layout.owned == partition.server_shards(SHAPES, count)[index]
        for name, (a, b) in layout.owned.items():
            spans = sorted(iv for n, iv in layout.piece_rows.values() if n == name)
            assert spans[0][0] == a and spans[-1][1] == b
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))  # no gap, no overlap
        for (name, f), key in layout.pieces.items():
            assert layout.piece_rows[key] == (name, layout.target(f)[name])
        assert layout.target(None) == layout.owned


@pytest.mark.parametrize("count,fragments", [(1, 2), (2, 2), (3, 2)])
def test_split_and_rows_move_rows_between_names_and_pieces(count, fragments):
    full = full_weights()
    for index in range(count):
        layout = SliceLayout(SHAPES, index, count, fragments)
        owned = {n: partition.take(full[n], iv) for n, iv in layout.owned.items()}
        pieces = layout.split(owned)
        for name, iv in layout.owned.items():
            assert torch.equal(layout.rows(pieces, name, iv), owned[name])
        for f in range(fragments):
            for name, iv in layout.target(f).items():
                rows = layout.rows(pieces, name, iv)
                assert tuple(rows.shape) == layout.piece_shape(name, iv)
                assert torch.equal(rows, partition.take(full[name], iv))


def test_split_copies_and_keyed_names_a_fragments_pieces():
    layout = SliceLayout(SHAPES, 0, 1, 2)
    full = full_weights()
    pieces = layout.split(full)
    next(iter(pieces.values())).add_(1.0)
    assert all(torch.equal(full[n], full_weights()[n]) for n in full)  # the source is untouched
    named = {n: torch.zeros(layout.piece_shape(n, iv)) for n, iv in layout.target(1).items()}
    keyed = layout.keyed(named, 1)
    assert list(keyed) == [layout.pieces[(n, 1)] for n in named]
    assert all(keyed[layout.pieces[(n, 1)]] is t for n, t in named.items())


def test_a_zero_d_parameter_stays_zero_d():
    layout = SliceLayout(SHAPES, 0, 1, 1)
    assert layout.piece_shape("model.norm.weight", layout.owned["model.norm.weight"]) == ()
