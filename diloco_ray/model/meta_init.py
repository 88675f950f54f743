"""Building a rank's model without ever holding the whole of it.

A rank builds its model on the meta device (shapes, no storage), lets FSDP shard that
empty model, allocates only its own rows (``to_empty``) and then fills them one module
at a time:

* from a checkpoint (``model_name``): each parameter's rows are read straight from the
  safetensors files with ``get_slice`` -- in the checkpoint's dtype, cast to fp32 only
  after the rows are cut -- so no process reads a whole tensor it does not hold;
* from a config (``model_config``): the values ``torch.manual_seed(seed)`` followed by
  ``AutoModelForCausalLM.from_config`` gives, bit for bit, each module materialised alone
  on the host, initialised, its rows copied in, and freed (:mod:`diloco_ray.model.hf_init`);
* whatever else has no values (a fresh PEFT adapter, a module a checkpoint lacks): the
  module is materialised alone, initialised with a seed derived from ``(seed, module
  name)`` (:func:`module_seed`), its rows copied in, and freed.

Either way the values depend on the seed (and the model) only, never on how the model
is sharded, so every rank of every replica agrees with an unsharded build. Host memory
beyond the rank's own rows is one module at most (the largest single module being
initialised, e.g. the embeddings), and nothing when loading from a checkpoint.
Nothing here knows about Ray or FSDP: :func:`fill` writes into whatever local tensors
the parameters hold (a DTensor's local shard, or the whole tensor).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from typing import Callable, Iterator

import torch
from torch import nn

from diloco_ray.errors import ConfigError, DataError, first_line
from diloco_ray.model import hf_init

# The prefix PEFT puts before the wrapped model's names, and the segment it inserts
# before a wrapped layer's own weights: the checkpoint has neither.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer"


def module_seed(seed: int, name: str) -> int:
    """The seed a module is initialised with: the run's seed and the module's name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class CheckpointRows:
    """Reads rows of named tensors from a Hugging Face safetensors checkpoint folder.

    Args:
        folder: holds ``model.safetensors`` or ``model.safetensors.index.json`` and
            its shards.
        prefix: the model's ``base_model_prefix`` (``"model"`` for Llama), tried on or
            off a name when the checkpoint was saved from a head-less or older model.
    """

    def __init__(self, folder: str, prefix: str = ""):
        self.folder, self.prefix = folder, prefix
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            self.files = read_weight_map(index)
        else:
            from safetensors import safe_open

            single = os.path.join(folder, "model.safetensors")
            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), "model.safetensors")
        self._open: dict[str, object] = {}

    @staticmethod
    def available(folder: str) -> bool:
        return any(
            os.path.isfile(os.path.join(folder, n)) for n in ("model.safetensors", "model.safetensors.index.json")
        )

    def key_for(self, name: str) -> str | None:
        """The checkpoint key of model parameter ``name`` (None: not in the checkpoint)."""
        if name.startswith(_PEFT_PREFIX):
            name = name[len(_PEFT_PREFIX) :].replace(_BASE_LAYER, "")
        candidates = [name]
        if self.prefix:
            dotted = f"{self.prefix}."
            candidates.append(name[len(dotted) :] if name.startswith(dotted) else dotted + name)
        return next((c for c in candidates if c in self.files), None)

    def rows(self, key: str, rows: slice | None) -> torch.Tensor:
        """Rows ``rows`` (all for None) of tensor ``key``, in the checkpoint's dtype."""
        from safetensors import safe_open

        file = self.files[key]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        piece = self._open[file].get_slice(key)
        return piece[:] if rows is None or not piece.get_shape() else piece[rows]

    def shape(self, key: str) -> tuple:
        self.rows(key, slice(0, 0))  # opens the file
        return tuple(self._open[self.files[key]].get_slice(key).get_shape())


def read_weight_map(index: str) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file) from its index file.

    A model folder may come from anyone (the hub, a shared disk), and every shard it names is
    opened: each must be a relative path inside the folder, never absolute or through ``..``.

    Raises:
        DataError: one line naming the index file and the entry.
    """
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{index}: not a model index with a weight_map ({first_line(e)})") from None
    if not isinstance(weight_map, dict):
        raise DataError(f"{index}: weight_map is not a mapping of tensor names to shard files")
    for name, file in weight_map.items():
        parts = file.replace("\\", "/").split("/") if isinstance(file, str) else []
        if not parts or os.path.isabs(file) or any(p in ("", ".", "..") for p in parts):
            raise DataError(
                f"{index}: weight_map entry {name!r}: {file!r} is not allowed; "
                "expected a shard file inside the model folder (no absolute path, no '..')"
            )
    return dict(weight_map)


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device: every parameter and buffer with its shape only."""
    with torch.device("meta"):
        return build()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t.data


def _held_rows(local: torch.Tensor, full_shape: tuple, world_size: int, rank: int) -> slice | None:
    """The rows of the full tensor that ``local`` holds (None: all of it)."""
    if not full_shape or tuple(local.shape) == tuple(full_shape):
        return None
    from diloco_ray.algo.sharding import shard_rows

    return shard_rows(full_shape[0], world_size, rank)


def _owning_modules(template: nn.Module) -> Iterator[tuple[str, nn.Module, list[nn.Module]]]:
    """``(name, module, parts)`` for every module that owns tensors, in model order;
    ``parts`` are the modules materialised and initialised together. A PEFT tuner layer
    initialises its adapter weights as one unit (its ``reset_*`` method), so they come
    with it; its wrapped ``base_layer`` is a module of its own."""
    tuner = _tuner_layer_class()
    taken: set[int] = set()
    for name, module in template.named_modules():
        if id(module) in taken:
            continue
        if tuner is not None and isinstance(module, tuner):
            base = module.get_base_layer()
            base_ids = {id(m) for m in base.modules()}
            parts = [m for m in module.modules() if id(m) not in base_ids]
            taken.update(id(m) for m in parts)
            yield name, module, parts
            continue
        owns_tensors = (
            next(module.parameters(recurse=False), None) is not None
            or next(module.buffers(recurse=False), None) is not None
        )
        if owns_tensors:
            yield name, module, [module]


def _initialise(root: nn.Module, name: str, module: nn.Module, parts: list[nn.Module], seed: int) -> None:
    """Materialise ``parts`` on the host and run the model's own initialiser on them."""
    tuner = _tuner_layer_class()

    for part in parts:
        part.to_empty(device="cpu", recurse=False)
        for t in list(part.parameters(recurse=False)) + list(part.buffers(recurse=False)):
            if t.is_floating_point():
                t.data.fill_(float("nan"))  # so an initialiser that skipped it is caught below
            if hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        if tuner is not None and isinstance(module, tuner):
            for adapter in module.active_adapters:
                if hasattr(module, "reset_lora_parameters"):
                    module.reset_lora_parameters(adapter, True)
                elif hasattr(module, "reset_ia3_parameters"):
                    module.reset_ia3_parameters(adapter)
        else:
            hf = _hf_model(root)
            if hf is None:
                raise ValueError("model_config: not a Hugging Face model: cannot initialise it")
            hf._init_weights(module)


def _tuner_layer_class():
    """PEFT's tuner-layer class when PEFT is in use (already imported: a model with an
    adapter was built with it), else None: importing PEFT only to ask would slow every
    rank's start."""
    module = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(module, "BaseTunerLayer", None)


def _hf_model(root: nn.Module):
    from transformers import PreTrainedModel

    return next((m for m in root.modules() if isinstance(m, PreTrainedModel)), None)


@torch.no_grad()
def fill(
    live: nn.Module,
    template: nn.Module,
    seed: int,
    reader: CheckpointRows | None = None,
    world_size: int = 1,
    rank: int = 0,
    schedule: list | None = None,
) -> dict[str, str]:
    """Write every parameter's and buffer's values into ``live``'s local storage.

    Args:
        live: the model to fill, already allocated (``to_empty``) and possibly sharded:
            a parameter's local tensor holds the rows :func:`~diloco_ray.algo.sharding.shard_rows`
            gives this rank.
        template: the same model unsharded on the meta device (built the same way);
            it is used for shapes and, one module at a time, to initialise values.
        seed: the run's seed (see :func:`module_seed`).
        reader: the checkpoint, or None to initialise everything.
        world_size, rank: this rank's place among the ranks sharding ``live``.
        schedule: for a model built from a config (no ``reader``), what
            :func:`~diloco_ray.model.hf_init.recorded_meta_model` recorded building
            ``template``'s Hugging Face model: its values are then those
            ``torch.manual_seed(seed)`` and the same build on the host give. Without it
            each module is seeded on its own.

    Returns:
        Parameter name -> where its values came from (``"checkpoint"`` or ``"init"``).
    """
    filler = _Filler(live, reader, world_size, rank)
    replayed = schedule is not None and reader is None
    if replayed:
        hf_init.initialise(template, schedule, seed, filler.keep, _tuner_layer_class())
    tuner = _tuner_layer_class()
    for name, module, parts in _owning_modules(template):
        # Replayed, every module but a PEFT adapter has its values already or is unset.
        must_be_set = replayed and not (tuner is not None and isinstance(module, tuner))
        filler.fill_module(template, name, module, parts, seed, must_be_set)
    missing = [n for n in filler.params if n not in filler.source]
    if missing:
        raise ValueError(f"no values for parameters {missing[:5]}")
    return filler.source


class _Filler:
    """One :func:`fill`: the live model's tensors and where each one's values came from.

    Args:
        live, reader, world_size, rank: as for :func:`fill`.
    """

    def __init__(self, live: nn.Module, reader: CheckpointRows | None, world_size: int, rank: int):
        self.params = dict(live.named_parameters())
        self.buffers = dict(live.named_buffers())
        self.reader, self.world_size, self.rank = reader, world_size, rank
        self.source: dict[str, str] = {}

    def put(self, full_name: str, tensor: torch.Tensor, key: str | None = None) -> None:
        """``full_name``'s rows: of ``tensor`` (initialised on the host), or read from the
        checkpoint's ``key`` (``tensor`` then gives the full shape only)."""
        local = _local(self.params[full_name] if full_name in self.params else self.buffers[full_name])
        rows = _held_rows(local, tuple(tensor.shape), self.world_size, self.rank)
        if key is not None:
            value = self.reader.rows(key, rows)
        else:
            value = tensor.data if rows is None else tensor.data[rows]
            if value.is_floating_point() and bool(torch.isnan(value).any()):
                raise ValueError(_unset(full_name))
        local.copy_(value.reshape(local.shape))
        self.source[full_name] = "init" if key is None else "checkpoint"

    def keep(self, full_name: str, tensor: torch.Tensor) -> None:
        """:meth:`put` for the replayed build, which also offers tied copies: not kept."""
        if full_name in self.params or full_name in self.buffers:
            self.put(full_name, tensor)

    def fill_module(
        self, template: nn.Module, name: str, module: nn.Module, parts: list[nn.Module], seed: int, must_be_set: bool
    ) -> None:
        """Fill the tensors of ``parts`` not filled yet: from the checkpoint where it has
        them, else all of them initialised on the host (an error where ``must_be_set``)."""
        wanted = self._unfilled(name, module, parts)
        if not wanted:
            return
        keys = {n: self.reader.key_for(n) if self.reader is not None and n in self.params else None for n, _ in wanted}
        if any(k is None for k in keys.values()):
            if must_be_set:
                raise ValueError(_unset(next(n for n, k in keys.items() if k is None)))
            _initialise(template, name, module, parts, seed)
            wanted = self._unfilled(name, module, parts)  # looked up afresh: materialising replaces them
        for full_name, tensor in wanted:
            self.put(full_name, tensor, keys[full_name])
        for part in parts:  # back to shapes only: the host copy is freed
            part.to("meta")

    def _unfilled(self, name: str, module: nn.Module, parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
        """``(full name, template tensor)`` of each live tensor of ``parts`` without values yet."""
        named = ((f"{name}.{n}" if name else n, t) for part in parts for n, t in _named_tensors(module, part))
        return [
            (full, t) for full, t in named if (full in self.params or full in self.buffers) and full not in self.source
        ]


def _unset(full_name: str) -> str:
    return (
        f"model_config: the model's initialiser leaves '{full_name}' unset, so it "
        "cannot be built shard by shard; load it from a checkpoint (model_name)"
    )


def _named_tensors(owner: nn.Module, part: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``part``'s own parameters and buffers, named relative to ``owner``."""
    prefix = next(n for n, m in owner.named_modules() if m is part)
    for n, t in list(part.named_parameters(recurse=False)) + list(part.named_buffers(recurse=False)):
        yield (f"{prefix}.{n}" if prefix else n), t


def checkpoint_folder(model_name: str) -> str | None:
    """The local folder of ``model_name``'s files (a folder as given, or the hub cache's
    snapshot); None when it has no safetensors weights to read rows from."""
    folder = model_name
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model_name, allow_patterns=["*.json", "*.safetensors"])
        except Exception as e:  # offline, unknown id: the same error as from_pretrained's
            raise ConfigError(f"model_name: cannot load a causal LM from '{model_name}': {first_line(e)}") from None
    return folder if CheckpointRows.available(folder) else None
