"""Every kind of bad input the ``diloco-ray`` command can be given, in one table.

Config values, YAML files, files and folders, URIs, command-line arguments, ``scale``
requests and resume targets: each case runs ``cli.main`` in-process (no subprocess, no
Ray) in a folder holding a finished run, another run's checkpoint, damaged checkpoints
and bad config files, and must end with exit status 2 and exactly one stderr line
``diloco-ray: error: <field or file>: ...`` that says what is allowed, no traceback, no
Ray started, and not one file or folder of that world created, changed or removed.
"""

# One case per line, so the table reads as a table.
# ruff: noqa: E501

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import socket
import warnings
from dataclasses import dataclass

import pytest
from conftest import ROOT, model_parts

from diloco_ray import cli

TINY = os.path.join(ROOT, "configs", "tiny.yaml")
PREFIX = "diloco-ray: error: "


@dataclass(frozen=True)
class Case:
    """One bad input.

    Args:
        id: the test id.
        argv: the command line; ``{tmp}`` is the world's folder, ``{tiny}`` configs/tiny.yaml.
        names: what the line must name first, right after the prefix (a field or a file).
        allowed: words of the line that say what is allowed instead (or what was found).
    """

    id: str
    argv: tuple
    names: str
    allowed: tuple = ()


def train(*sets: str, config: str = "{tiny}", out: str = "{tmp}/new") -> tuple:
    """``train CONFIG --set output_dir=OUT --set ...``: a new output_dir that must not appear."""
    argv = ["train", config, "--set", f"output_dir={out}"]
    for item in sets:
        argv += ["--set", item]
    return tuple(argv)


def scale(*args: str) -> tuple:
    return ("scale", *args)


RESUME_RUN = ("output_dir={tmp}/run", "resume_from={tmp}/run")

# fmt: off
CASES = [
    # --- config values: types and ranges ---------------------------------------------------
    Case("lr-not-a-number", train("lr=fast"), "lr: 'fast'", ("expected a number",)),
    Case("lr-negative", train("lr=-1"), "lr: -1.0", ("must be > 0.0",)),
    Case("lr-nan", train("lr=.nan"), "lr: nan", ("finite number",)),
    Case("batch-size-zero", train("batch_size=0"), "batch_size: 0", ("must be >= 1",)),
    Case("batch-size-fraction", train("batch_size=2.5"), "batch_size: 2.5", ("an integer",)),
    Case("seq-len-word", train("seq_len=long"), "seq_len: 'long'", ("an integer",)),
    Case("seq-len-too-short", train("seq_len=4"), "seq_len: 4", (">= 8",)),
    Case("seed-negative", train("seed=-1"), "seed: -1", (">= 0",)),
    Case("outer-momentum-one", train("outer_momentum=1.0"), "outer_momentum: 1.0", ("< 1.0",)),
    Case("split-ratio-too-big", train("split_ratio=0.9"), "split_ratio: 0.9", ("<= 0.5",)),
    Case("mixed-precision-unknown", train("mixed_precision=fp32"), "mixed_precision: 'fp32'", ("'bf16'",)),
    Case("use-peft-not-bool", train("use_peft=maybe"), "use_peft: 'maybe'", ("true/false",)),
    Case("device-unknown", train("device=tpu"), "device: 'tpu'", ("'cuda'",)),
    Case("compression-unknown", train("pseudo_grad_compression=zip"), "pseudo_grad_compression: 'zip'", ("'int8'",)),
    Case("checkpoint-steps-zero", train("checkpoint_steps=0"), "checkpoint_steps: 0", (">= 1",)),
    Case("max-replicas-zero", train("max_replicas=0"), "max_replicas: 0", (">= 1",)),
    Case("kwargs-not-a-mapping", train("outer_opt_kwargs=[1]"), "outer_opt_kwargs: [1]", ("a mapping",)),
    Case("target-modules-numbers", train("target_modules=[1,2]"), "target_modules: [1, 2]", ("module names",)),
    Case("ranks-per-replica-empty", train("ranks_per_replica=[]"), "ranks_per_replica: []", ("non-empty list",)),
    Case("nodes-per-replica-zero", train("nodes_per_replica=0"), "nodes_per_replica: 0", (">= 1",)),
    Case("nodes-per-replica-uneven", train("ranks_per_replica=3", "nodes_per_replica=2"), "nodes_per_replica: 2", ("ranks_per_replica=3", "multiple of nodes_per_replica")),
    Case("nodes-per-replica-uneven-list", train("ranks_per_replica=[2,3]", "nodes_per_replica=2"), "nodes_per_replica: 2", ("ranks_per_replica=[2, 3]", "(3 is not)")),
    Case("replica-resources-negative", train("replica_resources={a: -1}"), "replica_resources:", ("non-negative",)),
    # --- config values: rules between fields --------------------------------------------------
    Case("num-replicas-above-max", train("num_replicas=5", "max_replicas=2"), "num_replicas: 5", ("max_replicas=2",)),
    Case("min-replicas-above-num", train("min_replicas=3"), "num_replicas: 2", ("min_replicas=3",)),
    Case("no-model", train("model_config=null"), "model_name: not set", ("model_config",)),
    Case("model-config-no-type", train("model_config={hidden_size: 8}"), "model_config:", ("model_type",)),
    Case("no-dataset", train("dataset_name=null"), "dataset_name: not set", ("json_file_path",)),
    Case("log-with-unknown", train("log_with=mlflow"), "log_with: 'mlflow'", ("tensorboard, wandb",)),
    Case("wandb-field-without-wandb", train("wandb_project=p"), "wandb_project:", ("log_with: wandb",)),
    Case("log-dir-without-tensorboard", train("log_dir=tb"), "log_dir:", ("log_with: tensorboard",)),
    Case("prompt-without-completion", train("prompt_template=Q {q}"), "completion_template:", ("set both",)),
    Case("early-stopping-no-eval", train("early_stopping_patience=2", "eval_batches=0"), "early_stopping_patience:", ("eval_batches > 0",)),
    Case("merge-adapter-no-peft", train("merge_adapter=true"), "merge_adapter:", ("use_peft",)),
    Case("fragments-above-steps", train("sync_fragments=40"), "sync_fragments: 40", ("max_steps=30",)),
    Case("overlap-one-fragment", train("overlap_communication=true"), "overlap_communication:", ("sync_fragments >= 2",)),
    Case("decay-without-feedback", train("error_feedback_decay=0.9"), "error_feedback_decay: 0.9", ("topk", "error_feedback: true")),
    Case("decay-above-one", train("pseudo_grad_compression=topk", "error_feedback_decay=2"), "error_feedback_decay: 2", ("<= 1.0",)),
    Case("eval-every-zero", train("eval_every=0"), "eval_every: 0", (">= 1",)),
    Case("decoupled-with-deadline", train("sync_mode=decoupled", "round_timeout_s=5"), "round_timeout_s:", ("decoupled",)),
    Case("stale-correction-in-sync", train("stale_correction=momentum"), "stale_correction: momentum", ("sync_mode: decoupled",)),
    Case("stale-correction-without-momentum", train("sync_mode=decoupled", "stale_correction=momentum", "outer_momentum=0", "decoupled_momentum=every_step"), "stale_correction: momentum", ("outer_momentum > 0",)),
    Case("delayed-momentum-with-adamw", train("sync_mode=decoupled", "outer_opt=AdamW"), "decoupled_momentum: delayed", ("every_step",)),
    Case("grace-fraction-above-one", train("grace_fraction=2"), "grace_fraction: 2", ("<= 1.0",)),
    Case("inner-time-past-deadline", train("inner_time_s=9", "round_timeout_s=5"), "inner_time_s: 9", ("round_timeout_s=5",)),
    Case("momentum-warmup-without-momentum", train("outer_opt=Adam", "outer_momentum_warmup_rounds=3"), "outer_momentum_warmup_rounds: Adam has no momentum", ("set 0", "SGD")),
    Case("momentum-warmup-negative", train("outer_momentum_warmup_rounds=-1"), "outer_momentum_warmup_rounds: -1", (">= 0",)),
    Case("inner-opt-unknown", train("inner_opt=Adamm"), "inner_opt: 'Adamm'", ("did you mean 'Adam'", "allowed:")),
    Case("inner-opt-kwarg-unknown", train("inner_opt_kwargs={bogus: 1}"), "inner_opt_kwargs:", ("bogus",)),
    # --- fault_plan entries -------------------------------------------------------------------
    Case("fault-plan-mapping", train("fault_plan={kind: kill}"), "fault_plan:", ("a list",)),
    Case("fault-not-a-mapping", train("fault_plan=[kill]"), "fault_plan[0]: 'kill'", ("kind and round",)),
    Case("fault-kind-unknown", train("fault_plan=[{kind: explode, round: 0}]"), "fault_plan[0].kind: 'explode'", ("kill, freeze",)),
    Case("fault-no-round", train("fault_plan=[{kind: kill}]"), "fault_plan[0].round: missing", ("0-based round",)),
    Case("fault-round-negative", train("fault_plan=[{kind: kill, round: -1}]"), "fault_plan[0].round: -1", (">= 0",)),
    Case("fault-key-unknown", train("fault_plan=[{kind: kill, round: 0, when: 1}]"), "fault_plan[0].when: unknown key", ("allowed: factor",)),
    Case("fault-target-unknown", train("fault_plan=[{kind: kill, round: 0, target: moon}]"), "fault_plan[0].target: 'moon'", ("server or driver",)),
    Case("fault-server-freeze", train("fault_plan=[{kind: freeze, round: 0, target: server}]"), "fault_plan[0].kind: 'freeze'", ("target server",)),
    Case("fault-slow-no-seconds", train("fault_plan=[{kind: slow, round: 0}]"), "fault_plan[0].seconds:", ("seconds > 0",)),
    Case("fault-slowdown-factor-one", train("fault_plan=[{kind: slowdown, round: 0, factor: 1}]"), "fault_plan[0].factor: 1", ("> 1",)),
    # --- YAML files ---------------------------------------------------------------------------
    Case("yaml-syntax", train(config="{tmp}/cfg/syntax.yaml"), "config file '{tmp}/cfg/syntax.yaml' is not valid YAML", ("line 2, column 1",)),
    Case("yaml-tab", train(config="{tmp}/cfg/tab.yaml"), "config file '{tmp}/cfg/tab.yaml' is not valid YAML", ("'\\t'",)),
    Case("yaml-bad-bytes", train(config="{tmp}/cfg/bytes.yaml"), "config file '{tmp}/cfg/bytes.yaml' is not valid YAML", ("byte 6",)),
    Case("yaml-list", train(config="{tmp}/cfg/list.yaml"), "config file '{tmp}/cfg/list.yaml' holds a list", ("mapping of field: value",)),
    Case("yaml-scalar", train(config="{tmp}/cfg/scalar.yaml"), "config file '{tmp}/cfg/scalar.yaml' holds a string", ("mapping of field: value",)),
    Case("yaml-empty", train(config="{tmp}/cfg/empty.yaml"), "config file '{tmp}/cfg/empty.yaml' is empty", ("field: value",)),
    Case("yaml-only-comments", train(config="{tmp}/cfg/comments.yaml"), "config file '{tmp}/cfg/comments.yaml' is empty", ("field: value",)),
    Case("yaml-unknown-field", train(config="{tmp}/cfg/unknown.yaml"), "config file '{tmp}/cfg/unknown.yaml': unknown field 'outer_lrr'", ("did you mean 'outer_lr'",)),
    Case("yaml-value-wrong-type", train(config="{tmp}/cfg/typed.yaml"), "lr: 'fast'", ("expected a number",)),
    # --- files --------------------------------------------------------------------------------
    Case("config-missing", train(config="{tmp}/cfg/missing.yaml"), "config file '{tmp}/cfg/missing.yaml' does not exist", ("YAML file",)),
    Case("config-is-a-folder", train(config="{tmp}/cfg"), "config file '{tmp}/cfg' is a folder", ("YAML file",)),
    Case("config-unreadable", train(config="{tmp}/cfg/socket.yaml"), "config file '{tmp}/cfg/socket.yaml' cannot be read", ("YAML file",)),
    Case("json-file-missing", train("dataset_name=null", "json_file_path={tmp}/rows.jsonl"), "json_file_path: '{tmp}/rows.jsonl'", ("does not exist",)),
    Case("json-text-field-not-a-column", train("dataset_name=null", "json_file_path={tmp}/qa.jsonl", "text_field=nope"), "text_field: 'nope' is not a column of '{tmp}/qa.jsonl'", ("columns: ['question', 'answer']",)),
    Case("json-no-text-column", train("dataset_name=null", "json_file_path={tmp}/qa.jsonl"), "text_field: not set", ("'text' column", "['question', 'answer']")),
    Case("json-template-not-a-column", train("dataset_name=null", "json_file_path={tmp}/qa.jsonl", "prompt_template='Q {questoin} ='", "completion_template='{answer}'"), "prompt_template: 'Q {questoin} ='", ("'questoin'", "['question', 'answer']")),
    Case("json-file-is-a-folder", train("json_file_path={tmp}/run"), "json_file_path: '{tmp}/run'", ("not a file",)),
    Case("data-files-missing", train("dataset_kwargs={data_files: {tmp}/d.json}"), "dataset_kwargs.data_files: '{tmp}/d.json'", ("does not exist",)),
    Case("model-folder-missing", train("model_name=./no-model"), "model_name: './no-model'", ("hub id",)),
    Case("tokenizer-folder-missing", train("tokenizer_name=/no/tokenizer"), "tokenizer_name: '/no/tokenizer'", ("hub id",)),
    # --- URIs and output_dir --------------------------------------------------------------------
    Case("uri-ftp", train(out="ftp://host/run"), "output_dir: 'ftp://host/run' is not allowed", ("s3://bucket/path",)),
    Case("uri-no-slashes", train(out="s3:bucket/run"), "output_dir: 's3:bucket/run' is not a valid URI", ("s3://bucket/path",)),
    Case("uri-file-scheme", train(out="file:///tmp/run"), "output_dir: 'file:///tmp/run' is not allowed", ("plain path",)),
    Case("uri-no-bucket", train(out="s3:///run"), "output_dir: 's3:///run' has no bucket", ("s3://bucket/path",)),
    Case("uri-empty-segment", train(out="gs://bucket//run"), "output_dir: 'gs://bucket//run' has an empty", ("gs://bucket/path",)),
    Case("uri-port", train(out="s3://bucket:9000/run"), "output_dir: 's3://bucket:9000/run' has an invalid bucket", ("AWS_ENDPOINT_URL",)),
    Case("uri-query-option", train(out="s3://bucket/run?color=red"), "output_dir: 's3://bucket/run?color=red' has query option 'color'", ("take only region",)),
    Case("uri-credentials", train(out="s3://KEY:SECRET@bucket/run"), "output_dir: 's3://***@bucket/run' holds credentials", ("environment",)),
    Case("uri-resume-http", train("resume_from=http://host/ckpt"), "resume_from: 'http://host/ckpt' is not allowed", ("s3://bucket/path",)),
    Case("output-dir-is-a-file", train(out="{tmp}/notes.txt"), "output_dir: '{tmp}/notes.txt'", ("not a writable folder",)),
    Case("output-dir-under-a-file", train(out="{tmp}/notes.txt/run"), "output_dir: '{tmp}/notes.txt/run' cannot be created", ("writable folder",)),
    Case("output-dir-in-proc", train(out="/proc/self/run"), "output_dir: '/proc/self/run'", ("real disk",)),
    Case("output-dir-name-too-long", train(out="{tmp}/" + "x" * 300), "output_dir: '{tmp}/" + "x" * 300, ("at most 255",)),
    Case("output-dir-holds-a-run", train(out="{tmp}/run"), "output_dir: '{tmp}/run' already holds a run", ("resume_from", "overwrite_output_dir")),
    Case("output-dir-in-use", train(out="{tmp}/busy"), "output_dir: '{tmp}/busy' is in use by another diloco-ray run", ("another output_dir",)),
    Case("overwrite-a-live-run", train("overwrite_output_dir=true", out="{tmp}/busy"), "output_dir: '{tmp}/busy' is in use by another diloco-ray run", ("pid",)),
    Case("resume-a-live-run", train("resume_from={tmp}/busy", out="{tmp}/busy"), "output_dir: '{tmp}/busy' is in use by another diloco-ray run", ("wait for it to end",)),
    # --- the command line -------------------------------------------------------------------------
    Case("no-command", (), "the following arguments are required: command", ("usage: diloco-ray",)),
    Case("unknown-command", ("fly",), "command: invalid choice: 'fly'", ("'train', 'sweep', 'report', 'scale'",)),
    Case("train-without-config", ("train",), "the following arguments are required: config", ("usage: diloco-ray train",)),
    Case("train-unknown-option", ("train", "{tiny}", "--fast"), "unrecognized arguments: --fast", ("usage:",)),
    Case("set-without-value", ("train", "{tiny}", "--set"), "--set: expected one argument", ("KEY=VALUE",)),
    Case("set-without-equals", train("lr"), "--set expects KEY=VALUE, got 'lr'"),
    Case("set-without-key", train("=3"), "--set expects KEY=VALUE, got '=3'"),
    Case("set-bad-yaml", train("lr=[1,"), "--set lr: '[1,' is not a valid YAML value"),
    Case("set-unknown-field", train("lrr=1"), "--set: unknown field 'lrr'", ("did you mean 'lr'",)),
    Case("set-into-a-number", train("lr.x=1"), "--set lr.x: field 'lr' is not a mapping"),
    Case("report-extra-argument", ("report", "{tmp}/run", "again"), "unrecognized arguments: again", ("usage:",)),
    Case("builtin-num-samples-huge", train("dataset_kwargs.num_samples=20000000"), "dataset_kwargs.num_samples: 20000000", ("from 1 to 1,000,000",)),
    Case("dataset-remote-code", train("dataset_kwargs.trust_remote_code=true"), "dataset_kwargs.trust_remote_code: refused", ("loading script", "save_to_disk")),
    # --- sweeps: refused before Ray starts, nothing written -------------------------------------------
    Case("sweep-without-grid", ("sweep", "{tiny}", "--set", "output_dir={tmp}/sw"), "--grid: give at least one", ("FIELD=V1,V2",)),
    Case("sweep-unknown-field", ("sweep", "{tiny}", "--grid", "outer_rl=1,2"), "--grid: unknown field 'outer_rl'", ("--help",)),
    Case("sweep-bad-value", ("sweep", "{tiny}", "--grid", "outer_lr=0.5,-1", "--set", "output_dir={tmp}/sw"), "outer_lr", ("(trial trial-001-outer_lr=-1)",)),
    Case("sweep-output-dir", ("sweep", "{tiny}", "--grid", "output_dir=a,b"), "--grid output_dir: each trial gets its own folder", ("not sweepable",)),
    Case("sweep-no-eval", ("sweep", "{tiny}", "--grid", "outer_lr=0.5,1", "--set", "eval_batches=0", "--set", "output_dir={tmp}/sw"), "eval_batches: a sweep ranks its trials by eval loss", ("eval_batches > 0",)),
    Case("sweep-max-concurrent", ("sweep", "{tiny}", "--grid", "outer_lr=0.5,1", "--max-concurrent", "0"), "max_concurrent: 0 is not allowed", ("whole number >= 1",)),
    Case("sweep-in-a-bucket", ("sweep", "{tiny}", "--grid", "outer_lr=0.5,1", "--set", "output_dir=s3://bucket/sw"), "output_dir: a sweep keeps its trials", ("local path",)),
    Case("report-no-run", ("report", "{tmp}/cfg"), "output_dir: '{tmp}/cfg' has no metrics.jsonl"),
    Case("report-no-rounds", ("report", "{tmp}/busy"), "output_dir: '{tmp}/busy/metrics.jsonl' holds no round records"),
    # --- scale requests -----------------------------------------------------------------------------
    Case("scale-word", scale("{tmp}/busy", "three"), "replicas: 'three' is not allowed", ("whole number >= 1",)),
    Case("scale-fraction", scale("{tmp}/busy", "2.5"), "replicas: '2.5' is not allowed", ("whole number >= 1",)),
    Case("scale-negative", scale("{tmp}/busy", "-2"), "replicas: -2 is not allowed", ("whole number >= 1",)),
    Case("scale-zero", scale("{tmp}/busy", "0"), "replicas: 0 is not allowed", ("whole number >= 1",)),
    Case("scale-no-count", scale("{tmp}/busy"), "the following arguments are required: replicas", ("usage:",)),
    Case("scale-missing-folder", scale("{tmp}/gone", "2"), "output_dir: '{tmp}/gone' does not exist", ("holds no run",)),
    Case("scale-a-file", scale("{tmp}/notes.txt", "2"), "output_dir: '{tmp}/notes.txt' is not a folder", ("holds no run",)),
    Case("scale-not-a-run", scale("{tmp}/cfg", "2"), "output_dir: '{tmp}/cfg' holds no run to scale"),
    Case("scale-finished-run", scale("{tmp}/run", "2"), "output_dir: '{tmp}/run' holds a finished run", ("num_replicas",)),
    Case("scale-bad-uri", scale("ftp://host/run", "2"), "output_dir: 'ftp://host/run' is not allowed", ("s3://",)),
    # --- resume targets -------------------------------------------------------------------------------
    Case("resume-missing", train("resume_from={tmp}/gone"), "resume_from: '{tmp}/gone' does not exist"),
    Case("resume-a-file", train("resume_from={tmp}/notes.txt"), "resume_from: '{tmp}/notes.txt' is not a folder", ("checkpoint folder",)),
    Case("resume-no-checkpoint", train("resume_from={tmp}/cfg"), "resume_from: '{tmp}/cfg' holds no checkpoints", ("round-XXXXXXXX",)),
    Case("resume-only-temp-folders", train("resume_from={tmp}/half"), "resume_from: '{tmp}/half' holds no checkpoints", ("round-XXXXXXXX",)),
    Case("resume-corrupt", train("resume_from={tmp}/corrupt"), "resume_from: '{tmp}/corrupt' holds no valid checkpoint", ("checksum mismatch",)),
    Case("resume-no-manifest", train("resume_from={tmp}/incomplete/checkpoints/round-00000001"), "resume_from: '{tmp}/incomplete/checkpoints/round-00000001' holds no valid", ("incomplete checkpoint",)),
    Case("resume-not-ours", train("resume_from={tmp}/foreign"), "resume_from: checkpoint {tmp}/foreign/checkpoints/round-00000001 holds no parameter-server state", ("diloco-ray train wrote",)),
    Case("resume-other-run-into-finished-run", train("resume_from={tmp}/other", out="{tmp}/run"), "resume_from: '{tmp}/other' is another run's checkpoint", ("overwrite_output_dir",)),
    Case("resume-other-sync-fragments", train(*RESUME_RUN, "sync_fragments=2"), "sync_fragments: 2, but checkpoint {tmp}/run/checkpoints/round-00000002 was written with 1", ("resume with the value",)),
    Case("resume-other-server-count", train(*RESUME_RUN, "num_param_servers=2"), "num_param_servers: 2, but checkpoint {tmp}/run/checkpoints/round-00000002", ("server count",)),
    Case("resume-other-sync-mode", train(*RESUME_RUN, "sync_mode=decoupled"), "sync_mode: decoupled, but checkpoint {tmp}/run/checkpoints/round-00000002", ("sync_mode: sync",)),
    Case("resume-other-model", train(*RESUME_RUN, "model_config.hidden_size=64", "model_config.intermediate_size=128"), "resume_from: checkpoint {tmp}/run/checkpoints/round-00000002 holds another model ('model.embed_tokens.weight' is (", ("model_config",)),
    Case("resume-with-peft-added", train(*RESUME_RUN, "use_peft=true"), "resume_from: checkpoint {tmp}/run/checkpoints/round-00000002 holds another model", ("use_peft",)),
    # overwrite_output_dir clears a run before training: a refused resume must clear nothing.
    Case("resume-mismatch-with-overwrite", train(*RESUME_RUN, "sync_fragments=2", "overwrite_output_dir=true"), "sync_fragments: 2", ("written with 1",)),
]
# fmt: on


# --- the world every case runs in --------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def tiny_model_shapes() -> dict:
    """The trained parameters of configs/tiny.yaml's model, name -> shape (built on the meta device)."""
    from diloco_ray.config.schema import TrainerConfig
    from diloco_ray.data import tokenization
    from diloco_ray.model import loading

    config = TrainerConfig.from_yaml(TINY)
    model = loading.meta_model(*model_parts(config), tokenization.load_tokenizer(config.sections().model))
    return {n: list(p.shape) for n, p in loading.trained_parameters(model)}


def write_checkpoint(root: str, round_index: int, server_meta: bool = True) -> str:
    """A checkpoint that verifies, with the ``server.json`` a one-server synchronous run of
    configs/tiny.yaml writes (its weights are not needed: nothing here loads them)."""
    import torch

    from diloco_ray.persist import checkpoint, state_files

    tmp = checkpoint.begin(root, round_index)
    state_files.save_state(tmp, "outer", {"momentum": torch.zeros(2)})
    if server_meta:
        meta = {"round": round_index, "count": 1, "sync_fragments": 1, "sync_mode": "sync"}
        with open(os.path.join(tmp, "server.json"), "w") as f:
            json.dump({**meta, "shapes": tiny_model_shapes()}, f)
    return checkpoint.commit(tmp, root, round_index, {})


def write(path: str, text: str | bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def build_world(tmp: str):
    """Lay out every folder and file the cases point at; returns the lock held on
    ``busy`` (a run that is starting), to be closed after the case."""
    run = os.path.join(tmp, "run")  # a finished run, with a checkpoint and the user's notes
    write(os.path.join(run, "config.yaml"), open(TINY).read())
    write(os.path.join(run, "metrics.jsonl"), json.dumps({"event": "round", "round": 0}) + "\n")
    write(os.path.join(run, "final", "config.json"), "{}")
    write(os.path.join(run, "notes.txt"), "the user's own file")
    write_checkpoint(os.path.join(run, "checkpoints"), 2)
    write_checkpoint(os.path.join(tmp, "other", "checkpoints"), 1)
    corrupt = write_checkpoint(os.path.join(tmp, "corrupt", "checkpoints"), 3)
    with open(os.path.join(corrupt, "outer.safetensors"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")  # one byte flipped: the checksum no longer matches
    os.makedirs(os.path.join(tmp, "incomplete", "checkpoints", "round-00000001"))
    write(os.path.join(tmp, "incomplete", "checkpoints", "round-00000001", "outer.json"), "{}")
    os.makedirs(os.path.join(tmp, "half", "checkpoints", ".tmp-round-00000004-x"))
    write_checkpoint(os.path.join(tmp, "foreign", "checkpoints"), 1, server_meta=False)
    cfg = os.path.join(tmp, "cfg")
    write(os.path.join(cfg, "syntax.yaml"), "lr: [1,\n")
    write(os.path.join(cfg, "tab.yaml"), "lr:\t1\n")
    write(os.path.join(cfg, "bytes.yaml"), b"lr: 1\n\x80\x81\n")
    write(os.path.join(cfg, "list.yaml"), "- lr\n- seed\n")
    write(os.path.join(cfg, "scalar.yaml"), "tiny\n")
    write(os.path.join(cfg, "empty.yaml"), "")
    write(os.path.join(cfg, "comments.yaml"), "# lr: 3e-4\n")
    write(os.path.join(cfg, "unknown.yaml"), open(TINY).read() + "outer_lrr: 0.5\n")
    write(os.path.join(cfg, "typed.yaml"), open(TINY).read() + "lr: fast\n")
    unreadable = socket.socket(socket.AF_UNIX)  # a socket file: even root cannot open() it
    unreadable.bind(os.path.join(cfg, "socket.yaml"))
    unreadable.close()
    write(os.path.join(tmp, "notes.txt"), "not a folder")
    write(os.path.join(tmp, "qa.jsonl"), json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    busy = os.path.join(tmp, "busy")  # a run going on: its lock is held, its first checkpoint written
    write(os.path.join(busy, "metrics.jsonl"), json.dumps({"event": "start"}) + "\n")
    write_checkpoint(os.path.join(busy, "checkpoints"), 0)
    held = open(os.path.join(busy, ".diloco-ray.lock"), "a+")
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.write(f"pid {os.getpid()} on this host")
    held.flush()
    return held


def snapshot(folder: str) -> dict:
    """Every path under ``folder`` (folders too) with its kind, bytes and modification time."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest = None
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            found[os.path.relpath(path, folder)] = (st.st_mode, digest, st.st_mtime_ns)
    return found


def shown_as_python_does() -> None:
    """The warning filters of a plain ``python`` run (pytest's differ): what a user's
    terminal would show, each warning two more lines on stderr."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=hidden)


def fill(text: str, tmp: str) -> str:
    """``text`` with ``{tmp}`` and ``{tiny}`` filled in (not str.format: YAML values hold braces)."""
    return text.replace("{tmp}", tmp).replace("{tiny}", TINY)


# --- the test ------------------------------------------------------------------------------------


def test_the_table_covers_every_kind_of_bad_input():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, tmp_path, capsys, monkeypatch):
    import ray

    tmp = str(tmp_path)
    monkeypatch.chdir(tmp)  # a relative folder a case might create lands in the snapshot
    held = build_world(tmp)
    try:
        before = snapshot(tmp)
        with warnings.catch_warnings(record=True) as shown:
            shown_as_python_does()
            code = cli.main([fill(arg, tmp) for arg in case.argv])
        out, err = capsys.readouterr()
        assert not shown, [f"{w.category.__name__}: {w.message}" for w in shown]  # stderr lines in a shell
        assert snapshot(tmp) == before, err  # nothing created, changed or removed
    finally:
        held.close()
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    line = err.rstrip("\n")
    assert line.startswith(PREFIX + fill(case.names, tmp)), line
    for words in case.allowed:
        assert fill(words, tmp) in line, (words, line)
    assert not ray.is_initialized()
