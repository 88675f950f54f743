"""The DiLoCo outer optimizer: the global parameters, their outer-optimizer state and
the round counter, as pure tensor code.

:class:`OuterOptimizer` owns the fp32 global parameters, the ``torch.optim`` outer optimizer
(Nesterov SGD by default) with its checkpointable state, the outer learning-rate schedule
and the index of the next round. The parameter servers hold one per slice and drive it
through the rules of :mod:`diloco_ray.algo.aggregate` (what is rejected, the weighted mean,
its norm and whether it may be applied), :meth:`OuterOptimizer.apply_clipped` and
:meth:`OuterOptimizer.advance`; :meth:`OuterOptimizer.step` composes the very same calls on
whole tensors, in one process. It knows nothing about Ray, workers or communication;
callers hand it tensors and get tensors back.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor

from diloco_ray.algo.aggregate import (
    MEAN_OVERFLOWS,
    Rejected,
    Rejection,
    accepted_of,
    add_weighted,
    agree_on_norm,
    find_invalid,
    mean_in_place,
    squares_by_part,
    weight_scale,
)
from diloco_ray.algo.decoupled import delayed_nesterov_, delayed_nesterov_clipped_
from diloco_ray.algo.optimizers import build_outer_optimizer
from diloco_ray.config.sections import OuterOptimSection

__all__ = [
    "MEAN_OVERFLOWS",
    "OuterOptimizer",
    "OuterStepInfo",
    "Rejected",
    "Rejection",
    "clip_coefficient",
    "find_invalid",
    "outer_lr_at",
    "outer_momentum_at",
    "sync_advances",
]

_SCHEDULES = (None, "cosine", "linear", "polynomial")


def outer_lr_at(base_lr: float, schedule: str | None, r: int, T: int) -> float:
    """Outer learning rate for round ``r`` under ``schedule``.

    Args:
        base_lr: the peak outer learning rate (``config.outer_lr``).
        schedule: ``None`` (constant), ``"cosine"``, ``"linear"`` or ``"polynomial"``
            (quadratic decay).
        r: 0-based index of the round being applied.
        T: total number of outer rounds (``config.diloco_loops``); ``r`` is clamped
            to ``[0, T]`` so an over-long run decays to 0 instead of going negative.

    Raises:
        ValueError: unknown schedule, or a decaying schedule with ``T <= 0``.
    """
    if schedule is None:
        return float(base_lr)
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown outer_lr_schedule {schedule!r}; expected one of {_SCHEDULES}")
    if T <= 0:
        raise ValueError(f"outer_lr_schedule {schedule!r} needs diloco_loops > 0, got {T}")
    frac = min(max(r, 0), T) / T
    if schedule == "cosine":
        return float(base_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))
    if schedule == "linear":
        return float(base_lr) * (1.0 - frac)
    return float(base_lr) * (1.0 - frac) ** 2


def outer_momentum_at(momentum: float, warmup_updates: int, r: int) -> float:
    """Outer momentum of outer update ``r`` (0-based) with ``warmup_updates``
    (``outer_momentum_warmup_rounds``) of warm-up: ``momentum`` x (r + 1) / (warmup_updates + 1)
    until update ``warmup_updates``, which has the whole of it (0: the whole throughout).
    A short run's first pseudo-gradients, the largest, then do not compound through a
    full-strength buffer. Never 0: torch's SGD keeps no buffer for a step at momentum 0, so
    the first update's pseudo-gradient would be left out of it."""
    if warmup_updates <= 0:
        return float(momentum)
    return float(momentum) * min(max(r, 0) + 1, warmup_updates + 1) / (warmup_updates + 1)


def sync_advances(applied: bool, streaming: bool) -> bool:
    """Whether a sync moves the weights replicas hold to a new version: a streaming sync
    always does (its fragment's rows are re-sent, applied or not); a plain DiLoCo sync only
    when it applied an update. The server counts versions by this rule and the driver
    numbers the messages it hands out by it, before the commit returns.
    """
    return streaming or applied


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor global-norm clipping scales the gradient by, as ``clip_grad_norm_``
    computes it: ``min(1, max_norm / (total_norm + 1e-6))`` (1.0 when clipping is off).

    Kept apart from the step so a sharded server can clip by a norm taken across shards.
    """
    if max_norm is None:
        return 1.0
    return min(1.0, float(max_norm) / (float(total_norm) + 1e-6))


@dataclass
class OuterStepInfo:
    """What one ``OuterOptimizer.step`` call did.

    Args:
        applied: whether the global params were updated.
        accepted: indices (into the pseudo_grads list) whose pseudo-gradients were applied.
        rejected: indices that failed validation, and every index when their weighted mean
            was not finite (:data:`MEAN_OVERFLOWS`).
        reasons: index -> why it was rejected (a :class:`Rejected`).
        grad_norm: L2 norm of the outer gradient before clipping; None if not applied.
        lr: the outer lr used (or that would have been used).
        round: 0-based round index applied (or that would have been applied).
    """

    applied: bool
    accepted: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    reasons: dict[int, Rejected] = field(default_factory=dict)
    grad_norm: float | None = None
    lr: float = 0.0
    round: int = 0


class OuterOptimizer:
    """Owns the global params and applies DiLoCo outer updates to them.

    Args:
        global_params: name -> tensor; copied into fp32 leaf tensors this object owns
            (the caller's tensors are never mutated).
        outer: the outer-optimiser section of the job's config (``outer_opt``,
            ``outer_opt_kwargs``, ``outer_lr``, ``outer_momentum``, ``outer_lr_schedule``,
            ``outer_grad_clip``, ``diloco_loops``); :class:`diloco_ray.outer.OuterOptimizer`
            takes a whole TrainerConfig too.

    Attributes:
        round: the index of the next round (read-only; :meth:`advance` moves it).
        last_step: ``OuterStepInfo`` of the latest ``step`` call (None before any).
    """

    def __init__(self, global_params: Mapping[str, Tensor], outer: OuterOptimSection) -> None:
        self._params: dict[str, Tensor] = {}
        for name, p in global_params.items():
            if not p.is_floating_point():
                raise ValueError(f"global param {name!r} must be floating point, got {p.dtype}")
            self._params[name] = p.detach().to(dtype=torch.float32, copy=True)
        clip = outer.outer_grad_clip
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"outer_grad_clip must be None or a positive float, got {clip!r}")
        if outer.outer_lr_schedule not in _SCHEDULES:
            raise ValueError(f"unknown outer_lr_schedule {outer.outer_lr_schedule!r}; expected one of {_SCHEDULES}")
        self._clip = clip
        self._schedule = outer.outer_lr_schedule
        self._loops = int(outer.diloco_loops)
        self._optimizer = build_outer_optimizer(list(self._params.values()), outer)
        self._momentum_warmup = int(outer.outer_momentum_warmup_rounds)
        self._momentum = float(self._optimizer.defaults.get("momentum", 0.0))
        # An explicit lr in outer_opt_kwargs overrides outer_lr, schedule included.
        self._base_lr = float(self._optimizer.defaults["lr"])
        self._round = 0
        self.last_step: OuterStepInfo | None = None

    @property
    def round(self) -> int:
        """The index of the next round to apply: what the lr schedule reads and a checkpoint
        keeps. Only :meth:`advance` (and :meth:`load_state_dict`) move it."""
        return self._round

    def advance(self) -> None:
        """Move on to the next round. :meth:`step` calls it once it applied an update; a
        parameter server, once a round's last sync committed (applied or not, when it syncs
        in fragments) or a decoupled merge was applied."""
        self._round += 1

    @property
    def params(self) -> dict[str, Tensor]:
        """name -> current global fp32 tensor (the live tensors, updated in place)."""
        return dict(self._params)

    def step(self, pseudo_grads: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
        """Apply one outer round from the replicas' pseudo-gradients.

        Args:
            pseudo_grads: one name -> tensor dict per replica (``global - local``).
                Invalid ones (non-finite, wrong keys or shapes) are skipped and
                recorded in ``last_step``; a weighted mean past fp32's range is
                not applied, and every replica in it is recorded rejected.
            weights: one finite, non-negative weight per replica (e.g. tokens seen).

        Returns:
            The global params after the round (unchanged if nothing was applied).

        Raises:
            ValueError: length mismatch, or a negative / non-finite weight.
        """
        if len(pseudo_grads) != len(weights):
            raise ValueError(f"got {len(pseudo_grads)} pseudo-grads but {len(weights)} weights")
        for i, w in enumerate(weights):
            if not (math.isfinite(float(w)) and float(w) >= 0):
                raise ValueError(f"weight {i} must be finite and >= 0, got {w!r}")

        lr = self.lr_at(self.round)
        info = OuterStepInfo(applied=False, lr=lr, round=self.round)
        self.last_step = info
        # What the servers do a slice at a time (prepare, reduce, commit), on whole tensors.
        for i, g in enumerate(pseudo_grads):
            why = find_invalid(g, self._params)
            if why is not None:
                info.reasons[i] = why
        weight_of = {i: float(w) for i, w in enumerate(weights)}
        info.accepted, total = accepted_of(range(len(pseudo_grads)), weight_of, info.reasons)
        info.rejected = sorted(info.reasons)
        if not total > 0:
            return self.params
        # Every weight is known up front: scaled by their total's power of two, the sum of the
        # accepted ones holds a mean's worth.
        scale = weight_scale(sum(weight_of.values()))
        acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in self._params.items()}
        for i in info.accepted:
            for name, g in pseudo_grads[i].items():
                flat = g.detach().reshape(-1).to(acc[name].device, torch.float32)
                add_weighted(acc[name].view(-1), flat, weight_of[i] / scale, name)
        mean = mean_in_place(acc, total, scale)
        position = {n: k for k, n in enumerate(self._params)}
        parts = squares_by_part(mean, position, dict.fromkeys(mean, 0))
        accepted, norm, info.reasons = agree_on_norm(info.accepted, info.reasons, parts)
        info.accepted, info.rejected = list(accepted), sorted(info.reasons)
        if not accepted:
            return self.params
        info.grad_norm = norm
        self.apply_clipped(mean, lr, norm)
        self.advance()
        info.applied = True
        return self.params

    def lr_at(self, round_index: int) -> float:
        """The outer lr of round ``round_index`` under the configured schedule."""
        return outer_lr_at(self._base_lr, self._schedule, round_index, self._loops)

    def momentum_at(self, round_index: int) -> float:
        """The outer momentum of update ``round_index`` under ``outer_momentum_warmup_rounds``."""
        return outer_momentum_at(self._momentum, self._momentum_warmup, round_index)

    @property
    def max_norm(self) -> float | None:
        """``outer_grad_clip`` (None: no clipping)."""
        return self._clip

    def apply_clipped(self, mean: dict, lr: float, norm: float) -> None:
        """One outer step from an accepted mean, clipped by its global norm: what a server's
        commit takes for its rows and :meth:`step` for whole tensors.

        Args:
            mean: name -> the accepted weighted mean (any subset of the params), consumed
                as :meth:`apply` with ``in_place`` consumes it.
            lr: the outer lr for this step (see :meth:`lr_at`).
            norm: the global L2 norm of the whole mean (over every server's rows), which
                :func:`clip_coefficient` clips by.
        """
        self.apply(mean, lr, clip_coefficient(norm, self._clip), in_place=True)

    def apply(self, mean: Mapping[str, Tensor], lr: float, clip_coef: float = 1.0, in_place: bool = False) -> None:
        """One outer optimizer step from an already averaged, validated outer gradient.

        Only the params named in ``mean`` move (and only their optimizer state): the
        others get no gradient, and torch optimizers skip those. This is what a streaming
        sync of one fragment, or one server shard, needs. ``round`` is not advanced
        (:meth:`advance`).

        Args:
            mean: name -> outer gradient (any subset of the params, same shapes).
            lr: the outer lr for this step (see :meth:`lr_at`).
            clip_coef: factor to scale the gradient by (see :func:`clip_coefficient`).
            in_place: ``mean`` is the caller's scratch (a dict, as the server's sum is):
                its tensors are scaled in place and each is dropped from it once its
                parameter has stepped, one parameter at a time, so the step never holds
                more than one tensor beyond the weights, their state and what is left of
                the sum. The result is the same: the optimizers this takes update each
                parameter from its own gradient and state alone.
        """
        for name, g in mean.items():
            p = self._params[name]
            if g.shape != p.shape:
                raise ValueError(f"outer gradient for {name!r} has shape {tuple(g.shape)}, want {tuple(p.shape)}")
        for group in self._optimizer.param_groups:
            group["lr"] = lr
            if self._momentum_warmup:
                group["momentum"] = self.momentum_at(self.round)
        if in_place:
            for name in list(mean):
                p = self._params[name]
                p.grad = mean.pop(name).to(device=p.device, dtype=torch.float32)
                if clip_coef != 1.0:
                    p.grad.mul_(clip_coef)
                self._optimizer.step()  # steps only the parameter that has a gradient
                p.grad = None
            return
        for name, g in mean.items():
            p = self._params[name]
            g = g.to(device=p.device, dtype=torch.float32)
            p.grad = g * clip_coef if clip_coef != 1.0 else g  # never scale the caller's tensor
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)

    def momentum(self, name: str) -> Optional[Tensor]:
        """The outer momentum buffer of parameter ``name`` (SGD with momentum), or None
        before the first step or for an optimizer that keeps none."""
        return self._optimizer.state.get(self._params[name], {}).get("momentum_buffer")

    def cycle_grad(self, name: str) -> Optional[Tensor]:
        """Decoupled mode, clipped by the cycle: the unclipped sum of the cycle's merge
        gradients of parameter ``name`` (None before its first merge)."""
        return self._optimizer.state.get(self._params[name], {}).get("cycle_grad")

    def apply_delayed(
        self,
        mean: dict,
        lr: float,
        clip_coef: float,
        cycle_end: bool,
        cycle_coefs: Optional[tuple[float, float]] = None,
    ) -> None:
        """Decoupled mode's delayed-Nesterov step (:func:`~diloco_ray.algo.decoupled.delayed_nesterov_`)
        from one merge's outer gradient, consuming ``mean`` as :meth:`apply` with ``in_place``
        does. The buffer lives in the SGD optimizer's ``momentum_buffer`` state, so checkpoints
        carry it; ``round`` is not advanced.

        With ``cycle_coefs`` (the cycle's clip coefficient before this merge, and with it) the
        merge is clipped by its cycle instead of by ``clip_coef``
        (:func:`~diloco_ray.algo.decoupled.delayed_nesterov_clipped_`); the cycle's unclipped
        gradient lives in the optimizer's ``cycle_grad`` state, which checkpoints carry too."""
        beta, beta_next = self.momentum_at(self.round), self.momentum_at(self.round + 1)
        for name in list(mean):
            p = self._params[name]
            g = mean.pop(name).to(device=p.device, dtype=torch.float32)
            if g.shape != p.shape:
                raise ValueError(f"outer gradient for {name!r} has shape {tuple(g.shape)}, want {tuple(p.shape)}")
            state = self._optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p)
            if cycle_coefs is not None:  # clipped by the cycle: (coefficient before, with this merge)
                if state.get("cycle_grad") is None:
                    state["cycle_grad"] = torch.zeros_like(p)
                before, now = cycle_coefs
                delayed_nesterov_clipped_(
                    p.data,
                    g,
                    state["momentum_buffer"],
                    state["cycle_grad"],
                    lr,
                    beta,
                    before,
                    now,
                    cycle_end,
                    beta_next,
                )
                continue
            if clip_coef != 1.0:
                g.mul_(clip_coef)
            delayed_nesterov_(p.data, g, state["momentum_buffer"], lr, beta, cycle_end, beta_next)

    def state_dict(self) -> dict[str, Any]:
        """Snapshot: ``{"params": name -> clone, "optimizer": torch state, "round": int,
        "names": param order}``.

        The optimizer state is deep-copied: torch updates its buffers in place, so a
        shallow snapshot would drift as training continues.
        """
        return {
            "params": {k: v.detach().clone() for k, v in self._params.items()},
            "optimizer": copy.deepcopy(self._optimizer.state_dict()),
            "round": self.round,
            # torch keys optimizer state by position; the names make it loadable by name.
            "names": list(self._params),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore params, optimizer state and round from ``state_dict()`` output.

        Args:
            sd: a state dict from any ``OuterOptimizer`` whose params have the same
                names and shapes as this one's. It is copied, never aliased.
        """
        saved = sd["params"]
        reason = find_invalid(saved, self._params)
        if reason is not None:
            raise ValueError(f"cannot load outer optimizer state: {reason}")
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(saved[name])
        optim = copy.deepcopy(sd["optimizer"])
        names = sd.get("names")
        if names is not None and list(names) != list(self._params):
            if sorted(names) != sorted(self._params):
                raise ValueError("cannot load outer optimizer state: its parameter names differ")
            # Saved in another order: move each state entry to where its param is now.
            position = {name: i for i, name in enumerate(self._params)}
            optim["state"] = {position[names[int(i)]]: v for i, v in optim["state"].items()}
        # torch's load_state_dict keeps same-dtype/device state tensors by reference.
        self._optimizer.load_state_dict(optim)
        self._round = int(sd["round"])
