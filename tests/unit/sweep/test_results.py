"""Unit tests for diloco_ray.sweep.results and .report: what each trial did, read from its own
run; results.jsonl, best.yaml, the table and the plot (no Ray, no Tune: Tune's results are
stand-ins with an ``error``)."""

import json
import os

import pytest
import yaml

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import DataError
from diloco_ray.sweep.grid import build_trials
from diloco_ray.sweep.report import is_sweep, write_sweep_report
from diloco_ray.sweep.results import collect, read_results, table, write_results
from diloco_ray.sweep.runner import write_plans

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "tiny.yaml")


def base(folder) -> dict:
    return TrainerConfig.from_yaml(TINY, overrides={"output_dir": str(folder), "diloco_loops": 3}).to_dict()


class TuneResult:
    def __init__(self, error=None):
        self.error = error


class RemoteError(RuntimeError):
    """Like Ray's wrapper: the trial's own error is its ``cause``."""

    def __init__(self, cause):
        super().__init__("Traceback ...\n(RayTaskError) long remote traceback")
        self.cause = cause


def write_rounds(output_dir, losses):
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "metrics.jsonl"), "w") as f:
        for r, loss in enumerate(losses):
            f.write(json.dumps({"event": "round", "round": r, "eval_loss": loss}) + "\n")


@pytest.fixture
def swept(tmp_path):
    """Four trials of 3 rounds: finished (1.2), finished and best (0.9), stopped after 1
    round (its eval 0.8 beats both, but it did not finish), failed after 2 rounds."""
    trials = build_trials(base(tmp_path), {"outer_lr": [0.5, 0.7, 1.0, 1.3]}, str(tmp_path))
    os.makedirs(tmp_path / "sweep" / "configs")
    os.makedirs(tmp_path / "sweep" / "logs")
    plans = write_plans(trials, str(tmp_path / "sweep"))
    for t, losses in zip(trials, ([1.5, 1.3, 1.2], [1.4, 1.0, 0.9], [0.8], [1.6, 1.7])):
        write_rounds(t.config.output_dir, losses)
    errors = {trials[3].name: TuneResult(RemoteError(RuntimeError("lr: went NaN at round 2")))}
    tune_results = {t.name: errors.get(t.name, TuneResult()) for t in trials}
    seconds = {t.name: 10.0 + i for i, t in enumerate(trials)}
    result = collect(trials, plans, tune_results, seconds, str(tmp_path / "sweep"))
    write_results(result, trials)
    return trials, result


def test_each_trial_as_its_run_ended(swept):
    _, result = swept
    assert [(t.status, t.rounds, t.eval_loss) for t in result.trials] == [
        ("finished", 3, 1.2),
        ("finished", 3, 0.9),
        ("stopped", 1, 0.8),
        ("failed", 2, 1.7),
    ]
    assert [t.stopped_early for t in result.trials] == [False, False, True, False]
    assert result.trials[3].error == "lr: went NaN at round 2"  # the cause's line, not Ray's traceback
    assert result.trials[1].eval_curve == [[1, 1.4], [2, 1.0], [3, 0.9]]


def test_best_is_the_lowest_final_loss_among_the_finished(swept):
    trials, result = swept
    assert result.best.trial == trials[1].name
    best = yaml.safe_load(open(os.path.join(result.folder, "best.yaml")))
    assert best == trials[1].config.to_dict()  # the full config, as the trial ran it


def test_results_jsonl_has_a_line_a_trial_in_grid_order(swept):
    trials, result = swept
    lines = [json.loads(line) for line in open(os.path.join(result.folder, "results.jsonl"))]
    assert [r["trial"] for r in lines] == [t.name for t in trials]
    assert lines[2] == {
        "trial": trials[2].name,
        "overrides": {"outer_lr": 1.0},
        "status": "stopped",
        "eval_loss": 0.8,
        "rounds": 1,
        "planned_rounds": 3,
        "seconds": 12.0,
        "error": None,
        "output_dir": trials[2].config.output_dir,
        "eval_curve": [[1, 0.8]],
        "stopped_early": True,
    }
    assert read_results(result.folder) == result


def test_the_table(swept):
    _, result = swept
    rows = table(result).splitlines()
    assert rows[0].split() == ["#", "outer_lr", "eval_loss", "rounds", "status", "seconds"]
    assert rows[2].split() == ["1", "0.7", "0.9000", "3/3", "finished", "11"]
    assert rows[4].split()[:6] == ["3", "1.3", "1.7000", "2/3", "failed", "13"]
    assert rows[4].endswith("lr: went NaN at round 2")
    assert rows[-1].startswith(f"best: {result.best.trial} (eval_loss 0.9000)")


def test_no_finished_trial_no_best_yaml(tmp_path):
    trials = build_trials(base(tmp_path), {"outer_lr": [0.5]}, str(tmp_path))
    os.makedirs(tmp_path / "sweep" / "configs")
    os.makedirs(tmp_path / "sweep" / "logs")
    plans = write_plans(trials, str(tmp_path / "sweep"))
    result = collect(trials, plans, {}, {}, str(tmp_path / "sweep"))  # Tune gave nothing back: the run never started
    write_results(result, trials)
    assert result.trials[0].status == "failed" and result.trials[0].rounds == 0
    assert result.best is None and not os.path.exists(tmp_path / "sweep" / "best.yaml")
    assert table(result).splitlines()[-1] == "no trial finished: no best.yaml"


def test_report_draws_every_trial_in_one_plot(swept):
    _, result = swept
    assert is_sweep(result.folder) and not is_sweep(os.path.dirname(result.folder))
    text = write_sweep_report(result.folder)
    assert text.startswith(table(result)) and text.endswith(os.path.join(result.folder, "report.png"))
    assert os.path.getsize(os.path.join(result.folder, "report.png")) > 10_000


def test_a_damaged_results_file_is_one_line(tmp_path):
    (tmp_path / "results.jsonl").write_text('{"trial": "x"')
    with pytest.raises(DataError, match="results.jsonl: cannot be read as a sweep's results"):
        write_sweep_report(str(tmp_path))
