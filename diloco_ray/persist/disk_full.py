"""A full disk (or quota) told as one line: which folder, which file, and how to go on.

A full disk is an environment failure, not a bug: the command exits 1 with this line
instead of a traceback the user could not act on. Whether the write that failed was under
the run's ``output_dir`` is judged from its file name, or, for a write to an open file that
names none, from whether ``output_dir``'s disk is (nearly) full; a run that can be resumed
is pointed at its last good checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional


def disk_full_line(error: OSError, output_dir: Optional[str], resumable: bool = False) -> str:
    """The one line for a full disk (or quota): the folder, the file, and how to go on.

    Args:
        error: the ENOSPC/EDQUOT error (:func:`~diloco_ray.errors.disk_full`); its
            ``filename`` is None when a write to an open file failed.
        output_dir: the run's folder, when the command has one.
        resumable: whether to point at the last good checkpoint (``train``).
    """
    from diloco_ray.persist import storage

    what = os.strerror(error.errno).lower()  # "no space left on device", "disk quota exceeded"
    path = error.filename if isinstance(error.filename, str) else None
    local = output_dir and not storage.is_remote(output_dir)
    inside = local and (_is_under(path, output_dir) if path else _nearly_full(output_dir))
    if not inside:
        if path:
            return f"{what} writing '{path}'; free space on that disk and run again"
        # A write to an open file names no file; output_dir's disk has room, so it was another one.
        return f"{what} on a disk the run writes to (not output_dir's; Ray's temp folder?); free space and run again"
    line = f"output_dir: {what} writing '{path or output_dir}'; free space under '{output_dir}'"
    if not resumable:
        return line
    from diloco_ray.persist import checkpoint

    try:
        last, _ = checkpoint.latest_valid(os.path.join(output_dir, "checkpoints"))
    except OSError:
        last = None
    if last is None:
        return f"{line}, then run again (no checkpoint was written to resume from)"
    return f"{line}, then resume from its last good checkpoint ({last}) with --set resume_from={output_dir}"


def _is_under(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _nearly_full(folder: str) -> bool:
    """Whether ``folder``'s filesystem has (almost) nothing left: a write that failed with
    no file name (a write to an open file) most likely failed there."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(64 << 20, st.f_blocks * st.f_frsize // 100)
