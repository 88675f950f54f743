"""The config rules of a run across regions: the ``regions`` list, the home's name and
``min_regions``, the channel's files, and what the held-out check needs. One rule of
:data:`diloco_ray.config.validation.RULES`, after the fragments' own (so overlap here always
comes with ``sync_fragments`` >= 2)."""

from __future__ import annotations

from diloco_ray.config.fields import ConfigFields
from diloco_ray.errors import ConfigError


def check_regions(cfg: ConfigFields) -> None:
    """``regions``: a list of ``{name, replicas}``, names unique; what runs across regions
    today, the home's name and ``min_regions``, and the channel's TLS files."""
    if cfg.regions is None:
        if cfg.region_holdout_margin is not None:
            raise ConfigError("region_holdout_margin: tries a region's contribution; this run has no regions")
        if cfg.region_downlink != "weights":
            raise ConfigError(
                f"region_downlink: {cfg.region_downlink} says what a region gets; this run has no regions"
            )
        return
    _check_holdout(cfg)
    names = []
    for i, region in enumerate(cfg.regions):
        ok = isinstance(region, dict) and set(region) == {"name", "replicas"}
        name, replicas = (region.get("name"), region.get("replicas")) if ok else (None, None)
        if not (
            isinstance(name, str) and name.strip() and isinstance(replicas, int) and not isinstance(replicas, bool)
        ):
            ok = False
        if not ok or replicas < 1 or name in names:
            raise ConfigError(
                f"regions[{i}]: {region!r} is not allowed; expected {{name: a region name not used before, "
                "replicas: a whole number >= 1}"
            )
        names.append(name)
    if not names:
        raise ConfigError("regions: [] names no region; leave regions null for one cluster")
    if cfg.home_region in names:
        raise ConfigError(f"home_region: {cfg.home_region!r} is also in regions; give the home a name of its own")
    if cfg.min_regions > len(names) + 1:
        raise ConfigError(
            f"min_regions: {cfg.min_regions} is more than the run's {len(names) + 1} regions (the home and "
            f"{', '.join(names)}); allowed: 1 to {len(names) + 1}"
        )
    if cfg.min_regions > 1 and cfg.sync_fragments > 1:
        raise ConfigError(
            f"min_regions: {cfg.min_regions} needs whole rounds (sync_fragments: 1); with fragments each sync "
            "commits with whoever reported, as it does for min_replicas"
        )
    if isinstance(cfg.ranks_per_replica, list):
        raise ConfigError("regions: ranks_per_replica must be one number (a region's replicas have the same ranks)")
    missing = [f for f in ("channel_tls_cert", "channel_tls_key") if not getattr(cfg, f)]
    if missing:
        raise ConfigError(f"regions: the channel needs {' and '.join(missing)} (PEM files of the home's certificate)")
    if not cfg.channel_tokens_file:
        raise ConfigError("regions: the channel needs channel_tokens_file (each region's token: one `NAME TOKEN` line)")


def _check_holdout(cfg: ConfigFields) -> None:
    """The held-out check evaluates on the home's replicas while they wait for the round's
    weights: a sync-mode round that is synced whole, and an eval set to score on."""
    if cfg.region_holdout_margin is None:
        return
    if cfg.sync_mode != "sync" or cfg.sync_fragments != 1 or cfg.eval_batches == 0:
        raise ConfigError(
            f"region_holdout_margin: {cfg.region_holdout_margin} needs sync_mode: sync, sync_fragments: 1 "
            "and eval_batches > 0 (the home's replicas score each region's update on the eval batches "
            "between reporting and the round's weights); set it to null otherwise"
        )


def regions_take_the_step(sections) -> bool:
    """Whether each region takes the home's outer step itself from the sync's contributions
    rather than getting the weights messages (``sections``: a config's
    :class:`~diloco_ray.config.sections.Sections`): ``region_downlink: step``, or ``auto``
    with topk's pseudo-gradients (a sync's sparse contributions are then a fraction of the
    weights' bytes) and servers on the host (a region's copy steps on its CPU; the same step
    on a GPU rounds differently, and every sync would send the whole state again)."""
    downlink = sections.sync_codec.region_downlink
    if downlink != "auto":
        return downlink == "step"
    return sections.sync_codec.pseudo_grad_compression == "topk" and not sections.placement.server_gpus
