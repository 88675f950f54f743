"""A config that turns TLS verification off or sends traffic to another endpoint is
allowed (a local MinIO needs it) but never silent: one warning line each (no Ray, no
network)."""

import logging

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
