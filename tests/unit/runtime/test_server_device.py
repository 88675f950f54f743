"""A parameter server on a device (``server_gpus``), on the host: the float64 norm taken where
the tensors live is the host's; server_gpus is validated, asks Ray for the GPU and is never
ignored. A server's messages are built and read by the one codec path of every device
(tests/unit/algo/test_message_paths.py); tests/gpu runs a server on a real GPU."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.algo.aggregate import sum_of_squares
from diloco_ray.algo.decoupled import cycle_sumsq, sumsq_there
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.runtime.server import server_device

SHAPES = {"embed": (10, 4), "layers.0.w": (6, 4), "layers.0.norm": (4,), "layers.1.w": (6, 4), "head": (10, 4)}
NAMES = list(SHAPES)


def config(**fields) -> TrainerConfig:
    base = dict(max_steps=4, outer_lr=0.7, outer_momentum=0.9, compression_block=16, sync_fragments=2)
    return TrainerConfig(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", **{**base, **fields})


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
