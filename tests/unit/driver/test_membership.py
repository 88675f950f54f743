"""The pure membership policies: how to move towards a target, and whether a cluster can
hold the job at all."""

from conftest import tiny_config

from diloco_ray.driver.membership import Decision, capacity_shortfall, decide


def test_decide_starts_the_shortfall_counting_starting_replicas():
    assert decide(3, active=[0], starting=[]) == Decision(start=2)
    assert decide(3, active=[0], starting=[1]) == Decision(start=1)
    assert decide(2, active=[0], starting=[1, 2]) == Decision(cancel=[2])


def test_decide_stops_the_newest_extras_and_cancels_starts():
    assert decide(1, active=[0, 3, 1], starting=[4]) == Decision(stop=[3, 1], cancel=[4])
    assert decide(2, active=[0, 1], starting=[]) == Decision()


def test_capacity_adds_ranks_servers_gpus_and_custom_resources(tmp_path):
    cfg = tiny_config(tmp_path, num_replicas=2, ranks_per_replica=2, cpus_per_rank=1.0, server_cpus=0.5)
    assert capacity_shortfall(cfg, "cpu", {"CPU": 4.5}) is None
    short = capacity_shortfall(cfg, "cpu", {"CPU": 4.0})
    assert "CPU 4.5 (the cluster has 4)" in short and "num_replicas" in short
    assert "GPU 4 (the cluster has 2)" in capacity_shortfall(cfg, "cuda", {"CPU": 8, "GPU": 2})
    regions = tiny_config(
        tmp_path, num_replicas=3, replica_resources=[{"us": 1}, {"eu": 1}], server_resources={"us": 0.5}
    )
    # Replicas 0 and 2 in us (one rank each), replica 1 in eu, the server in us.
    assert capacity_shortfall(regions, "cpu", {"CPU": 8, "us": 2.5, "eu": 1}) is None
    assert "us 2.5 (the cluster has 2)" in capacity_shortfall(regions, "cpu", {"CPU": 8, "us": 2, "eu": 1})
