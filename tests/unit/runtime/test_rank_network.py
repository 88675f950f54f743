"""How a replica's ranks reach each other, without Ray: which interface gloo and NCCL are told
to use (the user's choice always wins), and the TCP store of a replica over several nodes,
which listens on the cluster address alone."""

from __future__ import annotations

import psutil
import pytest
import ray.util
import torch.distributed as dist

from diloco_ray.runtime import fsdp

GLOO, NCCL = fsdp.GLOO_IFNAME, fsdp.NCCL_IFNAME


def test_cpu_ranks_on_one_node_stay_on_the_loopback():
    assert fsdp.socket_interfaces(False, False, None, {}) == {GLOO: "lo"}


def test_gpu_ranks_on_one_node_leave_nccl_its_choice():
    assert fsdp.socket_interfaces(True, False, "eth0", {}) == {}


@pytest.mark.parametrize("on_gpu", [False, True])
def test_ranks_over_nodes_use_the_cluster_addresss_interface(on_gpu):
    assert fsdp.socket_interfaces(on_gpu, True, "ens5", {}) == {GLOO: "ens5", NCCL: "ens5"}
    assert fsdp.socket_interfaces(on_gpu, True, None, {}) == {}  # not found: the libraries choose


@pytest.mark.parametrize("spans_nodes", [False, True])
def test_what_the_user_set_wins(spans_nodes):
    env = {GLOO: "ib0", NCCL: "ib0"}
    assert fsdp.socket_interfaces(False, spans_nodes, "ens5", env) == {}
    assert fsdp.socket_interfaces(True, spans_nodes, "ens5", {NCCL: "ib0"}) == ({GLOO: "ens5"} if spans_nodes else {})


def test_the_interface_of_an_address():
    interfaces = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.7", "fe80::1%eth0"], "ib0": ["192.168.3.7"]}
    assert fsdp.interface_of("10.0.0.7", interfaces) == "eth0"
    assert fsdp.interface_of("fe80::1", interfaces) == "eth0"
    assert fsdp.interface_of("192.168.3.7", interfaces) == "ib0"
    assert fsdp.interface_of("10.0.0.8", interfaces) is None


def test_the_store_of_ranks_over_nodes_listens_on_the_cluster_address_alone(monkeypatch):
    # The node's cluster address, as Ray reports it (the loopback stands in for it here).
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    address, store = fsdp.serve_store(world_size=2)
    assert address.startswith("tcp://127.0.0.1:")
    port = int(address.rsplit(":", 1)[1])
    sockets = psutil.Process().net_connections("tcp")
    listening = [c.laddr.ip for c in sockets if c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    assert listening == ["127.0.0.1"]  # not 0.0.0.0 / ::, as PyTorch's own TCP store would
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
