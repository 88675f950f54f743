"""Tokenizers and models: loading from the hub or a folder, or building from a config.

This module owns how a rank gets its ``nn.Module`` and tokenizer, which parameters are
DiLoCo's *trained* parameters (the ones whose pseudo-gradients travel), and how the final
model is written in Hugging Face format. Nothing here knows about Ray.
"""

from __future__ import annotations

import os
import string
from typing import Iterable

import torch
from torch import nn

from diloco_ray.config import TrainerConfig
from diloco_ray.errors import ConfigError

BUILTIN_CHAR_TOKENIZER = "builtin:char"
_CHARS = list(string.printable[:95]) + ["\n", "\t"]


def char_tokenizer():
    """A character-level tokenizer over printable ASCII, built offline.

    Each character is one token; ``<pad>`` (0), ``<eos>`` (1) and ``<unk>`` (2) come first.
    It is a real ``PreTrainedTokenizerFast``, so it saves and reloads like any other.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + _CHARS)}
    # BPE with no merges splits text into single characters; Fuse joins them back.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def load_tokenizer(config: TrainerConfig):
    """The tokenizer named by ``tokenizer_name`` (default ``model_name``), with a pad token."""
    name = config.tokenizer_name or config.model_name or BUILTIN_CHAR_TOKENIZER
    if name == BUILTIN_CHAR_TOKENIZER:
        tok = char_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            field = "tokenizer_name" if config.tokenizer_name else "model_name"
            raise ConfigError(f"{field}: cannot load a tokenizer from '{name}' "
                              f"(not a local folder, and not reachable on the hub): {_first_line(e)}") from None
    if tok.pad_token is None:
        # Causal LMs often ship without one; padding positions are masked out of the loss.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.eos_token is None:
        raise ConfigError(f"tokenizer_name: the tokenizer from '{name}' has no eos token, "
                          "which packing needs to separate documents")
    return tok


def build_model(config: TrainerConfig, tokenizer) -> nn.Module:
    """The causal LM in fp32, identically initialised on every rank that calls this.

    ``model_name`` loads pretrained weights (``from_pretrained``, hub id or folder);
    ``model_config`` builds a fresh model of that architecture, seeded by ``config.seed``,
    with the vocabulary sized to the tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if config.model_name is not None:
        try:
            return AutoModelForCausalLM.from_pretrained(config.model_name, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model_name: cannot load a causal LM from '{config.model_name}' "
                              f"(not a local folder, and not reachable on the hub): {_first_line(e)}") from None
    arch = dict(config.model_config)
    model_type = arch.pop("model_type")
    arch.setdefault("vocab_size", len(tokenizer))
    arch.setdefault("pad_token_id", tokenizer.pad_token_id)
    arch.setdefault("eos_token_id", tokenizer.eos_token_id)
    arch.setdefault("bos_token_id", tokenizer.bos_token_id)
    arch.setdefault("max_position_embeddings", config.seq_len)
    try:
        hf_config = AutoConfig.for_model(model_type, **arch)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model_config: {_first_line(e)}") from None
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters DiLoCo synchronises: those that require grad, in a fixed order.

    ``named_parameters`` already drops tied duplicates (e.g. lm_head tied to the
    embeddings), so each tensor travels once.
    """
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def decoder_layers(model: nn.Module) -> Iterable[nn.Module]:
    """The repeated transformer blocks: FSDP wraps each as one unit."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            # The first ModuleList of blocks (model.layers, transformer.h, ...).
            return list(module)
    return []


def save_hf(model: nn.Module, tokenizer, weights: dict[str, torch.Tensor], path: str) -> None:
    """Load ``weights`` into ``model`` and write it as a Hugging Face folder.

    Args:
        model: an unsharded model of the trained architecture, holding the right values
            for everything that is not in ``weights`` (frozen parameters, buffers).
            Loading copies in place, so tied parameters stay tied.
        tokenizer: saved beside the weights.
        weights: the global weights, by parameter name.
        path: the destination folder (written to ``path.tmp`` then renamed, so a crash
            never leaves a half-written folder).
    """
    import shutil

    result = model.load_state_dict({n: torch.as_tensor(w) for n, w in weights.items()}, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights hold tensors the model does not have: {result.unexpected_keys[:5]}")
    tmp = f"{path}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
