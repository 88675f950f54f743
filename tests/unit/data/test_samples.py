"""Rows into samples: completion-only loss masking token by token, templates and
functions, padding and dynamic batches, length grouping, local file formats."""

import json
import os

import numpy as np
import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.data import plan as data
from diloco_ray.data import samples, sources
from diloco_ray.data.tokenization import char_tokenizer
from diloco_ray.errors import ConfigError, DataError

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def qa_file(path, n=40):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"{i}+1", "answer": str(i + 1), "noise": "x"}) + "\n")
    return str(path)


def make(**kw):
    fields = dict(model_config=TINY, seq_len=16, batch_size=2, split_ratio=0.1)
    fields.update(kw)
    return TrainerConfig(**fields).sections().data


def test_completion_only_labels_token_by_token(tmp_path, tok):
    cfg = make(
        json_file_path=qa_file(tmp_path / "qa.jsonl"), prompt_template="{question}=", completion_template="{answer}"
    )
    train = samples.load_token_data(cfg, tok).train
    rows = {json.loads(line)["question"]: json.loads(line)["answer"] for line in open(cfg.json_file_path)}
    for i in range(len(train)):
        n = int(train.lengths[i])
        ids, labels = train.input_ids[i], train.labels[i]
        text = tok.decode(ids[:n], skip_special_tokens=False)
        question = text.split("=")[0]
        prompt_len = len(question) + 1  # char tokenizer: one token a character
        answer = rows[question]
        assert text == f"{question}={answer}<eos>"
        assert (labels[:prompt_len] == samples.IGNORE).all()  # no loss on the prompt
        assert labels[prompt_len:n].tolist() == tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert (labels[n:] == samples.IGNORE).all() and (ids[n:] == tok.pad_token_id).all()


def test_batch_masks_and_dynamic_width(tok):
    ids = np.array([[5, 6, 7, 0, 0, 0], [5, 6, 0, 0, 0, 0]])
    labels = np.where(ids == 0, samples.IGNORE, ids)
    s = samples.Samples(ids, labels, np.array([3, 2]))
    full = s.batch(np.array([0, 1]))
    assert full["input_ids"].shape == (2, 6)
    assert full["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]
    dyn = s.batch(np.array([0, 1]), dynamic=True)
    assert dyn["input_ids"].shape == (2, 3) and dyn["labels"].tolist() == [[5, 6, 7], [5, 6, -100]]
    assert s.batch(np.array([1]), dynamic=True)["input_ids"].shape == (1, 2)


def test_template_naming_a_missing_column(tmp_path, tok):
    cfg = make(
        json_file_path=qa_file(tmp_path / "qa.jsonl"), prompt_template="{questoin}=", completion_template="{answer}"
    )
    with pytest.raises(DataError) as ei:
        samples.load_token_data(cfg, tok)
    msg = str(ei.value)
    assert msg.startswith("prompt_template:") and "questoin" in msg and "question" in msg and "noise" in msg


def test_the_first_record_check_says_what_the_task_would(tmp_path, tok):
    """The driver's check of a JSON Lines file's first record raises the tokenising task's
    own error, word for word; where the file does not start with a record on a line of
    its own, it leaves the judging to the task."""
    path = qa_file(tmp_path / "qa.jsonl")
    for bad in (
        dict(text_field="nope"),
        dict(prompt_template="{questoin}=", completion_template="{answer}"),
        dict(prompt_template="{question}=", completion_template="{answr}"),
    ):
        cfg = make(json_file_path=path, **bad)
        with pytest.raises(DataError) as in_task:
            samples.load_token_data(cfg, tok)
        with pytest.raises(DataError) as on_driver:
            samples.check_first_record(cfg)
        assert str(on_driver.value) == str(in_task.value)
    samples.check_first_record(make(json_file_path=path, text_field="question"))  # a column: fine
    blank_first = tmp_path / "blank.jsonl"
    blank_first.write_text('\n{"text": "a"}\n')
    assert sources.first_json_record(str(blank_first)) == {"text": "a"}
    for head in ('[{"text": "a"}]', '{\n  "text": "a"\n}', "[1, 2]\n", "not json\n", ""):
        other = tmp_path / "other.json"
        other.write_text(head)
        assert sources.first_json_record(str(other)) is None
        samples.check_first_record(make(json_file_path=str(other), text_field="nope"))  # the task's to judge


def test_prompt_and_completion_functions(tmp_path, tok, monkeypatch):
    mod = tmp_path / "my_prompts.py"
    mod.write_text(
        "def prompt(row):\n    return 'Q:' + row['question'] + ' A:'\ndef completion(row):\n    return row['answer']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make(
        json_file_path=qa_file(tmp_path / "qa.jsonl"),
        prompt_func="my_prompts:prompt",
        completion_func="my_prompts:completion",
        seq_len=24,
    )
    train = samples.load_token_data(cfg, tok).train
    text = tok.decode(train.input_ids[0][: train.lengths[0]], skip_special_tokens=False)
    assert text.startswith("Q:") and " A:" in text and text.endswith("<eos>")
    first_label = int(np.argmax(train.labels[0] != samples.IGNORE))
    assert tok.decode(train.input_ids[0][:first_label]).endswith(" A:")
    with pytest.raises(ConfigError, match="prompt_func"):
        samples.load_function("my_prompts", "prompt_func")
    with pytest.raises(ConfigError, match="completion_func"):
        samples.load_function("no_such_module_xyz:f", "completion_func")


def test_group_by_length_sorts_windows_and_keeps_the_set():
    idx = np.arange(10)
    lengths = np.array([1, 9, 3, 7, 5, 2, 8, 4, 6, 0])
    out = data.group_by_length(idx, lengths, window=5)
    assert sorted(out.tolist()) == idx.tolist()
    assert lengths[out[:5]].tolist() == [9, 7, 5, 3, 1] and lengths[out[5:]].tolist() == [8, 6, 4, 2, 0]


def test_rank_batches_group_by_length_uses_lengths():
    cfg = make(dataset_name="builtin:arithmetic", batch_size=2, max_steps=3, group_by_length=True)
    lengths = np.arange(100)[::-1].copy()
    plain = data.rank_batches([(0, 6)], make(dataset_name="builtin:arithmetic", batch_size=2, max_steps=3), 0, 100)
    grouped = data.rank_batches([(0, 6)], cfg, 0, 100, lengths)
    flat = np.concatenate([b for step in grouped for b in step])
    assert sorted(flat.tolist()) == sorted(np.concatenate([b for s in plain for b in s]).tolist())
    assert (np.diff(lengths[flat]) <= 0).all()


@pytest.mark.parametrize("fmt", ["csv", "text", "parquet"])
def test_local_files_by_format(tmp_path, tok, fmt):
    import datasets

    rows = [{"text": f"document number {i} " * 3} for i in range(30)]
    path = str(tmp_path / f"d.{'txt' if fmt == 'text' else fmt}")
    ds = datasets.Dataset.from_list(rows)
    if fmt == "csv":
        ds.to_csv(path, index=False)
    elif fmt == "parquet":
        ds.to_parquet(path)
    else:
        with open(path, "w") as f:
            f.write("\n".join(r["text"] for r in rows) + "\n")
    cfg = make(dataset_name=fmt, dataset_kwargs={"data_files": path})
    train, evals = sources.load_raw_splits(cfg)
    assert len(train) + len(evals) == 30 and train.column_names == ["text"]
    assert len(samples.load_token_data(cfg, tok).train) > 0


def test_tokenisation_is_cached_by_datasets(tmp_path, tok):
    path = qa_file(tmp_path / "qa.jsonl")
    raw, _ = sources.load_raw_splits(make(json_file_path=path))
    packed = samples.pack_texts(raw.rename_column("question", "text"), tok, "text", 8)
    assert packed.cache_files and all(os.path.exists(c["filename"]) for c in packed.cache_files)


def test_dataset_kwargs_the_loader_rejects(tmp_path):
    cfg = make(json_file_path=qa_file(tmp_path / "qa.jsonl"), dataset_kwargs={"num_samples": 5})
    with pytest.raises(ConfigError, match="^dataset_kwargs:.*num_samples"):
        sources.load_raw_splits(cfg)


def stream_reader(tmp_path, tok, **kw):
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n")
    cfg = make(
        json_file_path=str(path),
        streaming=True,
        streaming_eval_rows=10,
        shuffle_buffer=8,
        prompt_template="{question}=",
        completion_template="{answer}",
        **kw,
    )
    return samples.open_stream(cfg, tok)


def decoded(tok, s):
    return [tok.decode(s.input_ids[i][: s.lengths[i]], skip_special_tokens=True) for i in range(len(s))]


def test_stream_reader_positions(tmp_path, tok):
    reader, evals = stream_reader(tmp_path, tok)
    assert decoded(tok, evals)[:2] == ["0+1=1", "1+1=2"]  # the first rows are held out...
    first_epoch = decoded(tok, reader.read(np.arange(30)))
    assert sorted(first_epoch) == sorted(f"{i}+1={i + 1}" for i in range(10, 40))  # ...and never trained on
    assert first_epoch != sorted(first_epoch)  # shuffled
    fresh, _ = stream_reader(tmp_path, tok)
    assert decoded(tok, fresh.read(np.arange(5))) + decoded(tok, fresh.read(np.arange(5, 30))) == first_epoch
    assert decoded(tok, fresh.read(np.array([7, 3]))) == [first_epoch[7], first_epoch[3]]  # behind: starts over
    second_epoch = decoded(tok, reader.read(np.arange(30, 60)))
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch


def test_streaming_a_builtin_is_an_error(tok):
    with pytest.raises(ConfigError, match="^streaming:"):
        samples.open_stream(make(dataset_name="builtin:arithmetic", streaming=True), tok)


def test_split_slices_reach_load_dataset(tmp_path, tok):
    path = tmp_path / "rows.csv"
    path.write_text("text\n" + "\n".join(f"row number {i}" for i in range(50)) + "\n")
    cfg = make(
        dataset_name="csv",
        dataset_kwargs={"data_files": str(path)},
        dataset_split="train[:20]",
        eval_split="train[40:]",
    )
    train, evals = sources.load_raw_splits(cfg)
    assert [r["text"] for r in train] == [f"row number {i}" for i in range(20)]
    assert [r["text"] for r in evals] == [f"row number {i}" for i in range(40, 50)]
