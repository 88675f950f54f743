"""Two FSDP ranks (gloo, spawned processes, no Ray) build their model shard by shard.

Each rank goes through ``RankWorker.setup`` as in a real replica. The test checks that
a rank's memory grows by about its half of the model, never by the whole model (the
build before sharded loading grew by more than the whole model on every rank), and that
the rows each rank holds equal those of an unsharded build -- from a config, and from a
bf16 safetensors checkpoint with a LoRA adapter on top.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import model_parts, peak_rss, reset_peak_rss

from diloco_ray.algo.sharding import shard_rows
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import tokenization
from diloco_ray.model import loading as modeling
from diloco_ray.runtime import fsdp

# ~34M parameters: large enough that half of it stands out of the noise of a process.
BIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
SMALL = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def config(**fields) -> TrainerConfig:
    base = dict(
        dataset_name="builtin:arithmetic",
        seq_len=32,
        batch_size=2,
        max_steps=1,
        diloco_loops=1,
        ranks_per_replica=2,
        eval_batches=0,
        output_dir="unused",
        seed=5,
    )
    return TrainerConfig(**{**base, **fields})


def _rank(rank: int, meeting_points: list[str], jobs: list, out: str) -> None:
    import psutil

    from diloco_ray.runtime.rank import RankWorker

    torch.set_num_threads(1)
    results = []
    for fields, init_method in zip(jobs, meeting_points):
        gc.collect()
        before = reset_peak_rss()
        worker = RankWorker(config(**fields).to_dict(), 0, rank, 2)
        worker.setup(init_method)
        grew = peak_rss() - before
        rows = {n: (p.to_local() if hasattr(p, "to_local") else p.data).clone() for n, p in worker.params}
        listening = [c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        results.append({"grew": grew, "rows": rows, "listening": listening})
        worker.retire()
        del worker
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both ranks' rows and memory growth for each job, plus the unsharded builds."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    tok = tokenization.char_tokenizer()
    source = modeling.build_model(*model_parts(config(model_config=SMALL, seed=11)), tok)
    source.to(torch.bfloat16).save_pretrained(folder)  # a bf16 checkpoint, as hub models ship
    tok.save_pretrained(folder)
    # The first build pays for imports and data (a rank's fixed overhead), so the second
    # one's growth is the model's alone.
    jobs = [
        {"model_config": SMALL},
        {"model_config": BIG},
        {"model_name": folder, "use_peft": True, "target_modules": ["q_proj", "v_proj"]},
    ]
    out = str(tmp_path_factory.mktemp("ranks"))
    meeting_points = [fsdp.rendezvous() for _ in jobs]  # what the replica asks of rank 0
    mp.start_processes(_rank, args=(meeting_points, jobs, out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    whole = [
        modeling.build_model(*model_parts(config(**job)), tokenization.load_tokenizer(config(**job).sections().model))
        for job in jobs
    ]
    return jobs, ranks, whole


def test_a_rank_never_holds_the_whole_model(built):
    _, ranks, whole = built
    full_bytes = sum(p.numel() * 4 for _, p in modeling.trained_parameters(whole[1]))
    for r in range(2):
        grew = ranks[r][1]["grew"]
        # Its half (0.5), one module being initialised and the data; never the whole (>= 1.0).
        assert grew < 0.75 * full_bytes, f"rank {r} grew by {grew / full_bytes:.2f} x the model"


def test_the_ranks_meet_in_a_private_file_and_listen_on_loopback_only(built):
    """A replica's ranks share a node: nothing of their group may be reachable from
    another machine (PyTorch's TCP store would listen on every interface)."""
    _, ranks, _ = built
    for r in range(2):
        for job in ranks[r]:
            assert job["listening"] and all(ip.startswith("127.") for ip in job["listening"]), job["listening"]
    init_method = fsdp.rendezvous()
    folder = os.path.dirname(init_method.removeprefix("file://"))
    assert init_method.startswith("file://") and os.stat(folder).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("job", [1, 2], ids=["model_config", "bf16_checkpoint_with_lora"])
def test_rows_equal_an_unsharded_build(built, job):
    _, ranks, whole = built
    expected = dict(modeling.trained_parameters(whole[job]))
    for r in range(2):
        rows = ranks[r][job]["rows"]
        assert set(rows) == set(expected)
        for name, value in rows.items():
            full = expected[name].detach()
            want = full if full.dim() == 0 else full[shard_rows(full.shape[0], 2, r)]
            assert torch.equal(value, want), name


def test_checkpoint_rows_keep_the_checkpoint_values(built, tmp_path):
    jobs, _, whole = built
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(jobs[2]["model_name"], dtype=torch.float32)
    base = whole[2].get_base_model()
    for name, p in reference.named_parameters():
        peft_name = name.replace("q_proj.weight", "q_proj.base_layer.weight").replace(
            "v_proj.weight", "v_proj.base_layer.weight"
        )
        assert torch.equal(dict(base.named_parameters())[peft_name], p), name
