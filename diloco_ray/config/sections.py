"""The typed sections of a job's config: each part of the job receives only what it needs.

Users write one flat config (YAML, ``--set``, :class:`~diloco_ray.config.schema.TrainerConfig`).
Inside, a part takes the section it reads, a small frozen dataclass, instead of the whole
config: the inner optimiser takes :class:`InnerOptimSection`, the outer step
:class:`OuterOptimSection`, and so on. A section's fields carry the flat config's names, so
the README's field table (generated from :mod:`diloco_ray.config.fields`) is the meaning of
each. :meth:`Sections.of` builds every section once from a validated config
(``TrainerConfig.sections()`` keeps the result). A field sits in more than one section where
two parts read it: ``diloco_loops`` is the horizon of both the inner and the outer schedule,
``seq_len`` cuts the samples and sizes a built model's positions, ``max_steps`` and
``ranks_per_replica`` shape both a round and the data plan that feeds it.

Sections hold values only; the rules between fields stay in :mod:`diloco_ray.config.validation`.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional, TypeVar, Union

from diloco_ray.config import fields
from diloco_ray.config.fields import ConfigFields

__all__ = [
    "CheckpointSection",
    "DataSection",
    "DecoupledSection",
    "EvalSection",
    "FaultPlanSection",
    "InnerOptimSection",
    "MembershipSection",
    "ModelSection",
    "ObservabilitySection",
    "OuterOptimSection",
    "PeftSection",
    "PlacementSection",
    "RunShapeSection",
    "Sections",
    "SyncCodecSection",
    "section_of",
]

SectionT = TypeVar("SectionT")


def section_of(kind: type[SectionT], source: object) -> SectionT:
    """A ``kind`` section whose every field is read from the same-named attribute of ``source``
    (a validated config, say). Mappings and lists are copied, so the section shares nothing
    mutable with ``source``."""
    return kind(**{f.name: copy.deepcopy(getattr(source, f.name)) for f in dataclasses.fields(kind)})


@dataclass(frozen=True)
class RunShapeSection:
    """The shape of the run: how many outer rounds of how many inner steps, and the sync mode.

    Args:
        sync_mode, max_steps, diloco_loops, inner_time_s: the config fields of those names.
    """

    sync_mode: Literal["sync", "decoupled"]
    max_steps: int
    diloco_loops: int
    inner_time_s: Optional[float]


@dataclass(frozen=True)
class ModelSection:
    """What model trains and how each rank computes it.

    Args:
        model_name, model_config, tokenizer_name, mixed_precision, attn_implementation,
        gradient_checkpointing, torch_compile, seed, seq_len: the config fields of those
        names (``seed`` seeds the model's initialisation; ``seq_len`` is a ``model_config``
        model's ``max_position_embeddings`` unless that names its own).
    """

    model_name: Optional[str]
    model_config: Optional[dict]
    tokenizer_name: Optional[str]
    mixed_precision: Literal["no", "bf16", "fp16"]
    attn_implementation: Optional[str]
    gradient_checkpointing: bool
    torch_compile: bool
    seed: int
    seq_len: int


@dataclass(frozen=True)
class PeftSection:
    """The PEFT adapter trained instead of all weights (``use_peft``).

    Args:
        use_peft, peft_type, lora_r, lora_alpha, lora_dropout, target_modules, peft_bias:
        the config fields of those names.
    """

    use_peft: bool
    peft_type: Literal["LORA", "IA3"]
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: Optional[list]
    peft_bias: Literal["none", "all", "lora_only"]


@dataclass(frozen=True)
class DataSection:
    """Where the rows come from, how they become token samples, and how they are batched.

    Args:
        dataset_name, subset, dataset_split, eval_split, split_ratio, dataset_kwargs,
        json_file_path, text_field, seq_len, batch_size, grad_accum, num_workers, streaming,
        shuffle_buffer, streaming_eval_rows, dynamic_batch, seed, prompt_template,
        completion_template, prompt_func, completion_func, group_by_length: the config
        fields of those names (``seed`` orders the data).
        max_steps, ranks_per_replica: the shape of one replica's round, which its data plan
        is cut into (``[step][micro]`` per rank); a replica's own view of the config
        (``TrainerConfig.for_replica``) has its rank count here, never a list.
    """

    dataset_name: Optional[str]
    subset: Optional[str]
    dataset_split: str
    eval_split: Optional[str]
    split_ratio: float
    dataset_kwargs: dict
    json_file_path: Optional[str]
    text_field: Optional[str]
    seq_len: int
    batch_size: int
    grad_accum: int
    num_workers: int
    streaming: bool
    shuffle_buffer: int
    streaming_eval_rows: int
    dynamic_batch: bool
    seed: int
    prompt_template: Optional[str]
    completion_template: Optional[str]
    prompt_func: Optional[str]
    completion_func: Optional[str]
    group_by_length: bool
    max_steps: int
    ranks_per_replica: Union[int, list]


@dataclass(frozen=True)
class InnerOptimSection:
    """The inner optimiser every rank steps, and its learning-rate schedule over the run.

    Args:
        inner_opt, inner_opt_kwargs, lr, lr_schedule, warmup_steps, min_lr_ratio,
        max_grad_norm: the config fields of those names.
        max_steps, diloco_loops: the schedule's horizon, ``max_steps * diloco_loops`` inner steps.
    """

    inner_opt: str
    inner_opt_kwargs: dict
    lr: float
    lr_schedule: Literal["constant", "cosine", "linear"]
    warmup_steps: int
    min_lr_ratio: float
    max_grad_norm: Optional[float]
    max_steps: int
    diloco_loops: int


@dataclass(frozen=True)
class OuterOptimSection:
    """The outer optimiser the parameter server steps, its schedule and its clipping.

    Args:
        outer_opt, outer_opt_kwargs, outer_lr, outer_momentum, outer_lr_schedule,
        outer_grad_clip: the config fields of those names.
        diloco_loops: the outer schedule's horizon, in rounds.
    """

    outer_opt: str
    outer_opt_kwargs: dict
    outer_lr: float
    outer_momentum: float
    outer_lr_schedule: Optional[Literal["cosine", "linear", "polynomial"]]
    outer_grad_clip: Optional[float]
    diloco_loops: int


@dataclass(frozen=True)
class DecoupledSection:
    """How ``sync_mode: decoupled`` merges: the quorum, the grace window, staleness, momentum.

    Args:
        min_quorum, grace_window_s, grace_fraction, align_periods, staleness_power,
        stale_correction, decoupled_momentum: the config fields of those names.
    """

    min_quorum: int
    grace_window_s: float
    grace_fraction: float
    align_periods: bool
    staleness_power: float
    stale_correction: Literal["none", "momentum"]
    decoupled_momentum: Literal["every_step", "delayed"]


@dataclass(frozen=True)
class MembershipSection:
    """Elastic membership: how many replicas run, spares, and the deadlines that drop one.

    Args:
        num_replicas, min_replicas, spare_replicas, max_replicas, round_timeout_s,
        join_timeout_s, placement_timeout_s, abort_grace_s, stall_timeout_s, call_timeout_s,
        shutdown_grace_s, restore_on_retry: the config fields of those names.
    """

    num_replicas: int
    min_replicas: int
    spare_replicas: int
    max_replicas: Optional[int]
    round_timeout_s: Optional[float]
    join_timeout_s: float
    placement_timeout_s: float
    abort_grace_s: float
    stall_timeout_s: float
    call_timeout_s: float
    shutdown_grace_s: float
    restore_on_retry: bool

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(least, most) replicas that may run: ``min_replicas`` and ``max_replicas``
        (default: ``num_replicas``), as ``TrainerConfig.replica_bounds``."""
        return fields.replica_bounds(self.num_replicas, self.min_replicas, self.max_replicas)


@dataclass(frozen=True)
class PlacementSection:
    """Where the actors run: ranks per replica, devices, CPUs and custom Ray resources.

    Args:
        ranks_per_replica, device, cpus_per_rank, server_cpus, server_resources,
        replica_resources, num_param_servers: the config fields of those names.
    """

    ranks_per_replica: Union[int, list]
    device: Literal["auto", "cpu", "cuda"]
    cpus_per_rank: float
    server_cpus: float
    server_resources: Union[dict, list]
    replica_resources: Union[dict, list]
    num_param_servers: int

    def ranks_of(self, replica_id: int) -> int:
        """The ranks of replica ``replica_id``: ``ranks_per_replica``, or its entry of a list."""
        return fields.ranks_of(self.ranks_per_replica, replica_id)

    @property
    def max_ranks(self) -> int:
        """The most ranks any replica has."""
        return fields.max_ranks(self.ranks_per_replica)


@dataclass(frozen=True)
class SyncCodecSection:
    """What crosses a link and how: the codecs both ways, error feedback, Streaming DiLoCo's
    fragments and overlap, and the simulated links.

    Args:
        pseudo_grad_compression, error_feedback, error_feedback_decay, anchor_on_host,
        weights_compression, compression_block, topk_fraction, sync_fragments,
        overlap_communication, fragment_alpha, link_mbps, link_latency_ms: the config
        fields of those names.
    """

    pseudo_grad_compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"]
    error_feedback: bool
    error_feedback_decay: float
    anchor_on_host: bool
    weights_compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"]
    compression_block: int
    topk_fraction: float
    sync_fragments: int
    overlap_communication: bool
    fragment_alpha: float
    link_mbps: Optional[Union[float, list]]
    link_latency_ms: float


@dataclass(frozen=True)
class FaultPlanSection:
    """The faults to inject, for tests and benchmarks (parsed by :mod:`diloco_ray.config.fault_plan`).

    Args:
        fault_plan: the config field of that name, as written (null: none).
    """

    fault_plan: Optional[list]


@dataclass(frozen=True)
class CheckpointSection:
    """What the run leaves on disk: the output folder, checkpoints, resuming and the final save.

    Args:
        output_dir, overwrite_output_dir, checkpoint_steps, save_total_limit, resume_from,
        final_shard_mb, merge_adapter: the config fields of those names.
        sync_mode, num_param_servers, sync_fragments: the layout of the servers' state a
            checkpoint records and a resume must match.
        max_steps: the inner steps of a round, the unit ``checkpoint_steps`` counts in.
        ranks_per_replica, seed: what wrote a checkpoint, recorded in its manifest.
        overlap_communication: with ``sync_fragments``, whether a rank's weights stay apart
            from the global ones between syncs (then a stop writes no checkpoint).
    """

    output_dir: str
    overwrite_output_dir: bool
    checkpoint_steps: Optional[int]
    save_total_limit: Optional[int]
    resume_from: Optional[str]
    final_shard_mb: float
    merge_adapter: bool
    sync_mode: Literal["sync", "decoupled"]
    num_param_servers: int
    sync_fragments: int
    max_steps: int
    ranks_per_replica: Union[int, list]
    seed: int
    overlap_communication: bool


@dataclass(frozen=True)
class EvalSection:
    """When the run evaluates, and when it stops early on the eval loss.

    Args:
        eval_batches, eval_every, early_stopping_patience, early_stopping_threshold: the
        config fields of those names.
    """

    eval_batches: int
    eval_every: int
    early_stopping_patience: Optional[int]
    early_stopping_threshold: float


@dataclass(frozen=True)
class ObservabilitySection:
    """Where the run reports: step events, TensorBoard and W&B (metrics.jsonl is always written).

    Args:
        output_dir, log_with, log_dir, logging_steps, wandb_project, wandb_entity,
        wandb_run_name, wandb_tags: the config fields of those names (``output_dir`` holds
        metrics.jsonl and the default ``log_dir``).
    """

    output_dir: str
    log_with: Optional[list]
    log_dir: Optional[str]
    logging_steps: int
    wandb_project: Optional[str]
    wandb_entity: Optional[str]
    wandb_run_name: Optional[str]
    wandb_tags: list


@dataclass(frozen=True)
class Sections:
    """Every section of one config, built at once by :meth:`of`.

    Args:
        run, model, peft, data, inner_optim, outer_optim, decoupled, membership, placement,
        sync_codec, faults, checkpointing, evaluation, observability: one section each
        (the classes of this module, in that order).
    """

    run: RunShapeSection
    model: ModelSection
    peft: PeftSection
    data: DataSection
    inner_optim: InnerOptimSection
    outer_optim: OuterOptimSection
    decoupled: DecoupledSection
    membership: MembershipSection
    placement: PlacementSection
    sync_codec: SyncCodecSection
    faults: FaultPlanSection
    checkpointing: CheckpointSection
    evaluation: EvalSection
    observability: ObservabilitySection

    @classmethod
    def of(cls, config: ConfigFields) -> Sections:
        """Every section of ``config``, which must already be validated (a TrainerConfig is)."""
        return cls(
            run=section_of(RunShapeSection, config),
            model=section_of(ModelSection, config),
            peft=section_of(PeftSection, config),
            data=section_of(DataSection, config),
            inner_optim=section_of(InnerOptimSection, config),
            outer_optim=section_of(OuterOptimSection, config),
            decoupled=section_of(DecoupledSection, config),
            membership=section_of(MembershipSection, config),
            placement=section_of(PlacementSection, config),
            sync_codec=section_of(SyncCodecSection, config),
            faults=section_of(FaultPlanSection, config),
            checkpointing=section_of(CheckpointSection, config),
            evaluation=section_of(EvalSection, config),
            observability=section_of(ObservabilitySection, config),
        )
