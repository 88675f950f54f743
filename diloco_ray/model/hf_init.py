"""transformers' own initial values for a seed, one module at a time.

``torch.manual_seed(seed)`` followed by ``AutoModelForCausalLM.from_config(config)`` draws
every value from the one global generator: first the draws the modules' constructors make
(values it then overwrites), then ``_init_weights`` on each module in transformers' own
order (children before parents; a sub-model's ``post_init`` before the modules built after
it, e.g. Llama's body before its ``lm_head``). :func:`recorded_meta_model` builds the model
on the meta device and records that schedule (the constructors' draws, caught with a
dispatch mode, and where each ``post_init`` falls); :func:`initialise` replays it on the
host: each constructor draw is made again into scratch memory and dropped, and each
module is materialised alone in that same memory, given to ``_init_weights`` with the
generator where transformers had it, and handed over. The values equal transformers' own
build bit for bit (tests/unit/model/test_meta_init.py: Llama tied and untied, GPT-2,
Qwen2, GPT-NeoX, OPT), while the host holds one module's worth of scratch memory, reused
from one module to the next: a fresh allocation per module would fragment glibc's heap and
leave a rank holding more memory than the build needs.

Why transformers' draw and not a seed of its own per module: both give every tensor the
same distribution, and over many seeds both end at about the same loss, but a run's final
loss depends on its particular draw. Only transformers' draw keeps a run comparable, seed
for seed, with the model transformers itself builds from the same seed (docs/results.md
compares the two draws over seeds). A seed per module would also miss initialisers that
reach into children: GPT-2 draws its blocks' output projections with std 0.02 /
sqrt(2 x layers) from the block, not from the projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Draw:
    """One random draw a module's constructor made (``func(*args, **kwargs)``, an aten op
    that consumes the generator), recorded on the meta device: ``args`` hold the meta
    tensors, so only their shapes, strides and dtypes are known."""

    func: object
    args: tuple
    kwargs: dict

    def replay(self, scratch: "_Scratch") -> None:
        """Make the same draw on the host into scratch memory and drop the values: the
        global generator moves on exactly as it did when the module was built there."""
        scratch.reserve([x for x in [*self.args, *self.kwargs.values()] if isinstance(x, torch.Tensor)])

        def host(x):
            return scratch.like(x).zero_() if isinstance(x, torch.Tensor) else _on_host(x)

        self.func(*[host(a) for a in self.args], **{k: host(v) for k, v in self.kwargs.items()})
        scratch.release()

    def written(self) -> torch.Tensor | None:
        """The (meta) tensor the draw wrote into, or None for a draw that made a new one."""
        return next(iter(_written(self.func, self.args, self.kwargs)), None)


def _on_host(x):
    return torch.device("cpu") if isinstance(x, torch.device) else x


class _Scratch:
    """Host memory that the replayed draws and the modules being initialised use, one
    after another: a buffer per dtype, sized for the largest draw or module so far,
    handed out in regions and taken back whole (:meth:`release`). Every draw and module
    reuses the same pages, so the host holds one module's worth of memory however many
    come and go, and nothing is left for its allocator to fragment."""

    def __init__(self):
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.used: dict[torch.dtype, int] = {}

    @staticmethod
    def _span(t: torch.Tensor) -> int:
        """Elements from ``t``'s first to its last, rounded up to 64 bytes' worth."""
        span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
        return span + (-span % 16)

    def reserve(self, tensors: list[torch.Tensor]) -> None:
        """Make room for all of ``tensors`` at once (before handing any out)."""
        need: dict[torch.dtype, int] = {}
        for t in tensors:
            need[t.dtype] = need.get(t.dtype, 0) + self._span(t)
        for dtype, n in need.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() < n:
                self.buffers.pop(dtype, None)  # freed before the larger one is taken
                self.buffers[dtype] = torch.empty(n, dtype=dtype)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor with ``t``'s shape, strides and dtype, in a region
        of its own until :meth:`release`."""
        start, span = self.used.get(t.dtype, 0), self._span(t)
        buffer = self.buffers.get(t.dtype)
        if buffer is None or buffer.numel() < start + span:  # not reserved: a tensor of its own
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        self.used[t.dtype] = start + span
        return buffer[start : start + span].as_strided(t.shape, t.stride())

    def release(self) -> None:
        self.used.clear()


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


def initialise(template: nn.Module, schedule: list, seed: int, put: Callable, tuner: type | None = None) -> None:
    """Give ``put(name, tensor)`` every value transformers' own initialisation gives
    ``template``'s Hugging Face model after ``torch.manual_seed(seed)``, one module at a
    time: the constructors' draws are replayed into scratch memory, and each sub-model's
    ``post_init`` calls ``_init_weights`` on its modules, children before parents, each
    module once (as ``PreTrainedModel.initialize_weights`` does). A PEFT tuner layer
    (an instance of ``tuner``) stands for the layer it wraps; its adapter is left to the
    caller (:func:`diloco_ray.model.meta_init.fill`)."""
    names = {id(m): n for n, m in template.named_modules()}
    # What each _init_weights call writes, found by dry runs on the meta device before
    # anything is materialised: the host then sees one module's tensors come and go at a
    # time, with nothing else allocated in between to fragment its heap.
    steps: list = []
    done: set[int] = set()
    for step in schedule:
        if isinstance(step, Draw):
            steps.append(step)
            continue
        for module, hf in _post_order(step, step, tuner):
            if id(module) not in done:
                done.add(id(module))
                if owners := _written_by(module, hf):
                    steps.append((module, hf, owners))
    scratch = _Scratch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in steps:
            if isinstance(step, Draw):
                step.replay(scratch)
            else:
                _init_module(*step, names, put, scratch)


def _post_order(module: nn.Module, hf, tuner) -> Iterator[tuple[nn.Module, object]]:
    """``(module, the Hugging Face model whose _init_weights it gets)`` in the order of
    transformers' ``smart_apply``: children first, a sub-model using its own."""
    from transformers import PreTrainedModel

    if tuner is not None and isinstance(module, tuner):
        module = module.get_base_layer()
    for child in module.children():
        yield from _post_order(child, child if isinstance(child, PreTrainedModel) else hf, tuner)
    yield module, hf


def _written_by(module: nn.Module, hf) -> list[tuple[nn.Module, str]]:
    """``(owning module, tensor name)`` of every tensor ``hf._init_weights(module)``
    writes: its own, or a child's (GPT-2 scales its blocks' output projections from the
    block). Found by running it on the meta device, where nothing is drawn."""
    recorder = _WriteRecorder()
    try:
        with torch.random.fork_rng(devices=[]), recorder:
            hf._init_weights(module)
        written = {id(t) for t in recorder.tensors}
    except Exception:  # an initialiser that cannot run on meta: it writes its module's own tensors
        written = {id(t) for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))}
    return [
        (sub, n)
        for sub in module.modules()
        for n, t in list(sub._parameters.items()) + list(sub._buffers.items())
        if t is not None and id(t) in written
    ]


def _init_module(module: nn.Module, hf, owners: list, names: dict, put: Callable, scratch: _Scratch) -> None:
    """``hf._init_weights(module)`` on the host with only the tensors it writes
    (``owners``) materialised, in ``scratch``; each is then handed to ``put``."""
    subs = list({id(sub): sub for sub, _ in owners}.values())
    scratch.reserve([t for sub in subs for t in [*sub._parameters.values(), *sub._buffers.values()] if t is not None])
    for sub in subs:
        sub._apply(scratch.like, recurse=False)
        for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            if t.is_floating_point():
                t.data.fill_(float("nan"))  # so a value the initialiser left unset is caught
            if hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized
    hf._init_weights(module)
    for sub, n in owners:
        t = sub._parameters[n] if n in sub._parameters else sub._buffers[n]
        put(f"{names[id(sub)]}.{n}" if names[id(sub)] else n, t)
    for sub in subs:  # back to shapes only, the scratch memory free for the next one
        sub.to("meta")
    scratch.release()
