"""A run's ``output_dir`` as the driver sees it: a local folder, or a bucket.

With a local ``output_dir`` (shared storage on a cluster) everything is written in place.
With ``s3://`` or ``gs://``, the driver writes its own files (``config.yaml``,
``metrics.jsonl``, TensorBoard/W&B logs) into a node-local staging copy and uploads them
after every round; checkpoints and ``final/`` go straight to the bucket from the actors
that write them (see :mod:`cloud_checkpoint` and :func:`storage.publish`). This class is
the one place that knows which of the two it is: the trainer asks it where things go.
The lock and a scale request are written through :mod:`diloco_ray.files`, so a link
planted in a shared ``output_dir`` is refused or replaced, never written through.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from diloco_ray import files
from diloco_ray.config.sections import CheckpointSection, ModelSection, PeftSection
from diloco_ray.errors import ConfigError
from diloco_ray.persist import checkpoint, cloud_checkpoint, storage

SCALE_REQUEST_FILE = "scale_request.json"
LOCK_FILE = ".diloco-ray.lock"
# What a run writes into output_dir: overwrite_output_dir removes exactly these (never the
# whole folder, which may hold the user's own files).
RUN_OUTPUTS = (
    "checkpoints",
    "final",
    "final_merged",
    "logs",
    "metrics.jsonl",
    "config.yaml",
    SCALE_REQUEST_FILE,
    "report.png",
)
DRIVER_FILES = ("config.yaml", "metrics.jsonl")


class RunFolder:
    """Where a run's outputs go.

    Args:
        checkpointing: the job's checkpointing section; its ``output_dir`` is a folder or an
            ``s3://``/``gs://`` URI (``overwrite_output_dir`` and ``resume_from`` decide
            what :meth:`prepare` clears).
        log_dir: the job's ``log_dir`` (None: ``logs/`` in the run folder), which
            :meth:`publish` uploads when it lies inside the run folder.
    """

    def __init__(self, checkpointing: CheckpointSection, log_dir: Optional[str]):
        self.checkpointing, self.log_dir = checkpointing, log_dir
        self.mirror = storage.for_output_dir(checkpointing.output_dir)
        # The folder the driver writes into: the run's own, or the bucket's staging copy.
        self.local = self.mirror.local if self.mirror else checkpointing.output_dir
        self.checkpoints = self.path("checkpoints")  # a folder, or a URI in a bucket
        self.inflight = os.path.join(self.local, "checkpoints", "inflight")

    def lock(self) -> None:
        """Take the run folder for this process, before Ray starts and before anything
        in it is changed: a second ``diloco-ray train`` on the same output_dir is refused.

        An exclusive ``flock`` on ``LOCK_FILE``: the kernel releases it when the process
        exits, however it exits, so a crashed run leaves no stale lock. With a bucket the
        lock is on the node-local staging folder, so it keeps out a second run on the same
        machine only (a bucket has no lock to take).
        """
        import fcntl
        import socket

        os.makedirs(self.local, exist_ok=True)
        # Never through a link planted at the name: one line naming it instead (exit 2).
        handle = files.open_lock(os.path.join(self.local, LOCK_FILE))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ConfigError(in_use_message(self.checkpointing.output_dir, holder)) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        self._lock = handle

    def unlock(self) -> None:
        """Release :meth:`lock` (also released by the kernel when the process ends)."""
        handle, self._lock = getattr(self, "_lock", None), None
        if handle is not None:
            handle.close()

    @property
    def remote(self) -> bool:
        return self.mirror is not None

    @property
    def name(self) -> str:
        """The run's name for trackers and Ray metrics: ``output_dir``'s last component."""
        out = self.checkpointing.output_dir
        return os.path.basename(out.rstrip("/") if self.remote else os.path.abspath(out)) or "diloco"

    def path(self, name: str) -> str:
        """Where ``name`` (e.g. ``final``) lives: an absolute folder, or a URI."""
        if self.mirror:
            return f"{self.checkpointing.output_dir.rstrip('/')}/{name}"
        return os.path.abspath(os.path.join(self.local, name))

    # ---- the driver's own files --------------------------------------------------------
    def prepare(self, resuming: bool) -> None:
        """Create the local folder. A resumed run in a bucket continues its
        ``metrics.jsonl``; a new run (preflight refused a folder holding one, unless
        ``overwrite_output_dir``) starts a fresh one."""
        os.makedirs(self.local, exist_ok=True)
        metrics = os.path.join(self.local, "metrics.jsonl")
        if self.checkpointing.overwrite_output_dir and not (resuming and resumes_own_run(self.checkpointing)):
            self.clear_previous_run()
        if self.mirror and resuming:
            self.mirror.download(metrics)
        elif not resuming and os.path.exists(metrics) and self.mirror:
            # A bucket's staging copy may hold an older run's file; a new run starts afresh.
            os.remove(metrics)

    def clear_previous_run(self) -> list[str]:
        """Remove what an earlier run left (``RUN_OUTPUTS``), so that nothing of it (a
        checkpoint above all, which a later resume would pick up) outlives the overwrite.
        Returns the names removed."""
        import shutil

        removed = []
        for name in RUN_OUTPUTS:
            path = os.path.join(self.local, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
                removed.append(name)
            elif os.path.lexists(path):
                os.remove(path)
                removed.append(name)
            if self.mirror:
                self.mirror.delete(path)
        return removed

    def publish(self) -> None:
        """Upload the driver's files and logs to the bucket (no-op for a local folder)."""
        if not self.mirror:
            return
        self.mirror.upload_files(
            [os.path.join(self.local, f) for f in DRIVER_FILES if os.path.exists(os.path.join(self.local, f))]
        )
        logs = self.log_dir or os.path.join(self.local, "logs")
        if os.path.isdir(logs) and os.path.abspath(logs).startswith(os.path.abspath(self.local) + os.sep):
            self.mirror.upload(logs)

    # ---- checkpoints ------------------------------------------------------------------
    def begin_checkpoint(self, round: int) -> str:
        """The folder (or URI) writers put the checkpoint of ``round`` into."""
        if self.mirror:
            return cloud_checkpoint.begin(self.checkpoints, round)
        return checkpoint.begin(self.checkpoints, round)

    def commit_checkpoint(self, where: str, round: int, meta: dict, files: dict) -> str:
        """Seal it: the manifest last. ``files`` are the writers' hashes (used in a
        bucket; on disk the files are hashed here)."""
        if self.mirror:
            return cloud_checkpoint.commit(where, round, meta, files)
        return checkpoint.commit(where, self.checkpoints, round, meta)

    def prune(self, keep: Optional[int]) -> list[str]:
        if self.mirror:
            return cloud_checkpoint.prune(self.checkpoints, keep)
        return checkpoint.prune(self.checkpoints, keep)

    def discard_partial_writes(self) -> list[str]:
        """Remove what a run that stopped on a failed write (a full disk) was writing and
        nothing will ever read: temp checkpoint folders and ``final/``'s temp copy, so the
        space comes back. Call it only once nothing writes any more. Returns what went."""
        import shutil

        removed = self.prune(None)
        for name in ("final", "final_merged"):  # their temp folders: see files.replace_folder
            for path in files.leftovers(self.local, name):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    def latest_valid(self) -> tuple[Optional[str], list]:
        if self.mirror:
            return cloud_checkpoint.latest_valid(self.checkpoints)
        return checkpoint.latest_valid(self.checkpoints)

    # ---- scale requests from another process ------------------------------------------
    def read_scale_request(self, newer_than: float) -> Optional[tuple[float, int]]:
        """``(mtime, target)`` of a scale request newer than ``newer_than``, else None."""
        try:
            if self.mirror:
                mtime = self.mirror.mtime(SCALE_REQUEST_FILE)
                if mtime is None or mtime <= newer_than:
                    return None
                doc = json.loads(self.mirror.read_bytes(SCALE_REQUEST_FILE) or b"{}")
            else:
                path = os.path.join(self.local, SCALE_REQUEST_FILE)
                mtime = os.path.getmtime(path)
                if mtime <= newer_than:
                    return None
                with open(path) as f:
                    doc = json.load(f)
            return mtime, int(doc["target"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def resolve_resume(
    resume_from: str,
    checkpointing: Optional[CheckpointSection] = None,
    model: Optional[ModelSection] = None,
    peft: Optional[PeftSection] = None,
) -> tuple[str, list]:
    """The checkpoint to resume from (a folder or a URI) and the ones passed over.

    With the job's ``checkpointing`` section, a local checkpoint is also checked against the
    settings it must be resumed with (:func:`server_state.read_meta`), and with its ``model``
    and ``peft`` sections against the model it holds (:func:`server_state.check_model`), so
    a mismatch fails before Ray starts and before anything in output_dir changes (a
    bucket's is checked as the servers load).
    """
    storage.check_uri("resume_from", resume_from)  # "http://..." is a bad URI, not a missing folder
    if storage.is_remote(resume_from):
        return cloud_checkpoint.resolve_resume(resume_from)
    found = checkpoint.resolve_resume(resume_from)
    if checkpointing is not None:
        from diloco_ray.persist import server_state

        meta = server_state.read_meta(found[0], checkpointing)
        if model is not None:
            server_state.check_model(found[0], meta, model, peft)
    return found


def request_scale(output_dir: str, target: int) -> str:
    """Ask the driver of the run in ``output_dir`` (another process, maybe another
    machine when the run is in a bucket) to scale to ``target`` replicas at its next
    round boundary. Returns where the request was written."""
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ConfigError(
            f"replicas: {target!r} is not allowed; give a whole number >= 1 "
            "(the driver clamps it to [min_replicas, max_replicas])"
        )
    storage.check_uri("output_dir", output_dir)  # "ftp://..." is a bad URI, not a missing folder
    doc = json.dumps({"target": int(target), "time": time.time()}).encode()
    mirror = storage.for_output_dir(output_dir)
    if mirror:
        if not mirror.exists("metrics.jsonl"):
            raise ConfigError(f"output_dir: '{output_dir}' holds no run to scale")
        mirror.write_bytes(SCALE_REQUEST_FILE, doc)
        return mirror.remote(SCALE_REQUEST_FILE)
    _check_running(output_dir)
    path = os.path.join(output_dir, SCALE_REQUEST_FILE)
    files.write_atomic(path, doc)  # a failed write (a full disk) leaves nothing behind
    return path


def _check_running(output_dir: str) -> None:
    """That the local folder ``output_dir`` holds a run a scale request can reach: a
    ConfigError naming output_dir when it does not exist, holds no run, or holds a
    finished one (``final/`` written and no driver holding :data:`LOCK_FILE`)."""
    if not os.path.isdir(output_dir):
        what = "is not a folder" if os.path.exists(output_dir) else "does not exist"
        raise ConfigError(
            f"output_dir: '{output_dir}' {what}: it holds no run to scale; give a running run's output_dir"
        )
    if not os.path.isfile(os.path.join(output_dir, "metrics.jsonl")):
        raise ConfigError(f"output_dir: '{output_dir}' holds no run to scale (no metrics.jsonl)")
    if os.path.isdir(os.path.join(output_dir, "final")) and lock_holder(output_dir) is None:
        raise ConfigError(
            f"output_dir: '{output_dir}' holds a finished run (final/ is written and no diloco-ray train "
            "holds the folder); scale a running run, or set num_replicas when you resume this one"
        )


def in_use_message(output_dir: str, holder: str) -> str:
    """The refusal of a second run on a folder another driver holds."""
    return (
        f"output_dir: '{output_dir}' is in use by another diloco-ray run ({holder}); "
        "wait for it to end, or choose another output_dir"
    )


def lock_holder(output_dir: str) -> Optional[str]:
    """Who holds the local folder ``output_dir`` (``"pid N on host"``, as :meth:`RunFolder.lock`
    wrote it), or None when no driver does. Opened read-only: asking creates and changes
    nothing, so a refused second run leaves the folder as it found it; a link planted at
    the lock's name is a ConfigError naming it, never read through."""
    import fcntl

    try:
        handle = files.open_lock(os.path.join(output_dir, LOCK_FILE), create=False)
    except OSError:
        return None  # no lock file: no driver ever held this folder here
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return handle.read().strip() or "another process"
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None


def resumes_own_run(checkpointing: CheckpointSection) -> bool:
    """Whether ``resume_from`` points into ``output_dir`` (the run itself, its
    checkpoints folder or one of its checkpoints): the normal resume of a run."""
    out, src = checkpointing.output_dir.rstrip("/"), (checkpointing.resume_from or "").rstrip("/")
    if not storage.is_remote(out) and not storage.is_remote(src):
        out, src = os.path.realpath(out), os.path.realpath(src)
        return src == out or src.startswith(out + os.sep)
    return src == out or src.startswith(out + "/")
