"""What a parameter server keeps from sync to sync: its rows of the global weights with their
outer-optimizer state and position in the run (:class:`SliceStore`), and the data cursor
with the plans handed out on it (:class:`PlanLedger`).

Both change only when a sync commits (:meth:`ParameterServer.commit
<diloco_ray.runtime.server.ParameterServer.commit>`), and both are what a checkpoint
writes (:class:`~diloco_ray.persist.server_state.ServerCheckpoint`). The outer step and the
round counter are :class:`~diloco_ray.algo.outer.OuterOptimizer`'s (the same calls its
``step`` makes on whole tensors); the cursor's moves are :mod:`diloco_ray.data.plan`'s.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Optional

import numpy as np
import torch

from diloco_ray.algo import decoupled
from diloco_ray.algo.outer import OuterOptimizer, clip_coefficient, sync_advances
from diloco_ray.algo.slice_layout import SliceLayout
from diloco_ray.data import plan as data


class SliceStore:
    """One server's rows of the global weights, their outer state, and where they stand.

    Args:
        layout: which rows this server holds.
        optimizer: the outer optimizer over ``layout``'s pieces: it holds the fp32 rows, their
            momentum and the round index.
        sync_fragments: how many fragments a round syncs the model in.
    """

    def __init__(self, layout: SliceLayout, optimizer: OuterOptimizer, sync_fragments: int):
        self.layout, self.optimizer, self.sync_fragments = layout, optimizer, sync_fragments
        self.fragment = 0  # next fragment to sync within the round
        self.version = 0  # syncs committed: the version replicas hold
        self.round_accepted: Optional[set[int]] = None  # replicas with a fragment applied this round
        self.work = 0.0  # decoupled: rounds' worth of tokens merged (drives the lr schedule and the momentum cycle)
        self.cycle_clip = 1.0  # decoupled, delayed, clipped by the cycle: the clip coefficient of the cycle so far

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The fp32 rows, by optimizer piece."""
        return self.optimizer.params

    @property
    def round(self) -> int:
        """The index of the next round to apply."""
        return self.optimizer.round

    def momentum_of(self, name: str) -> Optional[torch.Tensor]:
        """The outer momentum of this server's rows of ``name`` (None before the first step)."""
        return self.optimizer.momentum(self.layout.pieces[(name, 0)])

    def rows_of(self, name: str) -> Optional[tuple[int, np.ndarray]]:
        """(first row, fp32 rows) of ``name`` this server holds, or None; on the host a view,
        not a copy (a server's GPU copies them down)."""
        iv = self.layout.owned.get(name)
        if iv is None:
            return None
        return iv[0], self.layout.rows(self.params, name, iv).cpu().numpy()

    def digest(self) -> str:
        """A digest of the rows' fp32 bits (in the layout's order) and the version."""
        h = hashlib.blake2b(digest_size=16)
        h.update(str(self.version).encode())
        for name, iv in self.layout.owned.items():
            rows = self.layout.rows(self.params, name, iv).detach().cpu().contiguous().reshape(-1)
            h.update(name.encode())
            h.update(rows.view(torch.uint8).numpy())
        return h.hexdigest()

    # ---- a sync's commit ---------------------------------------------------------------
    def step(self, mean: dict, lr: float, norm: float) -> None:
        """The outer step of the current fragment from its accepted ``mean`` (name -> rows,
        consumed), clipped by ``norm``, the norm over every server's rows."""
        self.optimizer.apply_clipped(self.layout.keyed(mean, self.fragment), lr, norm)

    def advance(self, accepted: list[int]) -> Optional[set[int]]:
        """Move past the current fragment's sync: the version (when replicas get new weights),
        the fragment, and after a round's last fragment the round. Returns, when the round
        ended, the replicas whose round of data counts as trained; else None."""
        streaming = self.sync_fragments > 1
        if sync_advances(applied=bool(accepted), streaming=streaming):
            self.version += 1
        # A replica's round of data counts as trained once any of its fragments was
        # applied: its work reached the global weights, and handing the data out again
        # would train it into those fragments twice. Fragments it missed lose that part
        # of its work, as a dropped replica's round is lost in plain DiLoCo.
        got = set(accepted)
        self.round_accepted = got if self.round_accepted is None else self.round_accepted | got
        if self.fragment < self.sync_fragments - 1:
            self.fragment += 1
            return None
        trained, self.round_accepted = self.round_accepted, None
        self.fragment = 0
        self.optimizer.advance()
        return trained

    def merge_lr(self) -> float:
        """Decoupled mode: the outer lr, following the schedule by ``work``."""
        return self.optimizer.lr_at(int(self.work + decoupled.CYCLE_EPS))

    def merge(
        self, mean: dict, lr: float, norm: float, share: float, delayed: bool, cycle_norm: Optional[float] = None
    ) -> None:
        """Decoupled mode: one outer step from a merge's accepted ``mean`` (consumed) worth
        ``share`` of a round; with ``delayed`` Nesterov its momentum applies each time
        ``work`` passes a whole round (:mod:`diloco_ray.algo.decoupled`)."""
        before, self.work = self.work, self.work + share
        keyed = self.layout.keyed(mean, 0)
        end = decoupled.cycle_ends(before, self.work)
        if delayed and cycle_norm is not None:  # clipped by the cycle (outer_grad_clip)
            coefs = (self.cycle_clip, clip_coefficient(cycle_norm, self.optimizer.max_norm))
            self.optimizer.apply_delayed(keyed, lr, 1.0, end, cycle_coefs=coefs)
            self.cycle_clip = 1.0 if end else coefs[1]
        elif delayed:
            self.optimizer.apply_delayed(keyed, lr, clip_coefficient(norm, self.optimizer.max_norm), end)
        else:
            self.optimizer.apply_clipped(keyed, lr, norm)
        self.optimizer.advance()
        self.version += 1

    # ---- checkpoints -------------------------------------------------------------------
    def position(self) -> dict:
        """Where the rows stand, as a checkpoint records it."""
        accepted = None if self.round_accepted is None else sorted(self.round_accepted)
        return {
            "fragment": self.fragment,
            "version": self.version,
            "round_accepted": accepted,
            "work": self.work,
            "cycle_clip": self.cycle_clip,
        }

    def restore_position(self, meta: Mapping) -> None:
        """Back to the :meth:`position` a checkpoint recorded (absent keys: a fresh run's)."""
        self.fragment, self.version = meta.get("fragment", 0), meta.get("version", 0)
        accepted = meta.get("round_accepted")
        self.round_accepted = None if accepted is None else set(accepted)
        self.work = float(meta.get("work", 0.0))
        self.cycle_clip = float(meta.get("cycle_clip", 1.0))


class PlanLedger:
    """The data cursor, and in decoupled mode the plans handed out on it and not yet merged.
    Every server keeps one and moves it the same way; the driver reads server 0's.

    Args:
        sequences_for: replica id -> the training sequences it consumes in a round.
        owner: how errors name the server (``server 0``).
    """

    def __init__(self, sequences_for: Callable[[int], int], owner: str):
        self.sequences_for, self.owner = sequences_for, owner
        self.cursor = data.DataCursor()
        self.in_flight: dict[int, list] = {}  # decoupled: replica id -> its reserved plan

    def plan_round(self, replica_ids: list[int]) -> list[list[tuple[int, int]]]:
        """The stream ranges each replica of ``replica_ids`` trains on next, in order (no
        state change)."""
        return data.plan_round(self.cursor, [self.sequences_for(i) for i in replica_ids])

    def reserve(self, replica_id: int) -> list[tuple[int, int]]:
        """Decoupled mode: take the next plan for ``replica_id`` off the cursor; it is in
        flight until a merge settles it or :meth:`release` gives it back."""
        if replica_id in self.in_flight:
            raise RuntimeError(f"{self.owner}: replica {replica_id} already has a plan in flight")
        plan, self.cursor = data.reserve(self.cursor, self.sequences_for(replica_id))
        self.in_flight[replica_id] = plan
        return plan

    def release(self, replica_id: int) -> None:
        """Decoupled mode: the replica's plan was never trained (it died): hand it out again."""
        plan = self.in_flight.pop(replica_id, None)
        if plan:
            self.cursor = data.give_back(self.cursor, plan)

    def resume_cursor(self) -> data.DataCursor:
        """The cursor a resumed run starts from: in-flight plans are given back, because the
        work on them is not in the weights (and in-flight work is not checkpointed)."""
        return data.give_back(self.cursor, [r for plan in self.in_flight.values() for r in plan])

    def restore(self, cursor: data.DataCursor) -> None:
        """Back to a checkpoint's cursor, nothing in flight."""
        self.cursor, self.in_flight = cursor, {}

    def commit_round(self, plans: dict, trained: set[int], unused: dict) -> dict[int, list]:
        """A round ended: the plans of ``trained`` replicas are consumed (less their
        ``unused`` ranges), the others go back. Returns replica id -> what it consumed."""
        ids = list(plans)
        rest = [unused.get(i, []) for i in ids]
        self.cursor = data.commit_round(self.cursor, [plans[i] for i in ids], [i in trained for i in ids], rest)
        return {i: data.trained_part(plans[i], unused.get(i, [])) for i in ids if i in trained}

    def settle_merge(self, plans: dict, accepted: list[int], unused: dict) -> dict[int, list]:
        """Decoupled mode: a merge's plans leave flight; the ``accepted`` ones are trained
        (less their ``unused`` ranges, which go back), the others go back whole. Returns
        replica id -> what it consumed."""
        consumed: dict[int, list] = {}
        for rid, plan in plans.items():
            self.in_flight.pop(rid, None)
            if rid in accepted:
                consumed[rid] = data.trained_part(plan, unused.get(rid, []))
                self.cursor = data.give_back(self.cursor, unused.get(rid, []))
            else:
                self.cursor = data.give_back(self.cursor, plan)
        return consumed
