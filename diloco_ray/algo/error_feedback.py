"""Error feedback's books, kept one way by everyone who sends a lossy message: a rank for its
rows of ``global - local``, a region for its replicas' merged mean.

:class:`FeedbackLedger` keeps one rule: **what the servers applied of a sender's messages,
plus what the sender still holds, is the sum of everything it was handed to send** (with
``error_feedback_decay`` 1; a decay below 1 shrinks what is held by that factor each send).
It holds

* the **residual**: one fp32 tensor per parameter over the rows the sender holds, and
  every message's piece takes from or adds to its own rows, so a tensor that fragments or
  servers cut into pieces keeps each piece in its place;
* the **unsettled sends**: per launch attempt (the driver's counter), the messages sent
  then, until the home's verdict on them comes back (:meth:`settle`). A message carried
  its values out of the residual when it was encoded; one that was not applied (late,
  lost with its link, rejected, a fragment of a member that sat out its round) puts them
  back, to be sent again.

What happens to the books at the start of a period follows from the period's flags
(:meth:`start_period`): a replica reset after a non-finite pseudo-gradient starts from
nothing; a restore or a re-run forgets what was sent (a re-run rewinds the residual to the
round's start, :meth:`rewind`; a restore reloads). A checkpoint holds the residual with
every send still unsettled put back (:meth:`saved_residual`): what no verdict reached is
not in the checkpoint's weights.

The ledger never decodes a message itself: the sender hands :meth:`settle` the reader of
its own messages (a rank's decodes where its rows live), so the bytes are read as the
servers read them. Plain tensors, no Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from diloco_ray.algo import partition
from diloco_ray.algo.device_copy import DownCopy

# A message's pieces as the servers decode it: name -> (first row, fp32 rows).
Reader = Callable[[Any], Mapping[str, tuple[int, torch.Tensor]]]
CPU = torch.device("cpu")


def keeps_residual(codec: str, error_feedback: bool) -> bool:
    """Whether a sender with ``codec`` keeps error feedback's books: when asked
    (``error_feedback``) and always with ``topk``, which drops most values; never with
    ``none``, which drops nothing (a residual would never be sent)."""
    return (error_feedback or codec == "topk") and codec != "none"


class FeedbackLedger:
    """One sender's residual and unsettled sends.

    Args:
        held: name -> ``(first row, end row)`` the sender holds of each parameter (a 0-d
            parameter: ``(0, 1)``); the residual covers exactly these rows.
        shapes: name -> the parameter's full shape.
        decay: ``error_feedback_decay``: the residual's weight in the next message.
    """

    def __init__(self, held: Mapping[str, tuple[int, int]], shapes: Mapping[str, Sequence[int]], decay: float = 1.0):
        self.held = {n: (int(a), int(b)) for n, (a, b) in held.items()}
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.decay = decay
        self.residual: dict[str, torch.Tensor] = {}
        # Launch attempt -> what was sent then (a DownCopy: ``wait()`` gives the buffers).
        self.unsettled: dict[int, Any] = {}

    # ---- what a message takes ---------------------------------------------------------
    def rows(self, rows: partition.Rows, device: torch.device = CPU) -> dict[str, torch.Tensor]:
        """Views of the residual of ``rows`` (name -> (first, end) rows of the full
        parameter) on ``device``, where the codec writes back what it drops. A parameter
        never sent yet starts at zeros; one kept elsewhere moves to ``device`` first."""
        views = {}
        for name, iv in rows.items():
            held = self.residual.get(name)
            self.residual[name] = (
                torch.zeros(self._held_shape(name), device=device) if held is None else held.to(device)
            )
            views[name] = partition.take(self.residual[name], iv, self.held[name][0])
        return views

    def feed(self, rows: partition.Rows, device: torch.device = CPU) -> dict[str, torch.Tensor]:
        """:meth:`rows`, decayed in place: what goes into the next message beside the
        pseudo-gradient (the codec then leaves there what it did not carry)."""
        views = self.rows(rows, device)
        if self.decay != 1.0:
            for view in views.values():
                view.mul_(self.decay)
        return views

    def keep(self, attempt: Optional[int], sent: Any) -> None:
        """Hold ``sent`` (a DownCopy of the messages of launch ``attempt``) until its verdict."""
        if attempt is not None:
            self.unsettled[attempt] = sent

    # ---- what the home says of them -----------------------------------------------------
    def settle(self, verdicts: Mapping[int, bool], read: Reader, device: torch.device = CPU) -> None:
        """Close the sends the home has a verdict on (launch attempt -> applied): a send
        not applied puts back what it carried. The home hands out verdicts in launch order,
        every launch its own: a send older than the newest verdict and without one of its
        own was lost to the home (a home resumed from a checkpoint, whose state the sender
        takes up another way) and is dropped."""
        if not verdicts:
            return
        for attempt, applied in sorted(verdicts.items()):
            sent = self.unsettled.pop(attempt, None)
            if sent is not None and not applied:
                self.put_back(sent.wait(), read, device)
        newest = max(verdicts)
        self.unsettled = {a: s for a, s in self.unsettled.items() if a > newest}

    def put_back(self, buffers: Sequence, read: Reader, device: torch.device = CPU) -> None:
        """Add the values ``buffers`` carried (read as the servers read them) into the
        residual of their rows."""
        for buf in buffers:
            for name, (start, values) in read(buf).items():
                rows = self.rows({name: (start, start + partition.num_rows(values.shape))}, device)[name]
                rows.add_(values.to(rows.device).view(rows.shape))

    def start_period(
        self, *, reset_inner: bool, reset: bool, restart: bool, verdicts: Mapping[int, bool], read: Reader, device=CPU
    ) -> None:
        """The books as a period starts, by its flags: a sender whose last pseudo-gradient
        was non-finite starts from nothing (``reset_inner``); a restore (``reset``) or a
        re-run (``restart``) forgets what was sent, undone by the reload or the rewind;
        then the verdicts heard since the last period are settled."""
        if reset_inner:
            self.clear()
        if reset or restart:
            self.forget_sent()
        self.settle(verdicts, read, device)

    def forget_sent(self) -> None:
        """Drop every unsettled send: its work is undone another way."""
        self.unsettled = {}

    def clear(self) -> None:
        """Hold nothing: no residual, no unsettled send (a fresh start)."""
        self.residual, self.unsettled = {}, {}

    # ---- a round's start, a checkpoint, a restarted sender --------------------------------
    def rewind(self, residual: Mapping[str, torch.Tensor]) -> None:
        """Back to a round's start: that round's ``residual`` (fresh tensors, taken as
        they are), and nothing sent since (a re-run sends it again)."""
        self.residual, self.unsettled = dict(residual), {}

    def saved_residual(self, read: Reader, device: torch.device = CPU) -> dict[str, torch.Tensor]:
        """The residual a checkpoint keeps: every send still unsettled put back, into copies
        (the live books stay as they are). With nothing unsettled, the residual itself: a
        checkpoint only reads it, and a copy would cost its size again where it lives."""
        if not self.unsettled:
            return dict(self.residual)
        books = FeedbackLedger(self.held, self.shapes, self.decay)
        books.residual = {n: t.clone() for n, t in self.residual.items()}
        for sent in self.unsettled.values():
            books.put_back(sent.wait(), read, device)
        return books.residual

    def state_dict(self) -> dict:
        """The residual and the unsettled sends' bytes (uint8 tensors), for a sender that
        must take its books up again where it stopped (a region's agent restarted)."""
        sent = {
            str(a): [torch.from_numpy(np.ascontiguousarray(b)) for b in s.wait()] for a, s in self.unsettled.items()
        }
        return {"residual": dict(self.residual), "unsettled": sent}

    def load_state_dict(self, state: Mapping) -> None:
        """Take up :meth:`state_dict` (or a checkpoint's ``{"residual": ...}``); a name
        this ledger does not hold, or a residual of the wrong shape, is refused."""
        residual = {n: t.clone() for n, t in (state.get("residual") or {}).items()}
        for name, t in residual.items():
            if name not in self.held or tuple(t.shape) != self._held_shape(name):
                raise ValueError(f"a saved residual of {name!r} {tuple(t.shape)} does not fit the rows held")
        sent = state.get("unsettled") or {}
        self.residual = residual
        self.unsettled = {int(a): DownCopy([b.contiguous() for b in bufs]) for a, bufs in sent.items()}

    def _held_shape(self, name: str) -> tuple:
        shape = self.shapes[name]
        if not shape:
            return ()
        first, end = self.held[name]
        return (end - first, *shape[1:])
