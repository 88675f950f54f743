"""A replica's process group and how its model is sharded over it (FSDP2).

The ranks of one replica meet at a store file that rank 0 names (:func:`rendezvous`), join
one process group (:func:`join_process_group`: gloo on CPU, NCCL on GPUs) and shard the model
while it is still empty (:func:`shard`: each decoder layer one FSDP unit, the rest the
root), so each rank allocates and loads its rows only. :func:`replica_total` is the one
small collective of an inner step. A one-rank replica needs none of this.
"""

from __future__ import annotations

import os

import torch

from diloco_ray.model import loading as modeling
from diloco_ray.runtime import host_memory

LOOPBACK_ONLY = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def rendezvous() -> str:
    """The process group's ``init_method``, made by rank 0: a store file in a folder of
    its own (mode 0700), removed when this process exits.

    Why a file and not ``tcp://``: a replica's ranks always share a node (one STRICT_PACK
    placement group), and PyTorch's TCP store listens on every interface of the node
    whatever host it is given, with no authentication, so anyone who can reach the node
    could join or disturb the group. A file in a private folder is reachable by this
    user's processes on this node only; PyTorch deletes it once every rank let go.
    """
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="diloco-ray-rendezvous-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return f"file://{os.path.join(folder, 'store')}"


def join_process_group(init_method: str, rank: int, world_size: int, device: torch.device) -> None:
    """Join the replica's process group at rank 0's :func:`rendezvous`."""
    import torch.distributed as dist

    # FSDP's all-gathered layers come and go every step: keep glibc from
    # holding on to their pages (see diloco_ray.runtime.host_memory).
    host_memory.fix_mmap_threshold(host_memory.FSDP_RANK_THRESHOLD)
    # The ranks' own connections stay on the loopback too, unless the user chose an
    # interface (GLOO_/NCCL_SOCKET_IFNAME are read when the group is built).
    for name in LOOPBACK_ONLY:
        os.environ.setdefault(name, "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


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
