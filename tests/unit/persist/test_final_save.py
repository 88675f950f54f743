"""Unit tests for diloco_ray.persist.final_save: final/ streamed from server slices (no Ray)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import model_parts
from transformers import AutoModelForCausalLM

from diloco_ray.algo import partition
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import tokenization
from diloco_ray.model import loading as modeling
from diloco_ray.persist import final_save

ARCH = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def config(tmp_path, **fields) -> TrainerConfig:
    return TrainerConfig(
        **{"model_config": ARCH, "dataset_name": "builtin:arithmetic", "output_dir": str(tmp_path / "run"), **fields}
    )


def servers_of(weights: dict, count: int):
    """What ``count`` servers hold: their row slices, and a fetch that reads them the way
    ServerGroup.tensor does (every server asked, the slices assembled), counting calls."""
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    owned = partition.server_shards(shapes, count)
    calls = []

    def fetch(name):
        calls.append(name)
        slices = [
            (rows[name][0], weights[name][rows[name][0] : rows[name][1]] if shapes[name] else weights[name])
            for rows in owned
            if name in rows
        ]
        return final_save.assemble_rows(name, shapes[name], slices)

    return shapes, fetch, calls


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_final_loads_with_from_pretrained_and_equals_the_servers(tmp_path, tied):
    cfg = config(tmp_path, model_config={**ARCH, "tie_word_embeddings": tied})
    tok = tokenization.load_tokenizer(cfg.sections().model)
    weights = {
        n: p.detach().numpy().copy()
        for n, p in modeling.trained_parameters(modeling.build_model(*model_parts(cfg), tok))
    }
    shapes, fetch, calls = servers_of(weights, 2)
    folder = str(tmp_path / "final")
    final_save.save_model(
        folder, modeling.meta_model(*model_parts(cfg), tok), tok, shapes, fetch, max_shard_bytes=40_000
    )
    index = json.load(open(os.path.join(folder, final_save.WEIGHTS_INDEX)))
    assert len(set(index["weight_map"].values())) >= 3 and set(index["weight_map"]) == set(weights)
    assert calls == list(weights)  # each tensor fetched once, in order: one at a time
    model = AutoModelForCausalLM.from_pretrained(folder)
    got = dict(model.named_parameters())
    assert all(torch.equal(got[n], torch.from_numpy(w)) for n, w in weights.items())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert os.path.exists(os.path.join(folder, "tokenizer.json"))


def test_plan_shards_keeps_order_and_limits_size():
    shapes = {"a": (10,), "b": (10,), "c": (30,), "d": (1,)}
    assert final_save.plan_shards(shapes, max_bytes=80) == [["a", "b"], ["c"], ["d"]]
    assert final_save.plan_shards(shapes, max_bytes=10**6) == [["a", "b", "c", "d"]]
    assert final_save.shard_file_names(1) == ["model.safetensors"]
    assert final_save.shard_file_names(2)[1] == "model-00002-of-00002.safetensors"


def test_missing_rows_or_a_wrong_size_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="servers hold 3 of the 4 rows of 'w'"):
        final_save.assemble_rows("w", (4, 2), [(0, np.zeros((3, 2), dtype=np.float32))])
    with pytest.raises(ValueError, match="'w': fetched 3 values"):
        final_save.write_shard(str(tmp_path / "x.safetensors"), ["w"], {"w": (2, 2)}, lambda n: np.zeros(3))


def test_adapter_written_by_peft_loads_and_equals(tmp_path):
    from peft import PeftModel

    cfg = config(tmp_path, use_peft=True, target_modules=["q_proj", "v_proj"])
    tok = tokenization.load_tokenizer(cfg.sections().model)
    trained = modeling.build_model(*model_parts(cfg), tok)
    adapter = {n: p.detach().clone() + 0.5 for n, p in modeling.trained_parameters(trained)}  # "trained" values
    folder = str(tmp_path / "final")
    final_save.save_adapter(folder, modeling.meta_model(*model_parts(cfg), tok), tok, adapter)
    assert os.path.exists(os.path.join(folder, "adapter_config.json"))
    base = modeling.build_model(*model_parts(config(tmp_path)), tok)
    loaded = dict(PeftModel.from_pretrained(base, folder).named_parameters())
    assert all(torch.equal(loaded[n], t) for n, t in adapter.items())
