"""Unit tests for diloco_ray.sweep.grid: the grid, its trials and how many fit side by side (no Ray)."""

import os

import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.sweep.grid import build_trials, concurrent_trials, parse_grid, trial_name, trial_need

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "tiny.yaml")
BASE = TrainerConfig.from_yaml(TINY, overrides={"output_dir": "/tmp/never-written"}).to_dict()


def tiny(**fields) -> TrainerConfig:
    return TrainerConfig.from_yaml(TINY, overrides=fields)


def test_values_are_yaml_and_fields_keep_their_order():
    grid = parse_grid(["outer_lr=0.5,1.0", "lr_schedule=cosine,linear", "target_modules=[q_proj],[q_proj,v_proj]"])
    assert list(grid) == ["outer_lr", "lr_schedule", "target_modules"]
    assert grid["outer_lr"] == [0.5, 1.0]
    assert grid["lr_schedule"] == ["cosine", "linear"]
    assert grid["target_modules"] == [["q_proj"], ["q_proj", "v_proj"]]


@pytest.mark.parametrize(
    "items,message",
    [
        (["outer_lr"], "--grid expects FIELD=V1,V2,..., got 'outer_lr'"),
        (["outer_lr="], "--grid expects FIELD=V1,V2,..., got 'outer_lr='"),
        (["outer_rl=0.5,1.0"], "--grid: unknown field 'outer_rl'"),
        (["outer_lr=0.5", "outer_lr=1.0"], "--grid outer_lr: given twice"),
        (["outer_lr=0.5,0.5"], "--grid outer_lr: a value is listed twice"),
        (["outer_lr=[0.5"], "--grid outer_lr: '[0.5' is not a comma-separated list of YAML values"),
        ([], "--grid: give at least one FIELD=V1,V2,..."),
    ],
)
def test_a_bad_grid_is_one_line_naming_the_field(items, message):
    with pytest.raises(ConfigError) as e:
        parse_grid(items)
    assert e.value.args[0].startswith(message)


def test_every_combination_in_order_each_in_its_own_folder(tmp_path):
    grid = {"outer_lr": [0.5, 1.0], "outer_momentum": [0.0, 0.5]}
    trials = build_trials(BASE, grid, str(tmp_path))
    assert [t.overrides for t in trials] == [
        {"outer_lr": 0.5, "outer_momentum": 0.0},
        {"outer_lr": 0.5, "outer_momentum": 0.5},
        {"outer_lr": 1.0, "outer_momentum": 0.0},
        {"outer_lr": 1.0, "outer_momentum": 0.5},
    ]
    assert trials[1].name == "trial-001-outer_lr=0.5-outer_momentum=0.5"
    assert trials[1].config.output_dir == os.path.join(str(tmp_path), "sweep", trials[1].name)
    assert (trials[2].config.outer_lr, trials[2].config.outer_momentum) == (1.0, 0.0)
    assert trials[0].config.lr == tiny().lr  # the rest is the base's
    assert BASE["outer_lr"] == tiny().outer_lr  # the base is not changed


def test_a_value_the_config_refuses_names_the_field_and_the_trial(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_trials(BASE, {"outer_lr": [0.5, -1.0]}, str(tmp_path))
    assert "outer_lr" in e.value.args[0] and "(trial trial-001-outer_lr=-1.0)" in e.value.args[0]


@pytest.mark.parametrize("field", ["output_dir", "resume_from"])
def test_the_folders_are_not_sweepable(tmp_path, field):
    with pytest.raises(ConfigError, match=f"--grid {field}: each trial gets its own folder"):
        build_trials(BASE, {field: ["a", "b"]}, str(tmp_path))


def test_a_dotted_field_reaches_into_a_dict_field(tmp_path):
    [trial] = build_trials(BASE, {"outer_opt_kwargs.nesterov": [False]}, str(tmp_path))
    assert trial.config.outer_opt_kwargs == {"nesterov": False}
    assert trial.name == "trial-000-outer_opt_kwargs.nesterov=false"


def test_names_are_folder_safe():
    assert trial_name(3, {"fault_plan": [{"kind": "kill"}], "lr": 1e-3}) == "trial-003-fault_plan=kind_kill-lr=0.001"


def test_a_trial_reserves_its_servers_replicas_and_spares():
    cfg = tiny(num_replicas=2, max_replicas=3, spare_replicas=1, cpus_per_rank=2, server_cpus=0.5)
    assert trial_need(cfg, cluster_has_gpus=False) == {"CPU": 0.5 + 4 * 2}
    assert trial_need(cfg, cluster_has_gpus=True) == {"CPU": 8.5, "GPU": 4.0}  # device auto
    assert "GPU" not in trial_need(tiny(device="cpu"), cluster_has_gpus=True)


@pytest.mark.parametrize(
    "cluster,need,fits",
    [
        ({"CPU": 3.0}, {"CPU": 2.5}, 1),
        ({"CPU": 10.0}, {"CPU": 2.5}, 4),
        ({"CPU": 5.0}, {"CPU": 2.5}, 2),  # exactly two
        ({"CPU": 64.0, "GPU": 8.0}, {"CPU": 2.5, "GPU": 4.0}, 2),  # the GPUs bound it
        ({"CPU": 1.0}, {"CPU": 2.5}, 1),  # none fits: one at a time, the trainer reports it
    ],
)
def test_how_many_trials_fit_side_by_side(cluster, need, fits):
    assert concurrent_trials(cluster, need) == fits
