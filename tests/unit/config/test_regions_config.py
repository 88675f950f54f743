"""The regions fields: what a run across regions may say, one line for what it may not,
and a region's member counting its replicas' data."""

import dataclasses

import pytest
from conftest import tiny_config

from diloco_ray.config.fields import REGION_ID_BASE
from diloco_ray.config.schema import TrainerConfig
from diloco_ray.errors import ConfigError

CHANNEL = dict(channel_tls_cert="home.pem", channel_tls_key="home.key", channel_tokens_file="tokens")


def test_a_region_member_plans_its_replicas_worth_of_data(tmp_path):
    cfg = tiny_config(tmp_path, regions=[{"name": "eu", "replicas": 2}, {"name": "us", "replicas": 3}], **CHANNEL)
    one = cfg.sequences_for(0)
    assert [cfg.sequences_for(REGION_ID_BASE + i) for i in range(2)] == [2 * one, 3 * one]
    assert cfg.sections().data.sequences_for(REGION_ID_BASE + 1) == 3 * one
    assert cfg.sections().channel.region_of(REGION_ID_BASE) == {"name": "eu", "replicas": 2}
    assert cfg.region_of(0) is None and cfg.region_of(REGION_ID_BASE + 2) is None


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(regions=[{"name": "eu"}], **CHANNEL), r"regions\[0\]: .* is not allowed; expected \{name: "),
        (dict(regions=[{"name": "eu", "replicas": 0}], **CHANNEL), r"regions\[0\]: "),
        (dict(regions=[{"name": "eu", "replicas": 1}, {"name": "eu", "replicas": 2}], **CHANNEL), r"regions\[1\]: "),
        (dict(regions=[], **CHANNEL), "regions: \\[\\] names no region"),
        (dict(regions=[{"name": "eu", "replicas": 1}]), "the channel needs channel_tls_cert and channel_tls_key"),
        (dict(regions=[{"name": "eu", "replicas": 1}], home_region="eu", **CHANNEL), "home_region: 'eu' is also"),
        (dict(regions=[{"name": "eu", "replicas": 1}], min_regions=3, **CHANNEL), "min_regions: 3 is more than"),
        (
            dict(regions=[{"name": "eu", "replicas": 1}], min_regions=2, sync_fragments=2, **CHANNEL),
            "min_regions: 2 needs whole rounds",
        ),
        (dict(region_holdout_margin=0.01), "region_holdout_margin: tries a region's contribution; this run has no"),
        (dict(region_downlink="step"), "region_downlink: step says what a region gets; this run has no regions"),
        (dict(regions=[{"name": "eu", "replicas": 1}], region_downlink="both", **CHANNEL), "region_downlink"),
        *(
            (dict(regions=[{"name": "eu", "replicas": 1}], region_holdout_margin=0.01, **other, **CHANNEL), needs)
            for needs in ["region_holdout_margin: 0.01 needs sync_mode: sync, sync_fragments: 1 and eval_batches > 0"]
            for other in (
                dict(sync_mode="decoupled"),
                dict(sync_fragments=2),
                dict(sync_fragments=2, overlap_communication=True),
                dict(eval_batches=0),
            )
        ),
        (dict(regions=[{"name": "eu", "replicas": 1}], region_holdout_margin=-1.0, **CHANNEL), "region_holdout_margin"),
    ],
)
def test_what_a_run_across_regions_may_not_say_is_one_line(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, **fields)


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_region_s_own_view_of_the_home_s_job_is_a_valid_one_cluster_config(tmp_path, mode):
    from diloco_ray.regions.agent import in_region_config

    home = tiny_config(
        tmp_path / "home",
        num_replicas=2,
        regions=[{"name": "eu", "replicas": 3}, {"name": "us", "replicas": 1}],
        pseudo_grad_compression="topk",
        sync_mode=mode,
        **({"min_quorum": 4} if mode == "decoupled" else {"min_regions": 3, "round_timeout_s": 60}),
        **({} if mode == "decoupled" else {"region_holdout_margin": 0.02}),  # the home's alone
        region_downlink="step",  # the home's alone
        **CHANNEL,
    )
    for region in home.regions:
        own = in_region_config(home.to_dict(), region, str(tmp_path / region["name"]))
        assert own.num_replicas == region["replicas"] and own.regions is None and own.region_holdout_margin is None
        assert own.pseudo_grad_compression == "none" and not own.error_feedback  # the leg inside is plain
        assert own.sync_mode == mode and own.seed == home.seed and own.output_dir == str(tmp_path / region["name"])


@pytest.mark.parametrize("mode", ["sync", "decoupled"])
def test_a_region_s_copy_of_the_home_s_servers_is_built_from_the_home_s_job(tmp_path, mode):
    """regions.mirror: the home's job, less what is the home's own (its regions, its channel,
    its faults, its members' rules), is a valid config of the same servers."""
    from diloco_ray.config.region_rules import regions_take_the_step
    from diloco_ray.regions.mirror import mirror_config

    home = tiny_config(
        tmp_path / "home",
        regions=[{"name": "eu", "replicas": 3}],
        pseudo_grad_compression="topk",
        region_downlink="auto",
        num_param_servers=2,
        sync_mode=mode,
        fault_plan=[{"kind": "nan", "region": "eu", "replica": 1, "round": 0}],
        **({"min_quorum": 2} if mode == "decoupled" else {"min_regions": 2, "round_timeout_s": 60}),
        **CHANNEL,
    )
    assert regions_take_the_step(home.sections())  # auto, with topk
    copy = TrainerConfig.from_dict(mirror_config(home.to_dict()))
    assert copy.regions is None and copy.fault_plan is None
    for name in ("outer_optim", "checkpointing"):
        assert getattr(copy.sections(), name) == getattr(home.sections(), name), name
    codec, home_codec = copy.sections().sync_codec, home.sections().sync_codec  # all but region_downlink
    assert dataclasses.replace(codec, region_downlink=home_codec.region_downlink) == home_codec
    merging, home_merging = copy.sections().decoupled, home.sections().decoupled  # all but min_quorum
    assert (merging.decoupled_momentum, merging.stale_correction) == (
        home_merging.decoupled_momentum,
        home_merging.stale_correction,
    )
    assert copy.sections().placement.num_param_servers == 2
