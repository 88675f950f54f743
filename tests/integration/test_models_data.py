"""Real loading paths with things the test makes: a tiny Llama saved with save_pretrained
and loaded by path, JSONL rows with prompt/completion templates, LoRA and IA3 through
peft (only trainable parameters travel), FSDP over a peft model, early stopping, and the
model options as a rank really builds them."""

import json
import os
import random

import pytest
import torch
from conftest import first_round, tiny_config
from safetensors import safe_open

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.data.tokenization import char_tokenizer
from diloco_ray.observe.metrics import read_events
from diloco_ray.runtime.rank import RankWorker

# Bytes a message adds to its payload (magic, offsets, row starts) for a handful of tensors.
HEADER = 512

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = char_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=128,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def sums_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    rng = random.Random(3)
    with open(path, "w") as f:
        for _ in range(1500):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"question": f"{a} plus {b}", "answer": str(a + b), "noise": "x"}) + "\n")
    return str(path)


def peft_config(tmp_path, llama_folder, sums_jsonl, **kw):
    fields = dict(
        model_config=None,
        model_name=llama_folder,
        tokenizer_name=None,
        dataset_name=None,
        dataset_kwargs={},
        json_file_path=sums_jsonl,
        prompt_template="{question} = ",
        completion_template="{answer}",
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        seq_len=24,
        batch_size=8,
        max_steps=15,
        lr=3e-3,
    )
    fields.update(kw)
    return tiny_config(tmp_path / "run", **fields)


def adapter_numel(folder):
    n = 0
    for fn in os.listdir(folder):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fn), "pt") as f:
                n += sum(
                    f.get_slice(k).get_shape().numel()
                    if hasattr(f.get_slice(k).get_shape(), "numel")
                    else int(torch.tensor(f.get_slice(k).get_shape()).prod())
                    for k in f.keys()
                )
    return n


def test_lora_over_fsdp_sends_only_the_adapter_and_learns(ray_local, tmp_path, llama_folder, sums_jsonl):
    """Two replicas of two FSDP ranks over a LoRA model: only the adapter travels (each
    rank its rows, in one message each), the loss falls, and the merged model has no LoRA
    layers left."""
    from transformers import AutoModelForCausalLM

    cfg = peft_config(
        tmp_path, llama_folder, sums_jsonl, diloco_loops=4, merge_adapter=True, ranks_per_replica=2, grad_accum=2
    )
    result = DilocoFSDPTrainer(cfg).train()
    final = result.final_path
    assert os.path.exists(os.path.join(final, "adapter_config.json"))
    n = adapter_numel(final)
    assert 0 < n < 10_000  # r=4 on q_proj and v_proj of two 64-wide layers: 4096 values
    for r in result.rounds:
        # fp32, adapter only (frozen weights never travel), plus one small header per rank's message
        assert 4 * n * r["replicas"] < r["bytes_up"] <= (4 * n + 2 * HEADER) * r["replicas"]
        if r["round"] == 0:  # both replicas built the seeded adapter (equal digests): kept, not loaded
            assert r["bytes_down"] == 0
        else:  # the adapter's weights, to both replicas
            assert 4 * n * 2 < r["bytes_down"] <= (4 * n + 2 * HEADER) * 2
    losses = [r["eval_loss"] for r in result.rounds]
    assert losses[-1] < losses[0]
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(cfg.output_dir, "final_merged"))
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_ia3_adapter(ray_local, tmp_path, llama_folder, sums_jsonl):
    cfg = peft_config(
        tmp_path,
        llama_folder,
        sums_jsonl,
        peft_type="IA3",
        target_modules=["k_proj", "v_proj", "down_proj"],
        num_replicas=1,
        diloco_loops=2,
        max_steps=5,
    )
    result = DilocoFSDPTrainer(cfg).train()
    config = json.load(open(os.path.join(result.final_path, "adapter_config.json")))
    assert config["peft_type"] == "IA3"
    n = adapter_numel(result.final_path)
    assert n == 2 * (64 + 64 + 128)  # one scale per k/v output and down_proj input, per layer
    assert all(4 * n < r["bytes_up"] <= 4 * n + HEADER for r in result.rounds)


def test_early_stopping(streaming_run):
    # A threshold no round can beat: stop after `patience` rounds without improvement.
    cfg, result = streaming_run
    assert cfg.diloco_loops == 6 and cfg.early_stopping_patience == 2
    assert len(result.rounds) == 3 and os.path.exists(os.path.join(result.final_path, "config.json"))
    assert [e["round"] for e in read_events(cfg.output_dir, "early_stop")] == [3]


def test_model_options_are_what_a_rank_builds(tmp_path, llama_folder, sums_jsonl, monkeypatch):
    # Fixed batch shapes: torch.compile on CPU costs ~10 s per shape it meets (dynamic
    # batches recompiled for every width: 86 s), and the dynamic batches are tested below.
    # The rank's torch.compile traces and trains through dynamo and AOTAutograd as ever, but
    # without inductor's C++ code generation (24 s with a cold inductor cache, as on a fresh
    # CI machine): what this test asks is that the rank compiles the model it trains.
    compile_model = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: compile_model(model, backend="aot_eager"))
    cfg = peft_config(
        tmp_path,
        llama_folder,
        sums_jsonl,
        attn_implementation="eager",
        gradient_checkpointing=True,
        torch_compile=True,
        use_peft=False,
        max_steps=2,
    )
    worker = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
    worker.setup()
    facts = worker.describe()
    assert facts["compiled"] and facts["attn_implementation"] == "eager" and facts["gradient_checkpointing"]
    grads, stats = first_round(worker, [(0, cfg.sequences_per_replica_round)])
    assert stats.inner_steps == 2
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_dynamic_batches_are_padded_to_the_batch(tmp_path, llama_folder, sums_jsonl):
    cfg = peft_config(
        tmp_path,
        llama_folder,
        sums_jsonl,
        dynamic_batch=True,
        group_by_length=True,
        num_workers=1,
        use_peft=False,
        max_steps=2,
    )
    worker = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
    worker.setup()
    plan = [(0, cfg.sequences_per_replica_round)]
    from diloco_ray.data import plan as data

    batches = data.rank_batches(plan, cfg.sections().data, 0, len(worker.tokens.train), worker.tokens.train.lengths)
    widths = [b["input_ids"].shape[1] for _, _, b in worker.batches.micro_batches(worker.tokens.train, batches, 0)]
    assert widths and max(widths) < cfg.seq_len  # padded to the batch, not to seq_len (DataLoader worker)
    grads, stats = first_round(worker, plan)
    assert stats.inner_steps == 2 and stats.tokens < cfg.sequences_per_replica_round * cfg.seq_len
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.fixture(scope="module")
def streaming_run(ray_local, tmp_path_factory, llama_folder, sums_jsonl):
    """A streaming run of 6 rounds that early stopping ends after 3 (a threshold no round
    can beat, patience 2): test_streaming_run reads its 3 rounds, test_early_stopping the stop."""
    cfg = peft_config(
        tmp_path_factory.mktemp("streaming"),
        llama_folder,
        sums_jsonl,
        use_peft=False,
        streaming=True,
        shuffle_buffer=64,
        streaming_eval_rows=64,
        diloco_loops=6,
        early_stopping_patience=2,
        early_stopping_threshold=100.0,
        max_steps=6,
        group_by_length=True,
        dynamic_batch=True,
    )
    return cfg, DilocoFSDPTrainer(cfg).train()


def test_streaming_run(streaming_run):
    cfg, result = streaming_run
    rounds = result.rounds
    assert [r["replicas"] for r in rounds] == [2, 2, 2]
    assert rounds[-1]["eval_loss"] < rounds[0]["eval_loss"]
    positions = sorted(
        p for r in rounds for plan in r["data_ranges"].values() for s, c in plan for p in range(s, s + c)
    )
    assert positions == list(range(2 * 3 * cfg.sequences_per_replica_round))


def test_ranks_read_the_data_one_task_tokenised(ray_local, tmp_path, sums_jsonl, monkeypatch):
    # The driver's one task tokenises; a rank given its ref reads the arrays from the object
    # store (read-only, not a copy) and tokenises nothing itself.
    from diloco_ray.data import samples, tokenization
    from diloco_ray.runtime.replica import start_token_data

    cfg = tiny_config(
        tmp_path / "run",
        dataset_name=None,
        dataset_kwargs={},
        json_file_path=sums_jsonl,
        prompt_template="{question} = ",
        completion_template="{answer}",
        seq_len=24,
    )
    expected = samples.load_token_data(cfg.sections().data, tokenization.load_tokenizer(cfg.sections().model))
    shared = start_token_data(cfg.sections().data, cfg.sections().model)
    monkeypatch.setattr(samples, "load_token_data", lambda *a: pytest.fail("the rank tokenised the data itself"))
    worker = RankWorker(cfg.to_dict(), replica_id=0, rank=0, world_size=1)
    worker.setup(token_data=shared)
    for split in ("train", "eval"):
        got, want = getattr(worker.tokens, split), getattr(expected, split)
        assert len(got) == len(want) > 0
        for field in ("input_ids", "labels", "lengths"):
            assert (getattr(got, field) == getattr(want, field)).all(), (split, field)
    assert not worker.tokens.train.input_ids.flags.writeable
    streamed = tiny_config(tmp_path / "s", streaming=True).sections()
    assert start_token_data(streamed.data, streamed.model) is None  # ranks read a stream


def test_a_data_error_in_the_tokenising_task_reaches_the_user(ray_local, tmp_path, sums_jsonl):
    from diloco_ray.errors import DataError, unwrap

    # Loaded as `dataset_name: json` with data_files: the driver reads no record of it (a
    # json_file_path's first record is checked before Ray), so the task finds the typo.
    cfg = tiny_config(
        tmp_path / "run",
        dataset_name="json",
        dataset_kwargs={"data_files": sums_jsonl},
        prompt_template="{questoin} = ",
        completion_template="{answer}",
        seq_len=24,
    )
    with pytest.raises(Exception) as info:
        DilocoFSDPTrainer(cfg).train()
    error = unwrap(info.value)
    assert isinstance(error, DataError), repr(info.value)[:500]
    message = str(error)  # the original, not Ray's wrapper with the remote traceback
    assert message.startswith("prompt_template:") and "questoin" in message and "question" in message
