"""Building a rank's model without ever holding the whole of it.

A rank builds its model on the meta device (shapes, no storage), lets FSDP shard that
empty model, allocates only its own rows (``to_empty``) and then fills them one module
at a time:

* from a checkpoint (``model_name``): each parameter's rows are read straight from the
  safetensors files with ``get_slice`` -- in the checkpoint's dtype, cast to fp32 only
  after the rows are cut -- so no process reads a whole tensor it does not hold;
* from a config (``model_config``): the values ``torch.manual_seed(seed)`` followed by
  ``AutoModelForCausalLM.from_config`` gives, bit for bit (:func:`fill` with the
  ``schedule`` of :func:`recorded_meta_model`). transformers draws every value from the
  one global generator: first the draws the modules' constructors make (values it then
  overwrites), then its ``_init_weights`` on each module in its own order (children
  before parents, a sub-model's ``post_init`` before the modules built after it). Here
  the constructors' draws are made again into a scratch tensor, one at a time, and each
  module is materialised alone on the host, given to ``_init_weights`` with the
  generator where transformers had it, its rows copied in, and freed;
* whatever else has no values (a fresh PEFT adapter, a module a checkpoint lacks): the
  module is materialised alone, initialised with a seed derived from ``(seed, module
  name)`` (:func:`module_seed`), its rows copied in, and freed.

Either way the values depend on the seed (and the model) only, never on how the model
is sharded, so every rank of every replica agrees with an unsharded build. Host memory
beyond the rank's own rows is one module at most (the largest single module being
initialised, e.g. the embeddings), and nothing when loading from a checkpoint.
Nothing here knows about Ray or FSDP: :func:`fill` writes into whatever local tensors
the parameters hold (a DTensor's local shard, or the whole tensor).

Why the transformers draw and not a seed per module (0137b71 to 2026-11-25): both give
every tensor the same distribution, and over seeds 1-20 of ``configs/tiny.yaml`` both end
at the same median (0.772 and 0.766), each with 4-5 seeds still above 0.82 at the end;
but a run's final loss depends on its particular draw, so only the transformers draw
keeps a run comparable, seed for seed, with the model transformers itself builds and
with the runs measured before sharded building (over seeds 1-7 alone the per-module
draw ended at median 0.827, the transformers draw at 0.790).
The per-module seeds also missed initialisers that reach into children: GPT-2's output
projections got std 0.02 instead of 0.02 / sqrt(2 x layers).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from diloco_ray.errors import ConfigError, first_line

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
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
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


def meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device: every parameter and buffer with its shape only."""
    with torch.device("meta"):
        return build()


@dataclass(frozen=True)
class Draw:
    """One random draw a module's constructor made (``func(*args, **kwargs)``, an aten op
    that consumes the generator), recorded on the meta device: ``args`` hold the meta
    tensors, so only their shapes, strides and dtypes are known."""

    func: object
    args: tuple
    kwargs: dict

    def replay(self) -> None:
        """Make the same draw on the host into scratch tensors and drop the values: the
        global generator moves on exactly as it did when the module was built there."""

        def host(x):
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu").zero_()
            return torch.device("cpu") if isinstance(x, torch.device) else x

        self.func(*[host(a) for a in self.args], **{k: host(v) for k, v in self.kwargs.items()})

    def written(self) -> torch.Tensor | None:
        """The (meta) tensor the draw wrote into, or None for a draw that made a new one."""
        return next(iter(_written(self.func, self.args, self.kwargs)), None)


def recorded_meta_model(build: Callable[[], nn.Module]) -> tuple[nn.Module, list]:
    """``build()`` on the meta device, and the schedule of what transformers would have
    done with the generator building it on the host: the constructors' :class:`Draw` s in
    the order they were made, with each Hugging Face (sub-)model, whose ``post_init``
    initialises its modules, placed after the last draw of the modules built before it
    finished (construction follows registration order)."""
    recorder = _DrawRecorder()
    with torch.random.fork_rng(devices=[]), torch.device("meta"), recorder:  # a host draw leaves no trace
        model = build()
    return model, _schedule(model, recorder.draws)


class _DrawRecorder(TorchDispatchMode):
    """Keeps every aten op that consumes the random generator."""

    def __init__(self):
        super().__init__()
        self.draws: list[Draw] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.draws.append(Draw(func, tuple(args), dict(kwargs)))
        return func(*args, **kwargs)


class _WriteRecorder(TorchDispatchMode):
    """Keeps the tensors (views resolved to their base) that ops write into."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.tensors.extend(_written(func, args, kwargs))
        return func(*args, **kwargs)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(t, torch.Tensor):
                out.append(t._base if t._base is not None else t)
    return out


def _schedule(model: nn.Module, draws: list[Draw]) -> list:
    from transformers import PreTrainedModel

    order = list(model.modules())
    built_at = {}  # tensor id -> position in registration order of the first module holding it
    for i, module in enumerate(order):
        for t in list(module._parameters.values()) + list(module._buffers.values()):
            if t is not None:
                built_at.setdefault(id(t), i)
    last_of = {id(m): i + sum(1 for _ in m.modules()) - 1 for i, m in enumerate(order)}  # end of its subtree
    placed = []
    for i, module in enumerate(order):
        if isinstance(module, PreTrainedModel):
            end = last_of[id(module)]
            if module is model:
                at = len(draws)  # the outermost post_init runs last, after every draw
            else:
                mine = [k for k, d in enumerate(draws) if built_at.get(id(d.written()), len(order)) <= end]
                at = max(mine) + 1 if mine else 0
            placed.append((at, end, -i, module))  # a nested model finishes first
    placed.sort(key=lambda p: p[:3])
    steps: list = []
    k = 0
    for at, _, _, module in placed:
        steps.extend(draws[k:at])
        k = max(k, at)
        steps.append(module)
    return steps


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
    adapter was built with it), else None -- importing PEFT costs a rank 0.2 s."""
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
            :func:`recorded_meta_model` recorded building ``template``'s Hugging Face
            model: its values are then those ``torch.manual_seed(seed)`` and the same
            build on the host give. Without it each module is seeded on its own.

    Returns:
        Parameter name -> where its values came from (``"checkpoint"`` or ``"init"``).
    """
    params = dict(live.named_parameters())
    buffers = dict(live.named_buffers())
    source: dict[str, str] = {}

    def put(full_name: str, tensor: torch.Tensor, key: str | None = None) -> None:
        """``full_name``'s rows: of ``tensor`` (initialised on the host), or read from the
        checkpoint's ``key`` (``tensor`` then gives the full shape only)."""
        local = _local(params[full_name] if full_name in params else buffers[full_name])
        rows = _held_rows(local, tuple(tensor.shape), world_size, rank)
        if key is not None:
            value = reader.rows(key, rows)
        else:
            value = tensor.data if rows is None else tensor.data[rows]
            if value.is_floating_point() and bool(torch.isnan(value).any()):
                raise ValueError(_unset(full_name))
        local.copy_(value.reshape(local.shape))
        source[full_name] = "init" if key is None else "checkpoint"

    replayed = schedule is not None and reader is None
    if replayed:
        _init_as_transformers(template, schedule, seed, lambda n, t: put(n, t) if n in params or n in buffers else None)
    tuner = _tuner_layer_class()
    for name, module, parts in _owning_modules(template):

        def owned():  # looked up afresh: materialising replaces the tensors
            return [
                (f"{name}.{n}" if name else n, t)
                for part in parts
                for n, t in _named_tensors(module, part)
                if (f"{name}.{n}" if name else n) in params or (f"{name}.{n}" if name else n) in buffers
            ]

        wanted = [(n, t) for n, t in owned() if n not in source]
        if not wanted:
            continue
        keys = {n: reader.key_for(n) if reader is not None and n in params else None for n, _ in wanted}
        if any(k is None for k in keys.values()):
            if replayed and not (tuner is not None and isinstance(module, tuner)):
                raise ValueError(_unset(next(n for n, k in keys.items() if k is None)))
            _initialise(template, name, module, parts, seed)
            wanted = [(n, t) for n, t in owned() if n not in source]
        for full_name, tensor in wanted:
            put(full_name, tensor, keys[full_name])
        for part in parts:  # back to shapes only: the host copy is freed
            part.to("meta")
    missing = [n for n in params if n not in source]
    if missing:
        raise ValueError(f"no values for parameters {missing[:5]}")
    return source


def _unset(full_name: str) -> str:
    return (
        f"model_config: the model's initialiser leaves '{full_name}' unset, so it "
        "cannot be built shard by shard; load it from a checkpoint (model_name)"
    )


def _init_as_transformers(template: nn.Module, schedule: list, seed: int, put: Callable) -> None:
    """Give ``put(name, tensor)`` every value transformers' own initialisation gives
    ``template``'s Hugging Face model after ``torch.manual_seed(seed)``, one module at a
    time: the constructors' draws are replayed into scratch tensors, and each sub-model's
    ``post_init`` calls ``_init_weights`` on its modules, children before parents, each
    module once (as ``PreTrainedModel.initialize_weights`` does). A PEFT tuner layer
    stands for the layer it wraps; its adapter is left to :func:`fill`."""
    names = {id(m): n for n, m in template.named_modules()}
    tuner = _tuner_layer_class()
    done: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in schedule:
            if isinstance(step, Draw):
                step.replay()
                continue
            for module, hf in _post_order(step, step, tuner):
                if id(module) not in done:
                    done.add(id(module))
                    _init_module(module, hf, names, put)


def _post_order(module: nn.Module, hf, tuner) -> Iterator[tuple[nn.Module, object]]:
    """``(module, the Hugging Face model whose _init_weights it gets)`` in the order of
    transformers' ``smart_apply``: children first, a sub-model using its own."""
    from transformers import PreTrainedModel

    if tuner is not None and isinstance(module, tuner):
        module = module.get_base_layer()
    for child in module.children():
        yield from _post_order(child, child if isinstance(child, PreTrainedModel) else hf, tuner)
    yield module, hf


def _init_module(module: nn.Module, hf, names: dict, put: Callable) -> None:
    """``hf._init_weights(module)`` on the host, with only the tensors it writes
    materialised (its own, or a child's: GPT-2 scales its blocks' output projections
    from the block), then handed to ``put`` and freed."""
    recorder = _WriteRecorder()
    try:
        with torch.random.fork_rng(devices=[]), recorder:  # a dry run on the meta device
            hf._init_weights(module)
        written = {id(t) for t in recorder.tensors}
    except Exception:  # an initialiser that cannot run on meta: it writes its module's own tensors
        written = {id(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))}
    owners = [
        (sub, n)
        for sub in module.modules()
        for n, t in list(sub._parameters.items()) + list(sub._buffers.items())
        if t is not None and id(t) in written
    ]
    if not owners:
        return
    subs = list({id(sub): sub for sub, _ in owners}.values())
    for sub in subs:
        sub.to_empty(device="cpu", recurse=False)
        for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            if t.is_floating_point():
                t.data.fill_(float("nan"))  # so a value the initialiser left unset is caught
            if hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized
    hf._init_weights(module)
    for sub, n in owners:
        t = sub._parameters[n] if n in sub._parameters else sub._buffers[n]
        put(f"{names[id(sub)]}.{n}" if names[id(sub)] else n, t)
    for sub in subs:  # back to shapes only: the host copy is freed
        sub.to("meta")


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
