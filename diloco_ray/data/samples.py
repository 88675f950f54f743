"""Rows into token samples: packed plain text, or prompt/completion pairs whose loss is
on the completion only.

* Plain text (``text_field``): documents are joined with eos and cut into ``seq_len``
  blocks, as transformers' ``run_clm`` does; every token is a label.
* Prompt/completion (``prompt_template``/``completion_template``, Python format strings
  over a row's columns, or ``prompt_func``/``completion_func`` as ``module:function``):
  one sample per row, ``prompt + completion + eos`` cut to ``seq_len``; prompt tokens get
  label -100, so the loss is on the completion alone.

Tokenisation runs through ``datasets.map``, so ``datasets`` caches it on disk (keyed by
the data and the function) and ranks or rounds never redo it. :class:`Samples` holds the
result as arrays and cuts batches, padded to ``seq_len`` or, with ``dynamic_batch``, to
the longest sample of the batch.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Optional

import numpy as np

from diloco_ray.config.sections import DataSection, ModelSection
from diloco_ray.data import sources, tokenization
from diloco_ray.errors import ConfigError, DataError

IGNORE = -100  # label of tokens the loss skips (prompt, padding)


class Samples:
    """Token samples as padded arrays.

    Args:
        input_ids: ``[n, seq_len]`` token ids, padded with ``pad_id``.
        labels: ``[n, seq_len]`` labels, ``-100`` where no loss is taken.
        lengths: ``[n]`` real (unpadded) length of each sample.
    """

    def __init__(self, input_ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray):
        self.input_ids, self.labels, self.lengths = input_ids, labels, lengths

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, idx: np.ndarray, dynamic: bool = False) -> dict:
        """``input_ids``, ``labels``, ``attention_mask`` for samples ``idx`` as torch
        tensors; with ``dynamic``, cut to the longest of them instead of ``seq_len``."""
        import torch  # only ranks cut batches (see the module docstring)

        width = int(self.lengths[idx].max()) if dynamic and len(idx) else self.input_ids.shape[1]
        ids = torch.from_numpy(self.input_ids[idx, :width])
        mask = torch.from_numpy((np.arange(width)[None, :] < self.lengths[idx, None]).astype(np.int64))
        return {"input_ids": ids, "labels": torch.from_numpy(self.labels[idx, :width]), "attention_mask": mask}


class TokenData:
    """Training and eval samples of a job.

    Args:
        train: training samples.
        eval: eval samples (may be empty).
        stream: with ``streaming``, the reader the training samples come from (``train``
            is then empty, and each round reads its plan from the stream).
    """

    def __init__(self, train: Samples, eval: Samples, stream: "StreamReader | None" = None):
        self.train, self.eval, self.stream = train, eval, stream


# ---------------------------------------------------------------------------------------


def pack_texts(dataset, tokenizer, text_field: str, seq_len: int):
    """Tokenise ``text_field`` and pack into rows of exactly ``seq_len`` token ids
    (documents joined with eos; the tail of each map batch shorter than ``seq_len`` is
    dropped)."""
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        flat = [t for doc in ids for t in (*doc, eos)]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i : i + seq_len] for i in range(0, n, seq_len)]}

    return dataset.map(
        tokenize_and_pack,
        batched=True,
        batch_size=1000,
        remove_columns=dataset.column_names,
        **_desc(dataset, "tokenise+pack"),
    )


def load_function(spec: str, field: str) -> Callable:
    """The function named ``module:function`` (e.g. ``my_pkg.prompts:build``)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{field}: '{spec}' is not of the form module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}: cannot import '{spec}': {e}") from None
    if not callable(fn):
        raise ConfigError(f"{field}: '{spec}' is not callable")
    return fn


def row_formatter(data: DataSection, columns: list[str], source: str) -> Optional[Callable[[dict], tuple[str, str]]]:
    """``row -> (prompt, completion)`` from the templates or functions, or None for plain
    text. A template naming a missing column is a DataError listing the columns."""
    if data.prompt_func or data.completion_func:
        prompt_fn = load_function(data.prompt_func, "prompt_func")
        completion_fn = load_function(data.completion_func, "completion_func")
        return lambda row: (str(prompt_fn(row)), str(completion_fn(row)))
    if data.prompt_template is None:
        return None

    def fill(field: str, template: str, row: dict) -> str:
        try:
            return template.format(**row)
        except KeyError as e:
            raise DataError(
                f"{field}: '{template}' names column {e} which {source} does not have; columns: {columns}"
            ) from None
        except (IndexError, ValueError) as e:
            raise ConfigError(f"{field}: '{template}' is not a usable format string ({e})") from None

    return lambda row: (
        fill("prompt_template", data.prompt_template, row),
        fill("completion_template", data.completion_template, row),
    )


def check_first_record(data: DataSection) -> None:
    """Check a ``json_file_path``'s first record against the columns the job names (the
    text field, or the prompt/completion templates), with the tokenising task's own rules
    and messages: a misnamed column then fails on the driver in a second, before Ray
    starts. Other sources, and columns only later records lack, are the task's to find."""
    if data.json_file_path is None or data.prompt_func or data.completion_func:
        return
    row = sources.first_json_record(data.json_file_path)
    if row is None:
        return
    name, columns = f"'{data.json_file_path}'", list(row)
    formatter = row_formatter(data, columns, name)
    if formatter is None:
        sources.resolve_text_field(columns, data.text_field, name, [c for c, v in row.items() if isinstance(v, str)])
    else:
        formatter(row)


def tokenize_pairs(dataset, tokenizer, formatter: Callable, seq_len: int):
    """One sample per row: ``prompt + completion + eos`` cut to ``seq_len``, with the
    prompt's labels masked. Rows whose prompt fills ``seq_len`` are dropped (no label)."""
    eos = tokenizer.eos_token_id

    def encode(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        pairs = [formatter(row) for row in rows]
        prompts = tokenizer([p for p, _ in pairs])["input_ids"]  # with BOS, if the tokenizer adds one
        completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
        out = {"input_ids": [], "labels": []}
        for p, c in zip(prompts, completions):
            ids = (p + c + [eos])[:seq_len]
            labels = ([IGNORE] * len(p) + c + [eos])[:seq_len]
            if any(label != IGNORE for label in labels):
                out["input_ids"].append(ids)
                out["labels"].append(labels)
        return out

    return dataset.map(
        encode,
        batched=True,
        batch_size=1000,
        remove_columns=dataset.column_names,
        **_desc(dataset, "tokenise prompt+completion"),
    )


def _desc(dataset, text: str) -> dict:
    # A progress description exists only for map-style data sets (streams map lazily).
    import datasets

    return {"desc": text} if isinstance(dataset, datasets.Dataset) else {}


def _to_samples(dataset, seq_len: int, pad_id: int, packed: bool) -> Samples:
    if len(dataset) == 0:
        empty = np.zeros((0, seq_len), dtype=np.int64)
        return Samples(empty, empty.copy(), np.zeros(0, dtype=np.int64))
    if packed:  # fixed-length rows: one array, no padding
        ids = np.asarray(dataset.with_format("numpy")["input_ids"], dtype=np.int64)
        return Samples(ids, ids, np.full(len(ids), seq_len, dtype=np.int64))
    return _rows_to_samples(list(dataset), seq_len, pad_id)


class StreamReader:
    """Samples of a streamed data set by position in the endless training stream.

    Position ``k`` is the ``k``-th sample of the tokenised stream; epoch ``e`` reads the
    data set shuffled with seed ``seed + e`` (a ``shuffle_buffer``-sized buffer), and the
    next epoch starts where one runs out. The reader moves forward, skipping positions
    other replicas read (tokenising is cheap next to training on a sample); a position
    behind it (a range handed out again after a replica failed) makes it start over.

    Args:
        stream: the training ``IterableDataset`` (raw rows).
        to_samples: turns a raw ``IterableDataset`` into one of ``input_ids``/``labels``.
        data: the job's data section (seed, shuffle_buffer, seq_len).
        pad_id: the tokenizer's pad id.
    """

    def __init__(self, stream, to_samples: Callable, data: DataSection, pad_id: int):
        self.stream, self.to_samples, self.data, self.pad_id = stream, to_samples, data, pad_id
        self._restart()

    def _restart(self) -> None:
        self.position, self.epoch = 0, 0
        self._iter = self._epoch_iter(0)

    def _epoch_iter(self, epoch: int):
        shuffled = self.stream.shuffle(seed=self.data.seed + epoch, buffer_size=self.data.shuffle_buffer)
        return iter(self.to_samples(shuffled))

    def _next(self) -> dict:
        for _ in range(2):
            try:
                return next(self._iter)
            except StopIteration:
                self.epoch += 1
                self._iter = self._epoch_iter(self.epoch)
        raise DataError("streaming: the data set yields no training sample (is it empty, or shorter than seq_len?)")

    def read(self, positions: np.ndarray) -> Samples:
        """The samples at ``positions`` (any order), in that order."""
        wanted = sorted(set(int(p) for p in positions))
        if wanted and wanted[0] < self.position:
            self._restart()
        found = {}
        for p in wanted:
            while self.position < p:
                self._next()
                self.position += 1
            found[p] = self._next()
            self.position += 1
        return _rows_to_samples([found[int(p)] for p in positions], self.data.seq_len, self.pad_id)


def _rows_to_samples(rows: list[dict], seq_len: int, pad_id: int) -> Samples:
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for i, row in enumerate(rows):
        k = len(row["input_ids"])
        ids[i, :k], lengths[i] = row["input_ids"], k
        labels[i, :k] = row["labels"] if "labels" in row else row["input_ids"]
    return Samples(ids, labels, lengths)


def _tokenizer_for(data: DataSection, tokenizer, columns: list[str], string_cols: list[str], source: str):
    """``raw dataset -> tokenised dataset`` as configured (packing or prompt/completion)."""
    formatter = row_formatter(data, columns, source)
    if formatter is None:
        field = sources.resolve_text_field(columns, data.text_field, source, string_cols)
        return lambda raw: pack_texts(raw, tokenizer, field, data.seq_len), True
    return lambda raw: tokenize_pairs(raw, tokenizer, formatter, data.seq_len), False


def open_stream(data: DataSection, tokenizer) -> tuple[StreamReader, Samples]:
    """For ``streaming: true``: a reader over the training stream, and the eval samples."""
    train_stream, eval_raw = sources.load_stream(data)
    name = f"'{data.json_file_path or data.dataset_name}'"
    columns = eval_raw.column_names
    tokenize, packed = _tokenizer_for(data, tokenizer, columns, sources.string_columns(eval_raw), name)
    formatter = row_formatter(data, columns, name)
    if formatter is not None:
        formatter(eval_raw[0])  # a template naming a missing column fails here, with the columns
    evals = _to_samples(tokenize(eval_raw), data.seq_len, tokenizer.pad_token_id, packed)
    return StreamReader(train_stream, tokenize, data, tokenizer.pad_token_id), evals


def prepare_token_data(data: DataSection, model: ModelSection) -> TokenData:
    """A job's samples, tokenised once for all of its ranks: the body of the Ray task the
    driver starts with the replicas (``model`` names the tokenizer)."""
    # As on the ranks: the task's worker process may host a rank later.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return load_token_data(data, tokenization.load_tokenizer(model))


def load_token_data(data: DataSection, tokenizer) -> TokenData:
    """Load both splits and turn them into samples as configured."""
    train_raw, eval_raw = sources.load_raw_splits(data)
    name = f"'{data.json_file_path or data.dataset_name}'"
    out = []
    for raw, source in ((train_raw, name), (eval_raw, f"{name} (eval split)")):
        formatter = row_formatter(data, raw.column_names, source)
        if formatter is not None and len(raw):
            formatter(raw[0])  # a template naming a missing column fails here, with the columns
        tokenize, packed = _tokenizer_for(data, tokenizer, raw.column_names, sources.string_columns(raw), source)
        out.append(_to_samples(tokenize(raw), data.seq_len, tokenizer.pad_token_id, packed))
    if len(out[0]) == 0:
        raise DataError(
            f"seq_len: {name} yields no training sample (fewer than seq_len={data.seq_len} "
            "tokens of text, or prompts that fill seq_len); lower seq_len or use more data"
        )
    return TokenData(*out)
