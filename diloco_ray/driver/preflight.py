"""Checks of a job that need more than the config's own fields, run before Ray starts.

:func:`TrainerConfig.validate` checks each field and the rules between fields. What it
cannot see is the world around the config: whether the optimizer names are real
``torch.optim`` classes that accept the given kwargs, whether local files and folders
exist, whether a JSON Lines file's first record has the columns the job names, whether
``output_dir`` already holds a run, whether ``resume_from`` is a checkpoint, whether a
bucket is reachable. :func:`check` runs all of those on the
driver, so a typo fails in a second with one line instead of minutes later inside an
actor. Every failure is a :class:`~diloco_ray.errors.UserInputError` naming the field.
"""

from __future__ import annotations

import os
from typing import Optional

from diloco_ray.config.fields import codec_defaults
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.config.sections import (
    ChannelSection,
    CheckpointSection,
    DataSection,
    InnerOptimSection,
    ModelSection,
    OuterOptimSection,
    SyncCodecSection,
)
from diloco_ray.data import samples
from diloco_ray.errors import ConfigError, DataError
from diloco_ray.persist.run_folder import in_use_message, lock_holder, resumes_own_run

RUN_MARKERS = ("final", "checkpoints")  # besides round records in metrics.jsonl


def check_optimizers(inner: InnerOptimSection, outer: OuterOptimSection) -> None:
    """Build both optimizers over one dummy parameter, so unknown names and kwargs the
    class rejects fail here, naming ``inner_opt``/``outer_opt`` or their kwargs."""
    import torch

    from diloco_ray.algo.optimizers import build_inner_optimizer, build_outer_optimizer

    build_inner_optimizer([torch.zeros(1, requires_grad=True)], inner)
    build_outer_optimizer([torch.zeros(1, requires_grad=True)], outer)


def _looks_local(name: Optional[str]) -> bool:
    """A model or data set name written as a path (hub ids are ``org/name``)."""
    return bool(name) and name.startswith(("/", "./", "../", "~"))


def check_paths(data: DataSection, model: ModelSection) -> None:
    """Local files and folders the job reads exist (hub ids are left to the loaders)."""
    if data.json_file_path is not None and not os.path.isfile(data.json_file_path):
        raise DataError(f"json_file_path: '{data.json_file_path}' does not exist or is not a file")
    if data.json_file_path is not None:
        try:  # here, not in a rank actor minutes later: a file the driver cannot read at all
            with open(data.json_file_path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise DataError(f"json_file_path: '{data.json_file_path}' cannot be read ({e.strerror or e})") from None
        samples.check_first_record(data)
    named = {"model_name": model.model_name, "tokenizer_name": model.tokenizer_name, "dataset_name": data.dataset_name}
    for field, value in named.items():
        if (
            value
            and not value.startswith("builtin:")
            and _looks_local(value)
            and not os.path.exists(os.path.expanduser(value))
        ):
            raise DataError(
                f"{field}: '{value}' looks like a local path but does not exist; "
                "give an existing folder or a hub id such as 'HuggingFaceTB/SmolLM2-135M'"
            )
    files = (data.dataset_kwargs or {}).get("data_files")
    for path in [files] if isinstance(files, str) else (files if isinstance(files, list) else []):
        if (
            isinstance(path, str)
            and "://" not in path
            and not any(c in path for c in "*?[")
            and not os.path.exists(path)
        ):
            raise DataError(f"dataset_kwargs.data_files: '{path}' does not exist")


def holds_run(listing: list[str], metrics_text: Optional[str]) -> Optional[str]:
    """Why a folder with these entries (and this metrics.jsonl) holds a run, or None.

    A folder where a run died before its first round (startup events only) does not
    count: refusing it would make a fixed config impossible to rerun in place.
    """
    for marker in RUN_MARKERS:
        if marker in listing:
            return f"{marker}/"
    if metrics_text and '"event": "round"' in metrics_text:
        return "round records in metrics.jsonl"
    return None


PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")


def check_local_folder(field: str, path: str) -> None:
    """That a local folder can be created (or is there) and written, without creating
    anything: not on a kernel pseudo-filesystem, every name within the filesystem's
    limit, the whole path within PATH_MAX, and its nearest existing parent writable."""
    full = os.path.realpath(os.path.expanduser(path))
    if any(full == root or full.startswith(root + os.sep) for root in PSEUDO_FILESYSTEMS):
        raise ConfigError(
            f"{field}: '{path}' is on a kernel pseudo-filesystem ({full}); "
            "give a folder on a real disk or shared storage"
        )
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
        path_max = os.pathconf(parent, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long = next((n for n in full.split(os.sep) if len(n.encode()) > name_max), None)
    if long is not None:
        raise ConfigError(
            f"{field}: '{path}' has a name of {len(long.encode())} bytes ('{long[:20]}...'); "
            f"this filesystem allows at most {name_max}"
        )
    if len(full.encode()) >= path_max:
        raise ConfigError(
            f"{field}: '{path}' is {len(full.encode())} bytes long; this system allows paths shorter than {path_max}"
        )
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: '{path}' cannot be created: '{parent}' is not a writable folder")


def check_output_dir(checkpointing: CheckpointSection, resuming: bool) -> None:
    """Refuse to start into an ``output_dir`` that already holds a run, unless resuming
    that run or ``overwrite_output_dir``: a new run, and a resume from *another* run's
    checkpoint, would mix two runs' records and checkpoints. Touches nothing."""
    from diloco_ray.persist import storage

    # A live run first, even when overwriting or resuming: "already holds a run" would
    # suggest overwrite_output_dir or a resume, and both are refused while it runs.
    holder = None if storage.is_remote(checkpointing.output_dir) else lock_holder(checkpointing.output_dir)
    if holder is not None:
        raise ConfigError(in_use_message(checkpointing.output_dir, holder))
    if checkpointing.overwrite_output_dir or (resuming and resumes_own_run(checkpointing)):
        return

    mirror = storage.for_output_dir(checkpointing.output_dir)
    if mirror is not None:
        listing = mirror.listdir(mirror.local)
        data = mirror.read_bytes("metrics.jsonl") if "metrics.jsonl" in listing else None
        text = data.decode("utf-8", "replace") if data else None
    else:
        path = checkpointing.output_dir
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"output_dir: '{path}' is a file; give a folder")
        listing = os.listdir(path) if os.path.isdir(path) else []
        metrics = os.path.join(path, "metrics.jsonl")
        text = open(metrics, encoding="utf-8", errors="replace").read() if os.path.isfile(metrics) else None
    why = holds_run(listing, text)
    if why and resuming:
        raise ConfigError(
            f"resume_from: '{checkpointing.resume_from}' is another run's checkpoint, and output_dir "
            f"'{checkpointing.output_dir}' already holds a run ({why}); resume into a new output_dir, "
            "or set overwrite_output_dir: true to replace that run"
        )
    if why:
        raise ConfigError(
            f"output_dir: '{checkpointing.output_dir}' already holds a run ({why}); choose a new "
            "output_dir, set resume_from to continue it, or set overwrite_output_dir: true"
        )


# dataset_kwargs keys (at any depth: storage_options, client_kwargs) that send a data
# set's reads elsewhere, or that turn TLS off when false.
_ENDPOINT_KEYS = ("endpoint_url", "endpoint_override", "endpoint")
_TLS_KEYS = ("verify", "ssl_verify", "use_ssl", "tls_verify_certificates")


def loosened_settings(checkpointing: CheckpointSection, data: DataSection) -> list[str]:
    """One line for each setting (the output and resume folders, the data set's keyword
    arguments) that turns TLS verification off or overrides an endpoint: a config is code,
    and these are where a hostile one reads a run's data."""
    from diloco_ray.persist.uris import is_remote, loosened, redact

    lines = [
        f"{field}: {redact(value)!r} {what}"
        for field in ("output_dir", "resume_from")
        if is_remote(value := getattr(checkpointing, field))
        for what in loosened(value)
    ]

    def walk(value, where: str) -> None:
        for key, inner in value.items() if isinstance(value, dict) else ():
            here = f"{where}.{key}"
            if key in _ENDPOINT_KEYS and inner:
                lines.append(f"{here}: {inner!r} sends the data set's reads to another endpoint")
            elif key in _TLS_KEYS and inner in (False, "false", "False", 0):
                lines.append(f"{here}: {inner!r} turns TLS certificate checks off")
            walk(inner, here)

    walk(data.dataset_kwargs, "dataset_kwargs")
    return lines


def drifting_outer_step(outer: OuterOptimSection, codec: SyncCodecSection) -> Optional[str]:
    """One line when the outer step is one that drifts with its codec: ``topk`` under Nesterov
    momentum of 0.9 or more, which only a config that sets it gets (topk's own step and the
    plain default have 0.5 or none). The measurement it cites is docs/slow-links.md's; the step
    it offers is topk's own for this run's length."""
    if codec.pseudo_grad_compression != "topk" or outer.outer_opt != "SGD" or outer.outer_momentum < 0.9:
        return None
    own = codec_defaults({"pseudo_grad_compression": "topk", "diloco_loops": outer.diloco_loops})
    warmup = own["outer_momentum_warmup_rounds"]
    momentum = f"Nesterov {own['outer_momentum']:g} warmed up over {warmup:g} updates" if warmup else "no momentum"
    return (
        f"outer_momentum: {outer.outer_momentum:g} with pseudo_grad_compression: topk drifts: on the text "
        "benchmark (4 replicas, 16 rounds, 3 seeds) topk at 1/16 under Nesterov 0.9 ended 12-18% above the "
        "same topk at lr 1.3 without momentum (docs/slow-links.md, Codec frontier); leave outer_lr and "
        f"outer_momentum null for topk's own step over {outer.diloco_loops} rounds (lr {own['outer_lr']:g}, "
        f"{momentum}), or set outer_lr: {own['outer_lr']:g} and outer_momentum: {own['outer_momentum']:g}"
    )


def check_channel(channel: ChannelSection) -> None:
    """With regions: the channel's tokens and TLS files can be read (the tokens are only read)."""
    if not channel.regions:
        return
    from diloco_ray.channel.credentials import RegionTokens, read_pem

    RegionTokens(channel.channel_tokens_file, [r["name"] for r in channel.regions])
    read_pem(channel.channel_tls_cert, "channel_tls_cert")
    read_pem(channel.channel_tls_key, "channel_tls_key")


def check(config: TrainerConfig, resuming: bool) -> None:
    """Every check that can run before Ray starts (see the module docstring), and a
    warning for each of :func:`loosened_settings` and for a :func:`drifting_outer_step`."""
    from diloco_ray.logs import log
    from diloco_ray.persist import storage

    sections = config.sections()
    checkpointing = sections.checkpointing
    for field in ("output_dir", "resume_from"):
        value = getattr(checkpointing, field)
        if value:  # every value: "s3:bucket" (no "//") must not become a local folder named so
            storage.check_uri(field, value)
    for line in loosened_settings(checkpointing, sections.data):
        log.warning("%s (a config is code: run only configs whose author you trust)", line)
    drift = drifting_outer_step(sections.outer_optim, sections.sync_codec)
    if drift:
        log.warning("%s", drift)
    check_optimizers(sections.inner_optim, sections.outer_optim)
    check_paths(sections.data, sections.model)
    check_channel(sections.channel)
    mirror = storage.for_output_dir(checkpointing.output_dir)
    if mirror is not None:
        if checkpointing.checkpoint_steps is not None and checkpointing.checkpoint_steps < checkpointing.max_steps:
            # In-flight snapshots are small files written many times a round by every
            # rank; they stay on shared local storage.
            raise ConfigError(
                f"checkpoint_steps: {checkpointing.checkpoint_steps} < max_steps asks for in-flight "
                "snapshots, which need a local (or shared) output_dir, not a bucket; "
                "use a multiple of max_steps"
            )
        mirror.check_writable()
    else:
        check_local_folder("output_dir", checkpointing.output_dir)
    check_output_dir(checkpointing, resuming)
