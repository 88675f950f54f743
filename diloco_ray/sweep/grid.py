"""What a sweep is made of, decided before anything runs: the grid, its trials, and how
many of them the cluster holds at once.

``--grid FIELD=V1,V2,...`` names any config field and its values (each value is YAML, as
``--set``'s are); the trials are every combination, in the order the grids were given.
Every trial's config is built and validated here, so a bad value is one line naming the
field and the trial before Ray starts. A trial's runs go to ``OUTPUT_DIR/sweep/<name>``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import re
from typing import Any

import yaml

from diloco_ray.config.fields import FIELD_NAMES
from diloco_ray.config.schema import TrainerConfig, apply_override
from diloco_ray.control.ray_connection import cpus_needed
from diloco_ray.errors import ConfigError

SWEEP_FOLDER = "sweep"


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of a sweep.

    Args:
        index: its place in the grid's order (0-based).
        overrides: field -> value, the grid's share of its config.
        config: the full config it runs (base config, ``--set``, then ``overrides``;
            ``output_dir`` is the trial's own folder).
    """

    index: int
    overrides: dict
    config: TrainerConfig

    @property
    def name(self) -> str:
        return trial_name(self.index, self.overrides)


def trial_name(index: int, overrides: dict) -> str:
    """``trial-003-outer_lr=0.5-outer_momentum=0.0``: sortable, and readable as a folder."""
    parts = "-".join(f"{k}={_short(v)}" for k, v in overrides.items())
    return f"trial-{index:03d}-{parts}"[:120]


def parse_grid(items: list[str]) -> dict[str, list]:
    """``["outer_lr=0.5,1.0", ...]`` -> ``{"outer_lr": [0.5, 1.0]}``, fields in the given order.

    The values are YAML flow items split on top-level commas; a value that is itself a list
    goes in brackets (``target_modules=[q_proj],[q_proj,v_proj]`` is two values)."""
    grid: dict[str, list] = {}
    for item in items:
        field, sep, raw = item.partition("=")
        field = field.strip()
        if not sep or not field or not raw.strip():
            raise ConfigError(f"--grid expects FIELD=V1,V2,..., got '{item}'")
        if field.split(".")[0] not in FIELD_NAMES:
            raise ConfigError(f"--grid: unknown field '{field}' (see `diloco-ray train --help`)")
        if field in grid:
            raise ConfigError(f"--grid {field}: given twice; list all its values in one --grid")
        try:
            values = yaml.safe_load(f"[{raw}]")
        except yaml.YAMLError:
            raise ConfigError(f"--grid {field}: '{raw}' is not a comma-separated list of YAML values") from None
        if len(values) != len({yaml.safe_dump(v) for v in values}):
            raise ConfigError(f"--grid {field}: a value is listed twice in '{raw}'")
        grid[field] = values
    if not grid:
        raise ConfigError("--grid: give at least one FIELD=V1,V2,... to sweep")
    return grid


def build_trials(base: dict, grid: dict[str, list], output_dir: str) -> list[Trial]:
    """Every combination of ``grid`` over the ``base`` config values (the YAML file with
    ``--set`` applied), each validated, each in ``output_dir/sweep/<trial name>``."""
    clash = sorted(set(grid) & {"output_dir", "resume_from"})
    if clash:
        raise ConfigError(f"--grid {clash[0]}: each trial gets its own folder under output_dir/sweep; not sweepable")
    trials = []
    for index, combo in enumerate(itertools.product(*grid.values())):
        overrides = dict(zip(grid, combo))
        values = copy.deepcopy(base)
        for key, value in overrides.items():
            apply_override(values, key, value)
        name = trial_name(index, overrides)
        values["output_dir"] = os.path.join(output_dir, SWEEP_FOLDER, name)
        try:
            config = TrainerConfig.from_dict(values, source=f"trial {name}")
        except ConfigError as e:
            raise ConfigError(f"{e.args[0]} (trial {name})") from None
        trials.append(Trial(index, overrides, config))
    return trials


def trial_need(config: TrainerConfig, cluster_has_gpus: bool) -> dict[str, float]:
    """What one trial's trainer reserves at most: CPUs, and a GPU a rank where its ranks
    run on GPUs (``device: cuda``, or ``auto`` on a cluster with GPUs)."""
    s = config.sections()
    need = {"CPU": cpus_needed(s.membership, s.placement)}
    if config.device == "cuda" or (config.device == "auto" and cluster_has_gpus):
        replicas = s.membership.replica_bounds[1] + s.membership.spare_replicas
        need["GPU"] = float(replicas * s.placement.max_ranks)
    return need


def concurrent_trials(cluster: dict[str, float], need: dict[str, float]) -> int:
    """How many trials fit the cluster side by side (at least 1: a trial that does not fit
    at all is the trainer's own placement timeout to report)."""
    fits = [math.floor(cluster.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0]
    return max(1, min(fits, default=1))


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").strip()
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "_"
