"""GPU paths: NCCL process groups, FSDP2 on CUDA, bf16. Skipped on machines without CUDA.

Run on a GPU node with ``python -m pytest -q tests/gpu``.
"""

import pytest
import torch

from conftest import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def ray_gpu():
    import ray

    ray.init(num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _train(cfg):
    from diloco_ray import DilocoFSDPTrainer

    return DilocoFSDPTrainer(cfg).train()


def test_one_gpu_per_replica_bf16(ray_gpu, tmp_path):
    n = min(2, torch.cuda.device_count())
    cfg = tiny_config(tmp_path / "run", device="cuda", num_replicas=n, min_replicas=1,
                      mixed_precision="bf16", diloco_loops=3, max_steps=8, cpus_per_rank=1)
    result = _train(cfg)
    assert [r["replicas"] for r in result.rounds] == [n] * 3
    losses = [r["eval_loss"] for r in result.rounds]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over NCCL needs 2 GPUs")
def test_fsdp_over_nccl_two_ranks(ray_gpu, tmp_path):
    cfg = tiny_config(tmp_path / "run", device="cuda", num_replicas=1, min_replicas=1,
                      ranks_per_replica=2, diloco_loops=2, max_steps=8, grad_accum=2, cpus_per_rank=1)
    result = _train(cfg)
    assert [r["replicas"] for r in result.rounds] == [1, 1]
    assert result.rounds[-1]["eval_loss"] < result.rounds[0]["eval_loss"] * 1.05
