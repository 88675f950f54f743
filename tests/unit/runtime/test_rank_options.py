"""Options a rank applies when it builds its model, checked on a RankWorker in-process
(one rank, no Ray): peft_bias, tokenizer_name, fp16 with a gradient scaler."""

import pytest
import torch
from conftest import first_round

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data.tokenization import char_tokenizer
from diloco_ray.runtime.rank import RankWorker


def worker(tmp_path, **kw):
    fields = dict(
        model_config={
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "attention_bias": True,
        },
        dataset_name="builtin:arithmetic",
        dataset_kwargs={"num_samples": 300},
        seq_len=16,
        batch_size=2,
        max_steps=2,
        diloco_loops=1,
        eval_batches=1,
        output_dir=str(tmp_path),
    )
    fields.update(kw)
    w = RankWorker(TrainerConfig(**fields).to_dict(), replica_id=0, rank=0, world_size=1)
    w.setup()
    return w


@pytest.mark.parametrize("bias, trains_bias", [("none", False), ("all", True)])
def test_peft_bias_decides_whether_biases_train(tmp_path, bias, trains_bias):
    w = worker(tmp_path, use_peft=True, target_modules=["q_proj", "v_proj"], peft_bias=bias)
    trained = w.describe()["trained"]
    assert any("lora_A" in n for n in trained)
    assert any(n.endswith(".bias") for n in trained) == trains_bias


def test_tokenizer_name_is_used(tmp_path):
    folder = tmp_path / "tok"
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    tok.save_pretrained(folder)
    w = worker(tmp_path, tokenizer_name=str(folder))
    assert "<extra>" in w.tokenizer.get_vocab()
    assert w.describe()["trained"]["model.embed_tokens.weight"][0] == len(tok)  # vocab sized to it


def test_fp16_on_cpu_with_a_gradient_scaler(tmp_path):
    w = worker(tmp_path, mixed_precision="fp16")
    assert w.state.scaler is not None
    plan = [(0, w.config.sequences_per_replica_round)]
    grads, stats = first_round(w, plan)
    assert stats.inner_steps == 2 and all(torch.isfinite(g).all() for g in grads.values())
    assert all(g.dtype == torch.float32 for g in grads.values())  # fp32 pseudo-gradients
    payload = sum(4 * g.numel() for g in grads.values())
    assert payload < stats.bytes_up < payload + 4096  # what travels: fp32 payload plus one small header


@pytest.mark.parametrize("budget, steps, unused", [(1e-6, 1, [(2, 4)]), (600.0, 3, [])])
def test_inner_time_s_runs_the_steps_that_fit_and_gives_back_the_rest(tmp_path, budget, steps, unused):
    w = worker(tmp_path, max_steps=3, inner_time_s=budget)  # batch_size 2: two positions a step
    grads, stats = first_round(w, [(0, 6)])
    assert stats.inner_steps == steps and stats.unused == unused
    assert 0 < stats.loss_tokens and not stats.aborted
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())  # it trained, and sends
