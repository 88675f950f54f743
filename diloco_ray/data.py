"""Training data: loading, tokenising and packing, and which replica reads what.

Two halves:

* **Loading** (:func:`load_token_blocks`): a data set from ``datasets.load_dataset``, a
  folder saved with ``save_to_disk``, a local JSON/JSONL file, or a builtin generator
  (``builtin:arithmetic``, no network) is tokenised and packed into fixed ``seq_len``
  blocks with ``datasets.map`` (so the work is cached by ``datasets``, not redone per
  round or per rank).
* **The data plan** (pure functions over integers): the training stream is an endless
  sequence of block indices, one seeded permutation per epoch. The parameter server owns
  a :class:`DataCursor` into it: a frontier, plus ranges that were handed out but never
  applied (a replica died, was late, or was rejected). Each round, replica slot ``s``
  gets the ``s``-th batch of ranges: returned ranges first, then fresh ones from the
  frontier. Only the ranges of applied replicas are committed, so with any history of
  joins, drops, retries and resumes every stream position is trained on exactly once.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from diloco_ray.config import TrainerConfig
from diloco_ray.errors import ConfigError, DataError

# ---------------------------------------------------------------------------------------
# Builtin data sets (generated, offline)
# ---------------------------------------------------------------------------------------


def arithmetic_rows(num_samples: int = 20000, digits: int = 1, seed: int = 0) -> list[dict]:
    """Rows ``{"text": "a+b=c", "question": "a+b", "answer": "c"}`` with a, b < 10**digits.

    A task with a checkable answer, so a user can watch a tiny model learn it: with one
    digit a 2-layer model gets most sums right within a couple of minutes on a CPU.
    """
    rng = random.Random(seed)
    hi = 10 ** digits - 1
    rows = []
    for _ in range(num_samples):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        rows.append({"text": f"{a}+{b}={a + b}", "question": f"{a}+{b}", "answer": str(a + b)})
    return rows


BUILTIN_DATASETS: dict[str, Callable[..., list[dict]]] = {"builtin:arithmetic": arithmetic_rows}

# Eval rows of a builtin come from another seed, so they are not the training rows.
_EVAL_SEED_OFFSET = 1_000_003


def _builtin_splits(config: TrainerConfig):
    import datasets

    gen = BUILTIN_DATASETS.get(config.dataset_name)
    if gen is None:
        raise ConfigError(f"dataset_name: unknown builtin '{config.dataset_name}'; "
                          f"allowed: {', '.join(BUILTIN_DATASETS)}")
    kwargs = dict(config.dataset_kwargs)
    try:
        train = gen(seed=config.seed, **kwargs)
        n_eval = max(64, int(len(train) * config.split_ratio))
        eval_rows = gen(seed=config.seed + _EVAL_SEED_OFFSET, **{**kwargs, "num_samples": n_eval})
    except TypeError as e:
        raise ConfigError(f"dataset_kwargs: {e} (for {config.dataset_name})") from None
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(eval_rows)


# ---------------------------------------------------------------------------------------
# Loading from files, folders and the hub
# ---------------------------------------------------------------------------------------


def load_raw_splits(config: TrainerConfig):
    """(train, eval) ``datasets.Dataset`` objects for the configured source."""
    import datasets

    if config.dataset_name is not None and config.dataset_name.startswith("builtin:"):
        return _builtin_splits(config)
    if config.json_file_path is not None:
        path = config.json_file_path
        if not os.path.isfile(path):
            raise DataError(f"json_file_path: '{path}' does not exist or is not a file")
        if config.eval_split is not None:
            raise ConfigError("eval_split: a json_file_path has a single split; leave eval_split unset "
                              "to hold out split_ratio of it")
        full = _guarded("json_file_path", path, lambda: datasets.load_dataset(
            "json", data_files=path, split="train", **config.dataset_kwargs))
        return _hold_out(full, config, "json_file_path", path)

    name = config.dataset_name
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")) or \
            os.path.exists(os.path.join(name, "state.json")):
        return _from_disk(name, config)

    def load(split):
        return _guarded("dataset_name", name, lambda: datasets.load_dataset(
            name, config.subset, split=split, **config.dataset_kwargs))

    train = load(config.dataset_split)
    if config.eval_split is not None:
        return train, load(config.eval_split)
    return _hold_out(train, config, "dataset_name", name)


def _from_disk(path: str, config: TrainerConfig):
    import datasets

    loaded = _guarded("dataset_name", path, lambda: datasets.load_from_disk(path))
    if isinstance(loaded, datasets.DatasetDict):
        if config.dataset_split not in loaded:
            raise DataError(f"dataset_split: '{config.dataset_split}' is not a split of '{path}'; "
                            f"splits: {list(loaded)}")
        train = loaded[config.dataset_split]
        if config.eval_split is not None:
            if config.eval_split not in loaded:
                raise DataError(f"eval_split: '{config.eval_split}' is not a split of '{path}'; "
                                f"splits: {list(loaded)}")
            return train, loaded[config.eval_split]
        return _hold_out(train, config, "dataset_name", path)
    return _hold_out(loaded, config, "dataset_name", path)


def _hold_out(full, config: TrainerConfig, field: str, source: str):
    if len(full) < 2:
        raise DataError(f"{field}: '{source}' has {len(full)} rows; at least 2 are needed "
                        "(one to train on, one to evaluate)")
    parts = full.train_test_split(test_size=config.split_ratio, seed=config.seed)
    return parts["train"], parts["test"]


def _guarded(field: str, source: str, load: Callable):
    try:
        return load()
    except FileNotFoundError as e:
        raise DataError(f"{field}: '{source}' not found ({_short(e)})") from None
    except (ValueError, OSError, ConnectionError) as e:
        raise DataError(f"{field}: cannot load '{source}': {_short(e)}") from None


def _short(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def resolve_text_field(columns: list[str], text_field: str | None, source: str,
                       string_columns: list[str] | None = None) -> str:
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
    raise DataError(f"text_field: not set and {source} has no 'text' column; "
                    f"set text_field to one of {columns}")


# ---------------------------------------------------------------------------------------
# Tokenising and packing
# ---------------------------------------------------------------------------------------


def pack_texts(dataset, tokenizer, text_field: str, seq_len: int):
    """Tokenise ``text_field`` and pack into rows of exactly ``seq_len`` token ids.

    Documents are joined with the eos token and cut into blocks, as in transformers'
    ``run_clm``; the tail of each map batch shorter than ``seq_len`` is dropped.
    """
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        flat = [t for doc in ids for t in (*doc, eos)]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    return dataset.map(tokenize_and_pack, batched=True, batch_size=1000,
                       remove_columns=dataset.column_names, desc="tokenise+pack")


class TokenBlocks:
    """Packed ``[n, seq_len]`` int64 token blocks for training and eval.

    Args:
        train: training blocks.
        eval: eval blocks (may be empty).
    """

    def __init__(self, train: np.ndarray, eval: np.ndarray):
        self.train = train
        self.eval = eval


def load_token_blocks(config: TrainerConfig, tokenizer) -> TokenBlocks:
    """Load, tokenise and pack both splits as configured."""
    train_raw, eval_raw = load_raw_splits(config)
    source = f"'{config.json_file_path or config.dataset_name}'"
    field = resolve_text_field(train_raw.column_names, config.text_field, source, _string_columns(train_raw))
    train = _as_array(pack_texts(train_raw, tokenizer, field, config.seq_len), config.seq_len)
    eval_field = resolve_text_field(eval_raw.column_names, config.text_field, f"{source} (eval split)",
                                    _string_columns(eval_raw))
    evals = _as_array(pack_texts(eval_raw, tokenizer, eval_field, config.seq_len), config.seq_len)
    if len(train) == 0:
        raise DataError(f"seq_len: {source} holds fewer than seq_len={config.seq_len} tokens; "
                        "lower seq_len or use more data")
    return TokenBlocks(train, evals)


def _string_columns(dataset) -> list[str]:
    return [name for name, feature in dataset.features.items()
            if getattr(feature, "dtype", None) in ("string", "large_string")]


def _as_array(dataset, seq_len: int) -> np.ndarray:
    if len(dataset) == 0:
        return np.zeros((0, seq_len), dtype=np.int64)
    return np.asarray(dataset.with_format("numpy")["input_ids"], dtype=np.int64)


# ---------------------------------------------------------------------------------------
# The data plan: pure functions over integers
# ---------------------------------------------------------------------------------------


def epoch_permutation(num_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the ``num_blocks`` training blocks."""
    return np.random.default_rng([seed, epoch]).permutation(num_blocks)


def stream_indices(start: int, count: int, num_blocks: int, seed: int) -> np.ndarray:
    """Block indices at positions ``[start, start + count)`` of the endless training stream."""
    positions = np.arange(start, start + count)
    epochs = positions // num_blocks
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = epoch_permutation(num_blocks, seed, int(epoch))[positions[mask] % num_blocks]
    return out


Range = tuple[int, int]  # (start, count) of stream positions


@dataclass
class DataCursor:
    """Where the training stream stands.

    Args:
        frontier: every position before it has been handed out at least once.
        returned: ranges handed out but not applied, to be handed out again first
            (sorted, non-overlapping).
    """

    frontier: int = 0
    returned: list[Range] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"frontier": self.frontier, "returned": [list(r) for r in self.returned]}

    @classmethod
    def from_dict(cls, d: dict) -> "DataCursor":
        return cls(int(d["frontier"]), [(int(s), int(c)) for s, c in d["returned"]])


def _normalise(ranges: list[Range]) -> list[Range]:
    """Sorted, with adjacent or overlapping ranges merged and empty ones dropped."""
    out: list[list[int]] = []
    for start, count in sorted(r for r in ranges if r[1] > 0):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][0] + out[-1][1], start + count) - out[-1][0]
        else:
            out.append([start, count])
    return [(s, c) for s, c in out]


def plan_round(cursor: DataCursor, slots: int, per_replica: int) -> list[list[Range]]:
    """The ranges each of ``slots`` replicas trains on this round (``per_replica`` each):
    returned ranges first, in order, then fresh positions from the frontier."""
    returned = list(cursor.returned)
    frontier = cursor.frontier
    plans = []
    for _ in range(slots):
        need, mine = per_replica, []
        while need and returned:
            start, count = returned[0]
            take = min(need, count)
            mine.append((start, take))
            need -= take
            returned[0] = (start + take, count - take)
            if returned[0][1] == 0:
                returned.pop(0)
        if need:
            mine.append((frontier, need))
            frontier += need
        plans.append(_normalise(mine))
    return plans


def commit_round(cursor: DataCursor, plans: list[list[Range]], applied: list[bool]) -> DataCursor:
    """The cursor after a round in which ``plans[i]`` was applied iff ``applied[i]``.

    Everything handed out is taken off the cursor; what was not applied goes back to
    ``returned``, so the next round hands it out again.
    """
    handed = [r for plan in plans for r in plan]
    fresh_end = max([s + c for s, c in handed if s + c > cursor.frontier] + [cursor.frontier])
    leftover = _subtract(cursor.returned, handed)
    back = [r for plan, ok in zip(plans, applied) if not ok for r in plan]
    return DataCursor(fresh_end, _normalise(leftover + back))


def _subtract(ranges: list[Range], taken: list[Range]) -> list[Range]:
    """The parts of ``ranges`` not covered by ``taken`` (interval arithmetic)."""
    out = []
    for start, count in ranges:
        pieces = [(start, start + count)]
        for t_start, t_count in taken:
            t_end = t_start + t_count
            pieces = [piece for a, b in pieces
                      for piece in ([(a, b)] if t_end <= a or t_start >= b else
                                    [p for p in ((a, min(b, t_start)), (max(a, t_end), b)) if p[1] > p[0]])]
        out.extend((a, b - a) for a, b in pieces)
    return _normalise(out)


def plan_indices(plan: list[Range], num_blocks: int, seed: int) -> np.ndarray:
    """Block indices of a replica's plan, in order."""
    if not plan:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([stream_indices(s, c, num_blocks, seed) for s, c in plan])


def rank_batches(plan: list[Range], config: TrainerConfig, rank: int, num_blocks: int) -> list[list[np.ndarray]]:
    """The micro-batches one rank trains on in one round: ``[step][micro] -> block indices``.

    A replica's plan is consumed step by step; inside a step, micro-batch ``m`` of rank
    ``j`` is the ``(m * ranks + j)``-th run of ``batch_size`` blocks. One replica with one
    rank therefore reads its plan in order, which makes DiLoCo with one replica
    comparable batch for batch with a plain training loop.
    """
    ranks, bs, accum = config.ranks_per_replica, config.batch_size, config.grad_accum
    indices = plan_indices(plan, num_blocks, config.seed)
    if len(indices) != config.sequences_per_replica_round:
        raise ValueError(f"plan holds {len(indices)} positions, a round needs {config.sequences_per_replica_round}")
    steps = []
    for t in range(config.max_steps):
        micro = []
        for m in range(accum):
            offset = ((t * accum + m) * ranks + rank) * bs
            micro.append(indices[offset:offset + bs])
        steps.append(micro)
    return steps


def eval_batches_for_rank(num_eval_blocks: int, eval_batches: int, batch_size: int,
                          rank: int, ranks: int) -> list[np.ndarray]:
    """The eval batches rank ``rank`` scores: a fixed prefix of the eval split, so every
    round's eval loss is measured on the same sequences."""
    out = []
    for b in range(rank, eval_batches, ranks):
        idx = np.arange(b * batch_size, min((b + 1) * batch_size, num_eval_blocks))
        if len(idx):
            out.append(idx)
    return out
