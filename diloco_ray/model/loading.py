"""Models: loading from the hub or a folder, or building from a config.

This module owns how a rank gets its ``nn.Module`` (its tokenizer comes from
:mod:`diloco_ray.data.tokenization`), which parameters are
DiLoCo's *trained* parameters (the ones whose pseudo-gradients travel), and how the final
model is written in Hugging Face format. Nothing here knows about Ray.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from diloco_ray import files
from diloco_ray.config.sections import ModelSection, PeftSection
from diloco_ray.errors import ConfigError, first_line
from diloco_ray.model import hf_init
from diloco_ray.model import meta_init as model_init


def build_model(
    model: ModelSection,
    peft: PeftSection,
    tokenizer,
    device: str | torch.device = "cpu",
    shard: Callable[[nn.Module], None] | None = None,
    world_size: int = 1,
    rank: int = 0,
) -> nn.Module:
    """The causal LM in fp32, identically initialised on every rank that calls this.

    ``model_name`` loads pretrained weights (hub id or folder); ``model_config`` builds a
    fresh model of that architecture, with the vocabulary sized to the tokenizer and the
    values ``torch.manual_seed(model.seed)`` and ``AutoModelForCausalLM.from_config``
    give (a PEFT adapter: seeded per module). Either way the model is built on the meta device, handed to
    ``shard`` (FSDP's ``fully_shard``) before any storage exists, and only then are its
    rows allocated on ``device`` and filled, one parameter at a time (see
    :mod:`diloco_ray.model.meta_init`): no rank ever holds the whole model.

    Args:
        model: the job's model section (which model, how it is computed, its seed).
        peft: the job's PEFT section (the adapter trained instead of all weights, if any).
        tokenizer: sizes the vocabulary of a ``model_config`` model.
        device: where the parameters live.
        shard: called with the empty (meta) model; must leave each parameter holding
            the rows ``shard_rows(rows, world_size, rank)`` (as ``fully_shard`` does).
        world_size, rank: this rank's place among the ranks ``shard`` splits over.
    """
    build, folder = _factory(model, tokenizer)
    reader = model_init.CheckpointRows(folder) if folder is not None else None
    if model.model_name is not None and reader is None:
        # No safetensors weights (a .bin checkpoint): no rows to read, so load it whole.
        whole = _adapt(_load_whole(model), model, peft)
        if shard is not None:
            shard(whole)
        return whole.to(device)
    live, template, schedule = _meta_models(build, reader, model, peft)
    if shard is not None:
        shard(live)
    live.to_empty(device=device)
    if hasattr(_base(live), "tie_weights"):
        _base(live).tie_weights()  # to_empty may have replaced a tied parameter
    model_init.fill(live, template, model.seed, reader, world_size, rank, schedule)
    return live


def _meta_models(
    build: Callable[[], nn.Module], reader: model_init.CheckpointRows | None, model: ModelSection, peft: PeftSection
) -> tuple[nn.Module, nn.Module, list | None]:
    """``(live, template, schedule)`` on the meta device: the model to shard and fill, the
    one :func:`meta_init.fill` takes shapes and values from, and (built from a config) the
    draws transformers made building the template. Sets ``reader``'s name prefix."""
    try:
        live = _adapt(model_init.meta_model(build), model, peft)
    except ValueError as e:
        raise ConfigError(f"attn_implementation: {first_line(e)}") from None
    # From a config, the template also records the draws transformers makes building it,
    # so that the values are those of torch.manual_seed(seed) and from_config on the host.
    bare, schedule = hf_init.recorded_meta_model(build) if reader is None else (model_init.meta_model(build), None)
    template = _adapt(bare, model, peft)
    if reader is not None:
        reader.prefix = getattr(_base(template), "base_model_prefix", "")
    return live, template, schedule


def meta_model(model: ModelSection, peft: PeftSection, tokenizer) -> nn.Module:
    """The configured model (with its PEFT adapter) on the meta device: its config,
    names and shapes, no weights."""
    build, _ = _factory(model, tokenizer, download=False)
    return _adapt(model_init.meta_model(build), model, peft)


def _factory(model: ModelSection, tokenizer, download: bool = True) -> tuple[Callable[[], nn.Module], str | None]:
    """(a function that builds the bare model, the checkpoint folder to read or None;
    None too without ``download``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    if model.model_name is not None:
        folder = model_init.checkpoint_folder(model.model_name) if download else None
        try:
            hf_config = AutoConfig.from_pretrained(model.model_name)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model_name: cannot load a causal LM from '{model.model_name}': {first_line(e)}"
            ) from None
        return (lambda: AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **extra)), folder
    arch = dict(model.model_config)
    model_type = arch.pop("model_type")
    arch.setdefault("vocab_size", len(tokenizer))
    arch.setdefault("pad_token_id", tokenizer.pad_token_id)
    arch.setdefault("eos_token_id", tokenizer.eos_token_id)
    arch.setdefault("bos_token_id", tokenizer.bos_token_id)
    arch.setdefault("max_position_embeddings", model.seq_len)
    try:
        hf_config = AutoConfig.for_model(model_type, **arch)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model_config: {first_line(e)}") from None
    return (lambda: AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **extra)), None


def _load_whole(model: ModelSection) -> nn.Module:
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    try:
        return AutoModelForCausalLM.from_pretrained(model.model_name, dtype=torch.float32, **extra)
    except (OSError, ValueError) as e:
        field = "attn_implementation" if model.attn_implementation and "attn" in str(e).lower() else "model_name"
        raise ConfigError(f"{field}: cannot load a causal LM from '{model.model_name}': {first_line(e)}") from None


def _base(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _adapt(net: nn.Module, model: ModelSection, peft: PeftSection) -> nn.Module:
    """Gradient checkpointing and the PEFT adapter, as configured."""
    if model.gradient_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not peft.use_peft:
        return net
    from peft import IA3Config, LoraConfig, get_peft_model

    if peft.peft_type == "LORA":
        peft_config = LoraConfig(
            r=peft.lora_r,
            lora_alpha=peft.lora_alpha,
            lora_dropout=peft.lora_dropout,
            target_modules=peft.target_modules,
            bias=peft.peft_bias,
            task_type="CAUSAL_LM",
        )
    else:
        # IA3 scales feed-forward inputs, other modules' outputs; name them when targets are given.
        ff = [m for m in (peft.target_modules or []) if m in _FEEDFORWARD_NAMES]
        peft_config = IA3Config(
            target_modules=peft.target_modules,
            feedforward_modules=ff if peft.target_modules else None,
            task_type="CAUSAL_LM",
        )
    try:
        # On a meta model the adapter's values are set later (model_init.fill).
        return get_peft_model(net, peft_config)
    except ValueError as e:
        raise ConfigError(f"target_modules: {first_line(e)}") from None


_FEEDFORWARD_NAMES = {"down_proj", "fc2", "c_proj", "w2", "dense_4h_to_h"}


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
    """Load ``weights`` into ``model`` and write it as a Hugging Face folder (a PEFT
    model writes its adapter: adapter_config.json and the adapter weights).

    Args:
        model: an unsharded model of the trained architecture, holding the right values
            for everything that is not in ``weights`` (frozen parameters, buffers).
            Loading copies in place, so tied parameters stay tied.
        tokenizer: saved beside the weights.
        weights: the global weights, by parameter name.
        path: the destination folder (written to a hidden temp folder beside it, then
            renamed: a crash never leaves a half-written folder, see
            :func:`diloco_ray.files.replace_folder`).
    """
    result = model.load_state_dict({n: torch.as_tensor(w) for n, w in weights.items()}, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"weights hold tensors the model does not have: {result.unexpected_keys[:5]}")
    files.replace_folder(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))


def save_merged(model: nn.Module, tokenizer, path: str) -> None:
    """Fold a PEFT adapter into its base weights and write a plain Hugging Face model."""
    merged = model.merge_and_unload()
    files.replace_folder(path, lambda tmp: (merged.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
