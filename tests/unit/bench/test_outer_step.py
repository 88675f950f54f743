"""bench/outer_step.py's bookkeeping: which rows count as done, and the summary over seeds
(no Ray: the sweep is replaced where a test would reach it)."""

import json
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
import outer_step  # noqa: E402


def row(step, seed, loss, status="finished", setting="text4", codec="none", corpus=None):
    corpus = corpus or ("builtin" if setting == "tiny" else "text-a")
    return {
        "setting": setting,
        "corpus": corpus,
        "codec": codec,
        "step": step,
        "seed": seed,
        "status": status,
        "final_eval_loss": loss,
    }


def test_the_summary_takes_finished_seeds_and_compares_like_with_like():
    rows = [
        row("0.5/0.5", 0, 4.0),
        row("0.5/0.5", 1, 4.4),
        row("0.5/0.5", 2, 4.2),
        row("1/0", 0, 4.1),
        row("1/0", 1, 4.3),
        row("1/0", 2, 4.6),
        row("0.7/0.9", 0, 6.0, status="stopped"),  # a screen's early stop is not a result
        row("0.7/0", 0, 4.05),  # one seed: held against every step on that seed
        row("1.3/0", 5, 3.0),  # a seed nobody else ran: its own best
        row("0.5/0.5", 0, 9.0, codec="int8"),  # another codec: its own best
    ]
    summary = {(r["codec"], r["step"]): r for r in outer_step.summary(rows)}
    assert ("none", "0.7/0.9") not in summary
    best, other = summary[("none", "0.5/0.5")], summary[("none", "1/0")]
    assert (best["median"], best["max"], best["median_vs_best"]) == (4.2, 4.4, 1.0)
    assert other["median"] == 4.3 and other["median_vs_best"] == pytest.approx(4.3 / 4.2)
    assert other["max_vs_best"] == pytest.approx(4.6 / 4.4)
    assert summary[("none", "0.7/0")]["median_vs_best"] == pytest.approx(4.05 / 4.0)
    assert summary[("none", "1.3/0")]["median_vs_best"] == 1.0
    assert summary[("int8", "0.5/0.5")]["median_vs_best"] == 1.0


def test_runs_on_another_corpus_are_neither_compared_nor_taken_as_done(tmp_path, sweeps, monkeypatch):
    """A text task is its corpus: a new transformers rebuilds it from other docstrings, and
    the same job's losses move with it from the first eval on. Rows name their corpus, and
    only rows of one corpus are compared, or count as a step already run."""
    rows = [
        row("0.5/0.5", 0, 4.0, corpus="text-a"),
        row("1/0", 0, 3.0, corpus="text-b"),
        {k: v for k, v in row("1/0", 0, 2.0).items() if k != "corpus"},  # from before rows named one
    ]
    summary = {(r["corpus"], r["step"]): r for r in outer_step.summary(rows)}
    assert summary[("text-a", "0.5/0.5")]["median_vs_best"] == 1.0
    assert summary[("text-b", "1/0")]["median_vs_best"] == 1.0
    assert summary[(outer_step.UNRECORDED, "1/0")]["median_vs_best"] == 1.0
    log = str(tmp_path / "log.jsonl")
    write(log, row("1/0", 0, 3.0, corpus="text-b"))
    monkeypatch.setattr(outer_step, "corpus_of", lambda setting: "text-a")
    monkeypatch.setattr(outer_step, "setting_values", lambda setting, seed: {"diloco_loops": 16})
    outer_step.run("text4", "none", 0, [1.0], [0.0], None, log)  # done on text-b only: runs
    assert len(sweeps) == 1


def test_a_step_is_named_with_its_schedule_and_momentum_warmup():
    assert outer_step.step_name(0.5, 0.5) == "0.5/0.5"
    assert outer_step.step_name(1.0, 0.0, {"outer_lr_schedule": "cosine"}) == "1/0 cosine"
    warm = {"outer_lr_schedule": None, "outer_momentum_warmup_rounds": 4}
    assert outer_step.step_name(0.7, 0.9, warm) == "0.7/0.9 warmup 4"


@pytest.fixture
def sweeps(monkeypatch):
    calls = []

    def fake_sweep(values, grid, **kwargs):
        calls.append((values, grid, kwargs))
        return types.SimpleNamespace(trials=[])

    monkeypatch.setattr(outer_step, "sweep", fake_sweep)
    return calls


def write(log, *rows):
    with open(log, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_a_screened_step_is_not_run_again_but_a_confirmation_runs_a_stopped_one(tmp_path, sweeps):
    log = str(tmp_path / "log.jsonl")
    write(log, row("0.7/0.9", 0, 6.0, status="stopped", setting="tiny"))
    outer_step.run("tiny", "none", 0, [0.7], [0.9], 4, log)  # a screen: the early stop stands
    assert sweeps == []
    outer_step.run("tiny", "none", 0, [0.7], [0.9], None, log)  # a confirmation: to the end
    ((values, grid, kwargs),) = sweeps
    assert grid == {"outer_lr": [0.7], "outer_momentum": [0.9]}
    assert kwargs["grace_rounds"] == values["diloco_loops"]  # no trial can be stopped early
    assert values["outer_lr_schedule"] is None


@pytest.mark.parametrize(
    "variant, field",
    [
        ({"outer_lr_schedule": "cosine"}, "outer_lr_schedule"),
        ({"outer_momentum_warmup_rounds": 4}, "outer_momentum_warmup_rounds"),
    ],
)
def test_a_schedule_or_a_momentum_warmup_is_a_step_of_its_own(tmp_path, sweeps, variant, field):
    log = str(tmp_path / "log.jsonl")
    write(log, row("0.5/0.5", 0, 0.75, setting="tiny"))
    outer_step.run("tiny", "none", 0, [0.5], [0.5], None, log)
    assert sweeps == []
    outer_step.run("tiny", "none", 0, [0.5], [0.5], None, log, variant=variant)
    ((values, _, _),) = sweeps
    assert values[field] == variant[field]


def test_the_markdown_table_lists_each_seed_under_its_step():
    table = outer_step.markdown([row("1/0", 1, 4.3), row("1/0", 0, 4.1), row("1/0", 2, 4.6, status="stopped")])
    header, rule, line = table.splitlines()
    assert rule == "|---" * 9 + "|"
    assert line == "| text4 | text-a | none | 1/0 | 4.1000 / 4.3000 | 4.2000 | 4.3000 | 1.000 | 1.000 |"
