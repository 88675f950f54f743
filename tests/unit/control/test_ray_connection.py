"""How the driver reaches Ray (no Ray started here): RAY_ADDRESS, a live local head, a
stale cluster file, one another user wrote, nothing."""

import os
import socket

import pytest

from diloco_ray.config.schema import TrainerConfig
from diloco_ray.control import ray_connection
from diloco_ray.control.ray_connection import answers, decide, foreign_owner, logical_cpus


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


def test_a_cluster_file_of_another_user_is_never_followed():
    assert decide(None, "127.0.0.1:6379", True, owned=False) == ("start", None)
    # RAY_ADDRESS is the user's own word: who owns Ray's file does not matter then.
    assert decide("10.0.0.1:6379", "127.0.0.1:6379", True, owned=False) == ("join", "10.0.0.1:6379")


def planted_cluster_file(tmp_path, address: str, owner: int | None = None) -> str:
    folder = tmp_path / "ray"
    folder.mkdir()
    path = folder / "ray_current_cluster"
    path.write_text(address + "\n")
    if owner is not None:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, owner, owner)
    return str(path)


def test_foreign_owner_names_the_file_the_folder_or_the_link(tmp_path):
    mine = planted_cluster_file(tmp_path, "127.0.0.1:1")
    assert foreign_owner(mine) is None
    assert foreign_owner(mine, uid=4242) == f"the file {mine} belongs to uid {os.getuid()}, not to you (uid 4242)"
    link = os.path.join(os.path.dirname(mine), "link")
    os.symlink(mine, link)
    assert foreign_owner(link) == f"{link} is a link"


@pytest.mark.parametrize("owner", [None, 65534])  # this user's file; one of nobody's
def test_a_live_head_named_by_another_users_file_gets_a_private_ray(tmp_path, monkeypatch, caplog, owner):
    """Someone else's ``ray_current_cluster`` names a live head: the run starts a Ray of its
    own and says why, where a file of the user's own is joined."""
    import ray

    with socket.socket() as head:  # something answers, as a live GCS would
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"127.0.0.1:{head.getsockname()[1]}"
        path = planted_cluster_file(tmp_path, address, owner)
        calls = []
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setattr(ray_connection, "cluster_file", lambda: path)
        monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
        sections = TrainerConfig(model_config={"model_type": "llama"}, dataset_name="builtin:arithmetic").sections()
        started = ray_connection.connect(sections.membership, sections.placement)
    if owner is None:
        assert (started, calls) == (False, [{"address": address}])
    else:
        assert started and calls[0]["address"] == "local"
        assert f"the file {path} belongs to uid 65534" in caplog.text and "starting a private one" in caplog.text


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


class FlakyRay:
    """``ray.init`` that fails its first ``failures`` calls, as a busy machine's head that
    misses Ray's start-up deadline does."""

    def __init__(self, failures: int):
        self.failures, self.inits, self.shutdowns, self.addresses = failures, 0, 0, []

    def init(self, address=None, **kwargs):
        self.inits += 1
        self.addresses.append(address)
        if self.inits <= self.failures:
            raise RuntimeError("Timed out waiting for the head\nstack")

    def shutdown(self):
        self.shutdowns += 1


@pytest.mark.parametrize("failures", [0, 1, ray_connection.REGION_START_TRIES - 1])
def test_a_region_starts_its_private_ray_again_until_it_starts(monkeypatch, failures):
    import ray

    fake, lines = FlakyRay(failures), []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(ray, "shutdown", fake.shutdown)
    monkeypatch.setattr(ray_connection.time, "sleep", lambda s: None)
    assert ray_connection.connect_region(lines.append) is True
    assert fake.inits == failures + 1 and fake.shutdowns == failures and set(fake.addresses) == {"local"}
    assert lines == [
        f"region: Ray did not start (Timed out waiting for the head); trying again ({n} of "
        f"{ray_connection.REGION_START_TRIES})"
        for n in range(1, failures + 1)
    ]


def test_a_region_gives_up_after_its_last_try_with_rays_error(monkeypatch):
    import ray

    fake = FlakyRay(ray_connection.REGION_START_TRIES)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", fake.init)
    monkeypatch.setattr(ray, "shutdown", fake.shutdown)
    monkeypatch.setattr(ray_connection.time, "sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="Timed out waiting for the head"):
        ray_connection.connect_region(lambda line: None)
    assert fake.inits == ray_connection.REGION_START_TRIES


def test_a_region_joins_the_cluster_ray_address_names(monkeypatch):
    import ray

    fake = FlakyRay(0)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(ray, "init", fake.init)
    assert ray_connection.connect_region(lambda line: None) is False
    assert fake.addresses == ["10.0.0.1:6379"]
