"""What a rank keeps across an interruption: its inner state in a checkpoint, and in-flight snapshots.

A rank's inner optimizer state and RNG state must carry over for training to go on exactly
as if never interrupted. :class:`RankState` writes them (local FSDP shards, safetensors and
JSON, never pickle) into a round checkpoint (``replicas/slot-S-rank-R``) or an in-flight
snapshot of a long round, and reads them back into a rank with the same ``world_size``.
"""

from __future__ import annotations

import os

import torch

from diloco_ray.persist import snapshot
from diloco_ray.runtime.messages import SnapshotPlan


class RankState:
    """The save and restore side of :class:`~diloco_ray.runtime.rank.RankWorker` (which sets
    ``optimizer``, ``params``, ``sync``, ``rank``, ``world_size`` and ``device``)."""

    def _save_snapshot(
        self, snapshots: SnapshotPlan, plan: list, step: int, loss_sum: torch.Tensor, tokens: tuple[int, int]
    ) -> None:
        """``tokens``: (tokens, loss tokens) trained on so far this round."""
        state = {
            **self._optimizer_and_rng(),
            "rows": {n: local_rows_of(p).detach().cpu() for n, p in self.params},
            "plan": [list(r) for r in plan],
            "loss_sum": float(loss_sum),
            "tokens": tokens[0],
            "loss_tokens": tokens[1],
        }
        snapshot.save(snapshots.folder, snapshots.slot, self.rank, step, state)

    @torch.no_grad()
    def _restore_snapshot(self, snapshots: SnapshotPlan, plan: list, loss_sum: torch.Tensor) -> tuple[int, int, int]:
        """Continue a round from an in-flight snapshot: (first step to run, tokens and
        loss tokens so far). A snapshot taken with another data plan does not apply: zeros."""
        step = snapshots.resume_step
        state = snapshot.load(snapshots.folder, snapshots.slot, self.rank, step)
        if state["plan"] != [list(r) for r in plan]:
            return 0, 0, 0
        for name, p in self.params:
            local_rows_of(p).copy_(state["rows"][name])
        self._restore_optimizer_and_rng(state)
        loss_sum += state["loss_sum"]
        return step, state["tokens"], state.get("loss_tokens", 0)

    # ---- inner state: what a checkpoint keeps of a replica -------------------------------
    def save_inner_state(self, folder: str, slot: int) -> dict:
        """Write this rank's inner optimizer state and RNG state to ``folder`` as
        ``replicas/slot-{slot}-rank-{rank}`` (safetensors + JSON, never pickle).
        ``folder`` may be a bucket URI; returns :func:`staging.publish`'s hashes."""
        from diloco_ray.persist import staging, state_files

        state = {
            **self._optimizer_and_rng(),
            "world_size": self.world_size,
            "sync": self.sync.state_dict(with_anchor=self.streamed),
        }
        if self.streamed:  # local weights differ from the global ones between rounds
            state["rows"] = {n: t.detach().cpu().clone() for n, t in self._local_rows().items()}
        sub = os.path.join(staging.scratch(folder), "replicas")
        os.makedirs(sub, exist_ok=True)
        written = state_files.save_state(sub, f"slot-{slot}-rank-{self.rank}", state)
        return staging.publish(folder, [f"replicas/{name}" for name in written])

    def load_inner_state(self, folder: str, slot: int) -> bool:
        """Restore what :meth:`save_inner_state` wrote; False (and a fresh optimizer) when
        the checkpoint has no state for this slot and rank."""
        from diloco_ray.persist import staging, state_files

        name = f"slot-{slot}-rank-{self.rank}"
        folder = staging.localize(folder, [f"replicas/{name}.json", f"replicas/{name}.safetensors"])
        sub = os.path.join(folder, "replicas")
        if not os.path.exists(os.path.join(sub, f"{name}.json")):
            return False
        state = state_files.load_state(sub, name)
        if state["world_size"] != self.world_size:
            return False
        self._restore_optimizer_and_rng(state)
        self.sync.load_state_dict(state.get("sync") or {})
        if "rows" in state and "anchor" in (state.get("sync") or {}):
            with torch.no_grad():
                for n, t in self._local_rows().items():
                    t.copy_(state["rows"][n])
        return True

    def _optimizer_and_rng(self) -> dict:
        """The inner optimizer state (local shards) and RNG state: what must carry over
        for training to go on exactly as if never interrupted."""
        return {
            "optimizer": _to_local_tree(self.optimizer.state_dict()),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
        }

    def _restore_optimizer_and_rng(self, state: dict) -> None:
        self.optimizer.load_state_dict(_like_params(state["optimizer"], [p for _, p in self.params]))
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"])


def local_rows_of(p: torch.Tensor) -> torch.Tensor:
    """The rows of ``p`` this process holds (the local shard of an FSDP DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p.data


def _to_local_tree(obj):
    """The same structure with every DTensor replaced by its local shard."""
    if hasattr(obj, "to_local"):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_local_tree(v) for v in obj)
    return obj


def _like_params(optim_state: dict, params: list) -> dict:
    """Wrap saved local optimizer tensors back into DTensors shaped like their params,
    so a sharded optimizer can load them (plain tensors for unsharded params)."""
    from torch.distributed.tensor import DTensor

    state = {}
    for idx, entries in optim_state["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.to_local().shape)
            else v
            for k, v in entries.items()
        }
    return {**optim_state, "state": state}
