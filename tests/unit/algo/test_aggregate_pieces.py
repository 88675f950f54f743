"""aggregate.add_pieces / add_corrected: a replica's encoded pieces added into a server's sum,
with weights scaled (weight_scale) so the sum holds a mean's worth."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo import compression, decoupled, partition
from diloco_ray.algo.aggregate import add_corrected, add_pieces, mean_in_place, weight_scale
from diloco_ray.algo.codecs import Codec

NAMES = ["a", "b", "c"]
SHAPES = {"a": (6, 3), "b": (5,), "c": ()}
TARGET = {"a": (2, 6), "b": (0, 5), "c": (0, 1)}
FIRST = {n: iv[0] for n, iv in TARGET.items()}


def shape_of(name: str) -> tuple:
    shape, (lo, hi) = SHAPES[name], TARGET[name]
    return shape if not shape else (hi - lo, *shape[1:])


def values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape_of(n), generator=g) for n in NAMES}


def found_of(tensors: dict, codec: str = "none") -> list:
    """The pieces of ``tensors`` as two ranks would send them (``a`` split in two), decoded lazily."""
    rank0 = {"a": tensors["a"][:2], "c": tensors["c"]}
    rank1 = {"a": tensors["a"][2:], "b": tensors["b"]}
    starts0, starts1 = {"a": 2, "c": 0}, {"a": 4, "b": 0}
    out = []
    for pieces, starts in ((rank0, starts0), (rank1, starts1)):
        buf, _ = compression.pack_pieces(pieces, starts, NAMES, Codec(codec, 4))
        for name, (start, piece) in compression.unpack_pieces(buf, NAMES, lazy=True)[0].items():
            out.append((name, (start, start + partition.num_rows(piece.shape)), piece))
    return out


def zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape_of(n)) for n in NAMES}


def test_pieces_add_up_to_the_weighted_sum():
    acc = zeros()
    first, second = values(1), values(2)
    add_pieces(acc, found_of(first), FIRST, 0.25)
    add_pieces(acc, found_of(second), FIRST, 2.0)
    for n in NAMES:
        torch.testing.assert_close(acc[n], 0.25 * first[n] + 2.0 * second[n])


def test_compressed_pieces_add_what_they_decode_to_chunk_by_chunk():
    sent = values(3)
    found = found_of(sent, "int8")
    acc, want = zeros(), zeros()
    add_pieces(acc, found, FIRST, 1.0)
    for name, span, piece in found:
        partition.put(want[name], span, piece.decode(), offset=FIRST[name])
    for n in NAMES:
        assert torch.equal(acc[n], want[n])
        assert (acc[n] - sent[n]).abs().max() < 0.05


def test_a_non_finite_value_raises_part_way():
    bad = values(4)
    bad["b"][3] = float("nan")
    acc = zeros()
    with pytest.raises(ValueError, match="non-finite values in 'b'"):
        add_pieces(acc, found_of(bad), FIRST, 1.0)
    torch.testing.assert_close(acc["a"][:2], bad["a"][:2])  # what came before it is in the sum


@pytest.mark.parametrize("with_momentum", [True, False])
def test_a_stale_contribution_is_corrected_against_the_momentum_before_it_is_added(with_momentum):
    sent, momentum = values(5), values(6)
    acc = zeros()
    add_corrected(acc, found_of(sent), FIRST, 0.5, lambda n: momentum[n] if with_momentum else None)
    for n in NAMES:
        want = sent[n].clone()
        if with_momentum:
            decoupled.correct_stale_(want, momentum[n])
        torch.testing.assert_close(acc[n], 0.5 * want)


@pytest.mark.parametrize("weights", [(0.25, 2.0), (1000.0, 3000.0), (1.0, 1.0), (123457.0, 7.0)])
def test_weights_scaled_by_a_power_of_two_leave_the_mean_bit_for_bit(weights):
    """The scale is a power of two, which multiplies exactly: the mean is what the raw-weighted
    sum divided by the total gives, to the bit."""
    total = sum(weights)
    scale = weight_scale(total)
    assert scale > total and scale / 2 <= total and scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    raw, scaled = zeros(), zeros()
    for seed, w in enumerate(weights):
        add_pieces(raw, found_of(values(seed)), FIRST, w)
        add_pieces(scaled, found_of(values(seed)), FIRST, w / scale)
    raw, scaled = mean_in_place(raw, total), mean_in_place(scaled, total, scale)
    for n in NAMES:
        assert torch.equal(raw[n], scaled[n])


def test_scaled_weights_keep_a_sum_near_the_fp32_limit_finite():
    big = {n: torch.full(shape_of(n), 3e38) for n in NAMES}
    big["a"][0] = -1e38
    scale = weight_scale(400.0)
    acc = zeros()
    add_pieces(acc, found_of(big), FIRST, 100.0 / scale)
    add_pieces(acc, found_of({n: v.abs() for n, v in big.items()}), FIRST, 300.0 / scale)
    mean = mean_in_place(acc, 400.0, scale)
    for n in NAMES:
        want = torch.full(shape_of(n), 3e38)
        if n == "a":
            want[0] = (100 * -1e38 + 300 * 1e38) / 400
        torch.testing.assert_close(mean[n], want, rtol=1e-6, atol=0)


def test_no_weight_gives_a_scale_of_one():
    assert weight_scale(0.0) == 1.0
