"""Unit tests for diloco_ray.runtime.round_start: a round's start state kept on disk (no Ray)."""

from __future__ import annotations

import gc
import os

import torch
from conftest import peak_rss, reset_peak_rss

from diloco_ray.runtime.round_start import RoundStart


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "optimizer": {
            "state": {
                0: {"exp_avg": torch.randn(5, 3, generator=g), "step": torch.tensor(4.0)},
                1: {"exp_avg": torch.randn(0, generator=g).bfloat16()},
            },
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": None,
        "residual": {"w": torch.randn(7, generator=g), "ids": torch.arange(3)},
    }


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_saved_state_comes_back_exactly_for_its_round_only():
    keep = RoundStart()
    original = state(1)
    keep.save(3, original)
    assert keep.load(2) is None
    first, second = keep.load(3), keep.load(3)
    assert same(first, original) and same(second, original)
    first["residual"]["w"].add_(1.0)  # each load is a fresh copy
    assert same(keep.load(3), original)
    keep.save(4, state(2))
    assert keep.load(3) is None and same(keep.load(4), state(2))
    keep.clear()
    assert keep.load(4) is None
    folder = keep.folder
    keep.close()
    assert not os.path.exists(folder)


def test_saving_holds_one_tensor_in_memory_not_the_state():
    keep = RoundStart()
    big = {f"t{i}": torch.randn(1024, 1024) for i in range(32)}  # 128 MB
    keep.save(0, big)  # warm: the kernels' and file code's pages
    gc.collect()
    before = reset_peak_rss()
    keep.save(1, big)
    assert peak_rss() - before < 3 * 4 * 1024 * 1024  # a few tensors' worth at most, not 128 MB
    assert same(keep.load(1), big)
    keep.close()
