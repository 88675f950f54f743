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
from typing import Callable, Optional

import numpy as np
import torch

from diloco_ray import sources
from diloco_ray.config import TrainerConfig
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

    def batch(self, idx: np.ndarray, dynamic: bool = False) -> dict[str, torch.Tensor]:
        """``input_ids``, ``labels``, ``attention_mask`` for samples ``idx``; with
        ``dynamic``, cut to the longest of them instead of ``seq_len``."""
        width = int(self.lengths[idx].max()) if dynamic and len(idx) else self.input_ids.shape[1]
        ids = torch.from_numpy(self.input_ids[idx, :width])
        mask = torch.from_numpy((np.arange(width)[None, :] < self.lengths[idx, None]).astype(np.int64))
        return {"input_ids": ids, "labels": torch.from_numpy(self.labels[idx, :width]), "attention_mask": mask}


class TokenData:
    """Training and eval samples of a job.

    Args:
        train: training samples.
        eval: eval samples (may be empty).
    """

    def __init__(self, train: Samples, eval: Samples):
        self.train, self.eval = train, eval


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
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    return dataset.map(tokenize_and_pack, batched=True, batch_size=1000,
                       remove_columns=dataset.column_names, desc="tokenise+pack")


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


def row_formatter(config: TrainerConfig, columns: list[str], source: str) -> Optional[Callable[[dict], tuple[str, str]]]:
    """``row -> (prompt, completion)`` from the templates or functions, or None for plain
    text. A template naming a missing column is a DataError listing the columns."""
    if config.prompt_func or config.completion_func:
        prompt_fn = load_function(config.prompt_func, "prompt_func")
        completion_fn = load_function(config.completion_func, "completion_func")
        return lambda row: (str(prompt_fn(row)), str(completion_fn(row)))
    if config.prompt_template is None:
        return None

    def fill(field: str, template: str, row: dict) -> str:
        try:
            return template.format(**row)
        except KeyError as e:
            raise DataError(f"{field}: '{template}' names column {e} which {source} does not have; "
                            f"columns: {columns}") from None
        except (IndexError, ValueError) as e:
            raise ConfigError(f"{field}: '{template}' is not a usable format string ({e})") from None

    return lambda row: (fill("prompt_template", config.prompt_template, row),
                        fill("completion_template", config.completion_template, row))


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

    return dataset.map(encode, batched=True, batch_size=1000, remove_columns=dataset.column_names,
                       desc="tokenise prompt+completion")


def _to_samples(dataset, seq_len: int, pad_id: int, packed: bool) -> Samples:
    if len(dataset) == 0:
        empty = np.zeros((0, seq_len), dtype=np.int64)
        return Samples(empty, empty.copy(), np.zeros(0, dtype=np.int64))
    if packed:
        ids = np.asarray(dataset.with_format("numpy")["input_ids"], dtype=np.int64)
        return Samples(ids, ids, np.full(len(ids), seq_len, dtype=np.int64))
    n = len(dataset)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    lengths = np.zeros(n, dtype=np.int64)
    for i, row in enumerate(dataset):
        k = len(row["input_ids"])
        ids[i, :k], labels[i, :k], lengths[i] = row["input_ids"], row["labels"], k
    return Samples(ids, labels, lengths)


def load_token_data(config: TrainerConfig, tokenizer) -> TokenData:
    """Load both splits and turn them into samples as configured."""
    train_raw, eval_raw = sources.load_raw_splits(config)
    name = f"'{config.json_file_path or config.dataset_name}'"
    out = []
    for raw, source in ((train_raw, name), (eval_raw, f"{name} (eval split)")):
        formatter = row_formatter(config, raw.column_names, source)
        if formatter is None:
            field = sources.resolve_text_field(raw.column_names, config.text_field, source,
                                               sources.string_columns(raw))
            tokenized = pack_texts(raw, tokenizer, field, config.seq_len)
        else:
            if len(raw):
                formatter(raw[0])  # a template naming a missing column fails here, with the columns
            tokenized = tokenize_pairs(raw, tokenizer, formatter, config.seq_len)
        out.append(_to_samples(tokenized, config.seq_len, tokenizer.pad_token_id, packed=formatter is None))
    if len(out[0]) == 0:
        raise DataError(f"seq_len: {name} yields no training sample (fewer than seq_len={config.seq_len} "
                        "tokens of text, or prompts that fill seq_len); lower seq_len or use more data")
    return TokenData(*out)
