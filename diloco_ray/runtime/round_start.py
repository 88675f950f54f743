"""A rank's state at the start of a round, kept on local disk for a re-run of the round.

With ``restore_on_retry`` a rank keeps its inner optimizer state, RNG state and
error-feedback residual as they were when the round began, so a re-run trains exactly as
the first attempt did. That copy is 8 bytes per parameter of the rank's share for AdamW
(more with a residual) and is read only when a round is run again, which is rare. Held in
memory it would be the largest thing a rank holds after its own training state (a rank's
floor is 20 bytes per parameter); here it is written to a node-local file one tensor at a
time (never a second full copy in memory) and read back the same way.

Plain code over tensors and files: no Ray.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Optional

import torch


def at_period_start(fragment: int, restart: bool, restore_on_retry: bool, resuming: bool = False) -> Optional[str]:
    """What a sender does with its round's start as a period begins, by the one rule ranks and
    regions follow: at a round's first period (``fragment`` 0), a re-run (``restart``) goes
    back to the state kept at the round's start (``"rewind"``: local := global, and with
    ``restore_on_retry`` the inner state and residual kept then), and otherwise, with
    ``restore_on_retry``, that state is kept for a re-run (``"note"``; not when ``resuming``
    from an in-flight snapshot, which is not a round's start). None: nothing to do."""
    if fragment != 0:
        return None
    if restart:
        return "rewind"
    return "note" if restore_on_retry and not resuming else None


class RoundStart:
    """The state of one round's start for one rank, spilled to a file.

    Args:
        folder: where the file goes (default: a new folder under the system's temp dir,
            removed by :meth:`close`).
    """

    def __init__(self, folder: str | None = None):
        self._own = folder is None
        if folder is None:
            _remove_orphans()
            folder = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
            # Removed when this object goes, or at exit; a killed process's folder is
            # removed by the next rank that starts on the node (_remove_orphans).
            weakref.finalize(self, shutil.rmtree, folder, True)
        self.folder = folder
        self.path = os.path.join(self.folder, "state.bin")
        self.round: int | None = None
        self._layout = None  # the state's structure, tensors replaced by their place in the file

    def save(self, round_index: int, state) -> None:
        """Write ``state`` (nested dicts/lists/tuples of tensors and plain values) as
        the start of ``round_index``, replacing what was kept before."""
        # Written over the last round's file rather than a new one: its pages are still in
        # the page cache, so this costs one copy into them, where a truncated file makes
        # the kernel free those pages and zero them again, several times the cost.
        with open(self.path, "r+b" if os.path.exists(self.path) else "wb") as f:
            self._layout = _write(state, f)
            f.truncate()
        self.round = round_index

    def load(self, round_index: int):
        """The state saved for ``round_index`` (tensors on the devices they came from),
        or None when the kept state belongs to another round or none was kept."""
        if self.round != round_index or self._layout is None:
            return None
        with open(self.path, "rb") as f:
            return _read(self._layout, f)

    def clear(self) -> None:
        self.round, self._layout = None, None

    def close(self) -> None:
        self.clear()
        if self._own:
            shutil.rmtree(self.folder, ignore_errors=True)


_PREFIX = "diloco-round-start-"


def _remove_orphans() -> None:
    """Remove the folders of processes that no longer run (killed ranks)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Stored:
    """Where one tensor lies in the file."""

    def __init__(self, offset: int, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.offset, self.shape, self.dtype, self.device = offset, shape, dtype, device


def _write(obj, f):
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        stored = _Stored(f.tell(), tuple(t.shape), t.dtype, t.device)
        host = t.to("cpu").contiguous()  # one tensor on the host at a time
        if host.numel():
            f.write(host.reshape(-1).view(torch.uint8).numpy().data)
        return stored
    if isinstance(obj, dict):
        return {k: _write(v, f) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_write(v, f) for v in obj)
    return obj


def _read(layout, f):
    if isinstance(layout, _Stored):
        out = torch.empty(layout.shape, dtype=layout.dtype)
        if out.numel():
            f.seek(layout.offset)
            f.readinto(out.reshape(-1).view(torch.uint8).numpy().data)  # straight into the tensor
        return out.to(layout.device)
    if isinstance(layout, dict):
        return {k: _read(v, f) for k, v in layout.items()}
    if isinstance(layout, (list, tuple)):
        return type(layout)(_read(v, f) for v in layout)
    return layout
