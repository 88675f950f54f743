"""The parameter server: the one source of truth for the global weights.

A thin adapter around :class:`~diloco_ray.outer.OuterOptimizer`. It holds the fp32
global weights, the outer optimizer state, the round index and the data position, and
applies a round as one unit: either every field advances together or none does.
Pseudo-gradients arrive as object-store references that the server resolves itself, so
they travel replica -> server directly, never through the driver.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from diloco_ray import data
from diloco_ray.config import TrainerConfig
from diloco_ray.outer import OuterOptimizer
from diloco_ray.sharding import assemble


@dataclass
class Contribution:
    """One replica's part of a round, as the driver hands it to the server.

    Args:
        replica_id: the replica.
        shard_refs: one object ref per rank, each resolving to that rank's rows of the
            pseudo-gradient (name -> array). Wrapped in a list so Ray does not resolve
            them on the driver's behalf.
        weight: its weight in the mean (tokens it trained on).
    """

    replica_id: int
    shard_refs: list
    weight: float


@dataclass
class AppliedRound:
    """What the server reports after a round (small; goes to the driver)."""

    applied: bool
    round: int                    # index of the round that was (or would have been) applied
    outer_lr: float
    pseudo_grad_norm: float | None
    accepted: list[int] = field(default_factory=list)   # replica ids
    rejected: dict[int, str] = field(default_factory=dict)  # replica id -> reason
    data_ranges: dict[int, list] = field(default_factory=dict)  # replica id -> applied stream ranges


class ParameterServer:
    """Holds the global model state and applies outer updates.

    Args:
        config: the job's TrainerConfig, as a dict.
    """

    def __init__(self, config: dict):
        self.config = TrainerConfig.from_dict(config)
        self.optimizer: OuterOptimizer | None = None
        self.shapes: dict[str, tuple] = {}
        self.cursor = data.DataCursor()

    def initialize(self, shard_refs: list, shapes: dict[str, tuple]) -> int:
        """Seed the global weights from one replica's rank shards; returns their bytes."""
        import ray

        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        params = assemble(ray.get(shard_refs), self.shapes)
        self.optimizer = OuterOptimizer(params, self.config)
        return self.weight_bytes()

    def weights(self) -> dict[str, np.ndarray]:
        """The current global weights (fp32 numpy; Ray stores them once per version)."""
        return {n: t.numpy() for n, t in self.optimizer.params.items()}

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.optimizer.params.values())

    # ---- checkpoints: the server writes and reads its own state ------------------------
    def save(self, folder: str) -> None:
        """Write the whole server state into ``folder`` (a checkpoint being assembled):
        ``global.safetensors`` (the weights, loadable on their own), ``outer`` (the outer
        optimizer) and ``server.json`` (round index, data cursor)."""
        import json

        from diloco_ray import checkpoint

        sd = self.optimizer.state_dict()
        checkpoint.save_tensors(os.path.join(folder, "global.safetensors"), sd["params"])
        checkpoint.save_state(folder, "outer", {"optimizer": sd["optimizer"], "round": sd["round"], "names": sd["names"]})
        with open(os.path.join(folder, "server.json"), "w") as f:
            json.dump({"round": sd["round"], "cursor": self.cursor.to_dict(),
                       "shapes": {n: list(s) for n, s in self.shapes.items()}}, f)

    def load(self, folder: str) -> int:
        """Restore the state :meth:`save` wrote; returns the weights' bytes."""
        import json

        from diloco_ray import checkpoint

        with open(os.path.join(folder, "server.json")) as f:
            meta = json.load(f)
        self.shapes = {n: tuple(s) for n, s in meta["shapes"].items()}
        loaded = checkpoint.load_tensors(os.path.join(folder, "global.safetensors"))
        params = {n: loaded[n] for n in self.shapes}  # the original order (safetensors sorts keys)
        outer = checkpoint.load_state(folder, "outer")
        self.optimizer = OuterOptimizer(params, self.config)
        self.optimizer.load_state_dict({"params": params, **outer})
        self.cursor = data.DataCursor.from_dict(meta["cursor"])
        return self.weight_bytes()

    def round_index(self) -> int:
        """The index of the next round to apply."""
        return self.optimizer.round

    def plan(self, slots: int) -> list[list[tuple[int, int]]]:
        """The stream ranges each of ``slots`` replicas trains on next (no state change)."""
        return data.plan_round(self.cursor, slots, self.config.sequences_per_replica_round)

    def apply(self, contributions: list[Contribution], plans: dict[int, list]) -> AppliedRound:
        """Average the contributions, take the outer step, and commit the data cursor,
        all or nothing. ``plans`` maps every replica that was handed data this round to
        its ranges; only the applied ones count as consumed.

        A contribution whose shards do not assemble, or whose pseudo-gradient holds
        NaN/Inf or mismatched shapes, is rejected and reported, never applied.
        """
        import ray

        rejected: dict[int, str] = {}
        usable: list[tuple[Contribution, dict[str, torch.Tensor]]] = []
        for c in contributions:
            try:
                usable.append((c, assemble(ray.get(c.shard_refs), self.shapes)))
            except ValueError as e:
                rejected[c.replica_id] = str(e)
            except ray.exceptions.RayError as e:  # its node went down after it reported
                rejected[c.replica_id] = f"pseudo-gradient lost in transit: {type(e).__name__}"
        self.optimizer.step([g for _, g in usable], [c.weight for c, _ in usable])
        info = self.optimizer.last_step
        for i, reason in info.reasons.items():
            rejected[usable[i][0].replica_id] = reason
        accepted = [usable[i][0].replica_id for i in info.accepted] if info.applied else []
        if info.applied:
            ids = list(plans)
            self.cursor = data.commit_round(self.cursor, [plans[i] for i in ids], [i in accepted for i in ids])
        return AppliedRound(applied=info.applied, round=info.round, outer_lr=info.lr,
                            pseudo_grad_norm=info.grad_norm, accepted=accepted, rejected=rejected,
                            data_ranges={i: plans[i] for i in accepted})
