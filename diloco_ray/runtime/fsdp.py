"""A replica's process group and how its model is sharded over it (FSDP2).

The ranks of one replica meet at rank 0's address (:func:`rendezvous_address`), join one
process group (:func:`join_process_group`: gloo on CPU, NCCL on GPUs) and shard the model
while it is still empty (:func:`shard`: each decoder layer one FSDP unit, the rest the
root), so each rank allocates and loads its rows only. :func:`replica_total` is the one
small collective of an inner step. A one-rank replica needs none of this.
"""

from __future__ import annotations

import torch

from diloco_ray.model import loading as modeling
from diloco_ray.runtime import host_memory


def rendezvous_address() -> tuple[str, int]:
    """(this node's ip, a free port) for the process group; asked of rank 0."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def join_process_group(master_addr: str, master_port: int, rank: int, world_size: int, device: torch.device) -> None:
    """Join the replica's process group at rank 0's address."""
    import torch.distributed as dist

    # FSDP's all-gathered layers come and go every step: keep glibc from
    # holding on to their pages (see diloco_ray.runtime.host_memory).
    host_memory.fix_mmap_threshold(host_memory.FSDP_RANK_THRESHOLD)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size)


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
