"""A config that turns TLS verification off or sends traffic to another endpoint is
allowed (a local MinIO needs it) but never silent: one warning line each (no Ray, no
network)."""

import logging

import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.driver import preflight


def config(**fields) -> TrainerConfig:
    return TrainerConfig(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic", **fields)


def loosened(cfg: TrainerConfig) -> list[str]:
    sections = cfg.sections()
    return preflight.loosened_settings(sections.checkpointing, sections.data)


def test_a_plain_config_loosens_nothing():
    assert loosened(config(output_dir="s3://bucket/run?region=eu-west-1")) == []


def test_each_loosened_setting_is_one_line_naming_its_field():
    cfg = config(
        output_dir="s3://bucket/run?endpoint_override=10.0.0.9:9000&scheme=http",
        resume_from="s3://bucket/old?tls_verify_certificates=false",
        dataset_kwargs={"storage_options": {"client_kwargs": {"endpoint_url": "http://x:9000", "verify": False}}},
    )
    assert loosened(cfg) == [
        "output_dir: 's3://bucket/run?endpoint_override=10.0.0.9:9000&scheme=http' sends to the endpoint "
        "'10.0.0.9:9000', not the provider's",
        "output_dir: 's3://bucket/run?endpoint_override=10.0.0.9:9000&scheme=http' sends over plain HTTP, "
        "unencrypted (scheme=http)",
        "resume_from: 's3://bucket/old?tls_verify_certificates=false' turns TLS certificate checks off "
        "(tls_verify_certificates=false)",
        "dataset_kwargs.storage_options.client_kwargs.endpoint_url: 'http://x:9000' sends the data set's "
        "reads to another endpoint",
        "dataset_kwargs.storage_options.client_kwargs.verify: False turns TLS certificate checks off",
    ]


def test_the_preflight_warns_before_it_touches_the_bucket(monkeypatch, caplog):
    """``check`` warns first: the bucket check after it is where the traffic would go."""
    from diloco_ray.persist import storage

    def unreachable(self):
        raise RuntimeError("stop here: the warning must come before the network")

    monkeypatch.setattr(storage.Mirror, "check_writable", unreachable)
    cfg = config(output_dir="s3://bucket/run?tls_verify_certificates=0")
    with caplog.at_level(logging.WARNING, logger="diloco_ray"):
        try:
            preflight.check(cfg, resuming=False)
        except RuntimeError:
            pass
    assert [r.getMessage() for r in caplog.records] == [
        "output_dir: 's3://bucket/run?tls_verify_certificates=0' turns TLS certificate checks off "
        "(tls_verify_certificates=0) (a config is code: run only configs whose author you trust)"
    ]


def drift(**fields):
    sections = config(**fields).sections()
    return preflight.drifting_outer_step(sections.outer_optim, sections.sync_codec)


def test_topk_under_nesterov_momentum_set_by_hand_gets_one_line_saying_what_to_set():
    line = drift(pseudo_grad_compression="topk", outer_momentum=0.9)
    assert line.startswith("outer_momentum: 0.9 with pseudo_grad_compression: topk drifts: ")
    assert line.endswith(
        "leave outer_lr and outer_momentum null for topk's own step over 10 rounds (lr 1.3, Nesterov 0.5 warmed "
        "up over 4 updates), or set outer_lr: 1.3 and outer_momentum: 0.5"
    )
    # Over a long run topk's own step has no momentum, and the line offers that one.
    assert drift(pseudo_grad_compression="topk", outer_momentum=0.9, diloco_loops=32).endswith(
        "null for topk's own step over 32 rounds (lr 1.3, no momentum), or set outer_lr: 1.3 and outer_momentum: 0"
    )
    assert drift(pseudo_grad_compression="topk", outer_lr=0.7, outer_momentum=0.95).startswith("outer_momentum: 0.95 ")


@pytest.mark.parametrize(
    "fields",
    [
        dict(pseudo_grad_compression="topk"),  # topk's own step
        dict(pseudo_grad_compression="topk", outer_lr=0.7),  # the plain default's momentum
        dict(pseudo_grad_compression="topk", outer_momentum=0.5),
        dict(pseudo_grad_compression="int8", outer_momentum=0.9),
        dict(),
        dict(pseudo_grad_compression="topk", outer_opt="Adam", outer_momentum=0.9),  # no Nesterov to drift
    ],
)
def test_every_other_step_is_left_alone(fields):
    assert drift(**fields) is None


def test_the_preflight_logs_the_drift_once(tmp_path, caplog):
    cfg = config(output_dir=str(tmp_path / "run"), pseudo_grad_compression="topk", outer_momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="diloco_ray"):
        preflight.check(cfg, resuming=False)
    assert [r.getMessage() for r in caplog.records] == [drift(pseudo_grad_compression="topk", outer_momentum=0.9)]
