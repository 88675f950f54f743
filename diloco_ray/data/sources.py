"""Where training rows come from: builtin generators, local files and folders, the hub.

This module owns turning a :class:`~diloco_ray.config.sections.DataSection` into two
``datasets.Dataset`` splits (train, eval) of raw rows, and finding the text column.
``builtin:arithmetic`` is generated offline; ``json_file_path`` and ``dataset_name:
json|csv|text|parquet`` with ``dataset_kwargs: {data_files: ...}`` read local files; a
folder written by ``save_to_disk`` loads with ``load_from_disk``; anything else goes to
``datasets.load_dataset(dataset_name, subset, split=...)`` (split slices such as
``train[:1000]`` work). Errors name the field and, for columns, list what is there.
"""

from __future__ import annotations

import os
import random
from typing import Any, Callable

from diloco_ray.config.sections import DataSection
from diloco_ray.errors import ConfigError, DataError, first_line

# ---------------------------------------------------------------------------------------
# Builtin data sets (generated, offline)
# ---------------------------------------------------------------------------------------


def arithmetic_rows(num_samples: int = 20000, digits: int = 1, seed: int = 0) -> list[dict]:
    """Rows ``{"text": "a+b=c", "question": "a+b", "answer": "c"}`` with a, b < 10**digits.

    A task with a checkable answer, so a user can watch a tiny model learn it: with one
    digit a 2-layer model gets most sums right within a couple of minutes on a CPU.
    """
    rng = random.Random(seed)
    hi = 10**digits - 1
    rows = []
    for _ in range(num_samples):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        rows.append({"text": f"{a}+{b}={a + b}", "question": f"{a}+{b}", "answer": str(a + b)})
    return rows


BUILTIN_DATASETS: dict[str, Callable[..., list[dict]]] = {"builtin:arithmetic": arithmetic_rows}

# Eval rows of a builtin come from another seed, so they are not the training rows.
_EVAL_SEED_OFFSET = 1_000_003


def _builtin_splits(data: DataSection):
    import datasets

    gen = BUILTIN_DATASETS.get(data.dataset_name)
    if gen is None:
        raise ConfigError(
            f"dataset_name: unknown builtin '{data.dataset_name}'; allowed: {', '.join(BUILTIN_DATASETS)}"
        )
    kwargs = dict(data.dataset_kwargs)
    try:
        train = gen(seed=data.seed, **kwargs)
        n_eval = max(64, int(len(train) * data.split_ratio))
        eval_rows = gen(seed=data.seed + _EVAL_SEED_OFFSET, **{**kwargs, "num_samples": n_eval})
    except TypeError as e:
        raise ConfigError(f"dataset_kwargs: {e} (for {data.dataset_name})") from None
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(eval_rows)


# ---------------------------------------------------------------------------------------
# Loading from files, folders and the hub
# ---------------------------------------------------------------------------------------


def is_builtin(data: DataSection) -> bool:
    """Whether the rows are generated here (``builtin:``), not read from anywhere."""
    return data.dataset_name is not None and data.dataset_name.startswith("builtin:")


def load_raw_splits(data: DataSection):
    """(train, eval) ``datasets.Dataset`` objects for the configured source."""
    import datasets

    if is_builtin(data):
        return _builtin_splits(data)
    if data.json_file_path is not None:
        path = data.json_file_path
        if not os.path.isfile(path):
            raise DataError(f"json_file_path: '{path}' does not exist or is not a file")
        if data.eval_split is not None:
            raise ConfigError(
                "eval_split: a json_file_path has a single split; leave eval_split unset to hold out split_ratio of it"
            )
        full = _guarded(
            "json_file_path",
            path,
            lambda: datasets.load_dataset("json", data_files=path, split="train", **data.dataset_kwargs),
        )
        return _hold_out(full, data, "json_file_path", path)

    name = data.dataset_name
    if (
        os.path.isdir(name)
        and os.path.exists(os.path.join(name, "dataset_dict.json"))
        or os.path.exists(os.path.join(name, "state.json"))
    ):
        return _from_disk(name, data)

    def load(split):
        return _guarded(
            "dataset_name",
            name,
            lambda: datasets.load_dataset(name, data.subset, split=split, **data.dataset_kwargs),
        )

    train = load(data.dataset_split)
    if data.eval_split is not None:
        return train, load(data.eval_split)
    return _hold_out(train, data, "dataset_name", name)


def load_stream(data: DataSection):
    """(train stream, eval ``Dataset``) for ``streaming: true``.

    The train stream is a ``datasets.IterableDataset`` read lazily (nothing is downloaded
    whole). Eval rows are ``eval_split``'s first ``streaming_eval_rows``, or, without an
    eval split, the first ``streaming_eval_rows`` rows of the training split, which the
    train stream then skips.
    """
    import datasets

    field, source, load = _stream_opener(data)
    n = data.streaming_eval_rows
    train = _guarded(field, source, lambda: load(data.dataset_split))
    if data.eval_split is not None:
        eval_rows = list(_guarded("eval_split", source, lambda: load(data.eval_split)).take(n))
    else:
        eval_rows = list(train.take(n))
        train = train.skip(n)
    if not eval_rows:
        raise DataError(f"{field}: '{source}' yielded no rows to evaluate on")
    return train, datasets.Dataset.from_list(eval_rows)


def _stream_opener(data: DataSection) -> tuple[str, str, Callable[[str], Any]]:
    """``(field, source, open)`` of a streamed dataset: the field naming it, its path or
    hub id, and ``open(split)`` giving that split as a ``datasets.IterableDataset``."""
    import datasets

    if data.json_file_path is not None:
        source = data.json_file_path
        if not os.path.isfile(source):
            raise DataError(f"json_file_path: '{source}' does not exist or is not a file")

        def load_json(split):
            return datasets.load_dataset(
                "json", data_files=source, split="train", streaming=True, **data.dataset_kwargs
            )

        return "json_file_path", source, load_json
    source = data.dataset_name
    if (
        source.startswith("builtin:")
        or os.path.exists(os.path.join(source, "state.json"))
        or os.path.exists(os.path.join(source, "dataset_dict.json"))
    ):
        raise ConfigError(f"streaming: '{source}' is already in memory or on disk; set streaming: false")

    def load(split):
        return datasets.load_dataset(source, data.subset, split=split, streaming=True, **data.dataset_kwargs)

    return "dataset_name", source, load


def _from_disk(path: str, data: DataSection):
    import datasets

    loaded = _guarded("dataset_name", path, lambda: datasets.load_from_disk(path))
    if isinstance(loaded, datasets.DatasetDict):
        if data.dataset_split not in loaded:
            raise DataError(f"dataset_split: '{data.dataset_split}' is not a split of '{path}'; splits: {list(loaded)}")
        train = loaded[data.dataset_split]
        if data.eval_split is not None:
            if data.eval_split not in loaded:
                raise DataError(f"eval_split: '{data.eval_split}' is not a split of '{path}'; splits: {list(loaded)}")
            return train, loaded[data.eval_split]
        return _hold_out(train, data, "dataset_name", path)
    return _hold_out(loaded, data, "dataset_name", path)


def _hold_out(full, data: DataSection, field: str, source: str):
    if len(full) < 2:
        raise DataError(
            f"{field}: '{source}' has {len(full)} rows; at least 2 are needed (one to train on, one to evaluate)"
        )
    parts = full.train_test_split(test_size=data.split_ratio, seed=data.seed)
    return parts["train"], parts["test"]


def _guarded(field: str, source: str, load: Callable):
    try:
        return load()
    except TypeError as e:  # load_dataset passes dataset_kwargs on to the builder
        raise ConfigError(f"dataset_kwargs: not accepted when loading '{source}' ({first_line(e)[:300]})") from None
    except FileNotFoundError as e:
        raise DataError(f"{field}: '{source}' not found ({first_line(e)[:300]})") from None
    except (ValueError, OSError, ConnectionError) as e:
        raise DataError(f"{field}: cannot load '{source}': {first_line(e)[:300]}") from None


def resolve_text_field(
    columns: list[str], text_field: str | None, source: str, string_columns: list[str] | None = None
) -> str:
    """The column holding the text: ``text_field`` if given, else 'text', else the only
    string column. Errors list the columns so the user can pick one.

    Args:
        columns: every column of the data set.
        text_field: the configured column, or None to detect it.
        source: how to name the data set in errors.
        string_columns: the columns holding strings (default: all of them).
    """
    if text_field is not None:
        if text_field not in columns:
            raise DataError(f"text_field: '{text_field}' is not a column of {source}; columns: {columns}")
        return text_field
    if "text" in columns:
        return "text"
    strings = columns if string_columns is None else string_columns
    if len(strings) == 1:
        return strings[0]
    raise DataError(f"text_field: not set and {source} has no 'text' column; set text_field to one of {columns}")


FIRST_RECORD_BYTES = 1 << 20  # a first record longer than this is left to the tokenising task


def first_json_record(path: str) -> dict | None:
    """The first record of a JSON Lines file, or None where the file does not start with
    one JSON object on a line of its own (a ``.json`` array, a pretty-printed object):
    reading those would mean reading the whole file, so the tokenising task judges them."""
    import json

    with open(path, "rb") as f:
        head = f.read(FIRST_RECORD_BYTES)
    for line in head.splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                return None
            return row if isinstance(row, dict) else None
    return None


# ---------------------------------------------------------------------------------------
# Tokenising and packing
# ---------------------------------------------------------------------------------------


def string_columns(dataset) -> list[str]:
    """The columns of ``dataset`` that hold strings."""
    return [
        name
        for name, feature in dataset.features.items()
        if getattr(feature, "dtype", None) in ("string", "large_string")
    ]
