"""A parameter server's device path (``server_gpus``) against its host path, in-process and
on the host: a server whose codec takes the device path (messages decoded and built by
diloco_ray.algo.device_message, here with CPU kernels) sums, steps and sends exactly what the
host path does; the GPU's float64 norm agrees with the host's; server_gpus is validated,
asks Ray for the GPU and is never ignored. tests/gpu runs a server on a real GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco_ray.algo import compression, device_message, partition, wire_layout
from diloco_ray.algo.aggregate import sum_of_squares
from diloco_ray.algo.decoupled import cycle_sumsq, sumsq_there
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.runtime.messages import Contribution
from diloco_ray.runtime.server import ParameterServer, server_device

SHAPES = {"embed": (10, 4), "layers.0.w": (6, 4), "layers.0.norm": (4,), "layers.1.w": (6, 4), "head": (10, 4)}
NAMES = list(SHAPES)


def config(**fields) -> TrainerConfig:
    base = dict(max_steps=4, outer_lr=0.7, outer_momentum=0.9, compression_block=16, sync_fragments=2)
    return TrainerConfig(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", **{**base, **fields})


def seeded_server(cfg: TrainerConfig, device_path: bool) -> ParameterServer:
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    seed, _ = compression.pack_pieces(weights, dict.fromkeys(NAMES, 0), NAMES, "none", {"version": 0})
    server = ParameterServer(cfg.to_dict())
    server.initialize([seed], SHAPES)
    if device_path:
        server.codec.on_host = False
    return server


def contribution(cfg: TrainerConfig, rid: int, round_index: int, fragment: int) -> Contribution:
    """One replica's pseudo-gradient of ``fragment``'s rows, as its one rank packs it."""
    g = torch.Generator().manual_seed(100 * round_index + 10 * fragment + rid)
    target = partition.fragments(SHAPES, cfg.sync_fragments)[fragment]
    pieces = {
        n: 0.01 * torch.randn(partition.take(torch.empty(SHAPES[n]), iv).shape, generator=g) for n, iv in target.items()
    }
    buf, _ = compression.pack_pieces(
        pieces, {n: iv[0] for n, iv in target.items()}, NAMES, cfg.pseudo_grad_compression, {}, block=16
    )
    return Contribution(rid, [buf], 1.0 + rid)


@pytest.mark.parametrize("codec,weights", [("int4", "int8"), ("none", "none"), ("topk", "bf16")])
def test_the_device_path_sums_steps_and_sends_what_the_host_path_does(codec, weights, monkeypatch):
    calls = {"unpack": 0, "pack": 0}
    for name, key in (("unpack_pieces", "unpack"), ("pack_pieces_filled", "pack")):
        monkeypatch.setattr(device_message, name, _counted(getattr(device_message, name), calls, key))
    cfg = config(pseudo_grad_compression=codec, weights_compression=weights, outer_grad_clip=0.05)
    host, dev = seeded_server(cfg, False), seeded_server(cfg, True)
    for round_index in range(3):
        plans = dict(zip([0, 1], host.data_plan([0, 1])))
        for fragment in range(cfg.sync_fragments):
            contributions = [contribution(cfg, rid, round_index, fragment) for rid in (0, 1)]
            out = []
            for server in (host, dev):
                prepared = server.prepare(fragment, contributions)
                applied = server.commit(plans, server.reduce(prepared))
                out.append((applied.pseudo_grad_norm, server.new_weights_message(fragment).copy()))
            assert out[0][0] == out[1][0]
            assert_same_message(out[0][1], out[1][1])
    for read in ("global_weights", "full_weights"):
        assert_same_message(getattr(host, read)(), getattr(dev, read)())
    assert calls["unpack"] >= 12 and calls["pack"] >= 8  # the device server's, never the host's


def _counted(function, calls: dict, key: str):
    def counted(*args, **kwargs):
        calls[key] += 1
        return function(*args, **kwargs)

    return counted


def assert_same_message(a: np.ndarray, b: np.ndarray) -> None:
    """The same pieces, bit for bit, and the same meta but for the send time; and the
    same layout: the same sections and data area. (The header's length is not compared:
    the send time is a float whose printed form varies in length.)"""
    (pa, ma), (pb, mb) = compression.unpack_pieces(a, NAMES), compression.unpack_pieces(b, NAMES)
    ma.pop("sent_at", None), mb.pop("sent_at", None)
    assert ma == mb and pa.keys() == pb.keys()
    (_, head_a, start_a), (_, head_b, start_b) = wire_layout.parse_header(a), wire_layout.parse_header(b)
    assert head_a["tensors"] == head_b["tensors"] and len(a) - start_a == len(b) - start_b
    for name in pa:
        assert pa[name][0] == pb[name][0] and torch.equal(pa[name][1], pb[name][1]), name


def test_the_float64_norm_taken_where_the_tensors_live_is_the_hosts():
    g = torch.Generator().manual_seed(3)
    values, cycle = torch.randn(70_001, generator=g), torch.randn(70_001, generator=g)
    torch.testing.assert_close(sumsq_there(values), sum_of_squares(values), rtol=1e-12, atol=0)
    torch.testing.assert_close(sumsq_there(values, cycle), cycle_sumsq(cycle, values), rtol=1e-12, atol=0)
    assert sumsq_there(torch.zeros(0)) == 0.0


def test_server_gpus_is_validated_and_never_ignored(monkeypatch):
    with pytest.raises(ConfigError, match="server_gpus"):
        config(server_gpus=2)
    with pytest.raises(ConfigError, match="server_gpus"):
        config(server_gpus=-1)
    assert server_device(0.0) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="server_gpus: 0.5 but this parameter server sees no CUDA device"):
        server_device(0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert server_device(1.0) == torch.device("cuda", 0)


def test_servers_ask_ray_for_their_gpus():
    from diloco_ray.driver.membership import capacity_shortfall

    placement = config(server_gpus=0.5, num_param_servers=2).sections().placement
    short = capacity_shortfall(placement, 1, "cpu", {"CPU": 64.0})
    assert short is not None and "GPU 1" in short
    assert capacity_shortfall(placement, 1, "cpu", {"CPU": 64.0, "GPU": 1.0}) is None
    assert capacity_shortfall(config().sections().placement, 1, "cpu", {"CPU": 64.0}) is None
