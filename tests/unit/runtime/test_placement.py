"""Where a replica's ranks run, without Ray: the placement group's bundles per node, each
rank's GPUs from fake Ray GPU ids (one replica, two replicas sharing an 8-GPU node, a replica
over two nodes), and the device a rank binds."""

from __future__ import annotations

import pytest
import torch

from diloco_ray.runtime.placement import RankPlacement, bind_device, place_ranks, replica_layout


def test_one_node_keeps_a_bundle_per_rank_packed():
    layout = replica_layout({"CPU": 2.0, "GPU": 1}, 4)
    assert layout.strategy == "STRICT_PACK"
    assert layout.bundles == [{"CPU": 2.0, "GPU": 1}] * 4
    assert layout.bundle_of_rank == [0, 1, 2, 3]


def test_several_nodes_get_one_bundle_each_holding_their_ranks():
    layout = replica_layout({"CPU": 2.0, "GPU": 1, "region-us": 0.001}, 16, nodes=2)
    assert layout.strategy == "STRICT_SPREAD"
    assert layout.bundles == [{"CPU": 16.0, "GPU": 8, "region-us": 0.008}] * 2
    assert layout.bundle_of_rank == [0] * 8 + [1] * 8


@pytest.mark.parametrize("ranks, nodes", [(3, 2), (1, 2), (4, 0)])
def test_uneven_spreads_are_refused(ranks, nodes):
    with pytest.raises(ValueError, match="evenly"):
        replica_layout({"CPU": 1.0}, ranks, nodes)


def test_cpu_ranks_see_no_gpus():
    placed = place_ranks([("n1", []), ("n1", [])])
    assert placed == [
        RankPlacement("n1", node_rank=0, local_rank=0, local_world_size=2, nodes=1),
        RankPlacement("n1", node_rank=0, local_rank=1, local_world_size=2, nodes=1),
    ]


def test_two_replicas_share_an_8_gpu_node_each_seeing_only_its_own_gpus():
    # Ray hands out a node's GPUs in any order; replica B even got interleaved ids.
    a = place_ranks([("node", [2]), ("node", [0]), ("node", [3]), ("node", [1])])
    b = place_ranks([("node", ["7"]), ("node", ["4"]), ("node", ["6"]), ("node", ["5"])])
    assert {p.visible_devices for p in a} == {"0,1,2,3"}
    assert {p.visible_devices for p in b} == {"4,5,6,7"}
    assert [p.local_rank for p in a] == [p.device_index for p in a] == [0, 1, 2, 3]
    assert [p.device_index for p in b] == [0, 1, 2, 3]
    # Every GPU of the node is bound exactly once over both replicas.
    bound = [p.visible_devices.split(",")[p.device_index] for p in a + b]
    assert sorted(bound) == [str(g) for g in range(8)]


def test_a_replica_over_two_nodes_sees_its_gpus_on_each_node():
    placed = place_ranks([("A", [6]), ("A", [7]), ("B", [1]), ("B", [0])])
    assert [p.node_rank for p in placed] == [0, 0, 1, 1]
    assert [p.local_rank for p in placed] == [0, 1, 0, 1]
    assert [p.visible_devices for p in placed] == ["6,7", "6,7", "0,1", "0,1"]
    assert [p.device_index for p in placed] == [0, 1, 0, 1]
    assert {p.nodes for p in placed} == {2} and {p.local_world_size for p in placed} == {2}


def test_gpu_ids_sort_as_numbers():
    placed = place_ranks([("n", ["10"]), ("n", ["9"]), ("n", ["11"]), ("n", ["8"])])
    assert placed[0].visible_devices == "8,9,10,11"


@pytest.mark.parametrize(
    "reports, words",
    [
        ([("n", [0]), ("n", [])], "some ranks"),
        ([("n", [0, 1]), ("n", [2, 3])], "one GPU"),
        ([("n", [0]), ("n", [0])], "share GPUs"),
    ],
    ids=["gpus-and-none", "two-gpus-a-rank", "fractional"],
)
def test_reports_that_cannot_be_one_replica_are_refused(reports, words):
    with pytest.raises(ValueError, match=words):
        place_ranks(reports)


def test_cpu_ranks_bind_the_cpu_and_leave_the_environment_alone():
    env: dict[str, str] = {}
    assert bind_device(place_ranks([("n", []), ("n", [])])[1], "cpu", env) == torch.device("cpu")
    assert env == {}


def test_without_a_placement_a_gpu_rank_binds_the_one_gpu_ray_showed_it():
    env: dict[str, str] = {}
    assert bind_device(None, "cuda", env) == torch.device("cuda", 0) and env == {}


def test_a_gpu_rank_sees_its_nodes_gpus_and_binds_its_own(monkeypatch):
    visible = {}
    monkeypatch.setattr(torch.cuda, "init", lambda: visible.setdefault("at_init", dict(env)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(env["CUDA_VISIBLE_DEVICES"].split(",")))
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "5"}  # what Ray set for the actor
    placed = place_ranks([("n", [4]), ("n", [5]), ("n", [6]), ("n", [7])])[1]
    assert bind_device(placed, "cuda", env) == torch.device("cuda", 1)
    assert visible["at_init"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # set before CUDA starts


def test_a_rank_whose_cuda_started_too_early_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA already saw Ray's one GPU
    placed = place_ranks([("n", [0]), ("n", [1])])[0]
    with pytest.raises(RuntimeError, match="before the replica assigned"):
        bind_device(placed, "cuda", {})
