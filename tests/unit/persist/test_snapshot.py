"""In-flight snapshots: only finished, intact snapshots count; ranks agree on a step."""

import os

import pytest
import torch

from diloco_ray.errors import DataError
from diloco_ray.persist import snapshot, state_files


def state(value):
    return {"rows": {"w": torch.full((2, 3), float(value))}, "step_loss": 0.5, "plan": [[0, 4]]}


def test_save_load_and_keep_two(tmp_path):
    folder = str(tmp_path / "round-00000003")
    for step in (2, 4, 6):
        snapshot.save(folder, slot=1, rank=0, step=step, state=state(step))
    assert snapshot.steps(folder, 1, 0) == [4, 6]  # the oldest was pruned
    loaded = snapshot.load(folder, 1, 0, 6)
    assert torch.equal(loaded["rows"]["w"], torch.full((2, 3), 6.0)) and loaded["plan"] == [[0, 4]]


def test_common_step_needs_every_rank_and_intact_files(tmp_path):
    folder = str(tmp_path / "r")
    for rank in (0, 1):
        snapshot.save(folder, 0, rank, 2, state(2))
    snapshot.save(folder, 0, 0, 4, state(4))  # rank 1 never reached step 4
    assert snapshot.common_step(folder, slot=0, ranks=2) == 2
    snapshot.save(folder, 0, 1, 4, state(4))
    assert snapshot.common_step(folder, slot=0, ranks=2) == 4
    with open(os.path.join(folder, "slot-0-rank-1-step-4.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")  # torn or corrupted
    assert not snapshot.intact(folder, 0, 1, 4)
    assert snapshot.common_step(folder, slot=0, ranks=2) == 2
    assert snapshot.common_step(folder, slot=5, ranks=2) is None


def test_unfinished_snapshot_does_not_count(tmp_path):
    folder = str(tmp_path / "r")
    snapshot.save(folder, 0, 0, 2, state(2))
    os.remove(os.path.join(folder, "slot-0-rank-0-step-2.done"))  # died before the marker
    assert snapshot.steps(folder, 0, 0) == [] and snapshot.common_step(folder, 0, 1) is None


def test_clear_before(tmp_path):
    root = str(tmp_path)
    for r in (1, 2, 3):
        snapshot.save(snapshot.round_dir(root, r), 0, 0, 2, state(r))
    snapshot.clear_before(root, 3)
    assert sorted(os.listdir(root)) == ["round-00000003"]


def test_a_snapshot_changed_after_the_driver_chose_it_is_refused_naming_it(tmp_path):
    folder = str(tmp_path / "r")
    snapshot.save(folder, 0, 0, 2, state(2))
    assert snapshot.common_step(folder, slot=0, ranks=1) == 2  # the driver's choice
    path = os.path.join(folder, "slot-0-rank-0-step-2.safetensors")
    state_files.save_tensors(path, {"rows.w": torch.full((2, 3), 9.0)})  # then the rank reads it
    with pytest.raises(DataError) as caught:
        snapshot.load(folder, 0, 0, 2)
    assert str(caught.value).startswith(f"in-flight snapshot {path}: ") and "\n" not in str(caught.value)
