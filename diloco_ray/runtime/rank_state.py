"""A rank's training state: its inner optimizer and RNG, stepped, kept and brought back.

A rank's inner optimizer state and RNG state must carry over for training to go on exactly
as if never interrupted. :class:`RankState` owns the inner optimizer (and fp16 gradient
scaler) over the rank's trained parameters, steps it, and keeps that state in three places:
a round checkpoint (``replicas/slot-S-rank-R``: local FSDP shards as safetensors and JSON,
never pickle), an in-flight snapshot of a long round, and the round's start on local disk
for a re-run of the round (:class:`~diloco_ray.runtime.round_start.RoundStart`). It reads
them back into a rank with the same ``world_size``.
"""

from __future__ import annotations

import os

import torch

from diloco_ray.algo.optimizers import build_inner_optimizer
from diloco_ray.algo.rank_sync import RankSync
from diloco_ray.config.sections import InnerOptimSection
from diloco_ray.persist import snapshot
from diloco_ray.runtime.messages import SnapshotPlan
from diloco_ray.runtime.round_start import RoundStart


class RankState:
    """One rank's inner optimizer over its trained parameters, and its save and restore.

    Args:
        params: the rank's trained parameters, ``(name, parameter)`` in model order (FSDP
            DTensors on a sharded rank).
        sync: the rank's :class:`~diloco_ray.algo.rank_sync.RankSync`, whose anchor and
            error-feedback residual are part of what a checkpoint and a round start keep.
        inner_optim: the inner optimizer, its schedule and ``max_grad_norm``.
        mixed_precision: the config field of that name (``fp16`` steps through a gradient scaler).
        rank: this rank's index inside the replica.
        world_size: ranks in the replica.
        device: where the parameters live.
        streamed: local weights may differ from the global ones at a round boundary (then a
            checkpoint keeps them too).
    """

    def __init__(
        self,
        params: list,
        sync: RankSync,
        inner_optim: InnerOptimSection,
        mixed_precision: str,
        rank: int,
        world_size: int,
        device: torch.device,
        streamed: bool,
    ):
        self.params, self.sync, self.inner_optim = params, sync, inner_optim
        self.rank, self.world_size, self.device, self.streamed = rank, world_size, device, streamed
        self.optimizer = build_inner_optimizer([p for _, p in params], inner_optim)
        self.scaler = torch.amp.GradScaler(device.type) if mixed_precision == "fp16" else None
        # The optimizer, RNG and residual at the start of the current round (on local
        # disk), so a re-run of the round starts exactly where the first attempt did.
        self.round_start = RoundStart()

    def local_rows(self) -> dict[str, torch.Tensor]:
        return local_rows(self.params)

    # ---- one inner step -----------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, step_loss: torch.Tensor) -> None:
        """Gradients of ``step_loss`` (scaled first under fp16)."""
        (self.scaler.scale(step_loss) if self.scaler else step_loss).backward()

    def step(self) -> None:
        """One inner optimizer step (gradients unscaled and clipped first), then no gradients."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.inner_optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in self.params], self.inner_optim.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def reset(self) -> None:
        """A fresh inner optimizer (and scaler), and no round start kept: what a replica whose
        pseudo-gradient was rejected as non-finite gets, so its poisoned state (NaN in
        AdamW's moments) does not make it diverge again next round. Its residual is cleared
        by the period's start (:meth:`RankSync.start_period
        <diloco_ray.algo.rank_sync.RankSync.start_period>`) and its weights are reloaded
        whole by the worker (:meth:`RankWorker.run_period
        <diloco_ray.runtime.rank.RankWorker.run_period>`)."""
        self.optimizer = build_inner_optimizer([p for _, p in self.params], self.inner_optim)
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.round_start.clear()

    # ---- a round's start, and a re-run of it --------------------------------------------
    def note_round_start(self, round_index: int) -> None:
        """Keep the inner optimizer, RNG and residual as ``round_index`` begins, for a re-run."""
        self.round_start.save(round_index, {**self._optimizer_and_rng(), "residual": self.sync.ledger.residual})

    @torch.no_grad()
    def rewind(self, round_index: int, keep: bool = False) -> None:
        """Back to the start of ``round_index``: local := anchor, and the round-start inner
        state when one was kept for that round. ``keep`` keeps it for another re-run."""
        for name, rows in self.local_rows().items():
            if name in self.sync.anchor:
                rows.copy_(self.sync.anchor[name].to(rows.dtype))
        saved = self.round_start.load(round_index)  # a fresh copy each time: load_state_dict may alias it
        if saved is not None:
            self._restore_optimizer_and_rng(saved)
            self.sync.ledger.rewind(saved["residual"])  # fresh copies, where they were kept; nothing sent since
            if not keep:
                self.round_start.clear()

    def close(self) -> None:
        self.round_start.close()

    # ---- in-flight snapshots of a long round --------------------------------------------
    def save_snapshot(
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
    def restore_snapshot(self, snapshots: SnapshotPlan, plan: list, loss_sum: torch.Tensor) -> tuple[int, int, int]:
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
            state["rows"] = {n: t.detach().cpu().clone() for n, t in self.local_rows().items()}
        sub = os.path.join(staging.scratch(folder), "replicas")
        os.makedirs(sub, exist_ok=True)
        written = state_files.save_state(sub, f"slot-{slot}-rank-{self.rank}", state)
        return staging.publish(folder, [f"replicas/{name}" for name in written])

    def load_inner_state(self, folder: str, slot: int) -> bool:
        """Restore what :meth:`save_inner_state` wrote, its files checked against the
        checkpoint's manifest first (:func:`staging.read_checked`); False (and a fresh
        optimizer) when the checkpoint has no state for this slot and rank."""
        from diloco_ray.persist import staging, state_files

        name = f"slot-{slot}-rank-{self.rank}"
        folder = staging.read_checked(folder, [f"replicas/{name}.json", f"replicas/{name}.safetensors"])
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
                for n, t in self.local_rows().items():
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


def local_rows(params: list) -> dict[str, torch.Tensor]:
    """name -> the rows this process holds of each of ``params`` (``(name, parameter)``)."""
    return {n: local_rows_of(p) for n, p in params}


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
