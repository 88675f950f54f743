"""A sweep through Ray Tune on the module's Ray, as ``diloco-ray sweep`` runs one: every trial a
full run in its own folder; a trial far behind the first at round 1 is stopped there (ASHA);
a trial whose run fails is reported with its one-line error and the sweep goes on; best.yaml
is the finished trial with the lowest final eval loss; and the cluster is whole afterwards
(no trial's actors or placement groups left)."""

import json
import os

import pytest
import ray
import yaml
from conftest import tiny_config

from diloco_ray import run_sweep
from diloco_ray.observe.metrics import read_events

pytestmark = pytest.mark.integration


def test_a_grid_of_four_trials_one_finished_one_stopped_two_failed(ray_local, tmp_path):
    # Round 2 takes 2 s (a slow replica): the time Tune's decision after round 1 needs to
    # reach a trial, where a tiny round takes 0.2 s (on a real job a round takes minutes).
    slow_round = [{"kind": "slow", "replica": 0, "round": 1, "step": 0, "seconds": 0.5}]
    base = tiny_config(tmp_path / "out", diloco_loops=3, max_steps=4, eval_batches=1, fault_plan=slow_round)
    grid = {
        # outer_lr 0.01 barely moves the weights: far behind 0.7 after round 1.
        "outer_lr": [0.7, 0.01],
        # A tokenizer folder that is not there: the run stops before Ray with one line.
        "tokenizer_name": ["builtin:char", str(tmp_path / "no-tokenizer")],
    }
    before = set(ray.util.placement_group_table())
    lines = []
    result = run_sweep(base, grid, max_concurrent=1, on_line=lines.append)  # one at a time: reproducible stops

    folder = tmp_path / "out" / "sweep"
    good, missing, slow, both = result.trials
    assert (good.status, good.rounds, good.planned_rounds) == ("finished", 3, 3)
    assert (slow.status, slow.rounds, slow.stopped_early) == ("stopped", 1, True), lines
    assert slow.eval_loss > good.eval_curve[0][1]  # why it was stopped
    for failed in (missing, both):
        assert failed.status == "failed" and failed.rounds == 0
        assert failed.error.startswith("tokenizer_name:") and "no-tokenizer" in failed.error
    assert result.best == good
    assert good.eval_loss == read_events(good.output_dir, "round")[-1]["eval_loss"]
    assert os.path.isdir(os.path.join(good.output_dir, "final"))

    records = [json.loads(line) for line in open(folder / "results.jsonl")]
    assert [r["trial"] for r in records] == [t.trial for t in result.trials]
    assert [r["stopped_early"] for r in records] == [False, False, True, False]
    assert all(r["seconds"] > 0 for r in records)
    best = yaml.safe_load(open(folder / "best.yaml"))
    assert (best["outer_lr"], best["tokenizer_name"]) == (0.7, "builtin:char")
    assert best["output_dir"] == good.output_dir

    assert any(line.startswith(f"{slow.trial}: stopped early after round 1/3") for line in lines), lines
    assert any(line.startswith(f"{missing.trial}: failed") and "tokenizer_name" in line for line in lines), lines
    # Nothing of the trials holds the cluster: every job's groups went with its driver.
    made = {k: pg for k, pg in ray.util.placement_group_table().items() if k not in before}
    assert made and all(pg["state"] == "REMOVED" for pg in made.values()), made
