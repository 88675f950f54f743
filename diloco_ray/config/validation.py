"""Validation of a config: each field's type and range, then the rules between fields.

Every problem is one :class:`~diloco_ray.errors.ConfigError` naming the field, the value and
what is allowed. The checks read the field table (:mod:`diloco_ray.config.fields`: types and
the ``ge``, ``gt``, ``le``, ``lt`` metadata); the rules between fields are small functions run
in the order of :data:`RULES`, the first problem winning. This module never imports the
schema, which calls :func:`validate` from ``TrainerConfig.__post_init__``.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Callable, Literal, Union

from diloco_ray.config import fault_plan as faults
from diloco_ray.config.fields import BUILTIN_MAX_DIGITS, BUILTIN_MAX_SAMPLES, FIELD_TYPES, FIELDS, ConfigFields
from diloco_ray.config.region_rules import check_regions
from diloco_ray.errors import ConfigError


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value) where value may be converted (int -> float, str -> [str])."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if origin is Literal:
        return value in typing.get_args(tp), value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        if isinstance(value, str):  # YAML reads "3e-4" as a string; accept it as a number
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is list and isinstance(value, str):  # target_modules: q_proj -> [q_proj]
        return True, [value]
    return isinstance(value, tp), value


def validate(cfg: ConfigFields) -> None:
    """Check types, ranges and the rules between fields; raise ConfigError on the first problem.

    ``cfg`` is normalised in place: numbers written as ints or strings become floats, a
    lone string becomes a list where a list is expected, and the rules clear what another
    field overrides (see :func:`_choose_sources`) and normalise ``log_with`` and ``link_mbps``.
    """
    if cfg.mixed_precision is False:  # YAML 1.1 reads a bare `no` as false
        cfg.mixed_precision = "no"
    for name, f in FIELDS.items():
        setattr(cfg, name, _checked_value(name, getattr(cfg, name), f.metadata))
    for rule in RULES:
        rule(cfg)


_BOUNDS = (("ge", float.__ge__, ">="), ("gt", float.__gt__, ">"), ("le", float.__le__, "<="), ("lt", float.__lt__, "<"))


def _checked_value(name: str, value: Any, bounds: typing.Mapping[str, Any]) -> Any:
    """``value`` of field ``name`` after its type and range checks (converted as :func:`_coerce` does)."""
    ok, value = _coerce(value, FIELD_TYPES[name])
    if not ok:
        raise ConfigError(f"{name}: {value!r} is not allowed; expected {_describe(FIELD_TYPES[name])}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}: {value!r} is not allowed; expected a finite number")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for rule, op, word in _BOUNDS:
            if rule in bounds and not op(float(value), float(bounds[rule])):
                raise ConfigError(f"{name}: {value!r} is not allowed; must be {word} {bounds[rule]}")
    return value


# --- the rules between fields, in the order they run ----------------------------------------


def _choose_sources(cfg: ConfigFields) -> None:
    """The model and the data each need a source; the one that takes precedence wins."""
    # Precedence, so that overlaying a recipe with --set model_name=... or
    # --set json_file_path=... switches the source cleanly; the loser is cleared, so the
    # resolved config.yaml shows what was used.
    if cfg.model_name is not None:
        cfg.model_config = None
    if cfg.json_file_path is not None:
        cfg.dataset_name, cfg.subset = None, None
    if cfg.model_name is None and cfg.model_config is None:
        raise ConfigError("model_name: not set; give a hub id or local folder, or model_config to build a model")
    if cfg.model_config is not None and "model_type" not in cfg.model_config:
        raise ConfigError("model_config: needs a model_type (e.g. llama) naming a transformers architecture")
    if cfg.dataset_name is None and cfg.json_file_path is None:
        raise ConfigError("dataset_name: not set; give a data set name or folder, or json_file_path")


def _check_replica_count(cfg: ConfigFields) -> None:
    lo, hi = cfg.replica_bounds
    if not lo <= cfg.num_replicas <= hi:
        raise ConfigError(f"num_replicas: {cfg.num_replicas} is outside [min_replicas={lo}, max_replicas={hi}]")


def _check_logging(cfg: ConfigFields) -> None:
    """``log_with`` names known trackers (normalised to a list); tracker settings need their tracker."""
    if cfg.log_with is not None:
        names = [cfg.log_with] if isinstance(cfg.log_with, str) else cfg.log_with
        bad = [n for n in names if n not in ("tensorboard", "wandb")]
        if bad:
            raise ConfigError(f"log_with: {bad[0]!r} is not allowed; expected tensorboard, wandb or a list of them")
        cfg.log_with = list(names)
    if "wandb" not in (cfg.log_with or []):
        for name in ("wandb_project", "wandb_entity", "wandb_run_name", "wandb_tags"):
            if getattr(cfg, name):
                raise ConfigError(f"{name}: set, but log_with does not include wandb; add log_with: wandb or remove it")
    if cfg.log_dir is not None and "tensorboard" not in (cfg.log_with or []):
        raise ConfigError(
            "log_dir: set, but log_with does not include tensorboard; add log_with: tensorboard or remove it"
        )
    if not all(isinstance(t, str) for t in cfg.wandb_tags):
        raise ConfigError(f"wandb_tags: {cfg.wandb_tags!r} is not allowed; expected a list of strings")


def _check_prompts_and_adapters(cfg: ConfigFields) -> None:
    """PEFT target names, and the prompt/completion formatting pairs."""
    if cfg.target_modules is not None and not all(isinstance(m, str) for m in cfg.target_modules):
        raise ConfigError(f"target_modules: {cfg.target_modules!r} is not allowed; expected a list of module names")
    if (cfg.prompt_template is None) != (cfg.completion_template is None):
        raise ConfigError(
            "completion_template: prompt_template and completion_template go together; set both or neither"
        )
    if (cfg.prompt_func is None) != (cfg.completion_func is None):
        raise ConfigError("completion_func: prompt_func and completion_func go together; set both or neither")
    if cfg.prompt_func is not None and cfg.prompt_template is not None:
        raise ConfigError("prompt_func: set together with prompt_template; use templates or functions")


def _check_no_remote_code(cfg: ConfigFields) -> None:
    """``load_dataset`` runs a data set's own loading script when ``trust_remote_code`` is
    true (``datasets`` 3.x, which the dependency range allows): code from the hub, run in
    the tokenising task, is refused outright rather than left to a config's author."""
    if (cfg.dataset_kwargs or {}).get("trust_remote_code"):  # false: the default, harmless
        raise ConfigError(
            "dataset_kwargs.trust_remote_code: refused; diloco-ray never runs a data set's loading "
            "script; use a data set in files (JSON, JSONL, Parquet, CSV) or one saved with save_to_disk"
        )


def _check_builtin_size(cfg: ConfigFields) -> None:
    """A builtin data set's ``num_samples`` and ``digits``: whole numbers within bounds, since
    the rows are generated in memory (see :data:`~diloco_ray.config.fields.BUILTIN_MAX_SAMPLES`)."""
    if not (cfg.dataset_name or "").startswith("builtin:"):  # json_file_path cleared it
        return
    kwargs = cfg.dataset_kwargs or {}
    for key, most in (("num_samples", BUILTIN_MAX_SAMPLES), ("digits", BUILTIN_MAX_DIGITS)):
        value = kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ConfigError(
                f"dataset_kwargs.{key}: {value!r} is not allowed; expected an integer from 1 to {most:,} "
                f"({cfg.dataset_name} generates its rows in memory)"
            )


def _check_what_needs_another_field(cfg: ConfigFields) -> None:
    """Settings that only mean something with another one: early stopping, adapter merging,
    the error-feedback decay."""
    if cfg.early_stopping_patience is not None and cfg.eval_batches == 0:
        raise ConfigError("early_stopping_patience: needs eval_batches > 0 (it watches the eval loss)")
    if cfg.merge_adapter and not cfg.use_peft:
        raise ConfigError("merge_adapter: there is no adapter to merge without use_peft: true")
    feedback = cfg.pseudo_grad_compression == "topk" or (cfg.error_feedback and cfg.pseudo_grad_compression != "none")
    if cfg.error_feedback_decay != 1.0 and not feedback:
        raise ConfigError(
            f"error_feedback_decay: {cfg.error_feedback_decay} weighs a residual this run does not keep; "
            "it needs pseudo_grad_compression: topk, or a lossy codec with error_feedback: true"
        )


def _streamed(cfg: ConfigFields) -> bool:
    """Whether a round syncs in fragments or overlaps its sync (Streaming DiLoCo)."""
    return cfg.sync_fragments > 1 or cfg.overlap_communication


def _check_fragments(cfg: ConfigFields) -> None:
    """Streaming DiLoCo's fragments and overlap."""
    if cfg.sync_fragments > cfg.max_steps:
        raise ConfigError(
            f"sync_fragments: {cfg.sync_fragments} is more than max_steps={cfg.max_steps}; "
            "each fragment needs at least one inner step of its own"
        )
    if cfg.overlap_communication and cfg.sync_fragments == 1:
        # Overlap merges a fragment's new weights one sync period late; with one fragment
        # that merge would land just before the same fragment's next pseudo-gradient is
        # taken, scaling every update by fragment_alpha (to nothing at alpha 0).
        raise ConfigError(
            "overlap_communication: true needs sync_fragments >= 2 (a fragment's weights are merged "
            "while the next fragment trains); set sync_fragments: 2 or more, or overlap_communication: false"
        )


def _check_fault_plan(cfg: ConfigFields) -> None:
    faults.check_reachable(faults.parse(cfg.fault_plan), cfg)


def _check_what_streaming_rules_out(cfg: ConfigFields) -> None:
    """In-flight snapshots and adaptive inner steps need whole-model syncs at round ends."""
    streamed = _streamed(cfg)
    if streamed and cfg.checkpoint_steps is not None and cfg.checkpoint_steps < cfg.max_steps:
        raise ConfigError(
            f"checkpoint_steps: {cfg.checkpoint_steps} < max_steps asks for in-flight snapshots, "
            "which need sync_fragments: 1 and overlap_communication: false; use a multiple of max_steps"
        )
    if cfg.inner_time_s is not None:
        if streamed:
            # A streaming round's sync periods end at fixed steps; a budget would move them.
            raise ConfigError(
                "inner_time_s: adaptive inner steps need sync_fragments: 1 and overlap_communication: false"
            )
        if cfg.round_timeout_s is not None and cfg.inner_time_s >= cfg.round_timeout_s:
            raise ConfigError(
                f"inner_time_s: {cfg.inner_time_s:g} must be below round_timeout_s={cfg.round_timeout_s:g}, "
                "which must also leave time for the sync"
            )


def _check_ranks_list(cfg: ConfigFields) -> None:
    ranks = cfg.ranks_per_replica
    if isinstance(ranks, list) and (
        not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks)
    ):
        raise ConfigError(
            f"ranks_per_replica: {ranks!r} is not allowed; expected a whole number >= 1 or a non-empty "
            "list of them (one per replica id)"
        )


def _check_nodes_per_replica(cfg: ConfigFields) -> None:
    """A replica's ranks are spread evenly over its nodes, so each rank count must divide."""
    nodes, ranks = cfg.nodes_per_replica, cfg.ranks_per_replica
    uneven = sorted({r for r in (ranks if isinstance(ranks, list) else [ranks]) if r % nodes})
    if uneven:
        raise ConfigError(
            f"nodes_per_replica: {nodes} does not divide ranks_per_replica={ranks!r}; a replica's ranks "
            "are spread evenly over its nodes, so each rank count must be a multiple of nodes_per_replica "
            f"({', '.join(map(str, uneven))} {'is' if len(uneven) == 1 else 'are'} not)"
        )


def _check_sync_mode(cfg: ConfigFields) -> None:
    """Decoupled mode's limits (:func:`_check_decoupled`); sync mode has no stale contributions."""
    if cfg.sync_mode == "decoupled":
        _check_decoupled(cfg, _streamed(cfg))
    elif cfg.stale_correction != "none":
        raise ConfigError(
            f"stale_correction: {cfg.stale_correction} corrects stale contributions, which only "
            "sync_mode: decoupled merges; use stale_correction: none in sync mode"
        )


def _check_placement(cfg: ConfigFields) -> None:
    """The custom Ray resources that pin servers and replicas to nodes."""
    resources = cfg.server_resources
    if isinstance(resources, list) and len(resources) != cfg.num_param_servers:
        raise ConfigError(
            f"server_resources: a list needs one mapping per server actor "
            f"(num_param_servers={cfg.num_param_servers}), got {len(resources)}"
        )
    for name in ("server_resources", "replica_resources"):
        _check_resources(name, getattr(cfg, name))


def _check_links(cfg: ConfigFields) -> None:
    """The simulated link rates: one positive number, or one per replica slot (normalised to floats)."""
    if cfg.link_mbps is None:
        return
    rates = cfg.link_mbps if isinstance(cfg.link_mbps, list) else [cfg.link_mbps]
    if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in rates):
        raise ConfigError(
            f"link_mbps: {cfg.link_mbps!r} is not allowed; expected a positive number "
            "or a list of them (one per replica slot)"
        )
    if isinstance(cfg.link_mbps, list):
        cfg.link_mbps = [float(r) for r in rates]
        if len(rates) < cfg.replica_bounds[1]:
            raise ConfigError(
                f"link_mbps: {len(rates)} links listed but up to {cfg.replica_bounds[1]} "
                "replicas may run; list one per replica slot"
            )
    else:
        cfg.link_mbps = float(cfg.link_mbps)


def _check_resources(field: str, value: Any) -> None:
    """A resources field: a mapping of resource name -> non-negative amount, or a
    non-empty list of such mappings."""
    mappings = value if isinstance(value, list) else [value]
    ok = bool(mappings) and all(
        isinstance(m, dict)
        and all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
            for k, v in m.items()
        )
        for m in mappings
    )
    if not ok:
        raise ConfigError(
            f"{field}: {value!r} is not allowed; expected a mapping of Ray resource name to a "
            "non-negative amount (e.g. {region-us: 1}) or a non-empty list of them"
        )


def _check_decoupled(cfg: ConfigFields, streamed: bool) -> None:
    """What ``sync_mode: decoupled`` cannot be combined with, and why."""
    if streamed:
        raise ConfigError(
            "sync_mode: decoupled merges whole-model pseudo-gradients; it needs sync_fragments: 1 "
            "and overlap_communication: false"
        )
    if cfg.round_timeout_s is not None:
        # Nothing waits for a slow replica: it contributes when done, discounted by staleness.
        raise ConfigError(
            "round_timeout_s: decoupled mode has no round deadline (a slow replica's work is merged "
            "when it arrives, discounted by staleness); remove it, or bound a period with inner_time_s"
        )
    if cfg.checkpoint_steps is not None and cfg.checkpoint_steps < cfg.max_steps:
        raise ConfigError(
            f"checkpoint_steps: {cfg.checkpoint_steps} < max_steps asks for in-flight snapshots, which "
            "sync_mode: decoupled does not take (a resumed run trains in-flight data again); use a "
            "multiple of max_steps"
        )
    members = cfg.replica_bounds[1] + len(cfg.regions or ())  # each other region merges as one learner
    if cfg.min_quorum > members:
        raise ConfigError(
            f"min_quorum: {cfg.min_quorum} is more than the {members} replicas{' and regions' if cfg.regions else ''} "
            "that may run; it must be at most num_replicas (or max_replicas), plus one per region"
        )
    if cfg.stale_correction == "momentum" and (cfg.outer_opt != "SGD" or cfg.outer_momentum == 0):
        raise ConfigError(
            f"stale_correction: momentum needs the outer momentum of outer_opt: SGD with outer_momentum > 0 "
            f"(got {cfg.outer_opt}, outer_momentum {cfg.outer_momentum}); use stale_correction: none"
        )
    if cfg.decoupled_momentum == "delayed":
        kwargs = cfg.outer_opt_kwargs or {}
        if cfg.outer_opt != "SGD" or kwargs.get("nesterov", True) is False or kwargs.get("dampening", 0):
            raise ConfigError(
                f"decoupled_momentum: delayed (the default) is Nesterov momentum (outer_momentum) applied "
                f"once per round; it needs outer_opt: SGD with Nesterov and no dampening (got {cfg.outer_opt}"
                f"{' ' + str(kwargs) if kwargs else ''}); set decoupled_momentum: every_step for other outer optimizers"
            )


RULES: tuple[Callable[[ConfigFields], None], ...] = (
    _choose_sources,
    _check_replica_count,
    _check_logging,
    _check_prompts_and_adapters,
    _check_no_remote_code,
    _check_builtin_size,
    _check_what_needs_another_field,
    _check_fragments,
    _check_what_streaming_rules_out,
    _check_ranks_list,
    _check_nodes_per_replica,
    _check_sync_mode,
    _check_placement,
    _check_links,
    check_regions,
    _check_fault_plan,  # after the regions it may name
)
