"""Writing ``final/`` as sharded safetensors straight from the parameter servers' slices.

The global weights live in row slices on the parameter servers. The writer (the driver)
streams them into Hugging Face's sharded layout one tensor at a time: each shard file's
safetensors header is written first (every tensor's shape and offset is known from the
shapes alone), then each tensor is fetched from the servers that hold its rows and its
bytes appended. No process ever holds more than one tensor of the model; the folder
loads with ``from_pretrained`` (``model.safetensors.index.json`` names the shard of
every tensor).

A PEFT adapter is small and is written by PEFT itself (``save_pretrained`` of the
adapter-wrapped model built on the meta device, handed the adapter's weights), so its
files are exactly what PEFT writes and reads.

Plain code over tensors and files: the server calls are behind the ``fetch`` argument.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from diloco_ray import files
from diloco_ray.config.sections import ModelSection, PeftSection

# What one tensor's rows look like when fetched: (first row, fp32 rows) per server holding some.
Fetch = Callable[[str], np.ndarray]

WEIGHTS_INDEX = "model.safetensors.index.json"


def plan_shards(shapes: Mapping[str, Sequence[int]], max_bytes: int, itemsize: int = 4) -> list[list[str]]:
    """Group the tensors, in order, into shards of at most ``max_bytes`` each (a tensor
    larger than that gets a shard of its own), as ``save_pretrained`` does."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return [s for s in shards if s]


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shard(path: str, names: Sequence[str], shapes: Mapping[str, Sequence[int]], fetch: Fetch) -> int:
    """Write one safetensors file of fp32 tensors ``names``, fetching each when its
    turn comes; returns the data bytes written.

    The format: an 8-byte little-endian header length, a JSON header (name -> dtype,
    shape, [start, end) in the data area), padded with spaces to 8 bytes, then the data.
    """
    header, offset = {}, 0
    for name in names:
        nbytes = math.prod(shapes[name]) * 4
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            values = np.ascontiguousarray(fetch(name), dtype="<f4")
            if values.size != math.prod(shapes[name]):
                raise ValueError(f"'{name}': fetched {values.size} values, want shape {tuple(shapes[name])}")
            f.write(values.data)
    return offset


def write_sharded(
    folder: str, shapes: Mapping[str, Sequence[int]], fetch: Fetch, max_shard_bytes: int = 2 << 30
) -> list[str]:
    """Write every tensor of ``shapes`` (keyed as the checkpoint names them) into
    ``folder`` as Hugging Face sharded safetensors plus the index; returns the files."""
    groups = plan_shards(shapes, max_shard_bytes)
    names = shard_file_names(len(groups))
    total = sum(write_shard(os.path.join(folder, f), g, shapes, fetch) for f, g in zip(names, groups))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, g in zip(names, groups) for n in g}}
        with open(os.path.join(folder, WEIGHTS_INDEX), "w") as f:
            json.dump(index, f, indent=2)
        names.append(WEIGHTS_INDEX)
    return names


def assemble_rows(name: str, shape: Sequence[int], slices: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """One full tensor from the row slices servers hold of it (each ``(first row, rows)``)."""
    if not shape:
        return np.asarray(slices[0][1], dtype=np.float32).reshape(())
    out = np.empty(tuple(shape), dtype=np.float32)
    covered = 0
    for start, rows in slices:
        out[start : start + rows.shape[0]] = rows
        covered += rows.shape[0]
    if covered != shape[0]:
        raise ValueError(f"servers hold {covered} of the {shape[0]} rows of '{name}'")
    return out


def save_model(
    folder: str,
    model_meta: torch.nn.Module,
    tokenizer,
    shapes: Mapping[str, Sequence[int]],
    fetch: Fetch,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """A full (non-PEFT) model: its config, sharded weights and tokenizer into ``folder``.

    Args:
        model_meta: the model on the meta device (for its config and state-dict keys).
        tokenizer: saved beside the weights.
        shapes: name -> shape of every trained parameter (the servers' layout).
        fetch: name -> that parameter's full fp32 values (one tensor at a time).
    """
    keys = set(model_meta.state_dict().keys())
    missing = sorted(keys - set(shapes) - _tied_keys(model_meta))
    if missing:
        raise ValueError(f"the servers hold no values for {missing[:5]} (frozen weights or persistent buffers)")
    os.makedirs(folder, exist_ok=True)
    write_sharded(folder, {n: shapes[n] for n in shapes if n in keys}, fetch, max_shard_bytes)
    model_meta.config.save_pretrained(folder)
    if getattr(model_meta, "generation_config", None) is not None and model_meta.can_generate():
        model_meta.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys of tensors tied to another one (saved once, under the other name)."""
    seen, tied = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen[id(tensor)] = name
    return tied


def save_adapter(folder: str, peft_meta, tokenizer, adapter: Mapping[str, torch.Tensor]) -> None:
    """A PEFT adapter: PEFT's own ``save_pretrained`` with the adapter weights given
    (the wrapped base model is on the meta device and never read)."""
    os.makedirs(folder, exist_ok=True)
    peft_meta.save_pretrained(folder, state_dict=dict(adapter))
    tokenizer.save_pretrained(folder)


def save_from_servers(
    model: ModelSection,
    peft: PeftSection,
    final_shard_mb: float,
    path: str,
    tensor: Callable[[str, tuple], np.ndarray],
    shapes: Mapping[str, tuple],
) -> str:
    """Write ``final/`` at ``path`` from the servers: the model as sharded safetensors of at
    most ``final_shard_mb`` each (or the PEFT adapter), one tensor at a time through
    ``tensor(name, shape)``, written to a scratch folder and published whole (a bucket's
    ``final/`` appears complete or not at all). ``model`` and ``peft`` are the job's
    sections: they build the model (on the meta device) whose layout is written."""
    from diloco_ray.data import tokenization
    from diloco_ray.model import loading as modeling
    from diloco_ray.persist import staging

    tokenizer = tokenization.load_tokenizer(model)
    meta = modeling.meta_model(model, peft, tokenizer)

    def write(folder: str) -> None:
        if peft.use_peft:
            adapter = {n: torch.from_numpy(tensor(n, s)) for n, s in shapes.items()}
            save_adapter(folder, meta, tokenizer, adapter)
        else:
            save_model(folder, meta, tokenizer, shapes, lambda n: tensor(n, shapes[n]), int(final_shard_mb * 2**20))

    files.replace_folder(staging.scratch(path), write)
    staging.publish_tree(path)
    return path
