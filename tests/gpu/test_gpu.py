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

    ray.init(
        address="local", num_cpus=8, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False
    )
    yield ray
    ray.shutdown()


def _train(cfg):
    from diloco_ray import DilocoFSDPTrainer

    return DilocoFSDPTrainer(cfg).train()


def test_one_gpu_per_replica_bf16(ray_gpu, tmp_path):
    n = min(2, torch.cuda.device_count())
    cfg = tiny_config(
        tmp_path / "run",
        device="cuda",
        num_replicas=n,
        min_replicas=1,
        mixed_precision="bf16",
        diloco_loops=3,
        max_steps=8,
        cpus_per_rank=1,
    )
    result = _train(cfg)
    assert [r["replicas"] for r in result.rounds] == [n] * 3
    losses = [r["eval_loss"] for r in result.rounds]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP over NCCL needs 2 GPUs")
def test_fsdp_over_nccl_two_ranks(ray_gpu, tmp_path):
    cfg = tiny_config(
        tmp_path / "run",
        device="cuda",
        num_replicas=1,
        min_replicas=1,
        ranks_per_replica=2,
        diloco_loops=2,
        max_steps=8,
        grad_accum=2,
        cpus_per_rank=1,
    )
    result = _train(cfg)
    assert [r["replicas"] for r in result.rounds] == [1, 1]
    assert result.rounds[-1]["eval_loss"] < result.rounds[0]["eval_loss"] * 1.05


def test_gradient_checkpointing_and_compile_bf16_on_gpu(ray_gpu, tmp_path):
    cfg = tiny_config(
        tmp_path / "run",
        device="cuda",
        num_replicas=1,
        min_replicas=1,
        mixed_precision="bf16",
        gradient_checkpointing=True,
        torch_compile=True,
        diloco_loops=2,
        max_steps=8,
        cpus_per_rank=1,
    )
    result = _train(cfg)
    losses = [r["eval_loss"] for r in result.rounds]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_servers_on_the_gpu_train_as_servers_on_the_host(ray_gpu, tmp_path):
    """server_gpus: CPU replicas (gloo) and a server on the one GPU, through Ray, against the
    same run with the server on the host: the same weights to float tolerance (the norm's
    float64 sum is taken in another order there)."""
    from conftest import max_abs_diff

    runs = {}
    for gpus in (0.0, 1.0):
        cfg = tiny_config(
            tmp_path / f"gpus{gpus:g}",
            device="cpu",
            server_gpus=gpus,
            pseudo_grad_compression="int8",
            outer_grad_clip=1.0,
            diloco_loops=2,
            cpus_per_rank=1,
        )
        runs[gpus] = _train(cfg)
    assert [r["replicas"] for r in runs[1.0].rounds] == [2, 2]
    assert max_abs_diff(tmp_path / "gpus1", tmp_path / "gpus0") < 1e-4


def _rank(tmp_path, **fields):
    from diloco_ray.runtime.rank import RankWorker

    cfg = tiny_config(
        tmp_path / "run",
        device="cuda",
        model_config={
            "model_type": "llama",
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
        **fields,
    )
    worker = RankWorker(cfg.to_dict(), 0, 0, 1, device="cuda")
    return worker


def test_sharded_load_puts_only_the_weights_on_the_gpu(tmp_path):
    """The model is built on the meta device and filled on the GPU: at load the GPU holds
    the weights (4 B/param) and nothing else -- no second copy moved over."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    worker = _rank(tmp_path)
    worker.setup()
    params = sum(p.numel() for _, p in worker.params)
    assert (torch.cuda.max_memory_allocated() - before) / params < 4.1


def test_anchor_on_host_sends_the_same_pseudo_gradient():
    """anchor_on_host keeps the anchor in pinned host memory (off the GPU); the
    pseudo-gradient taken against it equals the one taken on the GPU, bit for bit."""
    from diloco_ray.algo import compression
    from diloco_ray.algo.rank_sync import RankSync

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"a": (64, 32), "b": (7,)}
    start = {n: torch.randn(s, device="cuda", generator=g) for n, s in shapes.items()}
    local = {n: t + 0.01 * torch.randn(t.shape, device="cuda", generator=g) for n, t in start.items()}
    sent = {}
    for on_host in (False, True):
        sync = RankSync(shapes, 1, 0, anchor_on_host=on_host)
        sync.anchor = {n: sync._new_anchor(t) for n, t in start.items()}
        assert all(a.is_pinned() == on_host and (a.device.type == "cpu") == on_host for a in sync.anchor.values())
        (buf,) = sync.outgoing(0, local)
        sent[on_host] = {n: t for n, (_, t) in compression.unpack_pieces(buf, list(shapes))[0].items()}
    for name, grad in sent[False].items():
        assert torch.equal(sent[True][name], grad), name


def test_overlap_on_the_gpu_trains_as_the_host_path(ray_gpu, tmp_path):
    """overlap_communication on a GPU rank: its messages are built there and leave by their
    own call while the next period runs (rank_outbox). The same run with the anchor on the
    host (built on the host, sent with the stats) ends on the same weights to float
    tolerance (int8's bytes are the same on both; fp32 sums may round apart)."""
    from conftest import max_abs_diff

    for on_host in (False, True):
        cfg = tiny_config(
            tmp_path / f"host{int(on_host)}",
            device="cuda",
            num_replicas=1,
            min_replicas=1,
            sync_fragments=2,
            overlap_communication=True,
            pseudo_grad_compression="int8",
            error_feedback=True,
            anchor_on_host=on_host,
            diloco_loops=3,
            max_steps=8,
            cpus_per_rank=1,
        )
        result = _train(cfg)
        assert [r["replicas"] for r in result.rounds] == [1, 1, 1]
    assert max_abs_diff(tmp_path / "host0", tmp_path / "host1") < 1e-4
