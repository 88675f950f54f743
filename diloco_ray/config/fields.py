"""The config's field table: every knob of a diloco-ray job, declared once with its type,
default, one-line meaning, range and the section(s) of the job that read it, and the values
derived from the fields.

This module is the shape alone: :class:`ConfigFields` declares the fields and nothing checks
them here. :mod:`diloco_ray.config.validation` checks a :class:`ConfigFields` against this
table, :mod:`diloco_ray.config.schema` adds loading, saving and validation on construction
(:class:`~diloco_ray.config.schema.TrainerConfig`), and :mod:`diloco_ray.config.sections`
builds the typed sections each part of the job receives from the section names each field
declares here. The dependencies point one way: every other config module imports this one,
and this one imports none of them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

# A builtin data set is generated whole in memory, in every process that tokenizes it, as
# Python objects per row plus an Arrow copy. The cap allows far more rows than the default and
# than the sums of up to three digits hold, yet refuses a typo's extra zeros, which would fill
# a node's memory. A row's text grows with digits (a+b=c), so digits is bounded as well.
BUILTIN_MAX_SAMPLES = 1_000_000
BUILTIN_MAX_DIGITS = 18

# The sections of a job's config (the attributes of config.sections.Sections, in that order):
# each field below names the one or ones whose part reads it.
RUN, MODEL, PEFT, DATA = "run", "model", "peft", "data"
INNER_OPTIM, OUTER_OPTIM, DECOUPLED, MEMBERSHIP = "inner_optim", "outer_optim", "decoupled", "membership"
PLACEMENT, SYNC_CODEC, FAULTS = "placement", "sync_codec", "faults"
CHECKPOINTING, EVALUATION, OBSERVABILITY = "checkpointing", "evaluation", "observability"
CHANNEL = "channel"
SECTION_NAMES = (
    RUN,
    MODEL,
    PEFT,
    DATA,
    INNER_OPTIM,
    OUTER_OPTIM,
    DECOUPLED,
    MEMBERSHIP,
    PLACEMENT,
    SYNC_CODEC,
    FAULTS,
    CHECKPOINTING,
    EVALUATION,
    OBSERVABILITY,
    CHANNEL,
)
# A region joins the home's round as one member, under an id of its own: this plus the
# region's index in ``regions``, far above any replica's id.
REGION_ID_BASE = 1_000_000
# From this many rounds (diloco_loops) topk's own outer step drops its momentum (see
# CODEC_DEFAULTS below); the fields' help cites it, so it is named before them.
TOPK_LONG_RUN_ROUNDS = 32


def is_region_member(replica_id: int) -> bool:
    """Whether ``replica_id`` stands for a region (its one member in the home's round), not
    a replica: what the servers screen and the held-out check tries."""
    return replica_id >= REGION_ID_BASE


def _f(sections: str | tuple[str, ...], default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field with the section(s) that carry it, a one-line description and
    validation rules.

    Args:
        sections: the section (one of :data:`SECTION_NAMES`) or sections whose parts read
            the field; each carries it under its own name.
        default: the default value (dicts and lists are copied per instance).
        help: one line shown by ``--help`` and in the README's field table.
        rules: ``ge``/``gt``/``le``/``lt`` numeric bounds.
    """
    carried_by = (sections,) if isinstance(sections, str) else tuple(sections)
    unknown = [name for name in carried_by if name not in SECTION_NAMES]
    if unknown or not carried_by:
        raise ValueError(f"a field's sections must be some of {SECTION_NAMES}, got {sections!r}")
    meta = {"help": help, "sections": carried_by, **rules}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class DerivedValues:
    """The values derived from fields, each defined here once. :class:`ConfigFields` inherits
    them, and a section that carries the fields a value reads offers the same value
    (:mod:`diloco_ray.config.sections` takes it from this class), so nobody recomputes one
    differently.
    """

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(least, most) replicas that may run: ``min_replicas``, and ``max_replicas`` or else
        ``num_replicas`` (never under ``min_replicas``)."""
        return self.min_replicas, self.max_replicas or max(self.num_replicas, self.min_replicas)

    def ranks_of(self, replica_id: int) -> int:
        """The ranks of replica ``replica_id``: ``ranks_per_replica``, or its entry of a list
        (cycled by id)."""
        ranks = self.ranks_per_replica
        return int(ranks[replica_id % len(ranks)]) if isinstance(ranks, list) else int(ranks)

    @property
    def max_ranks(self) -> int:
        """The most ranks any replica has."""
        ranks = self.ranks_per_replica
        return max(ranks) if isinstance(ranks, list) else int(ranks)

    def sequences_for(self, replica_id: int) -> int:
        """Training sequences replica ``replica_id`` consumes in one outer round (all its
        ranks; a region's member: all its replicas')."""
        return (
            self.max_steps
            * self.grad_accum
            * self.batch_size
            * self.ranks_of(replica_id)
            * self.replicas_in(replica_id)
        )

    def replicas_in(self, replica_id: int) -> int:
        """The replicas behind member ``replica_id``: 1 for a replica of this cluster, a
        region's ``replicas`` for the member that stands for that region."""
        region = self.region_of(replica_id)
        return 1 if region is None else int(region["replicas"])

    def region_of(self, replica_id: int) -> Optional[dict]:
        """The entry of ``regions`` that member ``replica_id`` stands for (None: a replica)."""
        index = replica_id - REGION_ID_BASE
        return self.regions[index] if self.regions and 0 <= index < len(self.regions) else None

    @property
    def sequences_per_replica_round(self) -> int:
        """Training sequences one replica consumes in one outer round (all its ranks); with
        a list of ``ranks_per_replica``, each replica has its own (:meth:`sequences_for`)."""
        if isinstance(self.ranks_per_replica, list):
            raise TypeError("ranks_per_replica is a list: ask sequences_for(replica_id)")
        return self.sequences_for(0)


@dataclass
class ConfigFields(DerivedValues):
    """The fields of a DiLoCo job, unchecked; build a :class:`~diloco_ray.config.schema.TrainerConfig`,
    which validates them.

    Field names follow the seed documents (``max_steps`` is inner steps per outer round,
    ``diloco_loops`` the number of outer rounds); see each field's description. Each field
    names first the section(s) that carry it (:data:`SECTION_NAMES`), then its default, its
    description and its range.
    """

    # One field per line: the table below is the generated docs (README, --help) and the
    # sections' fields. The group headings order the docs; the first argument of each field
    # says which sections carry it.
    # fmt: off
    # --- model -----------------------------------------------------------------------
    model_name: Optional[str] = _f(MODEL, None, "Hugging Face hub id or local folder of a causal LM (from_pretrained); replaces model_config")
    model_config: Optional[dict] = _f(MODEL, None, "architecture of a fresh model, used when model_name is null, e.g. {model_type: llama, hidden_size: 64}")
    tokenizer_name: Optional[str] = _f(MODEL, None, "tokenizer hub id or folder (default: model_name, or 'builtin:char' for model_config)")
    mixed_precision: Literal["no", "bf16", "fp16"] = _f(MODEL, "no", "inner-loop compute precision; master weights stay fp32")
    attn_implementation: Optional[str] = _f(MODEL, None, "attention kernel passed to transformers (sdpa, eager, flash_attention_2; null: its default)")
    gradient_checkpointing: bool = _f(MODEL, False, "recompute activations in the backward pass to save memory")
    torch_compile: bool = _f(MODEL, False, "torch.compile the model on each rank")
    # --- data ------------------------------------------------------------------------
    dataset_name: Optional[str] = _f(DATA, None, "datasets.load_dataset name or folder; 'builtin:arithmetic' is generated offline")
    subset: Optional[str] = _f(DATA, None, "dataset configuration name (load_dataset's second argument)")
    dataset_split: str = _f(DATA, "train", "split to train on")
    eval_split: Optional[str] = _f(DATA, None, "split to evaluate on (default: hold out split_ratio of the training split)")
    split_ratio: float = _f(DATA, 0.05, "fraction of the training split held out for eval when there is no eval_split", gt=0.0, le=0.5)
    dataset_kwargs: dict = _f(DATA, {}, f"extra keyword arguments to load_dataset (e.g. data_files) or to a builtin generator (builtin:arithmetic: num_samples 1 to {BUILTIN_MAX_SAMPLES:,}, digits 1 to {BUILTIN_MAX_DIGITS})")
    json_file_path: Optional[str] = _f(DATA, None, "local JSON/JSONL file to train on; when set, it replaces dataset_name")
    text_field: Optional[str] = _f(DATA, None, "column holding the text (default: 'text', else the only string column)")
    seq_len: int = _f((MODEL, DATA), 512, "tokens per training sequence (texts are packed to this length)", ge=8)
    batch_size: int = _f(DATA, 8, "sequences per micro-batch, per rank", ge=1)
    grad_accum: int = _f(DATA, 1, "micro-batches accumulated per inner step", ge=1)
    num_workers: int = _f(DATA, 0, "DataLoader worker processes per rank", ge=0)
    streaming: bool = _f(DATA, False, "read the data set as a stream (load_dataset(streaming=True)) instead of downloading it whole")
    shuffle_buffer: int = _f(DATA, 10000, "shuffle buffer for streamed data sets", ge=1)
    streaming_eval_rows: int = _f(DATA, 1000, "with streaming: rows of eval_split (or held out from the train split) to evaluate on", ge=1)
    dynamic_batch: bool = _f(DATA, False, "pad to the longest sequence of a batch instead of seq_len")
    seed: int = _f((MODEL, DATA, CHECKPOINTING), 42, "seed for model init, data order and sampling", ge=0)
    # --- inner loop ------------------------------------------------------------------
    max_steps: int = _f((RUN, DATA, INNER_OPTIM, CHECKPOINTING), 500, "inner steps per outer round (H in the DiLoCo paper)", ge=1)
    inner_time_s: Optional[float] = _f(RUN, None, "adaptive inner steps: each replica's time budget for a round's inner steps; it runs as many as fit (at least 1, at most max_steps), judged from its own step times, and counts in the outer mean by the tokens it trained on; data it had no time for is handed out again (null: always max_steps)", gt=0.0)
    lr: float = _f(INNER_OPTIM, 3e-4, "inner learning rate (peak, after warmup)", gt=0.0)
    lr_schedule: Literal["constant", "cosine", "linear"] = _f(INNER_OPTIM, "cosine", "inner lr schedule over all inner steps of the run")
    warmup_steps: int = _f(INNER_OPTIM, 0, "inner steps of linear lr warmup at the start of the run", ge=0)
    min_lr_ratio: float = _f(INNER_OPTIM, 0.1, "final inner lr as a fraction of lr (cosine, linear)", ge=0.0, le=1.0)
    max_grad_norm: Optional[float] = _f(INNER_OPTIM, 1.0, "inner gradient clipping by global L2 norm (null: off)", gt=0.0)
    inner_opt: str = _f(INNER_OPTIM, "AdamW", "inner optimizer: a torch.optim class name")
    inner_opt_kwargs: dict = _f(INNER_OPTIM, {}, "extra keyword arguments for the inner optimizer (e.g. weight_decay, betas)")
    # --- outer loop ------------------------------------------------------------------
    diloco_loops: int = _f((RUN, INNER_OPTIM, OUTER_OPTIM), 10, "outer rounds to run", ge=1)
    outer_opt: str = _f(OUTER_OPTIM, "SGD", "outer optimizer: a torch.optim class name")
    outer_opt_kwargs: dict = _f(OUTER_OPTIM, {}, "extra keyword arguments for the outer optimizer (SGD: nesterov defaults to true)")
    outer_lr: Optional[float] = _f(OUTER_OPTIM, None, "outer learning rate (null: 0.5; 1.3 when pseudo_grad_compression: topk and outer_momentum is null too: topk then brings its whole outer step; see docs/results.md, Outer step)", gt=0.0)
    outer_momentum: Optional[float] = _f(OUTER_OPTIM, None, f"outer momentum, Nesterov with SGD (null: 0.5, with topk's outer step too, and 0 in topk's step when diloco_loops >= {TOPK_LONG_RUN_ROUNDS}, as SparseLoCo runs it; the DiLoCo paper's 0.9 with lr 0.7 is for runs of hundreds of rounds)", ge=0.0, lt=1.0)
    outer_lr_schedule: Optional[Literal["cosine", "linear", "polynomial"]] = _f(OUTER_OPTIM, None, "outer lr schedule over diloco_loops (null: constant)")
    outer_momentum_warmup_rounds: Optional[int] = _f(OUTER_OPTIM, None, f"outer updates (rounds; decoupled: merges) over which the outer momentum rises linearly to outer_momentum: update r (from 0) uses outer_momentum x (r + 1) / (this + 1); 0: the whole outer_momentum from the start (null: 4 with the default outer step or topk's, 0 with topk's over {TOPK_LONG_RUN_ROUNDS} rounds or more or one set by hand or an outer_opt other than SGD). Needs an outer_opt with a momentum (SGD)", ge=0)
    outer_grad_clip: Optional[float] = _f(OUTER_OPTIM, None, "clip the outer gradient to this global L2 norm (null: off)", gt=0.0)
    # --- decoupled mode ----------------------------------------------------------------
    sync_mode: Literal["sync", "decoupled"] = _f((RUN, CHECKPOINTING), "sync", "sync: every round waits for all replicas (up to round_timeout_s) and averages them; decoupled: each replica trains on its own clock and the server merges whatever has arrived (min_quorum, grace window, staleness discount; see docs/decoupled.md)")
    min_quorum: int = _f(DECOUPLED, 1, "decoupled: contributions the server waits for before an outer step (fewer when fewer replicas are active)", ge=1)
    grace_window_s: float = _f(DECOUPLED, 300.0, "decoupled: the longest grace window, in seconds (see grace_fraction)", ge=0.0)
    grace_fraction: float = _f(DECOUPLED, 0.25, "decoupled: after the quorum, the server waits for the replicas expected (from their pace) within this share of a typical period, each until its expected arrival plus a quarter of its period; at most grace_window_s", ge=0.0, le=1.0)
    align_periods: bool = _f(DECOUPLED, True, "decoupled: a period that would end well after others' arrivals (a replica that arrived just after a merge, a spare joining, a slower replica) gets a time budget that lands it with them, so merges hold the replicas that can arrive together and a slower replica runs a shorter H instead of being merged stale; not when min_quorum is all active replicas (lockstep) (false: every period runs max_steps)")
    staleness_power: float = _f(DECOUPLED, 1.0, "decoupled: a contribution s outer momentum steps stale (merges since it started with every_step; round's-worth cycles with delayed) is weighted by tokens * (1 + s) ** -staleness_power (0: no discount)", ge=0.0)
    stale_correction: Literal["none", "momentum"] = _f(DECOUPLED, "none", "decoupled: momentum corrects a stale contribution against the outer momentum before it is merged: a tensor whose pseudo-gradient points against the momentum loses its component along it (HeLoCo's reference, simplest form); none: stale contributions are only discounted (staleness_power). Needs an outer optimizer with momentum (SGD)")
    decoupled_momentum: Literal["every_step", "delayed"] = _f(DECOUPLED, "delayed", "decoupled: outer momentum rule; delayed applies each merge's gradient at once and Nesterov momentum once per round's worth of merged tokens (Async Local-SGD's delayed Nesterov), so momentum compounds once per round whatever the merge pattern and a cycle of whole merges is the synchronous step (needs outer_opt SGD with momentum); every_step steps outer_opt at every merge (any outer_opt; a merge of fewer replicas is a momentum step too)")
    # --- replicas and the cluster ----------------------------------------------------
    num_replicas: int = _f(MEMBERSHIP, 2, "DiLoCo replicas (workers) to run; each is one Ray actor group", ge=1)
    min_replicas: int = _f(MEMBERSHIP, 1, "rounds proceed while at least this many replicas report", ge=1)
    spare_replicas: int = _f(MEMBERSHIP, 0, "hot spares: replicas placed and set up but not training; one takes a lost replica's place at the next round boundary (decoupled mode: as soon as the loss is seen) with no cold start, and a new spare starts in the background", ge=0)
    max_replicas: Optional[int] = _f(MEMBERSHIP, None, "upper bound for scale() (default: num_replicas)", ge=1)
    ranks_per_replica: Union[int, list] = _f((DATA, PLACEMENT, CHECKPOINTING), 1, "FSDP ranks (processes; GPUs on GPU) inside one replica; a list gives one count per replica id (id i takes entry i mod the list's length), and each replica trains on data in proportion to its ranks", ge=1)
    nodes_per_replica: int = _f(PLACEMENT, 1, "nodes each replica's ranks are spread over, evenly: every ranks_per_replica must be a multiple of it; one placement group with a bundle per node (STRICT_SPREAD) and FSDP over all the ranks, which meet at a TCP store on the replica's first node (1: the replica shares one node)", ge=1)
    device: Literal["auto", "cpu", "cuda"] = _f(PLACEMENT, "auto", "where ranks run: cuda if the cluster has GPUs (auto), or forced")
    cpus_per_rank: float = _f(PLACEMENT, 1.0, "Ray CPUs reserved per rank actor (also its torch threads)", gt=0.0)
    server_cpus: float = _f(PLACEMENT, 1.0, "Ray CPUs reserved for the parameter-server actor", ge=0.0)
    server_gpus: float = _f(PLACEMENT, 0.0, "Ray GPUs each parameter-server actor takes, at most 1 (a server uses one; a fraction lets servers share one): the replicas' messages are decoded, summed and stepped there and the weights messages built there (0: the servers work on the host)", ge=0.0, le=1.0)
    server_resources: Union[dict, list] = _f(PLACEMENT, {}, "custom Ray resources the server actors need, to pin them to nodes (e.g. {head: 1}); a list gives one mapping per server actor")
    replica_resources: Union[dict, list] = _f(PLACEMENT, {}, "custom Ray resources every rank of a replica needs, to pin replicas to nodes or regions (e.g. {region-us: 1}); a list gives one mapping per replica id (id i takes entry i mod the list's length)")
    num_param_servers: int = _f((PLACEMENT, CHECKPOINTING), 1, "parameter-server actors; the parameters are split over them, balanced by bytes", ge=1)
    round_timeout_s: Optional[float] = _f(MEMBERSHIP, None, "straggler deadline for one round; late replicas are dropped from it", gt=0.0)
    join_timeout_s: float = _f(MEMBERSHIP, 0.0, "how long a round boundary waits for starting replicas before going on without them", ge=0.0)
    placement_timeout_s: float = _f(MEMBERSHIP, 600.0, "how long to wait for room for min_replicas replicas before giving up", gt=0.0)
    abort_grace_s: float = _f(MEMBERSHIP, 30.0, "how long a replica late for its round's deadline has to stop before it is dropped as unresponsive (a frozen process)", gt=0.0)
    stall_timeout_s: float = _f(MEMBERSHIP, 600.0, "a replica whose ranks show no progress (no inner step, no reply) for this long is dropped as frozen, with or without round_timeout_s (decoupled: it is told to stop first, and stays if it answers within abort_grace_s)", gt=0.0)
    call_timeout_s: float = _f(MEMBERSHIP, 600.0, "deadline for a call on a replica outside its round (eval, checkpoint, final save); one that misses it is dropped as dead", gt=0.0)
    shutdown_grace_s: float = _f(MEMBERSHIP, 60.0, "on SIGTERM or Ctrl-C: how long the driver may take to stop the round in flight and checkpoint the last completed round (with checkpoint_steps set) before it exits", ge=0.0)
    restore_on_retry: bool = _f(MEMBERSHIP, True, "on a re-run round, restore each replica's inner optimizer, RNG and error-feedback residual to the round's start (a host copy per rank: 8 bytes per parameter for AdamW, over the replica's ranks); false keeps them as trained, as torchft does. Local weights always restart from the global ones")
    fault_plan: Optional[list] = _f(FAULTS, None, "for tests and benchmarks: faults to inject, e.g. [{kind: kill, replica: 1, round: 2, step: 3}] (kinds: kill, freeze, slow, nan, drop_link, slowdown with factor: every step that many times as long from then on, or with seconds: that much longer, scale with factor: that period's pseudo-gradient times it; target server: kill; target driver: kill, term); every kind fires in both sync modes (decoupled: round is a merge index); see diloco_ray/config/fault_plan.py")
    # --- sync over slow links -----------------------------------------------------------
    pseudo_grad_compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"] = _f(SYNC_CODEC, "none", "codec for pseudo-gradients sent to the server (int8/int4: blockwise absmax scales; topk: per block the topk_fraction largest values, 2 bits each, with error feedback always on)")
    error_feedback: bool = _f(SYNC_CODEC, False, "carry each replica's compression residual into its next sync (reset when a replica joins; no effect with none; always on with topk)")
    error_feedback_decay: Optional[float] = _f(SYNC_CODEC, None, "with error feedback, each sync sends the codec's share of pseudo-gradient + decay x residual (null: 1.0; 0.95, SparseLoCo's, with topk's outer step: pseudo_grad_compression: topk with outer_lr and outer_momentum null)", ge=0.0, le=1.0)
    anchor_on_host: bool = _f(SYNC_CODEC, False, "on GPU, keep each rank's anchor (its rows of the global weights, 4 bytes per parameter over the replica's ranks) in pinned host memory instead of GPU memory, as torchft does; the pseudo-gradient is then taken on the host")
    weights_compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"] = _f(SYNC_CODEC, "none", "codec for the weights sent back to replicas, as a delta against what they hold (none: full fp32)")
    compression_block: int = _f(SYNC_CODEC, 2048, "values per absmax scale for the int8/int4 codecs, and per top-k selection for topk", ge=16)
    topk_fraction: Optional[float] = _f(SYNC_CODEC, None, "topk: the share of each block's values sent (null: 1/64 with topk's outer step: pseudo_grad_compression: topk with outer_lr and outer_momentum null; else 1/16; at block 2048 0.219 and 0.828 bits per parameter before headers; see docs/slow-links.md, Codec frontier)", gt=0.0, le=1.0)
    sync_fragments: int = _f((SYNC_CODEC, CHECKPOINTING), 1, "Streaming DiLoCo: sync 1/F of the parameters (strided layer groups) every max_steps/F inner steps (rounded down)", ge=1)
    overlap_communication: bool = _f((SYNC_CODEC, CHECKPOINTING), False, "keep running inner steps while a fragment's sync is in flight; merge it one sync period later")
    fragment_alpha: float = _f(SYNC_CODEC, 0.5, "with overlap: a returning fragment becomes alpha*local + (1-alpha)*global", ge=0.0, le=1.0)
    link_mbps: Optional[Union[float, list]] = _f(SYNC_CODEC, None, "simulated replica<->server link bandwidth in Mbit/s: a number, or a list per replica slot (null: not simulated)")
    link_latency_ms: float = _f(SYNC_CODEC, 0.0, "simulated one-way latency of each replica's link in ms", ge=0.0)
    # --- regions: Ray clusters of their own, joined by one channel --------------------------
    regions: Optional[list] = _f((CHANNEL, DATA, MEMBERSHIP), None, "other regions, each a Ray cluster of its own that joins this run over the channel (diloco-ray region): [{name: eu, replicas: 2}, ...]; each trains its replicas there and sends one merged message per sync (see README, Regions)")
    channel_host: str = _f(CHANNEL, "0.0.0.0", "with regions: the address the channel listens on")
    channel_port: int = _f(CHANNEL, 7443, "with regions: the channel's one TLS port, which the regions dial out to (0: any free port, logged)", ge=0, le=65535)
    channel_tls_cert: Optional[str] = _f(CHANNEL, None, "with regions: the home's TLS certificate (PEM file), which the regions check against their CA certificate")
    channel_tls_key: Optional[str] = _f(CHANNEL, None, "with regions: the private key of channel_tls_cert (PEM file)")
    channel_tokens_file: Optional[str] = _f(CHANNEL, None, "with regions: the file of the regions' tokens, one `NAME TOKEN` line per token (two for a region while it rotates), readable by its owner only; a call is the region its token is listed under. Read again when it changes: tokens are added, rotated and revoked without stopping the run; never written to config.yaml or a log")
    channel_timeout_s: float = _f(CHANNEL, 20.0, "with regions: a region not heard from for this long (its agent beats five times as often) is cut off: the round in flight goes on without it, and it takes part again once it is heard from", ge=2.0)
    home_region: str = _f(MEMBERSHIP, "home", "with regions: this region's name in the round records' regions")
    min_regions: int = _f(MEMBERSHIP, 1, "with regions, sync mode: a round is applied only when replicas of at least this many regions (the home counted) reported; else it runs again", ge=1)
    region_screen_norm: Optional[float] = _f(CHANNEL, 10.0, "with regions: a region's contribution whose L2 norm is over this many times the median of the sync's other contributions' (alone: of the last 8 accepted in syncs of its rows; none yet: rejected) is rejected as screened out (null: off); see docs/security.md", gt=1.0)
    region_holdout_margin: Optional[float] = _f(CHANNEL, None, "with regions, sync mode, whole rounds: each region's contribution is tried before it is applied (the round's weights minus it, evaluated on the eval batches on a home replica) and refused when that eval loss is more than this many nats above the round's weights' own (null: off); see docs/security.md", ge=0.0)
    region_downlink: Literal["auto", "step", "weights"] = _f(SYNC_CODEC, "weights", "with regions: what a region gets per sync. step: the sync's applied contributions as they crossed, with the step's inputs, and the region takes the outer step itself on its copy of the servers (checked by digest; the whole state once when it joins, falls behind or differs); weights: the weights messages, as the home's replicas get them (weights_compression); auto: step with pseudo_grad_compression: topk and servers on the host (server_gpus: 0), else weights. weights is the default until a region whose replica is replaced after an outage rejoins as reliably with step; see docs/slow-links.md")
    channel_max_frame_mb: float = _f(CHANNEL, 8.0, "with regions: the largest message the channel accepts, in MiB (transfers go in 1 MiB chunks)", ge=2.0)
    # --- PEFT ------------------------------------------------------------------------
    use_peft: bool = _f(PEFT, False, "train a PEFT adapter instead of all weights")
    peft_type: Literal["LORA", "IA3"] = _f(PEFT, "LORA", "PEFT method")
    lora_r: int = _f(PEFT, 8, "LoRA rank", ge=1)
    lora_alpha: float = _f(PEFT, 16.0, "LoRA alpha (scaling = alpha / r)", gt=0.0)
    lora_dropout: float = _f(PEFT, 0.05, "LoRA dropout", ge=0.0, lt=1.0)
    target_modules: Optional[list] = _f(PEFT, None, "module names to adapt (default: peft's choice for the architecture)")
    peft_bias: Literal["none", "all", "lora_only"] = _f(PEFT, "none", "which biases LoRA trains")
    final_shard_mb: float = _f(CHECKPOINTING, 2048.0, "largest shard file of final/ in MiB (sharded safetensors with an index, streamed from the servers one tensor at a time)", gt=0.0)
    merge_adapter: bool = _f(CHECKPOINTING, False, "also write the adapter merged into the base weights to output_dir/final_merged")
    prompt_template: Optional[str] = _f(DATA, None, "format string over a row's columns for the prompt (no loss on it)")
    completion_template: Optional[str] = _f(DATA, None, "format string over a row's columns for the completion (loss on it)")
    prompt_func: Optional[str] = _f(DATA, None, "module:function building the prompt from a row (instead of prompt_template)")
    completion_func: Optional[str] = _f(DATA, None, "module:function building the completion from a row")
    group_by_length: bool = _f(DATA, False, "order each replica's samples so batches hold similar lengths (less padding)")
    # --- output, eval, checkpoints, logging ------------------------------------------
    output_dir: str = _f((CHECKPOINTING, OBSERVABILITY), "outputs/diloco", "where config.yaml, metrics.jsonl, checkpoints/ and final/ go")
    overwrite_output_dir: bool = _f(CHECKPOINTING, False, "allow a new run into an output_dir that already holds one")
    eval_batches: int = _f(EVALUATION, 10, "eval batches after each outer update (0: no eval)", ge=0)
    eval_every: int = _f(EVALUATION, 1, "evaluate after every this many outer rounds and after the last (decoupled: rounds' worth of merged tokens); each eval sends the fp32 weights down one replica's link", ge=1)
    early_stopping_patience: Optional[int] = _f(EVALUATION, None, "stop after this many rounds without eval loss improving (null: never)", ge=1)
    early_stopping_threshold: float = _f(EVALUATION, 0.0, "how much eval loss must fall to count as improving", ge=0.0)
    checkpoint_steps: Optional[int] = _f(CHECKPOINTING, None, "checkpoint at the first round boundary after this many inner steps (decoupled: at the first merge after this many rounds' worth of merged inner steps; null: never)", ge=1)
    save_total_limit: Optional[int] = _f(CHECKPOINTING, None, "checkpoints kept (oldest pruned; null: all)", ge=1)
    resume_from: Optional[str] = _f(CHECKPOINTING, None, "checkpoint folder to resume from, or an output_dir meaning its latest")
    log_with: Optional[Union[str, list]] = _f(OBSERVABILITY, None, "tensorboard, wandb, or a list of both (metrics.jsonl is always written)")
    log_dir: Optional[str] = _f(OBSERVABILITY, None, "TensorBoard folder (default: output_dir/logs)")
    logging_steps: int = _f(OBSERVABILITY, 10, "inner steps between step events (each replica's loss and lr) in metrics.jsonl, the trackers and the progress bar", ge=1)
    wandb_project: Optional[str] = _f(OBSERVABILITY, None, "W&B project (default: diloco-ray); needs log_with: wandb")
    wandb_entity: Optional[str] = _f(OBSERVABILITY, None, "W&B entity (team or user; default: yours); needs log_with: wandb")
    wandb_run_name: Optional[str] = _f(OBSERVABILITY, None, "W&B run name (default: output_dir's last component); needs log_with: wandb")
    wandb_tags: list = _f(OBSERVABILITY, [], "W&B run tags; needs log_with: wandb")
    # fmt: on


# The null outer-step fields take the pseudo-gradient codec's defaults: ``topk`` brings its
# own outer step (SparseLoCo's lr 1.3, decayed error-feedback residual and 1/64 of each block),
# under Nesterov 0.5 warmed up like the plain step's in a run of fewer than
# TOPK_LONG_RUN_ROUNDS rounds, and without momentum, as SparseLoCo runs it, in a longer one:
# momentum led with 8 replicas and on the tiny task, was level with 4 over 16 rounds, and fell
# behind over 32 and 64, where the decayed residual already carries past rounds on. Every
# other codec takes the plain step, lr 0.5 under Nesterov 0.5, whose momentum-compounded step
# is one whole mean pseudo-gradient a round, with the momentum warmed up over the first 4
# updates (an early update's momentum otherwise carries the large first pseudo-gradients on
# for rounds): the DiLoCo paper's lr 0.7 under Nesterov 0.9 is tuned for hundreds of rounds
# and overshoots in the tens of rounds a fine-tune or a short run has (docs/results.md, Outer
# step, holds the sweep behind all of it). The outer step comes as a whole: a config that sets
# outer_lr or outer_momentum has chosen its own, the fields it leaves null take the plain
# values and its momentum no warm-up. A value the user sets always wins.
CODEC_DEFAULTS: dict[str, dict[str, float]] = {
    "topk": {
        "outer_lr": 1.3,
        "outer_momentum": 0.5,
        "error_feedback_decay": 0.95,
        "topk_fraction": 1 / 64,
        "outer_momentum_warmup_rounds": 4,
    },
}
PLAIN_DEFAULTS: dict[str, float] = {
    "outer_lr": 0.5,
    "outer_momentum": 0.5,
    "error_feedback_decay": 1.0,
    "topk_fraction": 1 / 16,
    "outer_momentum_warmup_rounds": 4,
}
# A codec's step over a run of at least this many rounds (diloco_loops): what changes.
LONG_RUN_DEFAULTS: dict[str, tuple[int, dict[str, float]]] = {
    "topk": (TOPK_LONG_RUN_ROUNDS, {"outer_momentum": 0.0, "outer_momentum_warmup_rounds": 0}),
}
# A step chosen by hand (or an outer_opt other than SGD, which may have no momentum) is taken as it is.
OWN_STEP_DEFAULTS: dict[str, float] = {"outer_momentum_warmup_rounds": 0}
OWN_OUTER_STEP = ("outer_lr", "outer_momentum")  # setting either is choosing the outer step
CODEC_FIELDS = ("pseudo_grad_compression", "outer_opt", "diloco_loops", *PLAIN_DEFAULTS)  # what codec_defaults reads


def codec_defaults(values: dict) -> dict[str, float]:
    """What the null codec-defaulted fields of ``values`` (field -> value) become: the
    codec's bundle (its long-run step when ``diloco_loops`` reaches the codec's long run)
    when the outer step is left to it, else the plain step's (with no momentum warm-up for a
    step chosen by hand)."""
    codec = values.get("pseudo_grad_compression")
    own_step = any(values.get(name) is not None for name in OWN_OUTER_STEP)
    bundle = {} if own_step or not isinstance(codec, str) else CODEC_DEFAULTS.get(codec, {})
    rounds = values.get("diloco_loops", ConfigFields.diloco_loops)  # (not an int: validate says so)
    long_run = LONG_RUN_DEFAULTS.get(codec) if bundle else None
    if long_run and isinstance(rounds, int) and rounds >= long_run[0]:
        bundle = {**bundle, **long_run[1]}
    if own_step or values.get("outer_opt", ConfigFields.outer_opt) != "SGD":  # (a missing field: its default)
        bundle = {**bundle, **OWN_STEP_DEFAULTS}
    return {name: bundle.get(name, plain) for name, plain in PLAIN_DEFAULTS.items() if values.get(name) is None}


FIELDS = {f.name: f for f in dataclasses.fields(ConfigFields)}
FIELD_NAMES = list(FIELDS)
# Each field's declared type, resolved once (the table's annotations are strings).
FIELD_TYPES = typing.get_type_hints(ConfigFields)


def field_help() -> list[tuple[str, Any, str]]:
    """(name, default, description) for every field, in declaration order."""
    out = []
    for f in dataclasses.fields(ConfigFields):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        out.append((f.name, default, f.metadata["help"]))
    return out
