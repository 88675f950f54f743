"""Unit tests for diloco_ray.data.plan: the data plan (pure integers) and loading/packing from
files made in the test (no network, no Ray)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import DataSection
from diloco_ray.data import plan as data
from diloco_ray.data import samples, sources
from diloco_ray.errors import ConfigError, DataError

MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


def make(**kw) -> DataSection:
    base = dict(model_config=MODEL, tokenizer_name="builtin:char", seq_len=16)
    if "json_file_path" not in kw and "dataset_name" not in kw:
        base["dataset_name"] = "builtin:arithmetic"
    return TrainerConfig(**{**base, **kw}).sections().data


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """Keep datasets' cache (load_dataset of JSON files) inside the test's tmp_path."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", tmp_path / "hf-datasets-cache" / "downloads")


@pytest.fixture(scope="module")
def tok():
    from diloco_ray.data.tokenization import char_tokenizer

    return char_tokenizer()


# --- the endless stream -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_stream_epochs_are_permutations(n):
    idx = data.stream_indices(0, 3 * n, n, seed=5)
    assert idx.dtype == np.int64 and idx.shape == (3 * n,)
    for e in range(3):
        assert sorted(idx[e * n : (e + 1) * n].tolist()) == list(range(n))
    if n >= 7:
        assert not np.array_equal(idx[:n], idx[n : 2 * n])
        assert not np.array_equal(idx[:n], np.arange(n))  # shuffled, not the identity


def test_stream_deterministic_and_seeded():
    a = data.stream_indices(0, 100, 40, seed=1)
    assert np.array_equal(a, data.stream_indices(0, 100, 40, seed=1))
    assert not np.array_equal(a, data.stream_indices(0, 100, 40, seed=2))
    assert np.array_equal(a[:40], data.epoch_permutation(40, 1, 0))
    assert np.array_equal(a[40:80], data.epoch_permutation(40, 1, 1))


@pytest.mark.parametrize("start, count", [(0, 10), (35, 10), (38, 90), (79, 2), (120, 1), (7, 0)])
def test_stream_range_equals_concatenated_pieces(start, count):
    n = 40
    whole = data.stream_indices(0, 200, n, seed=3)
    got = data.stream_indices(start, count, n, seed=3)
    assert np.array_equal(got, whole[start : start + count])
    cut = start + count // 3
    pieces = np.concatenate(
        [data.stream_indices(start, cut - start, n, 3), data.stream_indices(cut, start + count - cut, n, 3)]
    )
    assert np.array_equal(got, pieces)


def positions_of(plan):
    return [p for start, count in plan for p in range(start, start + count)]


def test_plan_round_hands_out_contiguous_fresh_ranges():
    cursor = data.DataCursor(frontier=17)
    assert data.plan_round(cursor, [5] * 3) == [[(17, 5)], [(22, 5)], [(27, 5)]]
    assert data.plan_round(cursor, [5] * 0) == []
    assert cursor == data.DataCursor(17)  # planning changes nothing


def test_plan_round_reissues_returned_ranges_first():
    cursor = data.DataCursor(frontier=40, returned=[(10, 3), (20, 4)])
    plans = data.plan_round(cursor, [5] * 2)
    assert plans == [[(10, 3), (20, 2)], [(22, 2), (40, 3)]]


def test_commit_round_returns_what_was_not_applied():
    cursor = data.DataCursor(frontier=0)
    plans = data.plan_round(cursor, [4] * 3)
    after = data.commit_round(cursor, plans, [True, False, True])
    assert after == data.DataCursor(frontier=12, returned=[(4, 4)])
    nxt = data.plan_round(after, [4] * 2)
    assert nxt == [[(4, 4)], [(12, 4)]]
    assert data.commit_round(after, nxt, [True, True]) == data.DataCursor(frontier=16, returned=[])


def test_any_history_of_drops_uses_every_position_exactly_once():
    rng = np.random.default_rng(0)
    cursor, used = data.DataCursor(), []
    for _ in range(200):
        slots = int(rng.integers(1, 5))
        plans = data.plan_round(cursor, [7] * slots)
        applied = [bool(rng.random() < 0.7) for _ in plans]
        if not any(applied):
            continue  # a round nobody finished is not applied: the cursor stays
        for plan, ok in zip(plans, applied):
            if ok:
                used.extend(positions_of(plan))
        cursor = data.commit_round(cursor, plans, applied)
    returned = positions_of(cursor.returned)
    assert len(used) == len(set(used))  # never repeated
    assert sorted(used + returned) == list(range(cursor.frontier))  # never skipped


def test_cursor_dict_round_trip():
    cursor = data.DataCursor(frontier=9, returned=[(1, 2), (5, 1)])
    assert data.DataCursor.from_dict(cursor.to_dict()) == cursor


# --- what each rank reads -----------------------------------------------------------------


def test_rank_batches_two_ranks_cover_the_round_exactly():
    cfg = make(ranks_per_replica=2, grad_accum=2, batch_size=3, max_steps=2, seed=9)
    assert data.sequences_per_step(cfg) * cfg.max_steps == 24
    num_blocks, start = 30, 11
    per_rank = [data.rank_batches([(start, 24)], cfg, r, num_blocks) for r in range(2)]
    for batches in per_rank:
        assert len(batches) == 2 and all(len(step) == 2 for step in batches)
        assert all(len(mb) == 3 for step in batches for mb in step)
    taken = np.concatenate([mb for batches in per_rank for step in batches for mb in step])
    expected = data.stream_indices(start, 24, num_blocks, cfg.seed)
    assert len(taken) == 24
    # No position of the range is read twice or skipped (positions, not block ids: the
    # range crosses an epoch boundary, so block ids may legitimately repeat).
    positions = []
    for r, batches in enumerate(per_rank):
        for t, step in enumerate(batches):
            for m, mb in enumerate(step):
                off = ((t * 2 + m) * 2 + r) * 3
                assert np.array_equal(mb, expected[off : off + 3])
                positions.extend(range(off, off + 3))
    assert sorted(positions) == list(range(24))
    assert sorted(taken.tolist()) == sorted(expected.tolist())


def test_rank_batches_two_ranks_no_duplicate_blocks_within_an_epoch():
    cfg = make(ranks_per_replica=2, grad_accum=2, batch_size=3, max_steps=2, seed=0)
    num_blocks = 100
    taken = np.concatenate(
        [mb for r in range(2) for step in data.rank_batches([(0, 24)], cfg, r, num_blocks) for mb in step]
    )
    assert len(np.unique(taken)) == 24
    assert set(taken.tolist()) == set(data.stream_indices(0, 24, num_blocks, 0).tolist())


def test_rank_batches_reads_a_split_plan_in_order():
    cfg = make(ranks_per_replica=1, grad_accum=1, batch_size=2, max_steps=3, seed=4)
    plan = [(3, 2), (40, 4)]
    flat = np.concatenate([mb for step in data.rank_batches(plan, cfg, 0, 50) for mb in step])
    assert np.array_equal(flat, np.concatenate([data.stream_indices(3, 2, 50, 4), data.stream_indices(40, 4, 50, 4)]))
    with pytest.raises(ValueError):
        data.rank_batches([(0, 5)], cfg, 0, 50)


def test_rank_batches_one_rank_reads_in_order():
    cfg = make(ranks_per_replica=1, grad_accum=2, batch_size=3, max_steps=2, seed=4)
    start, n = 5, 13
    batches = data.rank_batches([(start, 12)], cfg, 0, n)
    flat = np.concatenate([mb for step in batches for mb in step])
    assert np.array_equal(flat, data.stream_indices(start, 12, n, 4))


# --- eval ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_eval_batches_disjoint_union_is_prefix(ranks):
    per_rank = [data.eval_batches_for_rank(100, 5, 4, r, ranks) for r in range(ranks)]
    all_idx = np.concatenate([b for batches in per_rank for b in batches])
    assert sorted(all_idx.tolist()) == list(range(20))
    assert len(all_idx) == len(set(all_idx.tolist()))
    assert sum(len(b) for b in per_rank) == 5
    assert all(len(x) == 4 for batches in per_rank for x in batches)


def test_eval_batches_hand_values():
    got = data.eval_batches_for_rank(100, 5, 4, rank=1, ranks=2)
    assert [b.tolist() for b in got] == [[4, 5, 6, 7], [12, 13, 14, 15]]


def test_eval_batches_with_few_eval_blocks():
    # 10 blocks, 5 batches of 4 wanted: [0..3], [4..7], [8, 9], then nothing.
    per_rank = [data.eval_batches_for_rank(10, 5, 4, r, 2) for r in range(2)]
    assert [b.tolist() for b in per_rank[0]] == [[0, 1, 2, 3], [8, 9]]
    assert [b.tolist() for b in per_rank[1]] == [[4, 5, 6, 7]]
    assert data.eval_batches_for_rank(0, 5, 4, 0, 1) == []
    assert data.eval_batches_for_rank(100, 0, 4, 0, 1) == []


# --- text field ---------------------------------------------------------------------------


def test_resolve_text_field_explicit():
    assert sources.resolve_text_field(["body", "id"], "body", "'f'") == "body"
    assert sources.resolve_text_field(["text", "body"], "body", "'f'") == "body"


def test_resolve_text_field_explicit_missing():
    with pytest.raises(DataError) as ei:
        sources.resolve_text_field(["body", "id"], "content", "'my.jsonl'")
    msg = str(ei.value)
    assert msg.startswith("text_field:")
    assert "'content'" in msg and "'my.jsonl'" in msg
    assert "body" in msg and "id" in msg


def test_resolve_text_field_auto():
    assert sources.resolve_text_field(["id", "text", "meta"], None, "s") == "text"
    assert sources.resolve_text_field(["content"], None, "s") == "content"


def test_resolve_text_field_ambiguous():
    with pytest.raises(DataError) as ei:
        sources.resolve_text_field(["question", "answer"], None, "'src'")
    msg = str(ei.value)
    assert msg.startswith("text_field:") and "question" in msg and "answer" in msg and "'src'" in msg


# --- packing ------------------------------------------------------------------------------


def test_pack_texts_boundaries(tok):
    import datasets

    docs = ["12+35=47", "a", "hello world, this is a longer document", "", "x y", "9+9=18\n"] * 7
    ds = datasets.Dataset.from_dict({"body": docs, "other": list(range(len(docs)))})
    seq_len = 8
    packed = samples.pack_texts(ds, tok, "body", seq_len)
    assert packed.column_names == ["input_ids"]
    rows = [list(r) for r in packed["input_ids"]]
    assert all(len(r) == seq_len for r in rows)
    eos = tok.eos_token_id
    stream = []
    for d in docs:
        stream.extend(tok(d, add_special_tokens=False)["input_ids"])
        stream.append(eos)
    assert len(rows) == len(stream) // seq_len
    flat = [t for r in rows for t in r]
    assert flat == stream[: len(flat)]
    # Spot-check the start by hand: '1','2','+','3','5','=','4','7' then eos, 'a', eos.
    assert tok.decode(rows[0]) == "12+35=47"
    assert rows[1][:3] == [eos, tok.convert_tokens_to_ids("a"), eos]


def test_pack_texts_too_little_text(tok):
    import datasets

    packed = samples.pack_texts(datasets.Dataset.from_dict({"text": ["abc"]}), tok, "text", 16)
    assert len(packed) == 0


# --- loading from files -------------------------------------------------------------------


def write_jsonl(path, n=40, field="body"):
    rows = [{field: f"document {i}: " + "lorem ipsum " * (i % 4 + 1), "id": i} for i in range(n)]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def json_cfg(tmp_path, path, **kw):
    kw.setdefault("text_field", "body")
    return make(json_file_path=str(path), split_ratio=0.25, **kw)


def test_load_raw_splits_json_holds_out_eval(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = write_jsonl(path, 40)
    train, evals = sources.load_raw_splits(json_cfg(tmp_path, path))
    assert len(train) + len(evals) == 40
    assert len(evals) == 10
    assert set(train.column_names) == {"body", "id"}
    ids = sorted(list(train["id"]) + list(evals["id"]))
    assert ids == list(range(40))
    assert not set(list(train["id"])) & set(list(evals["id"]))
    assert {r["body"] for r in rows} == set(train["body"]) | set(evals["body"])


def test_load_raw_splits_json_hold_out_is_seeded(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 40)
    a = list(sources.load_raw_splits(json_cfg(tmp_path, path, seed=1))[1]["id"])
    b = list(sources.load_raw_splits(json_cfg(tmp_path, path, seed=1))[1]["id"])
    c = list(sources.load_raw_splits(json_cfg(tmp_path, path, seed=2))[1]["id"])
    assert a == b and a != c


def test_load_token_blocks_json(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 40)
    cfg = json_cfg(tmp_path, path)
    blocks = samples.load_token_data(cfg, tok)
    assert blocks.train.input_ids.dtype == np.int64 and blocks.eval.input_ids.dtype == np.int64
    assert blocks.train.input_ids.ndim == 2 and blocks.train.input_ids.shape[1] == 16
    assert blocks.eval.input_ids.ndim == 2 and blocks.eval.input_ids.shape[1] == 16
    train_raw, eval_raw = sources.load_raw_splits(cfg)

    def n_tokens(ds):
        return sum(len(t) + 1 for t in ds["body"])  # one char per token, plus eos

    assert len(blocks.train) == n_tokens(train_raw) // 16
    assert len(blocks.eval) == n_tokens(eval_raw) // 16
    assert tok.decode(blocks.train.input_ids[0]).startswith(train_raw[0]["body"][:16])


def test_load_raw_splits_missing_json(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(DataError) as ei:
        sources.load_raw_splits(json_cfg(tmp_path, path))
    assert str(ei.value).startswith("json_file_path:") and str(path) in str(ei.value)


def test_load_raw_splits_json_with_eval_split(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 10)
    with pytest.raises(ConfigError) as ei:
        sources.load_raw_splits(json_cfg(tmp_path, path, eval_split="test"))
    assert str(ei.value).startswith("eval_split:")


def test_load_raw_splits_json_with_one_row(tmp_path):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 1)
    with pytest.raises(DataError) as ei:
        sources.load_raw_splits(json_cfg(tmp_path, path))
    assert "json_file_path" in str(ei.value) and "1 rows" in str(ei.value)


def test_load_token_blocks_bad_text_field(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 20)
    with pytest.raises(DataError) as ei:
        samples.load_token_data(json_cfg(tmp_path, path, text_field="nope"), tok)
    msg = str(ei.value)
    assert "nope" in msg and "body" in msg and "id" in msg and str(path) in msg


def test_load_token_blocks_detects_the_only_string_column(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, 20)  # {"body": str, "id": int}
    blocks = samples.load_token_data(json_cfg(tmp_path, path, text_field=None), tok)
    assert len(blocks.train) > 0


def test_load_token_blocks_with_two_string_columns_is_ambiguous(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(20):
            f.write(json.dumps({"title": f"t{i}", "body": f"row {i} " * 8}) + "\n")
    with pytest.raises(DataError) as ei:
        samples.load_token_data(json_cfg(tmp_path, path, text_field=None), tok)
    assert "text_field" in str(ei.value) and "title" in str(ei.value) and "body" in str(ei.value)


def test_load_token_blocks_too_short_for_seq_len(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"text": "ab"}) + "\n")
    with pytest.raises(DataError) as ei:
        samples.load_token_data(make(json_file_path=str(path), seq_len=64, split_ratio=0.25), tok)
    assert str(ei.value).startswith("seq_len:")


def save_dataset_dict(folder):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": [f"train row {i} " * 3 for i in range(30)]}),
            "test": datasets.Dataset.from_dict({"text": [f"test row {i} " * 3 for i in range(10)]}),
        }
    )
    dd.save_to_disk(str(folder))


def test_load_from_disk_dataset_dict(tmp_path, tok):
    folder = tmp_path / "saved"
    save_dataset_dict(folder)
    cfg = make(dataset_name=str(folder), eval_split="test")
    train, evals = sources.load_raw_splits(cfg)
    assert len(train) == 30 and len(evals) == 10
    assert evals[0]["text"].startswith("test row 0")
    blocks = samples.load_token_data(cfg, tok)
    assert blocks.train.input_ids.shape[1] == 16 and blocks.eval.input_ids.shape[1] == 16
    assert tok.decode(blocks.eval.input_ids[0]) == ("test row 0 " * 3)[:16]


def test_load_from_disk_hold_out_and_missing_split(tmp_path):
    folder = tmp_path / "saved"
    save_dataset_dict(folder)
    train, evals = sources.load_raw_splits(make(dataset_name=str(folder), split_ratio=0.2))
    assert len(train) + len(evals) == 30 and len(evals) == 6
    with pytest.raises(DataError) as ei:
        sources.load_raw_splits(make(dataset_name=str(folder), eval_split="validation"))
    assert "eval_split" in str(ei.value) and "validation" in str(ei.value) and "test" in str(ei.value)
    with pytest.raises(DataError) as ei:
        sources.load_raw_splits(make(dataset_name=str(folder), dataset_split="nope"))
    assert "dataset_split" in str(ei.value) and "train" in str(ei.value)


# --- builtin ------------------------------------------------------------------------------


def test_arithmetic_rows_are_correct_sums():
    rows = sources.arithmetic_rows(num_samples=200, digits=2, seed=3)
    assert len(rows) == 200
    for r in rows:
        m = re.fullmatch(r"(\d{1,2})\+(\d{1,2})=(\d{1,3})", r["text"])
        assert m, r
        a, b, c = map(int, m.groups())
        assert a + b == c
        assert r["question"] == f"{a}+{b}" and r["answer"] == str(c)
    assert rows == sources.arithmetic_rows(num_samples=200, digits=2, seed=3)
    assert rows != sources.arithmetic_rows(num_samples=200, digits=2, seed=4)


def test_builtin_arithmetic_splits():
    cfg = make(dataset_kwargs={"num_samples": 300, "digits": 1}, seed=2)
    train, evals = sources.load_raw_splits(cfg)
    assert len(train) == 300
    assert len(evals) == 64  # max(64, 300 * split_ratio)
    for r in list(train) + list(evals):
        a, rest = r["text"].split("+")
        b, c = rest.split("=")
        assert int(a) + int(b) == int(c) and int(a) < 10 and int(b) < 10


def test_builtin_arithmetic_blocks(tok):
    cfg = make(dataset_kwargs={"num_samples": 100})
    blocks = samples.load_token_data(cfg, tok)
    text = tok.decode(blocks.train.input_ids.reshape(-1), skip_special_tokens=False)
    docs = [d for d in text.split("<eos>") if d][:-1]  # the last may be cut by packing
    assert len(docs) > 10
    for d in docs:
        lhs, c = d.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(c)


def test_unknown_builtin_and_bad_kwargs():
    with pytest.raises(ConfigError) as ei:
        sources.load_raw_splits(make(dataset_name="builtin:nope"))
    assert str(ei.value).startswith("dataset_name:") and "builtin:arithmetic" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        sources.load_raw_splits(make(dataset_kwargs={"bogus": 1}))
    assert str(ei.value).startswith("dataset_kwargs:") and "bogus" in str(ei.value)


def test_load_from_disk_single_dataset(tmp_path):
    import datasets

    folder = tmp_path / "single"
    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(20)]}).save_to_disk(str(folder))
    train, evals = sources.load_raw_splits(make(dataset_name=str(folder), split_ratio=0.25))
    assert len(train) == 15 and len(evals) == 5
    assert sorted(list(train["text"]) + list(evals["text"])) == sorted(f"row {i}" for i in range(20))


# ---- adaptive inner steps (inner_time_s): what a replica had no time for goes back


def test_ranges_of_positions():
    assert data.ranges_of(np.array([7, 3, 4, 5, 9, 8, 12])) == [(3, 3), (7, 3), (12, 1)]
    assert data.ranges_of(np.array([], dtype=np.int64)) == []


def test_unused_is_what_comes_after_the_steps_run_in_the_replicas_order():
    cfg = make(batch_size=2, grad_accum=2, max_steps=3)  # 4 sequences a step
    _, positions = data.plan_order([(10, 4), (40, 8)], cfg, num_blocks=100)
    assert data.unused_ranges(positions, 3, cfg) == []
    assert data.unused_ranges(positions, 1, cfg) == [(40, 8)]
    assert data.unused_ranges(positions, 2, cfg) == [(44, 4)]


def test_with_group_by_length_the_unused_positions_are_the_ones_not_read():
    cfg = make(batch_size=2, max_steps=4, group_by_length=True)
    lengths = np.arange(100)[::-1].copy() % 7  # a replica reads longest first within a window
    plan = [(0, 8)]
    indices, positions = data.plan_order(plan, cfg, 100, lengths)
    read = {int(i) for step in data.rank_batches(plan, cfg, 0, 100, lengths)[:2] for mb in step for i in mb}
    unused = data.unused_ranges(positions, 2, cfg)
    by_position = dict(zip(positions.tolist(), indices.tolist()))
    assert {by_position[p] for s, c in unused for p in range(s, s + c)} == set(indices.tolist()) - read


def test_unused_ranges_of_an_applied_plan_are_handed_out_again():
    cursor = data.DataCursor(frontier=0)
    plans = data.plan_round(cursor, [8] * 2)  # [(0, 8)], [(8, 8)]
    after = data.commit_round(cursor, plans, [True, True], unused=[[(4, 4)], []])
    assert after == data.DataCursor(frontier=16, returned=[(4, 4)])
    assert data.trained_part(plans[0], [(4, 4)]) == [(0, 4)]
    # An unapplied plan goes back whole, whatever it left unused.
    assert data.commit_round(cursor, plans, [True, False], unused=[[], [(12, 4)]]).returned == [(8, 8)]


def test_partial_rounds_still_use_every_position_exactly_once():
    rng = np.random.default_rng(1)
    cursor, used = data.DataCursor(), []
    for _ in range(200):
        plans = data.plan_round(cursor, [8] * int(rng.integers(1, 4)))
        applied = [bool(rng.random() < 0.8) for _ in plans]
        if not any(applied):
            continue
        unused = [[(p[-1][0] + p[-1][1] - k, k)] if (k := int(rng.integers(0, 3))) else [] for p in plans]
        unused = [u if u and u[0][1] <= p[-1][1] else [] for u, p in zip(unused, plans)]
        for plan, ok, rest in zip(plans, applied, unused):
            if ok:
                used.extend(positions_of(data.trained_part(plan, rest)))
        cursor = data.commit_round(cursor, plans, applied, unused)
    assert len(used) == len(set(used))
    assert sorted(used + positions_of(cursor.returned)) == list(range(cursor.frontier))


def test_decoupled_reservations_train_every_position_exactly_once():
    """Replicas reserve plans at their own times; a merge trains some (less what they had
    no time for), a loss gives a plan back; every position is trained exactly once."""
    rng = np.random.default_rng(7)
    cursor, in_flight, trained = data.DataCursor(), {}, []
    for _ in range(300):
        rid = int(rng.integers(0, 4))
        if rid not in in_flight:
            plan, cursor = data.reserve(cursor, 6)
            assert sum(c for _, c in plan) == 6
            in_flight[rid] = plan
            continue
        plan = in_flight.pop(rid)
        outcome = rng.integers(0, 3)
        if outcome == 0:  # lost or rejected
            cursor = data.give_back(cursor, plan)
        else:  # merged, maybe with a tail it had no time for
            positions = data.plan_positions(plan)
            cut = int(rng.integers(1, 7)) if outcome == 1 else 6
            unused = data.ranges_of(positions[cut:])
            trained += list(data.plan_positions(data.trained_part(plan, unused)))
            cursor = data.give_back(cursor, unused)
    handed_now = [p for plan in in_flight.values() for p in data.plan_positions(plan)]
    returned = [p for s, c in cursor.returned for p in range(s, s + c)]
    assert len(trained) == len(set(trained))
    everything = sorted(trained + handed_now + returned)
    assert everything == list(range(cursor.frontier))  # nothing lost, nothing twice
