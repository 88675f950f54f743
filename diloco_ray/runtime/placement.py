"""Where a replica's ranks run, as plain functions of what Ray reports (no Ray here).

:func:`replica_layout` turns a rank's resources, the replica's ranks and ``nodes_per_replica``
into the bundles of its one placement group, the group's strategy and the bundle each rank is
scheduled into. :func:`place_ranks` turns each rank's report (its Ray node id and the GPU ids
Ray gave it) into where it stands on its node and which GPUs it sees, as Ray Train's worker
group does: the ranks of a replica on one node see every GPU the replica holds there, so
NCCL can reach the others' GPUs over NVLink/P2P, and each binds its own. The replica
(:mod:`~diloco_ray.runtime.replica`) asks the reports and hands each rank its
:class:`RankPlacement` before the rank touches CUDA, and :func:`bind_device` is the
rank's side of it.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ReplicaLayout:
    """The placement group of one replica.

    Args:
        bundles: the group's bundles (resource name -> amount), in bundle index order.
        strategy: the group's Ray strategy (``STRICT_PACK`` or ``STRICT_SPREAD``).
        bundle_of_rank: rank ``r`` is scheduled into bundle ``bundle_of_rank[r]``.
    """

    bundles: list[dict[str, float]]
    strategy: str
    bundle_of_rank: list[int]


def replica_layout(per_rank: dict[str, float], ranks: int, nodes: int = 1) -> ReplicaLayout:
    """The placement group of a replica of ``ranks`` ranks, each needing ``per_rank``, spread
    evenly over ``nodes`` nodes (``ranks`` a multiple of ``nodes``: the config's rule).

    One node: a bundle per rank, STRICT_PACK, so the ranks share a node and its interconnect.
    Several: one bundle per node holding that node's ranks' resources, STRICT_SPREAD. Ray
    places a bundle whole on one node, so each node gets exactly its share of ranks; STRICT_SPREAD
    puts no two bundles on one node, so the replica spans exactly ``nodes`` nodes. (A bundle
    per rank with SPREAD would only prefer distinct nodes, and could put 3 ranks on one node
    and 1 on another.) Rank ``r`` goes into bundle ``r // (ranks // nodes)``: consecutive ranks
    share a node, so FSDP's neighbours talk over the fast link.
    """
    if nodes < 1 or ranks % nodes:
        raise ValueError(f"{ranks} ranks cannot be spread evenly over {nodes} node(s)")
    if nodes == 1:
        return ReplicaLayout([dict(per_rank) for _ in range(ranks)], "STRICT_PACK", list(range(ranks)))
    per_node = ranks // nodes
    bundle = {name: amount * per_node for name, amount in per_rank.items()}
    return ReplicaLayout([dict(bundle) for _ in range(nodes)], "STRICT_SPREAD", [r // per_node for r in range(ranks)])


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of a replica runs and which GPUs it sees.

    Args:
        node_id: the Ray node id of its node.
        node_rank: its node's index among the replica's nodes (in the order of their first rank).
        local_rank: its index among the replica's ranks on its node (in rank order).
        local_world_size: the replica's ranks on its node.
        nodes: how many nodes the replica spans.
        visible_devices: ``CUDA_VISIBLE_DEVICES`` for the rank: every GPU id the replica holds
            on its node, ascending (None: the replica has no GPUs).
        device_index: the CUDA device the rank binds, an index into ``visible_devices`` (None
            without GPUs).
    """

    node_id: str
    node_rank: int
    local_rank: int
    local_world_size: int
    nodes: int
    visible_devices: Optional[str] = None
    device_index: Optional[int] = None


def _gpu_order(gpu_id: str):
    """Sort key of a GPU id: numerically where it is a number (so "10" follows "9")."""
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def place_ranks(reports: Sequence[tuple[str, Sequence]]) -> list[RankPlacement]:
    """Each rank's :class:`RankPlacement`, from its ``(Ray node id, Ray GPU ids)`` in rank order.

    The ranks of a node see every GPU the replica holds there (ascending), and local rank ``k``
    binds the ``k``-th of them. Ray Train gets the same pairing by sorting its workers by GPU id
    before it numbers them; a replica's ranks are numbered at creation (the fault plan and the
    data plan name them), so here each rank takes the GPU at its local rank's place instead.
    Which process holds which of the replica's GPUs is bookkeeping to Ray: the replica's total
    per node is what it reserved either way.

    Raises ValueError when the reports cannot be one replica's: some ranks with GPUs and some
    without, a rank with other than one GPU, or two ranks of a node given the same GPU (a
    fractional GPU, which the replica never asks for).
    """
    gpus = [[str(g) for g in ids] for _, ids in reports]
    with_gpus = [bool(ids) for ids in gpus]
    if any(with_gpus) and not all(with_gpus):
        raise ValueError(f"some ranks of the replica have GPUs and some do not: {gpus}")
    if any(len(ids) > 1 for ids in gpus):
        raise ValueError(f"each rank binds one GPU; Ray gave the ranks {gpus}")
    node_order: list[str] = []
    on_node: dict[str, list[int]] = {}
    for rank, (node, _) in enumerate(reports):
        if node not in on_node:
            node_order.append(node)
            on_node[node] = []
        on_node[node].append(rank)
    visible: dict[str, list[str]] = {}
    for node, ranks in on_node.items():
        ids = [gpus[r][0] for r in ranks if gpus[r]]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ranks {ranks} on node {node} share GPUs {ids}: each needs a whole GPU of its own")
        visible[node] = sorted(ids, key=_gpu_order)
    placements = []
    for rank, (node, _) in enumerate(reports):
        local = on_node[node].index(rank)
        ids = visible[node]
        placements.append(
            RankPlacement(
                node_id=node,
                node_rank=node_order.index(node),
                local_rank=local,
                local_world_size=len(on_node[node]),
                nodes=len(node_order),
                visible_devices=",".join(ids) if ids else None,
                device_index=local if ids else None,
            )
        )
    return placements


def bind_device(placed: Optional[RankPlacement], device: str, environ: MutableMapping[str, str]) -> torch.device:
    """The torch device a rank computes on, given its :class:`RankPlacement` (None: as Ray
    started it, which on GPU shows each rank its one GPU as ``cuda:0``).

    On GPU it first sets ``CUDA_VISIBLE_DEVICES`` in ``environ`` (the rank's ``os.environ``) to
    every GPU the replica holds on its node, as Ray Train's worker group does. CUDA reads it
    once, when a process first asks for a device, so this must come before anything in the
    process touches CUDA; a process that already has is refused, as it would bind the wrong GPU.
    """
    if device != "cuda":
        return torch.device("cpu")
    if placed is None or placed.visible_devices is None:
        return torch.device("cuda", 0)
    environ["CUDA_VISIBLE_DEVICES"] = placed.visible_devices
    torch.cuda.init()  # CUDA starts now, with these devices, unless something started it before
    seen, wanted = torch.cuda.device_count(), len(placed.visible_devices.split(","))
    if seen != wanted:
        raise RuntimeError(
            f"this rank sees {seen} GPU(s) after CUDA_VISIBLE_DEVICES={placed.visible_devices}: CUDA was "
            "initialised in the process before the replica assigned its GPUs"
        )
    return torch.device("cuda", placed.device_index)
