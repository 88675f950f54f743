"""Unit tests for diloco_ray.config.schema: loading, overrides, validation messages (no Ray)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from diloco_ray.config.schema import (
    FIELD_NAMES,
    TrainerConfig,
    field_help,
    parse_set,
)
from diloco_ray.errors import ConfigError, UserInputError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))

BASE = dict(
    model_config={"model_type": "llama", "hidden_size": 32},
    tokenizer_name="builtin:char",
    dataset_name="builtin:arithmetic",
)


def make(**overrides) -> TrainerConfig:
    return TrainerConfig(**{**BASE, **overrides})


def write_yaml(path: Path, values) -> str:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


# --- YAML files shipped with the package --------------------------------------------------


def test_configs_folder_is_not_empty():
    assert CONFIGS, "configs/*.yaml should hold at least the tiny default"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_yaml_loads(path):
    cfg = TrainerConfig.from_yaml(str(path))
    assert isinstance(cfg, TrainerConfig)
    raw = yaml.safe_load(path.read_text())
    # Every key in the file reached the config (numbers may be normalised to float).
    for key, value in raw.items():
        got = getattr(cfg, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert got == pytest.approx(float(value)), key
        elif key == "log_with" and isinstance(value, str):
            assert got == [value], key  # one tracker is normalised to a list of one
        else:
            assert got == value, key


def test_tiny_yaml_values():
    path = [p for p in CONFIGS if p.name == "tiny.yaml"]
    if not path:
        pytest.skip("no configs/tiny.yaml")
    cfg = TrainerConfig.from_yaml(str(path[0]))
    assert cfg.model_config["model_type"] == "llama"
    assert cfg.dataset_name == "builtin:arithmetic"
    assert cfg.lr == pytest.approx(2e-3) and isinstance(cfg.lr, float)
    assert cfg.warmup_steps == 30
    assert isinstance(cfg.cpus_per_rank, float) and cfg.cpus_per_rank == 1.0


# --- construction and defaults ------------------------------------------------------------


def test_direct_construction_and_defaults():
    cfg = TrainerConfig(**BASE)
    assert cfg.outer_opt == "SGD"
    assert cfg.outer_lr == 0.5
    assert cfg.outer_momentum == 0.5
    assert cfg.inner_opt == "AdamW"
    assert cfg.model_config == {"model_type": "llama", "hidden_size": 32}
    assert cfg.num_replicas == 2 and cfg.ranks_per_replica == 1
    assert cfg.replica_bounds == (1, 2)


def test_dict_defaults_are_not_shared():
    a, b = make(), make()
    a.dataset_kwargs["x"] = 1
    a.inner_opt_kwargs["weight_decay"] = 0.1
    assert b.dataset_kwargs == {} and b.inner_opt_kwargs == {}


def test_sequences_per_replica_round():
    cfg = make(max_steps=5, grad_accum=3, batch_size=4, ranks_per_replica=2)
    assert cfg.sequences_per_replica_round == 5 * 3 * 4 * 2


def test_config_error_is_user_input_and_value_error():
    with pytest.raises(ConfigError) as ei:
        make(batch_size=0)
    assert isinstance(ei.value, UserInputError)
    assert isinstance(ei.value, ValueError)


# --- unknown fields -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, good", [("outer_lrr", "outer_lr"), ("num_replica", "num_replicas"), ("batchsize", "batch_size")]
)
def test_unknown_field_from_dict_names_closest(bad, good):
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_dict({**BASE, bad: 1}, source="my.yaml")
    msg = str(ei.value)
    assert f"'{bad}'" in msg
    assert f"'{good}'" in msg
    assert "my.yaml" in msg


@pytest.mark.parametrize("bad, good", [("outer_lrr", "outer_lr"), ("num_replica", "num_replicas")])
def test_unknown_field_from_yaml_names_closest_and_file(tmp_path, bad, good):
    path = write_yaml(tmp_path / "c.yaml", {**BASE, bad: 1})
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path)
    msg = str(ei.value)
    assert f"'{good}'" in msg and bad in msg and path in msg


@pytest.mark.parametrize("bad, good", [("outer_lrr", "outer_lr"), ("num_replica", "num_replicas")])
def test_unknown_field_in_overrides_names_closest(tmp_path, bad, good):
    path = write_yaml(tmp_path / "c.yaml", BASE)
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path, overrides={bad: 1})
    assert f"'{good}'" in str(ei.value) and bad in str(ei.value)


def test_unknown_dotted_override_names_closest(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", BASE)
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path, overrides={"outer_opt_kwarg.nesterov": False})
    assert "'outer_opt_kwargs'" in str(ei.value)


def test_unknown_field_far_from_everything_points_to_help():
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_dict({**BASE, "zzzzqqq": 1})
    assert "zzzzqqq" in str(ei.value)
    assert "--help" in str(ei.value)


def test_from_dict_rejects_non_mapping():
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_dict(["a"], source="src.yaml")
    assert "src.yaml" in str(ei.value) and "list" in str(ei.value)


# --- types and ranges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("batch_size", "x", "integer"),
        ("batch_size", 2.5, "integer"),
        ("batch_size", True, "integer"),
        ("use_peft", 3, "true/false"),
        ("use_peft", "yes", "true/false"),
        ("lr", True, "number"),
        ("lr", "fast", "number"),
        ("lr", [1], "number"),
        ("mixed_precision", "fp8", "'bf16'"),
        ("device", "tpu", "'cuda'"),
        ("outer_lr_schedule", "step", "'cosine'"),
        ("model_config", "llama", "mapping"),
        ("dataset_kwargs", None, "mapping"),
        ("max_grad_norm", "big", "null"),
        # out of range
        ("batch_size", 0, ">= 1"),
        ("grad_accum", -1, ">= 1"),
        ("seq_len", 4, ">= 8"),
        ("outer_momentum", 1.0, "< 1"),
        ("outer_momentum", -0.1, ">= 0"),
        ("split_ratio", 0.9, "<= 0.5"),
        ("split_ratio", 0.0, "> 0"),
        ("lr", 0.0, "> 0"),
        ("lr", -1e-3, "> 0"),
        ("min_lr_ratio", 1.5, "<= 1"),
        ("lora_dropout", 1.0, "< 1"),
        ("max_grad_norm", 0.0, "> 0"),
        ("seed", -1, ">= 0"),
    ],
)
def test_bad_value_names_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ConfigError) as ei:
        make(**{field: value})
    msg = str(ei.value)
    assert msg.startswith(f"{field}:"), msg
    assert repr(value) in msg, msg
    assert allowed in msg, msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 1),
        ("seq_len", 8),
        ("split_ratio", 0.5),
        ("outer_momentum", 0.0),
        ("min_lr_ratio", 1.0),
        ("max_grad_norm", None),
        ("eval_batches", 0),
    ],
)
def test_boundary_values_accepted(field, value):
    assert getattr(make(**{field: value}), field) == value


def test_coercions():
    cfg = make(lr=1, outer_lr="0.5", lr_schedule="linear", target_modules="q_proj", log_with="wandb")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.outer_lr == 0.5 and isinstance(cfg.outer_lr, float)
    assert cfg.target_modules == ["q_proj"]
    assert cfg.log_with == ["wandb"]


# --- cross-field rules --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model_config=None), "model_name"),
        (dict(model_config={"hidden_size": 32}), "model_config"),
        (dict(dataset_name=None), "dataset_name"),
        (dict(num_replicas=3, max_replicas=2), "num_replicas"),
        (dict(num_replicas=1, min_replicas=2), "num_replicas"),
        (dict(prompt_template="{question}"), "completion_template"),
        (dict(completion_template="{answer}"), "completion_template"),
        (dict(log_with="mlflow"), "log_with"),
        (dict(log_with=["tensorboard", "comet"]), "log_with"),
        (dict(target_modules=["q_proj", 3]), "target_modules"),
    ],
)
def test_cross_field_rules_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as ei:
        make(**kwargs)
    assert str(ei.value).startswith(f"{field}:"), str(ei.value)


def test_num_replicas_bounds_message_shows_bounds():
    with pytest.raises(ConfigError) as ei:
        make(num_replicas=5, min_replicas=1, max_replicas=3)
    assert "5" in str(ei.value) and "min_replicas=1" in str(ei.value) and "max_replicas=3" in str(ei.value)


def test_model_name_takes_precedence_over_model_config():
    cfg = make(model_name="some/model")
    assert cfg.model_name == "some/model"
    assert cfg.model_config is None  # cleared, so the resolved config shows what is used


def test_json_file_path_takes_precedence_over_dataset_name():
    cfg = make(json_file_path="data.jsonl", subset="en", dataset_kwargs={"num_samples": 5})
    assert cfg.json_file_path == "data.jsonl"
    assert cfg.dataset_name is None and cfg.subset is None
    assert cfg.dataset_kwargs == {"num_samples": 5}  # kept: load_dataset("json", ...) takes them


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"num_samples": 20_000_000}, "num_samples: 20000000"),  # a typo's extra zeros
        ({"num_samples": 0}, "num_samples: 0"),
        ({"num_samples": "many"}, "num_samples: 'many'"),
        ({"num_samples": True}, "num_samples: True"),
        ({"digits": 100_000}, "digits: 100000"),
    ],
)
def test_a_builtin_data_set_is_bounded_in_one_line(kwargs, named):
    with pytest.raises(ConfigError) as caught:
        make(dataset_kwargs=kwargs)
    line = str(caught.value)
    assert line.startswith(f"dataset_kwargs.{named} is not allowed") and "\n" not in line
    assert "from 1 to" in line and "builtin:arithmetic" in line


def test_a_builtin_data_set_at_its_bounds_is_accepted():
    assert make(dataset_kwargs={"num_samples": 1_000_000, "digits": 18}).dataset_kwargs["num_samples"] == 1_000_000
    # The bound is the builtin's: a file's loader gets the key as it is (and refuses it itself).
    assert make(json_file_path="d.jsonl", dataset_kwargs={"num_samples": 10**9}).json_file_path == "d.jsonl"


def test_model_config_without_tokenizer_name_is_accepted():
    cfg = make(tokenizer_name=None)
    assert cfg.tokenizer_name is None and cfg.model_config["model_type"] == "llama"


def test_precedence_via_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**BASE, "dataset_kwargs": {"num_samples": 5}})
    cfg = TrainerConfig.from_yaml(path, overrides=parse_set(["model_name=org/m", "json_file_path=d.jsonl"]))
    assert (cfg.model_name, cfg.model_config) == ("org/m", None)
    assert (cfg.json_file_path, cfg.dataset_name) == ("d.jsonl", None)


def test_cross_field_accepted_variants():
    cfg = make(model_config=None, tokenizer_name=None, model_name="some/model")
    assert cfg.model_name == "some/model"
    cfg = make(dataset_name=None, json_file_path="data.jsonl")
    assert cfg.json_file_path == "data.jsonl"
    cfg = make(num_replicas=4, min_replicas=2, max_replicas=8)
    assert cfg.replica_bounds == (2, 8)
    assert make(log_with=["tensorboard", "wandb"]).log_with == ["tensorboard", "wandb"]


# --- low-bandwidth sync settings ------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(max_steps=10, sync_fragments=11), "sync_fragments"),
        (dict(max_steps=10, sync_fragments=2, checkpoint_steps=5), "checkpoint_steps"),
        (dict(max_steps=10, sync_fragments=2, overlap_communication=True, checkpoint_steps=5), "checkpoint_steps"),
        # one fragment merged one period late would scale every update by fragment_alpha
        (dict(max_steps=10, overlap_communication=True), "overlap_communication"),
        (dict(fault_plan={"kind": "kill"}), "fault_plan"),
        (dict(fault_plan=[{"kind": "explode", "round": 1}]), "fault_plan[0].kind"),
        (dict(fault_plan=[{"kind": "kill", "target": "server", "round": 1}, {"kind": "kill"}]), "fault_plan[1].round"),
        (dict(fault_plan=[{"kind": "slow", "round": 1}]), "fault_plan[0].seconds"),
        (dict(fault_plan=[{"kind": "kill", "round": -1}]), "fault_plan[0].round"),
        (dict(fault_plan=[{"kind": "kill", "round": 0, "when": 3}]), "fault_plan[0].when"),
        (dict(num_param_servers=2, server_resources=[{"a": 1}]), "server_resources"),
        (dict(link_mbps=0), "link_mbps"),
        (dict(link_mbps=[10.0, -1.0]), "link_mbps"),
        (dict(num_replicas=3, link_mbps=[10.0, 20.0]), "link_mbps"),
        (dict(pseudo_grad_compression="int3"), "pseudo_grad_compression"),
        (dict(weights_compression="zip"), "weights_compression"),
        (dict(fragment_alpha=1.5), "fragment_alpha"),
        (dict(compression_block=4), "compression_block"),
    ],
)
def test_sync_settings_rejected_naming_field(overrides, field):
    with pytest.raises(ConfigError) as ei:
        make(**overrides)
    assert str(ei.value).startswith(f"{field}:"), str(ei.value)


def test_sync_settings_accepted():
    cfg = make(
        max_steps=12,
        sync_fragments=4,
        overlap_communication=True,
        checkpoint_steps=24,
        num_param_servers=2,
        server_resources=[{"a": 1}, {"b": 1}],
        link_mbps=[10, 20],
        pseudo_grad_compression="int4",
        error_feedback=True,
        weights_compression="int8",
    )
    assert cfg.link_mbps == [10.0, 20.0]
    assert make(link_mbps=5).link_mbps == 5.0
    assert make(error_feedback=True).error_feedback  # no effect with none, but allowed


# --- parse_set and overrides --------------------------------------------------------------


def test_parse_set_yaml_values():
    out = parse_set(
        [
            "lr=3e-4",
            "batch_size=4",
            "target_modules=[q_proj,v_proj]",
            "dataset_kwargs={num_samples: 10, digits: 1}",
            "use_peft=false",
            "model_name=org/name",
            "eval_split=",
            " output_dir = out/x",
        ]
    )
    assert out["batch_size"] == 4
    assert out["target_modules"] == ["q_proj", "v_proj"]
    assert out["dataset_kwargs"] == {"num_samples": 10, "digits": 1}
    assert out["use_peft"] is False
    assert out["model_name"] == "org/name"
    assert out["eval_split"] is None
    assert out["output_dir"] == "out/x"
    cfg = make(lr=out["lr"], target_modules=out["target_modules"])
    assert cfg.lr == 0.0003 and isinstance(cfg.lr, float)
    assert cfg.target_modules == ["q_proj", "v_proj"]


def test_parse_set_value_with_equals_sign():
    assert parse_set(["prompt_template=a=b"]) == {"prompt_template": "a=b"}


@pytest.mark.parametrize("item", ["x", "=3", "  =3"])
def test_parse_set_rejects_non_key_value(item):
    with pytest.raises(ConfigError) as ei:
        parse_set([item])
    assert "KEY=VALUE" in str(ei.value) and item in str(ei.value)


def test_parse_set_rejects_invalid_yaml_value():
    with pytest.raises(ConfigError) as ei:
        parse_set(["target_modules=[q_proj"])
    assert "target_modules" in str(ei.value)


def test_dotted_override_reaches_into_dict(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**BASE, "outer_opt_kwargs": {"dampening": 0.0}})
    cfg = TrainerConfig.from_yaml(path, overrides=parse_set(["outer_opt_kwargs.nesterov=false"]))
    assert cfg.outer_opt_kwargs == {"dampening": 0.0, "nesterov": False}


def test_dotted_override_creates_dict(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", BASE)
    cfg = TrainerConfig.from_yaml(
        path, overrides=parse_set(["outer_opt_kwargs.nesterov=false", "model_config.hidden_size=64"])
    )
    assert cfg.outer_opt_kwargs == {"nesterov": False}
    assert cfg.model_config == {"model_type": "llama", "hidden_size": 64}


def test_dotted_override_into_non_mapping_field(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**BASE, "lr": 0.01})
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path, overrides={"lr.x": 1})
    assert "'lr'" in str(ei.value) and "mapping" in str(ei.value)


def test_overrides_replace_yaml_values(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {**BASE, "batch_size": 2, "output_dir": "a"})
    cfg = TrainerConfig.from_yaml(path, overrides=parse_set(["batch_size=7", "lr=1e-2"]))
    assert cfg.batch_size == 7 and cfg.lr == 0.01 and cfg.output_dir == "a"


def test_override_validation_error_names_field(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", BASE)
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path, overrides=parse_set(["batch_size=x"]))
    assert str(ei.value).startswith("batch_size:")


# --- YAML files ---------------------------------------------------------------------------


def test_from_yaml_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(path)
    assert path in str(ei.value) and "does not exist" in str(ei.value)


def test_from_yaml_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_config: {model_type: llama\nlr: [1, 2\n")
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(str(path))
    assert str(path) in str(ei.value) and "YAML" in str(ei.value)
    assert "\n" not in str(ei.value)


def test_from_yaml_list_document(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(str(path))
    assert str(path) in str(ei.value) and "mapping" in str(ei.value)


def test_from_yaml_a_folder_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        TrainerConfig.from_yaml(str(tmp_path))
    assert str(tmp_path) in str(ei.value)


def test_yaml_float_strings_become_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model_config: {model_type: llama}\n"
        "tokenizer_name: builtin:char\n"
        "dataset_name: builtin:arithmetic\n"
        "lr: 3e-4\n"  # PyYAML reads this as the string '3e-4'
        "outer_lr: 1e0\n"
        "min_lr_ratio: 0\n"
    )
    assert yaml.safe_load(path.read_text())["lr"] == "3e-4"  # the reason for the coercion
    cfg = TrainerConfig.from_yaml(str(path))
    assert cfg.lr == 0.0003 and type(cfg.lr) is float
    assert cfg.outer_lr == 1.0 and type(cfg.outer_lr) is float
    assert cfg.min_lr_ratio == 0.0 and type(cfg.min_lr_ratio) is float


def test_to_yaml_from_yaml_round_trip(tmp_path):
    cfg = make(
        lr=3e-4,
        log_with="tensorboard",
        target_modules=["q_proj"],
        outer_opt_kwargs={"nesterov": False},
        dataset_kwargs={"num_samples": 10},
        max_replicas=4,
        eval_split="test",
        mixed_precision="bf16",
        round_timeout_s=12.5,
        seed=3,
    )
    path = tmp_path / "out" / "config.yaml"
    path.parent.mkdir()
    cfg.to_yaml(str(path))
    assert not (tmp_path / "out" / "config.yaml.tmp").exists()
    back = TrainerConfig.from_yaml(str(path))
    assert back == cfg
    assert dataclasses.asdict(back) == dataclasses.asdict(cfg)
    # The written file holds every field, defaults included.
    assert set(yaml.safe_load(path.read_text())) == set(FIELD_NAMES)


def test_to_yaml_round_trip_of_defaults(tmp_path):
    cfg = make()
    path = str(tmp_path / "config.yaml")
    cfg.to_yaml(path)
    assert TrainerConfig.from_yaml(path) == cfg


def test_to_dict_has_every_field():
    d = make().to_dict()
    assert list(d) == FIELD_NAMES
    assert d["outer_lr"] == 0.5


# --- help ---------------------------------------------------------------------------------


def test_field_help_covers_every_field():
    rows = field_help()
    assert [name for name, _, _ in rows] == FIELD_NAMES
    for name, default, text in rows:
        assert isinstance(text, str) and text.strip(), name
        assert "\n" not in text, name
    defaults = {name: default for name, default, _ in rows}
    assert defaults["outer_lr"] is None  # the codec's (see test_a_codec_brings_its_own_outer_defaults)
    assert defaults["inner_opt"] == "AdamW"
    assert defaults["dataset_kwargs"] == {}
    assert defaults["model_name"] is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"inner_time_s": 5.0, "sync_fragments": 2}, "inner_time_s: adaptive inner steps need sync_fragments: 1"),
        ({"inner_time_s": 30.0, "round_timeout_s": 30.0}, "inner_time_s: 30 must be below round_timeout_s=30"),
        ({"inner_time_s": 0}, "inner_time_s: 0.0 is not allowed; must be > 0.0"),
    ],
)
def test_inner_time_s_is_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make(**overrides)
    assert make(inner_time_s=5.0, round_timeout_s=30.0).inner_time_s == 5.0


def test_a_data_sets_loading_script_is_refused_and_false_is_allowed():
    """``trust_remote_code: true`` in dataset_kwargs would run a hub data set's script in the
    tokenising task (``datasets`` 3.x): refused, naming the key; false is the default."""
    with pytest.raises(ConfigError, match=r"^dataset_kwargs\.trust_remote_code: refused"):
        make(dataset_kwargs={"trust_remote_code": True})
    cfg = make(dataset_kwargs={"trust_remote_code": False})
    assert cfg.dataset_kwargs == {"trust_remote_code": False}


SECRETS = {
    "data_files": "train.jsonl",
    "token": "hf_SECRET1",
    "max_tokens": 512,
    "storage_options": {"key": "AKIASECRET2", "secret": "SECRET3", "anon": False},
}


def test_secrets_never_reach_config_yaml_or_print_config(tmp_path, capsys):
    """A hub token or cloud keys in dataset_kwargs are ``***`` in config.yaml and in
    ``--print-config``; everything else is as given (a file a run reads from, written with
    ``redact=False``, keeps them, owner-only)."""
    from diloco_ray import cli

    cfg = make(dataset_kwargs=SECRETS)
    cfg.to_yaml(str(tmp_path / "config.yaml"))
    text = (tmp_path / "config.yaml").read_text()
    assert not re.search("SECRET[123]", text)
    saved = yaml.safe_load(text)["dataset_kwargs"]
    assert saved == {**SECRETS, "token": "***", "storage_options": {"key": "***", "secret": "***", "anon": False}}
    cfg.to_yaml(str(tmp_path / "full.yaml"), redact=False)
    assert yaml.safe_load((tmp_path / "full.yaml").read_text())["dataset_kwargs"] == SECRETS
    assert (tmp_path / "full.yaml").stat().st_mode & 0o777 == 0o600

    source = tmp_path / "job.yaml"
    source.write_text(yaml.safe_dump({**BASE, "dataset_kwargs": SECRETS}))
    assert cli.main(["train", str(source), "--print-config"]) == 0
    shown = capsys.readouterr().out
    assert "data_files: train.jsonl" in shown and not re.search("SECRET[123]", shown)


def test_the_trackers_get_the_redacted_config(monkeypatch, tmp_path):
    """What W&B and TensorBoard are handed as the run's config (RunEvents.open) is redacted."""
    from diloco_ray.driver import trainer as trainer_module

    seen = {}
    monkeypatch.setattr(trainer_module.RunEvents, "open", lambda self, obs, config, run_dir: seen.update(config))
    trainer = trainer_module.DilocoFSDPTrainer(make(dataset_kwargs=SECRETS, output_dir=str(tmp_path / "run")))
    (tmp_path / "run").mkdir()
    trainer._open_records(trainer.config.sections())
    assert seen["dataset_kwargs"]["token"] == "***" and seen["dataset_kwargs"]["storage_options"]["secret"] == "***"


def test_topk_brings_its_own_outer_step_as_a_whole_and_a_value_set_wins():
    base = dict(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic")
    plain = TrainerConfig(**base)
    assert (plain.outer_lr, plain.outer_momentum, plain.error_feedback_decay, plain.topk_fraction) == (
        0.5,
        0.5,
        1.0,
        1 / 16,
    )
    sparse = TrainerConfig(**base, pseudo_grad_compression="topk")
    assert (sparse.outer_lr, sparse.outer_momentum, sparse.error_feedback_decay, sparse.topk_fraction) == (
        1.3,
        0.5,
        0.95,
        1 / 64,
    )
    mine = TrainerConfig(**base, pseudo_grad_compression="topk", topk_fraction=1 / 32)
    assert (mine.outer_lr, mine.outer_momentum, mine.error_feedback_decay, mine.topk_fraction) == (
        1.3,
        0.5,
        0.95,
        1 / 32,
    )
    # The outer step comes as a whole: a config that chose its own keeps the plain step's lr, fraction and decay.
    own = TrainerConfig(**base, pseudo_grad_compression="topk", outer_momentum=0.2)
    assert (own.outer_lr, own.outer_momentum, own.error_feedback_decay, own.topk_fraction) == (0.5, 0.2, 1.0, 1 / 16)
    # A value set by hand is kept whatever the defaults: the DiLoCo paper's step, for long runs.
    paper = TrainerConfig(**base, outer_lr=0.7, outer_momentum=0.9)
    assert (paper.outer_lr, paper.outer_momentum) == (0.7, 0.9)
    # What the run used is what config.yaml holds, so a resume uses it again.
    assert TrainerConfig.from_dict(sparse.to_dict()).to_dict() == sparse.to_dict()


@pytest.mark.parametrize("rounds, momentum, warmup", [(31, 0.5, 4), (32, 0.0, 0), (500, 0.0, 0)])
def test_topk_takes_sparselocos_momentum_free_step_over_a_long_run(rounds, momentum, warmup):
    base = dict(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", diloco_loops=rounds)
    sparse = TrainerConfig(**base, pseudo_grad_compression="topk")
    assert (sparse.outer_lr, sparse.outer_momentum, sparse.outer_momentum_warmup_rounds) == (1.3, momentum, warmup)
    assert (sparse.error_feedback_decay, sparse.topk_fraction) == (0.95, 1 / 64)
    assert TrainerConfig.from_dict(sparse.to_dict()).to_dict() == sparse.to_dict()
    # The rule is topk's: the plain step keeps its momentum however long the run, and a value set wins.
    assert (TrainerConfig(**base).outer_momentum, TrainerConfig(**base).outer_momentum_warmup_rounds) == (0.5, 4)
    mine = TrainerConfig(**base, pseudo_grad_compression="topk", outer_momentum_warmup_rounds=2)
    assert (mine.outer_momentum, mine.outer_momentum_warmup_rounds) == (momentum, 2)


def test_the_default_step_warms_its_momentum_up_and_a_chosen_one_is_taken_as_it_is():
    base = dict(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic")
    warm = lambda **f: TrainerConfig(**base, **f).outer_momentum_warmup_rounds  # noqa: E731
    assert warm() == 4 and warm(pseudo_grad_compression="int8") == 4  # the plain default step
    assert warm(pseudo_grad_compression="topk") == 4  # topk's own step warms its momentum up the same way
    assert warm(outer_lr=0.7) == 0 and warm(outer_momentum=0.9) == 0  # a step chosen by hand
    assert warm(outer_opt="Adam") == 0 and warm(outer_opt="Adam", pseudo_grad_compression="topk") == 0  # no momentum
    assert warm(outer_lr=0.7, outer_momentum_warmup_rounds=2) == 2  # a value set always wins
    saved = TrainerConfig(**base).to_dict()
    assert saved["outer_momentum_warmup_rounds"] == 4  # config.yaml says what the run used
    assert TrainerConfig.from_dict(saved).outer_momentum_warmup_rounds == 4


def test_the_config_a_region_is_handed_holds_no_secret():
    from diloco_ray.config.schema import without_secrets

    values = {
        "dataset_kwargs": {"token": "hf_x", "data_files": "a.json", "storage_options": {"key": "k", "anon": False}}
    }
    assert without_secrets(values) == {"dataset_kwargs": {"data_files": "a.json", "storage_options": {"anon": False}}}
