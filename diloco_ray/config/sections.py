"""The typed sections of a job's config: each part of the job receives only what it needs.

Users write one flat config (YAML, ``--set``, :class:`~diloco_ray.config.schema.TrainerConfig`).
Inside, a part takes the section it reads, a small frozen dataclass, instead of the whole
config: the inner optimiser takes :class:`InnerOptimSection`, the outer step
:class:`OuterOptimSection`, and so on. No section declares a field: each field is declared
once, in the table of :mod:`diloco_ray.config.fields`, with the sections that carry it, and
:func:`section` builds each class here from that table (the fields under the flat config's
names, in the table's order, and an ``Args:`` list of them with their descriptions). The
values derived from fields are the table's too (:class:`~diloco_ray.config.fields.DerivedValues`):
a section that carries a value's fields offers it by taking it from there.

:meth:`Sections.of` builds every section once from a validated config
(``TrainerConfig.sections()`` keeps the result). A field sits in more than one section where
two parts read it: ``diloco_loops`` is the horizon of both the inner and the outer schedule,
``seq_len`` cuts the samples and sizes a built model's positions, ``max_steps`` and
``ranks_per_replica`` shape both a round and the data plan that feeds it.

Sections hold values only; the rules between fields stay in :mod:`diloco_ray.config.validation`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, TypeVar

from diloco_ray.config import fields as table
from diloco_ray.config.fields import ConfigFields, DerivedValues

__all__ = [
    "ChannelSection",
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
    "section",
    "section_fields",
    "section_of",
]

SectionT = TypeVar("SectionT")

# Section name (a Sections attribute) -> its class, as section() builds them.
SECTION_CLASSES: dict[str, type] = {}


def section_fields(name: str) -> list[dataclasses.Field]:
    """The fields of the table that section ``name`` carries, in the table's order."""
    return [f for f in dataclasses.fields(ConfigFields) if name in f.metadata["sections"]]


def section(name: str) -> Callable[[type], type]:
    """Make a class the frozen dataclass of section ``name`` (one of
    :data:`~diloco_ray.config.fields.SECTION_NAMES`): its fields are the table's fields that
    name it, in the table's order, with the table's types and no defaults, and its docstring
    (the section's purpose) gains an ``Args:`` list of them with their descriptions."""

    def build(cls: type) -> type:
        carried = section_fields(name)
        if not carried or name in SECTION_CLASSES:
            raise ValueError(f"section {name!r}: no field names it, or it is built twice")
        cls.__annotations__ = {f.name: table.FIELD_TYPES[f.name] for f in carried}
        args = "\n".join(f"    {f.name}: {f.metadata['help']}" for f in carried)
        cls.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\nArgs:\n{args}\n"
        SECTION_CLASSES[name] = dataclass(frozen=True)(cls)
        return SECTION_CLASSES[name]

    return build


def section_of(kind: type[SectionT], source: object) -> SectionT:
    """A ``kind`` section whose every field is read from the same-named attribute of ``source``
    (a validated config, say). Mappings and lists are copied, so the section shares nothing
    mutable with ``source``."""
    return kind(**{f.name: copy.deepcopy(getattr(source, f.name)) for f in dataclasses.fields(kind)})


@section(table.RUN)
class RunShapeSection:
    """The shape of the run: how many outer rounds of how many inner steps, and the sync mode."""


@section(table.MODEL)
class ModelSection:
    """What model trains and how each rank computes it. ``seed`` seeds the model's
    initialisation; ``seq_len`` is a ``model_config`` model's ``max_position_embeddings``
    unless that names its own."""


@section(table.PEFT)
class PeftSection:
    """The PEFT adapter trained instead of all weights (``use_peft``)."""


@section(table.DATA)
class DataSection:
    """Where the rows come from, how they become token samples, and how they are batched.
    ``seed`` orders the data. ``max_steps`` and ``ranks_per_replica`` are the shape of one
    replica's round, which its data plan is cut into (``[step][micro]`` per rank); a
    replica's own view of the config (``TrainerConfig.for_replica``) has its rank count
    here, never a list."""

    ranks_of = DerivedValues.ranks_of
    sequences_for = DerivedValues.sequences_for
    sequences_per_replica_round = DerivedValues.sequences_per_replica_round
    replicas_in = DerivedValues.replicas_in
    region_of = DerivedValues.region_of


@section(table.INNER_OPTIM)
class InnerOptimSection:
    """The inner optimiser every rank steps, and its learning-rate schedule over the run, whose
    horizon is ``max_steps * diloco_loops`` inner steps."""


@section(table.OUTER_OPTIM)
class OuterOptimSection:
    """The outer optimiser the parameter server steps, its schedule (over ``diloco_loops``
    rounds) and its clipping. The codec-defaulted ``outer_lr`` and ``outer_momentum`` are
    never null here: a validated config has resolved them."""


@section(table.DECOUPLED)
class DecoupledSection:
    """How ``sync_mode: decoupled`` merges: the quorum, the grace window, staleness, momentum."""


@section(table.MEMBERSHIP)
class MembershipSection:
    """Elastic membership: how many replicas run, spares, and the deadlines that drop one."""

    replica_bounds = DerivedValues.replica_bounds


@section(table.PLACEMENT)
class PlacementSection:
    """Where the actors run: ranks per replica, devices, CPUs and custom Ray resources."""

    ranks_of = DerivedValues.ranks_of
    max_ranks = DerivedValues.max_ranks


@section(table.SYNC_CODEC)
class SyncCodecSection:
    """What crosses a link and how: the codecs both ways, error feedback, Streaming DiLoCo's
    fragments and overlap, and the simulated links. The codec-defaulted
    ``error_feedback_decay`` and ``topk_fraction`` are never null here: a validated config
    has resolved them."""


@section(table.FAULTS)
class FaultPlanSection:
    """The faults to inject, for tests and benchmarks, as written (parsed by
    :mod:`diloco_ray.config.fault_plan`; null: none)."""


@section(table.CHECKPOINTING)
class CheckpointSection:
    """What the run leaves on disk: the output folder, checkpoints, resuming and the final save.
    ``sync_mode``, ``num_param_servers`` and ``sync_fragments`` are the layout of the servers'
    state a checkpoint records and a resume must match; ``max_steps`` is the unit
    ``checkpoint_steps`` counts in; ``ranks_per_replica`` and ``seed`` say what wrote a
    checkpoint, in its manifest; ``overlap_communication``, with ``sync_fragments``, says
    whether a rank's weights stay apart from the global ones between syncs (then a stop
    writes no checkpoint)."""


@section(table.EVALUATION)
class EvalSection:
    """When the run evaluates, and when it stops early on the eval loss."""


@section(table.OBSERVABILITY)
class ObservabilitySection:
    """Where the run reports: step events, TensorBoard and W&B (metrics.jsonl is always
    written, in ``output_dir``, which also holds the default ``log_dir``). A validated
    ``log_with`` is a list (or null)."""


@section(table.CHANNEL)
class ChannelSection:
    """The other regions of the run and the channel they join it over (its port, TLS files
    and where its token is read from; never the token itself)."""

    region_of = DerivedValues.region_of


@dataclass(frozen=True)
class Sections:
    """Every section of one config, built at once by :meth:`of`.

    Args:
        run, model, peft, data, inner_optim, outer_optim, decoupled, membership, placement,
        sync_codec, faults, checkpointing, evaluation, observability, channel: one section each
        (the classes of this module, in that order; the names the table's fields give).
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
    channel: ChannelSection

    @classmethod
    def of(cls, config: ConfigFields) -> Sections:
        """Every section of ``config``, which must already be validated (a TrainerConfig is)."""
        return cls(**{part.name: section_of(SECTION_CLASSES[part.name], config) for part in dataclasses.fields(cls)})
