"""States as files, never pickle: any nesting of dicts, lists, tuples, tensors and scalars
as one safetensors file and one JSON skeleton.

A state (any nesting of dicts with str/int keys, lists, tuples, tensors, ints, floats,
bools, None and strs, e.g. a ``torch.optim`` state dict) is split by :func:`flatten_state`
into a flat tensor dict, stored as safetensors, and a JSON *skeleton* that records the
structure exactly (int keys, tuples, inf/nan floats); :func:`unflatten_state` puts it back.
Every write goes to a sibling temp file and is renamed into place. Checkpoint folders
(:mod:`diloco_ray.persist.checkpoint`) and in-flight snapshots are built from these.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from typing import Any, Mapping

import torch
from torch import Tensor

from diloco_ray import files
from diloco_ray.errors import DataError

FORMAT = 1  # of a state file and of a checkpoint's manifest
_CHUNK = 1 << 20

# Skeleton tags. Every JSON object in a skeleton is exactly one of these single-key
# objects, so user dict keys (even ones spelled like a tag) can never be misread as one.
_DICT = "$dict"  # dict with str keys only: {"$dict": {key: value}}
_ITEMS = "$items"  # dict with any int key: {"$items": [[key, value], ...]} keeps key types
_TUPLE = "$tuple"  # {"$tuple": [...]}; plain JSON lists are Python lists
_TENSOR = "$tensor"  # {"$tensor": "key in the flat tensor dict"}
_FLOAT = "$float"  # {"$float": "inf" | "-inf" | "nan"}; JSON has no literal for these


def flatten_state(state: Any, prefix: str = "") -> tuple[dict[str, Tensor], Any]:
    """Split a nested state into a flat tensor dict and a JSON-serialisable skeleton.

    Args:
        state: any nesting of dicts (str or int keys), lists, tuples, tensors, ints,
            floats (inf/nan included), bools, None and strs.
        prefix: first component of every tensor key (``"opt"`` gives ``"opt.state.0.step"``);
            lets several states share one tensor file without clashing.

    Returns:
        ``(tensors, skeleton)``: tensor keys are the dotted paths to each tensor (with a
        ``#n`` suffix when two paths would spell the same key, e.g. int key 0 and str key
        "0"); the tensors are the caller's own objects, not copies. The skeleton survives
        ``json.loads(json.dumps(skeleton))`` and :func:`unflatten_state` rebuilds ``state``.

    Raises:
        TypeError: a value or dict key of an unsupported type, named by its path.
    """
    flattener = _Flattener(prefix)
    skeleton = flattener.walk(state, [])
    return flattener.tensors, skeleton


class _Flattener:
    """One :func:`flatten_state` walk: the skeleton it returns, the tensors it collects.

    Args:
        prefix: as for :func:`flatten_state`.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.tensors: dict[str, Tensor] = {}

    def walk(self, obj: Any, path: list[str]) -> Any:
        """The skeleton of ``obj`` found at ``path``, its tensors added on the way."""
        if isinstance(obj, Tensor):
            return {_TENSOR: self._add(obj, path)}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return _leaf(obj)
        if isinstance(obj, tuple):
            return {_TUPLE: [self.walk(v, path + [str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.walk(v, path + [str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):
            return self._mapping(obj, path)
        raise TypeError(f"cannot checkpoint {_where(path)}: a {type(obj).__name__} is not a supported type")

    def _add(self, tensor: Tensor, path: list[str]) -> str:
        """Keep ``tensor`` under a key of its own, spelled from ``path``; the key."""
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise TypeError(f"cannot checkpoint {_where(path)}: {tensor.layout} tensors are not supported")
        parts = ([self.prefix] if self.prefix else []) + path
        key = ".".join(parts) if parts else "root"
        if key in self.tensors:
            n = 1
            while f"{key}#{n}" in self.tensors:
                n += 1
            key = f"{key}#{n}"
        self.tensors[key] = tensor
        return key

    def _mapping(self, obj: Mapping, path: list[str]) -> dict:
        """A dict's skeleton: ``$dict`` when every key is a str, else ``$items`` (int keys kept)."""
        for k in obj:
            if not isinstance(k, (str, int)):
                raise TypeError(
                    f"cannot checkpoint {_where(path)}: dict key {k!r} is a {type(k).__name__}, "
                    "only str and int keys are supported"
                )
        if all(isinstance(k, str) for k in obj):
            return {_DICT: {k: self.walk(v, path + [k]) for k, v in obj.items()}}
        return {_ITEMS: [[k, self.walk(v, path + [str(k)])] for k, v in obj.items()]}


def _leaf(obj: None | bool | int | float | str) -> Any:
    """A scalar's skeleton: itself as the plain JSON type, a tag for a non-finite float."""
    # bool before int: bool is an int subclass and must come back as a bool.
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, str):
        return str(obj)
    value = float(obj)
    if math.isfinite(value):
        return value
    return {_FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def _where(path: list[str]) -> str:
    return ".".join(path) or "<root>"


def unflatten_state(tensors: Mapping[str, Tensor], skeleton: Any) -> Any:
    """Rebuild the state that :func:`flatten_state` split into ``(tensors, skeleton)``.

    Args:
        tensors: the flat tensor dict (e.g. from :func:`load_tensors`); may hold extra keys.
        skeleton: the skeleton, possibly after a JSON round trip.

    Returns:
        The nested state, with the tensors from ``tensors`` (not copied) in place.

    Raises:
        DataError: the skeleton is malformed or names a tensor that ``tensors`` lacks.
    """
    return _rebuild(skeleton, tensors)


def _rebuild(node: Any, tensors: Mapping[str, Tensor]) -> Any:
    """The value a skeleton ``node`` stands for (see :func:`unflatten_state`)."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_rebuild(v, tensors) for v in node]
    if not (isinstance(node, dict) and len(node) == 1):
        raise DataError(f"malformed checkpoint skeleton: unexpected {type(node).__name__} {_short(node)}")
    ((tag, body),) = node.items()
    if tag == _TENSOR and isinstance(body, str):
        if body not in tensors:
            raise DataError(f"checkpoint skeleton refers to tensor {body!r}, missing from the tensor file")
        return tensors[body]
    if tag == _DICT and isinstance(body, dict):
        return {k: _rebuild(v, tensors) for k, v in body.items()}
    if tag == _ITEMS and isinstance(body, list):
        out: dict[Any, Any] = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                raise DataError(f"malformed checkpoint skeleton: bad dict item {_short(item)}")
            out[item[0]] = _rebuild(item[1], tensors)
        return out
    if tag == _TUPLE and isinstance(body, list):
        return tuple(_rebuild(v, tensors) for v in body)
    if tag == _FLOAT and body in ("inf", "-inf", "nan"):
        return float(body)
    raise DataError(f"malformed checkpoint skeleton: unknown node {_short(node)}")


def _short(obj: Any, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def save_tensors(path: str, tensors: Mapping[str, Tensor]) -> None:
    """Write ``tensors`` to a safetensors file at ``path`` (replaced atomically).

    Args:
        path: destination file.
        tensors: str key -> tensor, on any device, any layout of strides. Each is saved
            as a contiguous CPU clone: safetensors refuses non-contiguous tensors and
            tensors sharing storage (views of one buffer, tied weights), and a clone
            gives each its own exact-size buffer.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    copies = {
        str(k): t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for k, t in tensors.items()
    }
    # Write beside the target then rename, so a reader never sees half a file.
    tmp = _sibling_tmp(path)
    try:
        try:
            save_file(copies, tmp)
        except SafetensorError as exc:
            raise _as_os_error(exc, tmp) from exc
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_tensors(path: str) -> dict[str, Tensor]:
    """Read a safetensors file written by :func:`save_tensors` onto the CPU.

    Args:
        path: the ``.safetensors`` file.

    Raises:
        DataError: the file is missing or not a valid safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise DataError(f"checkpoint tensor file {path!r} does not exist")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise DataError(f"checkpoint tensor file {path!r} cannot be read: {exc}") from exc


def save_state(folder: str, name: str, state: Any) -> list[str]:
    """Write ``state`` as ``folder/name.safetensors`` plus ``folder/name.json``.

    Args:
        folder: an existing folder, normally the temp folder from :func:`begin`.
        name: base file name (no extension, no path separators), e.g. ``"global"``.
        state: anything :func:`flatten_state` accepts.

    Returns:
        The two file names written, relative to ``folder``. The safetensors file is
        written even when the state holds no tensors, so every state has both files.
    """
    if not name or name != os.path.basename(name) or name in (".", ".."):
        raise ValueError(f"state name must be a plain file name, got {name!r}")
    tensors, skeleton = flatten_state(state)
    tensor_file, json_file = f"{name}.safetensors", f"{name}.json"
    save_tensors(os.path.join(folder, tensor_file), tensors)
    doc = {"format": FORMAT, "skeleton": skeleton}
    _write_text_atomic(os.path.join(folder, json_file), json.dumps(doc, allow_nan=False, indent=1))
    return [tensor_file, json_file]


def load_state(folder: str, name: str) -> Any:
    """Read back a state written by :func:`save_state`.

    Args:
        folder: the folder holding ``name.json`` and ``name.safetensors``.
        name: the base name given to :func:`save_state`.

    Raises:
        DataError: a file is missing, unreadable, of an unknown format, or inconsistent.
    """
    json_path = os.path.join(folder, f"{name}.json")
    doc = _read_json(json_path, what="checkpoint state")
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and "skeleton" in doc):
        raise DataError(
            f"checkpoint state {json_path!r} has an unsupported format (expected format {FORMAT} with a skeleton)"
        )
    tensors = load_tensors(os.path.join(folder, f"{name}.safetensors"))
    try:
        return unflatten_state(tensors, doc["skeleton"])
    except DataError as exc:
        raise DataError(f"{json_path!r}: {exc}") from exc


def sha256_file(path: str) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB chunks.

    Args:
        path: a readable file.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _as_os_error(exc: Exception, path: str) -> Exception:
    """safetensors reports a failed write as ``SafetensorError('... (os error 28)')``: as
    the ``OSError`` it is, naming the file, so a full disk is recognised as one (see
    :func:`diloco_ray.errors.disk_full`); any other error as it is."""
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code), path)


def _sibling_tmp(path: str) -> str:
    folder, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".part", dir=folder)
    os.close(fd)
    return tmp


def _write_text_atomic(path: str, text: str) -> None:
    files.write_atomic(path, text, mode=0o600)  # owner-only, as the safetensors beside it


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise DataError(f"{what} {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{what} {path!r} is not valid JSON: {exc}") from exc


def _fsync_file(path: str) -> None:
    # Some platforms (Windows) cannot fsync a read-only handle; durability there is best effort.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    # Makes renames and new entries durable on POSIX; directories cannot be opened on Windows.
    if os.name == "nt":
        return
    _fsync_file(path)
