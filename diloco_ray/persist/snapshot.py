"""In-flight snapshots: a rank's progress inside a long round, so a restart loses at most
``checkpoint_steps`` inner steps instead of the whole round.

Round checkpoints (:mod:`diloco_ray.persist.checkpoint`) hold the state *between* rounds. With
``checkpoint_steps`` smaller than ``max_steps``, every rank also writes its own rows of
the local weights, its inner optimizer and RNG state and its progress every
``checkpoint_steps`` inner steps to ``checkpoints/inflight/round-R/``. After a resume
from the round-R checkpoint, each replica slot continues from the newest step that all
of its ranks saved intact, if that snapshot was taken with the same data plan.

Files: ``slot-S-rank-K-step-T.{safetensors,json}`` (from :func:`state_files.save_state`),
then ``...done`` last, holding the tensors' SHA-256: a snapshot without a matching
``.done`` does not exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

from diloco_ray import files
from diloco_ray.errors import DataError
from diloco_ray.persist import checkpoint, state_files

KEEP_PER_RANK = 2  # the newest may be torn by a crash; the one before is then used
_NAME = re.compile(r"^slot-(\d+)-rank-(\d+)-step-(\d+)\.done$")


def round_dir(root: str, round_index: int) -> str:
    """The folder of round ``round_index``'s snapshots under ``root`` (checkpoints/inflight)."""
    return os.path.join(root, checkpoint.round_folder_name(round_index))


def _name(slot: int, rank: int, step: int) -> str:
    return f"slot-{slot}-rank-{rank}-step-{step}"


def save(folder: str, slot: int, rank: int, step: int, state: dict[str, Any]) -> None:
    """Write one rank's snapshot after ``step`` inner steps; keep the newest two.

    Args:
        folder: the round's snapshot folder.
        slot: the replica's slot in this round.
        rank: the rank inside the replica.
        step: inner steps done in this round.
        state: tensors and plain values (see :func:`state_files.save_state`).
    """
    os.makedirs(folder, exist_ok=True)
    name = _name(slot, rank, step)
    state_files.save_state(folder, name, state)
    digest = state_files.sha256_file(os.path.join(folder, f"{name}.safetensors"))
    files.write_atomic(os.path.join(folder, f"{name}.done"), json.dumps({"sha256": digest}))
    for old in sorted(steps(folder, slot, rank))[:-KEEP_PER_RANK]:
        for ext in (".done", ".json", ".safetensors"):
            _remove(os.path.join(folder, _name(slot, rank, old) + ext))


def steps(folder: str, slot: int, rank: int) -> list[int]:
    """Steps at which ``(slot, rank)`` has a finished snapshot (``.done`` written)."""
    if not os.path.isdir(folder):
        return []
    out = []
    for fn in os.listdir(folder):
        m = _NAME.match(fn)
        if m and int(m.group(1)) == slot and int(m.group(2)) == rank:
            out.append(int(m.group(3)))
    return sorted(out)


def intact(folder: str, slot: int, rank: int, step: int) -> bool:
    """Whether the snapshot's tensors still match the checksum in its ``.done`` file."""
    name = _name(slot, rank, step)
    try:
        with open(os.path.join(folder, f"{name}.done")) as f:
            want = json.load(f)["sha256"]
        return state_files.sha256_file(os.path.join(folder, f"{name}.safetensors")) == want and os.path.exists(
            os.path.join(folder, f"{name}.json")
        )
    except (OSError, ValueError, KeyError):
        return False


def common_step(folder: str, slot: int, ranks: int) -> Optional[int]:
    """The newest step at which every rank of ``slot`` has an intact snapshot, or None."""
    shared = None
    for rank in range(ranks):
        mine = set(steps(folder, slot, rank))
        shared = mine if shared is None else shared & mine
    for step in sorted(shared or (), reverse=True):
        if all(intact(folder, slot, rank, step) for rank in range(ranks)):
            return step
    return None


def load(folder: str, slot: int, rank: int, step: int) -> dict[str, Any]:
    """The state :func:`save` wrote, checked against its ``.done`` checksum first: the
    driver chose the step with :func:`common_step`, but the rank reads it later, maybe on
    another node of a shared folder.

    Raises:
        DataError: one line naming the snapshot's file, when it no longer matches.
    """
    if not intact(folder, slot, rank, step):
        tensors = os.path.join(folder, f"{_name(slot, rank, step)}.safetensors")
        raise DataError(f"in-flight snapshot {tensors}: missing or not the checksum in its .done file; refused")
    return state_files.load_state(folder, _name(slot, rank, step))


def clear_before(root: str, round_index: int) -> None:
    """Delete the snapshots of rounds before ``round_index`` (a round checkpoint covers them)."""
    if not os.path.isdir(root):
        return
    for fn in os.listdir(root):
        m = re.match(r"^round-(\d+)$", fn)
        if m and int(m.group(1)) < round_index:
            shutil.rmtree(os.path.join(root, fn), ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
