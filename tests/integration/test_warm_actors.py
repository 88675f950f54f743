"""Actors kept from one run to the next in one process (``DILOCO_RAY_KEEP_ACTORS=1``,
runtime.warm_actors): a run on another run's kept actors ends with the weights a run on new
actors ends with, bit for bit, and keeps them again; a run of another shape lets them go and
starts its own; a run that fails keeps nothing."""

import pytest
from conftest import max_abs_diff, tiny_config

from diloco_ray import DilocoFSDPTrainer
from diloco_ray.runtime import warm_actors

pytestmark = pytest.mark.integration

SHAPE = dict(diloco_loops=2, max_steps=3, eval_batches=1)


def kept_ids() -> set[str]:
    return {a._actor_id.hex() for a in warm_actors.POOL.actors()}


class FailAfterRound:
    def on_round_end(self, trainer, record):
        raise RuntimeError("a callback failed")


def test_kept_actors_train_as_new_ones_do_and_are_let_go_when_they_do_not_fit(ray_local, tmp_path, monkeypatch):
    monkeypatch.setattr(warm_actors, "enabled", lambda: False)
    warm_actors.release()
    DilocoFSDPTrainer(tiny_config(tmp_path / "new", seed=1, **SHAPE)).train()
    assert len(warm_actors.POOL) == 0  # not asked for: nothing kept

    monkeypatch.setattr(warm_actors, "enabled", lambda: True)
    # Another run's state in the processes: its seed, lr and data all differ.
    DilocoFSDPTrainer(tiny_config(tmp_path / "other", seed=2, lr=1e-3, max_steps=5, eval_batches=2)).train()
    first = kept_ids()
    assert len(warm_actors.POOL) == 4 and len(first) == 4  # two one-rank replicas, a server, the step board

    DilocoFSDPTrainer(tiny_config(tmp_path / "kept", seed=1, **SHAPE)).train()
    assert kept_ids() == first  # the same processes ran it, and are kept again
    assert max_abs_diff(str(tmp_path / "kept"), str(tmp_path / "new")) == 0.0

    # Ranks of another size: the kept ranks are let go, not left holding their reservation
    # (the step board and the server, whose shapes did not change, are taken before them
    # and kept again).
    DilocoFSDPTrainer(tiny_config(tmp_path / "smaller", cpus_per_rank=0.25, **SHAPE)).train()
    second = kept_ids()
    assert len(second) == 4 and len(second & first) == 2

    with pytest.raises(RuntimeError, match="a callback failed"):
        DilocoFSDPTrainer(tiny_config(tmp_path / "failed", cpus_per_rank=0.25, **SHAPE), [FailAfterRound()]).train()
    assert len(warm_actors.POOL) == 0
