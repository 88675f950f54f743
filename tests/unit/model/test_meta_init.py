"""Unit tests for diloco_ray.model.hf_init through meta_init.fill: a model built from a
config, one module at a time from the meta device, holds exactly the values transformers
gives it after ``torch.manual_seed(seed)`` (no Ray, tiny models made in the test)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import model_parts

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data.tokenization import char_tokenizer
from diloco_ray.model import hf_init, loading

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
ARCHS = {
    "llama_untied": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "llama_tied": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True},
    # GPT-2 scales its blocks' output projections from the block's _init_weights, not the layer's.
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4},
    "qwen2": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2},
    "gpt_neox": {"model_type": "gpt_neox", **SMALL},
    "opt": {"model_type": "opt", "hidden_size": 32, "ffn_dim": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
}


def make(arch: dict, seed: int, **kw) -> TrainerConfig:
    return TrainerConfig(
        model_config=arch, tokenizer_name="builtin:char", dataset_name="builtin:arithmetic", seq_len=16, seed=seed, **kw
    )


def transformers_build(cfg: TrainerConfig, tok) -> torch.nn.Module:
    build, _ = loading._factory(cfg, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return build()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_values_are_transformers_own_for_the_seed(arch):
    tok = char_tokenizer()
    cfg = make(ARCHS[arch], seed=3)
    got = loading.build_model(*model_parts(cfg), tok).state_dict()
    want = transformers_build(cfg, tok).state_dict()
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


def test_base_model_under_a_lora_adapter_is_transformers_own():
    tok = char_tokenizer()
    cfg = make(ARCHS["llama_tied"], seed=4, use_peft=True, target_modules=["q_proj", "down_proj"])
    model = loading.build_model(*model_parts(cfg), tok)
    base = {k.replace(".base_layer", ""): v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    want = transformers_build(cfg, tok).state_dict()
    assert base.keys() == want.keys()
    assert all(torch.equal(base[k], want[k]) for k in want)
    lora_a = [v for k, v in model.named_parameters() if "lora_A" in k]
    assert lora_a and all(bool(torch.isfinite(v).all()) and float(v.abs().sum()) > 0 for v in lora_a)


def test_schedule_places_each_post_init_after_its_draws():
    tok = char_tokenizer()
    build, _ = loading._factory(make(ARCHS["llama_untied"], seed=0), tok)
    model, schedule = hf_init.recorded_meta_model(build)
    models = [i for i, step in enumerate(schedule) if not isinstance(step, hf_init.Draw)]
    # LlamaModel's post_init runs before lm_head is built (its draw), the outer model's last.
    assert [type(schedule[i]).__name__ for i in models] == ["LlamaModel", "LlamaForCausalLM"]
    assert models[1] == len(schedule) - 1 and isinstance(schedule[models[1] - 1], hf_init.Draw)
    assert schedule[models[1] - 1].written() is model.lm_head.weight


@pytest.mark.parametrize("file", ["/etc/passwd", "../x.safetensors", "shards/../../x.safetensors", 3])
def test_a_weight_map_naming_a_file_outside_the_model_folder_is_refused(tmp_path, file):
    from diloco_ray.errors import DataError
    from diloco_ray.model.meta_init import CheckpointRows

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-1.safetensors", "w": file}}))
    with pytest.raises(DataError) as caught:
        CheckpointRows(str(tmp_path))
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{index}: weight_map entry 'w': {file!r} is not allowed")


def test_a_weight_map_inside_the_folder_reads_its_shards(tmp_path):
    from safetensors.torch import save_file

    from diloco_ray.model.meta_init import CheckpointRows

    (tmp_path / "shards").mkdir()
    save_file({"w": torch.arange(6.0).reshape(3, 2)}, str(tmp_path / "shards" / "a.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "shards/a.safetensors"}}))
    assert torch.equal(CheckpointRows(str(tmp_path)).rows("w", slice(1, 2)), torch.tensor([[2.0, 3.0]]))
