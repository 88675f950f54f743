"""A replica's process group and how its model is sharded over it (FSDP2).

The ranks of one replica meet where rank 0 says (:func:`rendezvous`: a private store file when
they share a node, :func:`serve_store`: a TCP store on its node's cluster address when they
span nodes), join one process group (:func:`join_process_group`: gloo on CPU, NCCL on GPUs,
each library on the network interface :func:`socket_interfaces` picks) and shard the model
while it is still empty (:func:`shard`: each decoder layer one FSDP unit, the rest the root),
so each rank allocates and loads its rows only. :func:`replica_total` is the one small
collective of an inner step. A one-rank replica needs none of this.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Optional
from urllib.parse import urlsplit

import torch

from diloco_ray.model import loading as modeling
from diloco_ray.runtime import host_memory
from diloco_ray.runtime.placement import RankPlacement

GLOO_IFNAME, NCCL_IFNAME = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
LOOPBACK = "lo"


def rendezvous() -> str:
    """The process group's ``init_method`` for ranks that share a node, made by rank 0: a
    store file in a folder of its own (mode 0700), removed when this process exits.

    Why a file and not a TCP store: a file in a private folder is reachable by this user's
    processes on this node only, while a TCP store takes anyone who reaches its port, with no
    authentication (see :func:`serve_store`). PyTorch deletes the file once every rank let go.
    """
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="diloco-ray-rendezvous-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return f"file://{os.path.join(folder, 'store')}"


def serve_store(world_size: int):
    """Where ranks on several nodes meet: a TCP store served by rank 0, bound to its node's
    cluster address (the one Ray's nodes reach each other on). Returns (``tcp://host:port``,
    the store, which rank 0 keeps and hands to :func:`join_process_group`).

    PyTorch's TCP store, given only a host and a port, listens on every interface of the node
    (``0.0.0.0``/``::``) whatever host it is given. So the socket is made and bound here, to the
    cluster address and a free port, and handed to the store (``master_listen_fd``): nothing
    listens on the node's other interfaces. The store has no authentication: whoever reaches
    that address and port while the replica starts can read or write its keys, and so join or
    disturb the group. The ranks' gloo/NCCL connections are no different. It is meant for a
    cluster network only Ray's own nodes reach, which Ray asks of its ports anyway.
    """
    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # The store takes the socket over (it listens on it and closes it): detached, so Python
    # never closes it under the store.
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    address = f"[{host}]" if family == socket.AF_INET6 else host
    return f"tcp://{address}:{port}", store


def interface_of(address: str, interfaces: Mapping[str, list[str]]) -> Optional[str]:
    """The network interface that holds ``address``, from interface name -> its addresses
    (IPv6 link-local ones may carry a ``%zone``); None when none does."""
    for name, addresses in interfaces.items():
        if any(a.split("%", 1)[0] == address for a in addresses):
            return name
    return None


def socket_interfaces(
    on_gpu: bool, spans_nodes: bool, cluster_interface: Optional[str], environ: Mapping[str, str]
) -> dict[str, str]:
    """The ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` to set in a rank before it joins its
    group: only those the user has not set (``environ``), which always win.

    * On several nodes: the interface of the cluster address (``cluster_interface``), the one
      every node of the replica is known to reach; a library left to itself may pick another
      (gloo resolves the host name, NCCL takes the first interface that is not loopback or
      docker). None (not found): the libraries choose.
    * GPUs on one node: nothing. NCCL picks its transports (NVLink, P2P, shared memory between
      processes; its own interface for the bootstrap), and forcing the loopback would only
      narrow what it may use.
    * CPUs on one node: gloo on the loopback, so nothing of the group is reachable from
      another machine.
    """
    if spans_nodes:
        wanted = {GLOO_IFNAME: cluster_interface, NCCL_IFNAME: cluster_interface} if cluster_interface else {}
    elif on_gpu:
        wanted = {}
    else:
        wanted = {GLOO_IFNAME: LOOPBACK}
    return {name: value for name, value in wanted.items() if name not in environ}


def cluster_interface() -> Optional[str]:
    """The interface of this node's cluster address (Ray's node IP), or None."""
    import psutil
    import ray

    interfaces = {name: [a.address for a in entries] for name, entries in psutil.net_if_addrs().items()}
    return interface_of(ray.util.get_node_ip_address(), interfaces)


def join_process_group(
    init_method: str,
    rank: int,
    world_size: int,
    device: torch.device,
    placed: Optional[RankPlacement] = None,
    store=None,
) -> None:
    """Join the replica's process group at rank 0's :func:`rendezvous` (``file://``) or
    :func:`serve_store` (``tcp://``; rank 0 passes the ``store`` it serves, the others connect
    to it). ``placed``: where the replica's ranks run (None: on one node)."""
    import torch.distributed as dist

    # FSDP's all-gathered layers come and go every step: keep glibc from
    # holding on to their pages (see diloco_ray.runtime.host_memory).
    host_memory.fix_mmap_threshold(host_memory.FSDP_RANK_THRESHOLD)
    spans_nodes = placed is not None and placed.nodes > 1
    interface = cluster_interface() if spans_nodes else None
    # Read by gloo and NCCL when the group is built.
    os.environ.update(socket_interfaces(device.type == "cuda", spans_nodes, interface, os.environ))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not init_method.startswith("tcp://"):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        return
    if store is None:
        where = urlsplit(init_method)
        store = dist.TCPStore(where.hostname, where.port, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def shard(model: torch.nn.Module, mixed_precision: str) -> None:
    """FSDP2 over the replica's ranks: each decoder layer one unit, the rest the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 compute with fp32 gradient reduction; fp16 goes through autocast + scaler.
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for layer in modeling.decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def replica_total(count: int, world_size: int, device: torch.device) -> int:
    """``count`` summed over the replica's ranks (one small all-reduce)."""
    if world_size == 1:
        return count
    import torch.distributed as dist

    total = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    return int(total.item())
