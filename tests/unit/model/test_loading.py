"""Unit tests for diloco_ray.model.loading: the builtin tokenizer, building/loading tiny models,
trained parameters and Hugging Face export (all offline, models made in the test)."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from conftest import model_parts

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data.tokenization import char_tokenizer, load_tokenizer
from diloco_ray.errors import ConfigError
from diloco_ray.model.loading import build_model, decoder_layers, save_hf, trained_parameters

ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
MODEL = {"model_type": "llama", **ARCH}


def make(**kw) -> TrainerConfig:
    base = dict(model_config=MODEL, tokenizer_name="builtin:char", dataset_name="builtin:arithmetic", seq_len=16)
    return TrainerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def tiny_llama(tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=100,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        **ARCH,
    )
    return LlamaForCausalLM(cfg)


def state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the builtin character tokenizer ------------------------------------------------------


def test_char_tokenizer_round_trip(tok):
    s = "12+35=47\n"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(s)  # one token per character
    assert len(set(ids)) == len(set(s))
    assert tok.decode(ids) == s
    assert tok.convert_ids_to_tokens(ids) == list(s)
    for text in ["Hello, World! (x) ", "tab\there", "a , b . c"]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_char_tokenizer_special_ids(tok):
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.eos_token == "<eos>" and tok.eos_token_id == 1
    assert tok.unk_token == "<unk>" and tok.unk_token_id == 2
    assert len(tok) == 3 + 95 + 2
    assert tok("é", add_special_tokens=False)["input_ids"] == [2]
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    assert 0 not in ids and 1 not in ids  # plain text never produces pad/eos


def test_char_tokenizer_save_and_reload(tmp_path, tok):
    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["12+35=47\n", "The quick brown fox; 99%"]:
        assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.eos_token_id == 1 and back.pad_token_id == 0 and len(back) == len(tok)


def test_load_tokenizer_builtin(tok):
    t = load_tokenizer(make().sections().model)
    assert t.eos_token_id == 1 and t.pad_token_id == 0
    assert t("1+1=2", add_special_tokens=False)["input_ids"] == tok("1+1=2", add_special_tokens=False)["input_ids"]


# --- building from model_config -----------------------------------------------------------


def test_build_model_from_config(tok):
    model = build_model(*model_parts(make(seed=3)), tok)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.get_input_embeddings().weight.shape == (len(tok), 32)
    assert model.get_output_embeddings().weight.shape == (len(tok), 32)
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.max_position_embeddings == 16
    assert model.config.num_hidden_layers == 1
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(decoder_layers(model)) == 1


def test_build_model_seeded(tok):
    a = build_model(*model_parts(make(seed=7)), tok).state_dict()
    b = build_model(*model_parts(make(seed=7)), tok).state_dict()
    c = build_model(*model_parts(make(seed=8)), tok).state_dict()
    assert state_equal(a, b)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[w], c[w])
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_build_model_does_not_disturb_global_rng(tok):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(*model_parts(make()), tok)
    assert torch.equal(torch.rand(3), expected)


def test_build_model_explicit_vocab_kept(tok):
    model = build_model(*model_parts(make(model_config={**MODEL, "vocab_size": 128})), tok)
    assert model.get_input_embeddings().weight.shape[0] == 128


def test_build_model_bad_architecture(tok):
    with pytest.raises(ConfigError) as ei:
        build_model(*model_parts(make(model_config={"model_type": "not-a-real-arch", "hidden_size": 8})), tok)
    assert str(ei.value).startswith("model_config:")


# --- loading from a folder (the from_pretrained path) -------------------------------------


@pytest.fixture
def saved_model(tmp_path, tok):
    folder = tmp_path / "tiny-llama"
    model = tiny_llama(seed=11)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return str(folder), {k: v.clone() for k, v in model.state_dict().items()}


def test_load_from_folder(saved_model, tok):
    folder, weights = saved_model
    cfg = TrainerConfig(model_name=folder, dataset_name="builtin:arithmetic", seq_len=16)
    t = load_tokenizer(cfg.sections().model)
    text = "12+35=47\n"
    assert t(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert t.eos_token_id == 1
    model = build_model(*model_parts(cfg), t)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert state_equal(model.state_dict(), weights)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_load_tokenizer_defaults_to_builtin_char_for_model_config(tok):
    t = load_tokenizer(make(tokenizer_name=None).sections().model)
    assert len(t) == len(tok) and t.eos_token_id == 1
    assert t("9+9=18", add_special_tokens=False)["input_ids"] == tok("9+9=18", add_special_tokens=False)["input_ids"]


def test_model_name_wins_over_model_config(saved_model, tok):
    folder, weights = saved_model
    cfg = TrainerConfig(model_name=folder, model_config={**MODEL, "hidden_size": 64}, dataset_name="builtin:arithmetic")
    assert state_equal(build_model(*model_parts(cfg), tok).state_dict(), weights)


def test_tokenizer_name_overrides_model_name(saved_model):
    folder, _ = saved_model
    cfg = TrainerConfig(model_name=folder, tokenizer_name="builtin:char", dataset_name="builtin:arithmetic")
    assert load_tokenizer(cfg.sections().model).eos_token_id == 1


offline = pytest.mark.skipif(
    os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"),
    reason="needs HF_HUB_OFFLINE=1 so a missing model is not looked up on the hub",
)


@offline
def test_missing_model_folder(tmp_path, tok):
    missing = str(tmp_path / "no-such-model")
    cfg = TrainerConfig(model_name=missing, dataset_name="builtin:arithmetic")
    with pytest.raises(ConfigError) as ei:
        load_tokenizer(cfg.sections().model)
    assert str(ei.value).startswith("model_name:") and missing in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        build_model(*model_parts(cfg), tok)
    assert str(ei.value).startswith("model_name:") and missing in str(ei.value)
    assert "\n" not in str(ei.value)


@offline
def test_missing_tokenizer_names_tokenizer_name(tmp_path, saved_model):
    folder, _ = saved_model
    missing = str(tmp_path / "no-such-tokenizer")
    cfg = TrainerConfig(model_name=folder, tokenizer_name=missing, dataset_name="builtin:arithmetic")
    with pytest.raises(ConfigError) as ei:
        load_tokenizer(cfg.sections().model)
    assert str(ei.value).startswith("tokenizer_name:") and missing in str(ei.value)


# --- trained parameters -------------------------------------------------------------------


def test_trained_parameters_skips_frozen():
    model = tiny_llama()
    all_names = [n for n, _ in model.named_parameters()]
    model.model.norm.weight.requires_grad_(False)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    names = [n for n, _ in trained_parameters(model)]
    assert "model.norm.weight" not in names
    assert "model.layers.0.mlp.up_proj.weight" not in names
    assert names == [n for n in all_names if n not in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight")]
    assert all(p.requires_grad for _, p in trained_parameters(model))


def test_trained_parameters_tied_embeddings_once():
    model = tiny_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = trained_parameters(model)
    names = [n for n, _ in params]
    assert len(names) == len(set(names))
    ids = [id(p) for _, p in params]
    assert len(ids) == len(set(ids))
    assert sum(p is model.model.embed_tokens.weight for _, p in params) == 1
    assert "lm_head.weight" not in names
    untied = [n for n, _ in trained_parameters(tiny_llama(tie=False))]
    assert len(untied) == len(names) + 1 and "lm_head.weight" in untied


# --- export -------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_writes_loadable_folder(tmp_path, tok, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_llama(tie=tie, seed=1)
    g = torch.Generator().manual_seed(5)
    weights = {n: torch.randn(p.shape, generator=g) for n, p in trained_parameters(model)}
    path = tmp_path / "final"
    (tmp_path / "final").mkdir()
    (path / "stale.txt").write_text("old")  # a previous final/ is replaced, not merged
    save_hf(model, tok, weights, str(path))
    files = os.listdir(path)
    assert "config.json" in files
    assert glob.glob(str(path / "*.safetensors"))
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert "stale.txt" not in files
    assert sorted(os.listdir(tmp_path)) == ["final"]  # no temp folder left beside it
    # the weights were loaded into the model in place (tied parameters stay tied)
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])
    back = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    sd = back.state_dict()
    for n, w in weights.items():
        assert torch.equal(sd[n], w), n
    if tie:
        assert torch.equal(back.lm_head.weight, weights["model.embed_tokens.weight"])
    t = AutoTokenizer.from_pretrained(str(path))
    assert t("1+2=3", add_special_tokens=False)["input_ids"] == tok("1+2=3", add_special_tokens=False)["input_ids"]


def test_save_hf_never_writes_through_links_at_final_or_its_old_temp_name(tmp_path, tok):
    """In a shared output_dir, a link at final/ (or at final.tmp, where it was written
    first) pointing at someone's folder: the folder is left as it was, final/ is the model."""
    model = tiny_llama(seed=1)
    weights = {n: p.detach().clone() for n, p in trained_parameters(model)}
    theirs = {name: tmp_path / name for name in ("theirs", "theirs_too")}
    for folder in theirs.values():
        folder.mkdir()
        (folder / "keep.txt").write_text("theirs")
    out = tmp_path / "run"
    out.mkdir()
    (out / "final").symlink_to(theirs["theirs"])
    (out / "final.tmp").symlink_to(theirs["theirs_too"])
    save_hf(model, tok, weights, str(out / "final"))
    for folder in theirs.values():
        assert os.listdir(folder) == ["keep.txt"]
    assert not (out / "final").is_symlink() and "config.json" in os.listdir(out / "final")
