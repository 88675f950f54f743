"""``diloco-ray sweep``: every trial of a grid as a full DiLoCo run, through Ray Tune on the
cluster the runs use, with bad trials stopped early by their eval loss (ASHA).

The sweep owns ``OUTPUT_DIR/sweep/``: ``configs/`` (each trial's full config), ``logs/``
(each trial's console), one folder per trial (the run's own ``output_dir``), ``tune/``
(Tune's experiment state), and at the end ``results.jsonl`` (a line a trial, in grid order)
and ``best.yaml`` (the full config of the finished trial with the lowest final eval loss).

How many trials run side by side is what the cluster holds of the largest trial's
reservation (its servers, replicas and spares), so trials never compete for the same CPUs
and a cluster that fits one trial runs them one at a time. A trial's own actor reserves no
CPU and stays on the sweep's node, where its configs and folders are.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from typing import Callable, Optional

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError
from diloco_ray.persist.uris import is_remote
from diloco_ray.sweep import grid as grids
from diloco_ray.sweep.results import SweepResult, collect, write_results
from diloco_ray.sweep.trial import TrialPlan, run_trial


def sweep(
    base: TrainerConfig | dict,
    grid: dict[str, list],
    *,
    grace_rounds: int = 1,
    reduction_factor: int = 2,
    max_concurrent: Optional[int] = None,
    on_line: Callable[[str], None] = print,
    ray_output_to_file: bool = False,
) -> SweepResult:
    """Run every combination of ``grid`` over ``base`` and return what each trial did.

    Args:
        base: the config every trial starts from (a TrainerConfig, or its field values);
            its ``output_dir`` holds the sweep (``OUTPUT_DIR/sweep``).
        grid: field -> values, e.g. ``{"outer_lr": [0.5, 1.0], "outer_momentum": [0.0, 0.5]}``.
        grace_rounds: rounds every trial runs before ASHA may stop it.
        reduction_factor: ASHA's: about 1 in this many trials goes on at each rung.
        max_concurrent: at most this many trials at once (default: as many as the cluster
            holds side by side). One at a time makes the early stops reproducible: each
            trial is judged against the ones before it.
        on_line: where progress lines go (a trial finished, stopped or failed).
        ray_output_to_file: Ray's and Tune's own output (its tables included) goes to
            ``OUTPUT_DIR/sweep/logs/ray.log`` instead of the console (the CLI does, unless
            ``--verbose``); ``on_line`` must then write to a stream taken before the call.
    """
    for name, value, least in (("grace_rounds", grace_rounds, 1), ("reduction_factor", reduction_factor, 2)):
        if not isinstance(value, int) or value < least:
            raise ConfigError(f"{name}: {value!r} is not allowed; give a whole number >= {least}")
    if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
        raise ConfigError(f"max_concurrent: {max_concurrent!r} is not allowed; give a whole number >= 1")
    values = base.to_dict() if isinstance(base, TrainerConfig) else dict(base)
    output_dir = str(values.get("output_dir") or "")
    if output_dir and not is_remote(output_dir):  # a trial's run starts elsewhere (Tune's folder)
        output_dir = os.path.abspath(output_dir)
    trials = grids.build_trials(values, grid, output_dir)
    folder = prepare_folder(trials, output_dir)
    plans = write_plans(trials, folder)
    asha = {"grace_period": grace_rounds, "reduction_factor": reduction_factor}
    with _ray_session(trials, folder, ray_output_to_file) as session:
        with session.quiet.redirected() if session.quiet is not None else contextlib.nullcontext():
            tune_results, seconds = _fit(trials, plans, folder, asha, max_concurrent, on_line)
    results = collect(trials, plans, tune_results, seconds, folder)
    write_results(results, trials)
    return results


def _ray_session(trials: list, folder: str, ray_output_to_file: bool):
    """The sweep's Ray: the one this process is connected to, or a private one sized for the
    largest trial (a grid over num_replicas varies them), stopped at the end; Ray's output
    in ``folder/logs`` when asked."""
    from diloco_ray.control import ray_connection
    from diloco_ray.control.ray_session import RaySession
    from diloco_ray.observe.ray_output import RAY_LOG

    largest = max(trials, key=lambda t: grids.trial_need(t.config, cluster_has_gpus=False)["CPU"])
    s = largest.config.sections()
    output = os.path.join(folder, "logs", RAY_LOG) if ray_output_to_file else None
    return RaySession(lambda: ray_connection.connect(s.membership, s.placement), output)


def prepare_folder(trials: list, output_dir: str) -> str:
    """``OUTPUT_DIR/sweep``, new (or emptied with ``overwrite_output_dir``); refuses what a
    sweep cannot use before anything is written."""
    first = trials[0].config
    if not output_dir or is_remote(output_dir):
        raise ConfigError(
            f"output_dir: a sweep keeps its trials and results in a local folder, not '{output_dir}'; "
            "give a local path (a trial's run may still save to a bucket: sweep outside it)"
        )
    if first.eval_batches == 0:
        raise ConfigError("eval_batches: a sweep ranks its trials by eval loss; set eval_batches > 0")
    if first.resume_from:
        raise ConfigError("resume_from: a sweep starts every trial afresh; leave resume_from unset")
    folder = os.path.join(os.path.abspath(output_dir), grids.SWEEP_FOLDER)
    if os.path.exists(folder) and os.listdir(folder):
        if not first.overwrite_output_dir:
            raise ConfigError(
                f"output_dir: '{folder}' already holds a sweep; give another output_dir or "
                "--set overwrite_output_dir=true to replace it"
            )
        shutil.rmtree(folder)
    for sub in ("configs", "logs"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    return folder


def write_plans(trials: list, folder: str) -> dict[str, TrialPlan]:
    """Each trial's config file and folders; trial name -> :class:`TrialPlan`."""
    plans = {}
    for trial in trials:
        path = os.path.join(folder, "configs", f"{trial.name}.yaml")
        trial.config.to_yaml(path, redact=False)  # what its run reads: in full, owner-only
        log = os.path.join(folder, "logs", f"{trial.name}.log")
        plans[trial.name] = TrialPlan(path, os.path.abspath(trial.config.output_dir), log, cwd=os.getcwd())
    return plans


def _fit(trials, plans, folder, asha: dict, max_concurrent: Optional[int], on_line):
    """Tune's run over the trials: (trial name -> Tune's Result, trial name -> seconds)."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from diloco_ray.sweep.tune_lines import TrialLines

    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    need = _largest([grids.trial_need(t.config, has_gpus) for t in trials])
    side_by_side = grids.concurrent_trials(ray.cluster_resources(), need)
    if max_concurrent is not None:
        side_by_side = max(1, min(side_by_side, int(max_concurrent)))
    rounds = max(t.config.diloco_loops for t in trials)
    on_line(
        f"sweep: {len(trials)} trials, {side_by_side} at a time (each reserves {_fmt_need(need)}); "
        f"trials' consoles in {os.path.join(folder, 'logs')}"
    )
    lines = TrialLines(on_line, {t.name: t.config.diloco_loops for t in trials})
    trainable = functools.partial(run_trial, plans=plans, address=ray.get_runtime_context().gcs_address)
    here = f"node:{ray.util.get_node_ip_address()}"
    tuner = tune.Tuner(
        tune.with_resources(trainable, tune.PlacementGroupFactory([{"CPU": 0, here: 0.001}])),
        param_space={"trial": tune.grid_search([t.name for t in trials])},
        tune_config=tune.TuneConfig(
            metric="eval_loss",
            mode="min",
            # max_t past the last round: ASHA stops a trial that reaches max_t, and a trial on
            # its last round must still save its final weights.
            scheduler=ASHAScheduler(time_attr="round", max_t=rounds + 1, **asha),
            max_concurrent_trials=side_by_side,
            # A stopped trial's actor is ended, not kept for the next one: its run (a child
            # process, see trial.py) goes with it.
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=folder,
            verbose=0,
            callbacks=[lines],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    grid_results = tuner.fit()
    return {r.config["trial"]: r for r in grid_results if r.config}, lines.seconds


def _largest(needs: list[dict]) -> dict:
    return {k: max(n.get(k, 0.0) for n in needs) for k in {k for n in needs for k in n}}


def _fmt_need(need: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))


def run_sweep_cli(
    config_path: str, grid_items: list[str], overrides: dict, line: Callable = print, **options
) -> SweepResult:
    """The CLI's sweep: the YAML file with ``--set`` applied, swept over ``--grid``
    (``options``: :func:`sweep`'s keywords)."""
    from diloco_ray.config.schema import read_values

    values = read_values(config_path, overrides)
    TrainerConfig.from_dict(values, source=f"config file '{config_path}'")  # the base itself is valid
    return sweep(values, grids.parse_grid(grid_items), on_line=line, **options)
