"""The regions among the home's round members, and the channel opened for them.

:class:`RegionMember` stands for a region among the round's members: its id is
``REGION_ID_BASE`` plus the region's index, its data plan is its replicas' worth
(``DataSection.sequences_for``), and its period is the gateway's
(:class:`~diloco_ray.regions.gateway.RegionGateway`). :class:`RegionMembers` knows which
regions take part: a region joins the round once it is connected and its replicas are up,
leaves it when the loop drops it (late, or failed: a region silent for
``channel_timeout_s`` is lost), and joins again at a later boundary once it has
reconnected. :func:`open_channel` starts the gateway on the driver's node and returns them.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from diloco_ray.channel.credentials import RegionTokens, read_pem
from diloco_ray.config.fields import REGION_ID_BASE
from diloco_ray.config.region_rules import regions_take_the_step
from diloco_ray.config.sections import ChannelSection
from diloco_ray.logs import log
from diloco_ray.observe.events import MembershipEvent
from diloco_ray.regions.gateway import RegionGateway
from diloco_ray.runtime.messages import SyncPeriod


class RegionMember:
    """A region among the round's members: what the loops ask of a replica, carried by the gateway.

    Its replicas beat on their own cluster's step board, not the home's: the home judges a
    region by its channel (its agent's beats), so the loops' stall checks pass it by.

    Args:
        index: the region's place in ``regions``.
        name: the region's name.
        gateway: the :class:`RegionGateway` actor.
        servers: ``num_param_servers``.
        round_of: the index of the round the run is at (a checkpoint's, when one is taken).
        syncs: how many syncs the driver has chained (the last one made the period's weights).
    """

    def __init__(
        self, index: int, name: str, gateway, servers: int, round_of: Callable[[], int], syncs: Callable[[], int]
    ):
        self.id, self.name, self.gateway, self.servers = REGION_ID_BASE + index, name, gateway, servers
        self.round_of, self.syncs = round_of, syncs
        self.world_size = 1  # one message per sync, whatever runs behind it
        self.judged_by_steps = False
        self.shapes: dict = {}

    def run_period(self, job: SyncPeriod) -> tuple[list[list], list]:
        """Start the region's sync period: (per server, its buffer's ref; its stats' ref)."""
        outs = self.gateway.run_period.options(num_returns=self.servers + 1).remote(self.name, job, self.syncs())
        return [[outs[s]] for s in range(self.servers)], [outs[-1]]

    def abort(self, attempt: int) -> None:
        self.gateway.abort.remote(self.name, attempt)

    def save_inner_state(self, folder: str, slot: int, sent_verdicts: tuple = ()) -> list:
        """The region's part of a checkpoint (see :meth:`RegionGateway.save_region`)."""
        return [self.gateway.save_region.remote(self.name, folder, self.round_of(), sent_verdicts)]

    def stop(self, keep: bool = False) -> None:
        """Nothing to stop (or keep) here: the region's own cluster runs its replicas."""


class RegionMembers:
    """Which regions take part in the round.

    Args:
        regions: the regions section.
        gateway: the :class:`RegionGateway` actor.
        servers: ``num_param_servers``.
        on_event: where membership events go.
        round_of: the current round's index (for the events).
    """

    def __init__(self, regions: ChannelSection, gateway, servers: int, on_event: Callable, round_of: Callable):
        self.gateway, self.on_event, self.round_of = gateway, on_event, round_of
        self.serial = 0  # syncs chained (region_downlink: step: the gateway is told of each)
        self.members = [
            RegionMember(i, r["name"], gateway, servers, round_of, lambda: self.serial)
            for i, r in enumerate(regions.regions)
        ]
        self.taking_part: list[RegionMember] = []

    @property
    def active(self) -> list[RegionMember]:
        return list(self.taking_part)

    def note_sync(self, refs) -> None:
        """The driver chained a sync (its :class:`~diloco_ray.runtime.server_group.SyncRefs`):
        the regions that take the outer step themselves get its record from the gateway."""
        self.serial += 1
        self.gateway.note_sync.remote(self.serial, refs)

    def at_boundary(self, wait_s: float = 0.0) -> None:
        """Let every connected region take part (waiting up to ``wait_s`` for all of them)."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            connected = set(ray.get(self.gateway.connected.remote()))
            for member in self.members:
                if member.name in connected and member not in self.taking_part:
                    self.taking_part.append(member)
                    self.on_event(MembershipEvent("join", self.round_of(), replica_id=member.id, region=member.name))
            if len(self.taking_part) == len(self.members) or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def drop(self, member: RegionMember, reason: str) -> None:
        """``member`` leaves the round (late, failed); it joins again once it is connected."""
        if member in self.taking_part:
            self.taking_part.remove(member)
            event = MembershipEvent("leave", self.round_of(), replica_id=member.id, reason=reason, region=member.name)
            self.on_event(event)

    def restore(self, folder: Optional[str]) -> None:
        """The home's servers start from checkpoint ``folder`` behind what the regions hold
        (None: from nothing): every region takes up its part of it, or starts fresh."""
        import ray

        ray.get(self.gateway.restore.remote(folder))

    def close(self) -> None:
        """Tell the regions the run is over and close the channel."""
        import ray

        try:
            ray.get(self.gateway.stop.remote(), timeout=30)
        except Exception as e:  # the run is over either way: the regions' agents then give up on it
            log.warning("channel: could not tell the regions the run is over (%s)", type(e).__name__)


def open_channel(job: dict, sections, on_event: Callable, round_of: Callable) -> RegionMembers:
    """Start the channel's actor on the driver's node, where the tokens file is (``job``:
    the config as the regions get it, with no secret in it) and the members that stand for the
    regions; a region takes part once it has joined."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    r = sections.channel
    tokens_file = os.path.abspath(r.channel_tokens_file)
    RegionTokens(tokens_file, [region["name"] for region in r.regions])  # one clear error, here
    cert, key = read_pem(r.channel_tls_cert, "channel_tls_cert"), read_pem(r.channel_tls_key, "channel_tls_key")
    info = {region["name"]: {"config": job, "region": region, "index": i} for i, region in enumerate(r.regions)}
    servers = sections.placement.num_param_servers
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    gateway = (
        ray.remote(RegionGateway)
        .options(num_cpus=0, max_concurrency=8 + 4 * len(r.regions), scheduling_strategy=here)
        .remote(
            r,
            tokens_file,
            cert,
            key,
            info,
            servers,
            sections.data.seq_len,
            save_timeout_s=sections.membership.call_timeout_s / 2,
            fragments=sections.sync_codec.sync_fragments,
            steps=regions_take_the_step(sections),
        )
    )
    port = ray.get(gateway.address.remote(), timeout=sections.membership.call_timeout_s)
    log.info("channel: listening on %s:%d for regions %s", r.channel_host, port, ", ".join(info))
    return RegionMembers(r, gateway, servers, on_event, round_of)
