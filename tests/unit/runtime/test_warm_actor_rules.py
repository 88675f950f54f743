"""The rules of runtime.warm_actors without Ray: what is kept, what a run takes, what is let
go. (With Ray, end to end: tests/integration/test_warm_actors.py.)"""

import pytest

from diloco_ray.runtime import warm_actors


class Call:
    def __init__(self, result):
        self.result = result

    def remote(self, *args):
        return self.result


class FakeActor:
    """An actor handle whose retire and reset answer (a value, or an exception to raise)."""

    def __init__(self, name: str, retire=True, reset=None):
        self.name = name
        self.retire, self.reset = Call(retire), Call(reset)
        self.killed = False


@pytest.fixture
def pool(monkeypatch):
    cluster = {"id": "a"}

    def get(refs, timeout=None):
        for r in refs:
            if isinstance(r, Exception):
                raise r
        return refs

    def kill(actor, no_restart=True):
        actor.killed = True

    monkeypatch.setattr(warm_actors.ray, "get", get)
    monkeypatch.setattr(warm_actors.ray, "kill", kill)
    monkeypatch.setattr(warm_actors, "_cluster", lambda: cluster["id"])
    pool = warm_actors.WarmActors()
    pool.cluster = cluster
    return pool


def reset(actors):
    return [a.reset.remote() for a in actors]


def test_a_kept_unit_is_taken_by_its_key_and_only_once(pool):
    ranks, server = [FakeActor("r0"), FakeActor("r1")], FakeActor("s")
    assert pool.keep(("ranks",), ranks) and pool.keep(("server",), [server])
    assert pool.take(("server",), reset).actors == [server]
    assert pool.take(("ranks",), reset).actors == ranks
    assert len(pool) == 0 and not any(a.killed for a in [*ranks, server])


def test_a_miss_lets_everything_kept_go_first(pool):
    kept = [FakeActor("r0"), FakeActor("s")]
    pool.keep(("ranks", 0.5), kept[:1])
    pool.keep(("server",), kept[1:])
    assert pool.take(("ranks", 0.25), reset) is None
    assert len(pool) == 0 and all(a.killed for a in kept)


def test_a_miss_of_an_actor_that_reserves_nothing_lets_nothing_go(pool):
    """The step board: a run that finds none kept starts one, and the ranks and servers kept
    stay for the run to take."""
    kept = [FakeActor("r0"), FakeActor("s")]
    pool.keep(("ranks", 0.5), kept[:1])
    pool.keep(("server",), kept[1:])
    assert pool.take(("step-board",), reset, release_on_miss=False) is None
    assert len(pool) == 2 and not any(a.killed for a in kept)
    board = FakeActor("b")
    pool.keep(("step-board",), [board])
    assert pool.take(("step-board",), reset, release_on_miss=False).actors == [board]


def test_an_actor_that_cannot_retire_is_killed_not_kept(pool):
    busy = [FakeActor("r0"), FakeActor("r1", retire=False)]
    assert not pool.keep(("ranks",), busy)
    dead = FakeActor("r2", retire=RuntimeError("actor died"))
    assert not pool.keep(("ranks",), [dead])
    assert len(pool) == 0 and all(a.killed for a in [*busy, dead])


def test_one_that_died_while_kept_is_killed_and_the_next_of_its_key_taken(pool):
    gone, alive = FakeActor("r0", reset=RuntimeError("actor died")), FakeActor("r1")
    pool.keep(("ranks",), [gone])
    pool.keep(("ranks",), [alive])
    assert pool.take(("ranks",), reset).actors == [alive]
    assert gone.killed and not alive.killed


def test_actors_of_another_ray_are_forgotten(pool):
    old = FakeActor("r0")
    pool.keep(("ranks",), [old])
    pool.cluster["id"] = "b"  # ray.shutdown, then a new Ray
    assert pool.take(("ranks",), reset) is None
    assert not old.killed  # its Ray is gone: nothing to kill there
    pool.keep(("ranks",), [FakeActor("r1")])
    assert [a.name for a in pool.actors()] == ["r1"]


def test_nothing_is_kept_or_taken_unless_asked_for(monkeypatch, pool):
    monkeypatch.setattr(warm_actors, "POOL", pool)
    monkeypatch.delenv(warm_actors.ENV, raising=False)
    assert not warm_actors.keep(("ranks",), [FakeActor("r0")])
    monkeypatch.setenv(warm_actors.ENV, "1")
    assert warm_actors.keep(("ranks",), [FakeActor("r1")])
    monkeypatch.setenv(warm_actors.ENV, "0")
    assert warm_actors.take(("ranks",), reset) is None and len(pool) == 1
