"""A replica whose ranks span two nodes (``nodes_per_replica: 2``), on a two-node
``ray.cluster_utils.Cluster`` on this machine, with gloo on CPUs: it trains the default job to
the weights of the same replica on one node, its ranks sit on different nodes (the ``join``
event's ``nodes``), and a rank killed on either node is handled as any rank kill: its replica
is dropped as failed from that round on and the others go on."""

import pytest
import ray
from conftest import applied_positions, max_abs_diff, tiny_config
from ray.cluster_utils import Cluster

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.observe.metrics import read_events

pytestmark = pytest.mark.integration

OVER_TWO_NODES = dict(ranks_per_replica=2, nodes_per_replica=2)


@pytest.fixture(scope="module")
def two_nodes():
    # Room on each node for one rank of each of three replicas (0.5 CPU each) and the server.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def joins(output_dir) -> dict:
    """Replica id -> its ranks' node ids, from the ``join`` events."""
    return {e["replica_id"]: e["nodes"] for e in read_events(output_dir, "membership") if e["action"] == "join"}


def test_a_replica_over_two_nodes_trains_as_it_does_on_one(two_nodes, tmp_path):
    spread = DilocoFSDPTrainer(tiny_config(tmp_path / "spread", **OVER_TWO_NODES)).train()
    packed = DilocoFSDPTrainer(tiny_config(tmp_path / "packed", ranks_per_replica=2)).train()
    assert [r["replicas"] for r in spread.rounds] == [r["replicas"] for r in packed.rounds] == [2, 2, 2]
    for nodes in joins(tmp_path / "spread").values():
        assert len(nodes) == 2 and len(set(nodes)) == 2  # one rank on each node
    for nodes in joins(tmp_path / "packed").values():
        assert len(nodes) == 2 and len(set(nodes)) == 1
    assert max_abs_diff(tmp_path / "spread", tmp_path / "packed") <= 1e-6
    assert [r["train_loss"] for r in spread.rounds] == pytest.approx([r["train_loss"] for r in packed.rounds])


def test_a_rank_killed_on_either_node_drops_its_replica(two_nodes, tmp_path):
    # Replica 0 loses rank 0 (on the first node: it served the replica's store), replica 1
    # rank 1 (on the second node), both in round 1; replica 2 carries the run on.
    kills = [{"kind": "kill", "replica": rid, "rank": rid, "round": 1, "step": 1} for rid in (0, 1)]
    cfg = tiny_config(
        tmp_path / "run", num_replicas=3, diloco_loops=2, eval_batches=0, fault_plan=kills, **OVER_TWO_NODES
    )
    rounds = DilocoFSDPTrainer(cfg).train().rounds
    assert [r["round"] for r in rounds] == [0, 1]
    assert sorted(rounds[0]["replica_ids"]) == [0, 1, 2]
    assert sorted(rounds[1]["dropped"]) == [0, 1] and rounds[1]["replica_ids"] == [2]
    leaves = {e["replica_id"]: e["reason"] for e in read_events(cfg.output_dir, "membership") if e["action"] == "leave"}
    assert leaves == {0: "failed", 1: "failed"}
    nodes = joins(cfg.output_dir)
    assert len(set(nodes[0])) == len(set(nodes[1])) == 2
    positions = applied_positions(rounds)
    assert len(positions) == len(set(positions))
