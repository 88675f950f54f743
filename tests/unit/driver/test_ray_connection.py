"""How the driver reaches Ray (no Ray started here): RAY_ADDRESS, a live local head, a
stale cluster file, nothing."""

import socket

import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.driver.ray_connection import answers, decide, logical_cpus


@pytest.mark.parametrize(
    "env, recorded, alive, want",
    [
        ("10.0.0.1:6379", None, False, ("join", "10.0.0.1:6379")),  # ray job submit
        ("auto", "127.0.0.1:6379", True, ("join", "auto")),
        (None, None, False, ("start", None)),  # a clean machine
        (None, "127.0.0.1:6379", True, ("join", "127.0.0.1:6379")),  # a local head runs
        (None, "127.0.0.1:6379", False, ("start", None)),  # its head was killed
        ("", "127.0.0.1:6379", False, ("start", None)),
        ("local", "127.0.0.1:6379", True, ("start", None)),  # asked for a private one
    ],
)
def test_decide(env, recorded, alive, want):
    assert decide(env, recorded, alive) == want


def test_answers_tells_a_listening_port_from_a_dead_one():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert answers(f"127.0.0.1:{port}")
    assert not answers(f"127.0.0.1:{port}", timeout_s=0.5)
    assert not answers("not-an-address")


def test_a_private_ray_has_room_for_the_spares(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    base = dict(
        model_config={"model_type": "llama"},
        dataset_name="builtin:arithmetic",
        num_replicas=2,
        cpus_per_rank=1,
        server_cpus=0.5,
    )

    def cpus(**fields) -> int:
        sections = TrainerConfig(**base, **fields).sections()
        return logical_cpus(sections.membership, sections.placement)

    assert cpus() == 3  # 2 replicas x 1 + 0.5, rounded up
    # A spare needs its own rank's CPU, or its placement group is never reserved.
    assert cpus(spare_replicas=1) == 4
    assert cpus(spare_replicas=1, ranks_per_replica=[2, 1]) == 7
