"""Checkpoints on disk: their format, their integrity, and which one to resume from.

This module owns the bytes of a checkpoint and nothing above them. A checkpoint is a
folder ``root/round-{round:08d}`` (``round`` = outer rounds applied when it was saved,
i.e. the index of the next round to run) holding any number of *states* written with
:func:`~diloco_ray.persist.state_files.save_state` plus a ``manifest.json`` that lists every file with its SHA-256.

* Nothing is ever unpickled: a state is safetensors plus a JSON skeleton
  (:mod:`diloco_ray.persist.state_files`).
* Writes are atomic at the folder level: :func:`begin` makes a hidden temp folder
  ``root/.tmp-round-XXXXXXXX-*``; :func:`commit` writes the manifest *last*, fsyncs,
  and renames the folder into place. A crash at any point leaves either the previous
  checkpoints untouched or a temp folder that is never listed and that :func:`prune`
  removes later.
* :func:`verify` re-hashes every listed file (the manifest itself, and checking files
  against it, are :mod:`diloco_ray.persist.manifest`'s); :func:`latest_valid`,
  :func:`resolve_resume` and :func:`prune` only ever trust checkpoints that verify.

It knows nothing about Ray or the trainer: callers decide what states to save and what
``meta`` to put in the manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

from diloco_ray.errors import ConfigError, DataError
from diloco_ray.persist.manifest import (
    MANIFEST,
    first_bad_file,
    manifest_text,
    open_manifest,
    read_manifest,
    table_problem,
)
from diloco_ray.persist.state_files import FORMAT, _fsync_dir, _fsync_file, sha256_file

__all__ = [
    "FORMAT",
    "MANIFEST",
    "begin",
    "commit",
    "first_valid",
    "latest_valid",
    "list_checkpoints",
    "manifest_text",
    "prune",
    "read_manifest",
    "resolve_resume",
    "verify",
]

_TMP_PREFIX = ".tmp-"
# The one name of a round's folder (checkpoints, bucket checkpoints, in-flight snapshots).
ROUND_FOLDER = re.compile(r"^round-(\d+)$")


# ------------------------------------------------------------- checkpoint folders


def round_folder_name(round: int) -> str:
    """``round-XXXXXXXX``: the folder of round ``round``'s checkpoint (or snapshots)."""
    return f"round-{round:08d}"


def _check_round(round: int) -> int:
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"checkpoint round must be an int >= 0, got {round!r}")
    return round


def round_of_folder(path: str) -> int | None:
    """The round in a final folder's name, or None if it is not named ``round-N``."""
    m = ROUND_FOLDER.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def begin(root: str, round: int) -> str:
    """Start writing the checkpoint for ``round``: a fresh temp folder under ``root``.

    Args:
        root: the checkpoints folder (created if missing).
        round: outer rounds applied so far (the index of the next round to run).

    Returns:
        The temp folder's path; write states into it, then :func:`commit` it.
    """
    _check_round(round)
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{round_folder_name(round)}-", dir=root)


def commit(tmp: str, root: str, round: int, meta: dict) -> str:
    """Seal the temp folder from :func:`begin` and move it into place as ``root/round-XXXXXXXX``.

    Args:
        tmp: the temp folder, with every state already written into it.
        root: the checkpoints folder ``tmp`` lives in (the rename must not cross filesystems).
        round: the round given to :func:`begin`.
        meta: JSON-serialisable (finite floats only) caller data stored in the manifest.

    Returns:
        The final checkpoint folder. A folder of the same round that already exists (a
        rerun of that round after a crash or a resume) is replaced.

    Raises:
        ValueError: bad round, ``tmp`` is not a folder, or ``meta`` is not JSON-serialisable.
    """
    _check_round(round)
    if not os.path.isdir(tmp):
        raise ValueError(f"checkpoint temp folder {tmp!r} does not exist")
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta must be JSON-serialisable with finite floats: {exc}") from exc
    files, dirs = _sync_and_hash(tmp)
    # The manifest goes last: its presence is what marks the file set as complete.
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
        f.write(manifest_text(round, meta, files))
        f.flush()
        os.fsync(f.fileno())
    for d in dirs:
        _fsync_dir(d)
    return _move_into_place(tmp, root, round)


def _sync_and_hash(tmp: str) -> tuple[dict[str, str], list[str]]:
    """``(manifest path -> SHA-256 of each file under tmp, every folder from tmp down)``,
    each file fsynced first (a stale manifest is left out: the commit rewrites it)."""
    files: dict[str, str] = {}
    dirs = [tmp]
    for dirpath, dirnames, filenames in os.walk(tmp):
        dirnames.sort()
        dirs.extend(os.path.join(dirpath, d) for d in dirnames)
        for fn in sorted(filenames):
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, tmp).replace(os.sep, "/")
            if rel == MANIFEST:
                continue  # a stale manifest from an interrupted commit is rewritten
            _fsync_file(full)
            files[rel] = sha256_file(full)
    return files, dirs


def _move_into_place(tmp: str, root: str, round: int) -> str:
    """Rename the sealed ``tmp`` to ``root/round-XXXXXXXX``, replacing one already there."""
    final = os.path.join(root, round_folder_name(round))
    old = None
    if os.path.exists(final):
        # Move the old one aside under a temp name rather than deleting it first: if we
        # crash between the two renames, prune() still finds and removes it.
        old = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}old-{round_folder_name(round)}-", dir=root)
        os.rmdir(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: str) -> str | None:
    """Check that the checkpoint at ``path`` is complete and intact.

    Args:
        path: a checkpoint folder.

    Returns:
        None when it is, else a one-line reason: missing folder or manifest, a manifest
        that is not valid JSON or not format 1, a listed file that is missing, or the
        first file whose SHA-256 differs (``checksum mismatch for 'global.safetensors'``).
        Every file of the checkpoint must be listed: a manifest that lists none, or a
        file in the folder that the manifest does not list, fails too (a manifest is
        the commit of exactly the files it names).
    """
    manifest, reason = open_manifest(path)
    if reason is None:
        reason = table_problem(manifest) or _listing_problem(path, manifest)
    if reason is None:
        reason = first_bad_file(path, manifest["files"])
    return reason


def _listing_problem(path: str, manifest: dict) -> str | None:
    """Why the manifest's file table (checked by :func:`table_problem`) does not describe
    the folder, or None: it must list every file the folder holds, and the round in its name."""
    files = manifest["files"]
    unlisted = sorted(set(_files_under(path)) - set(files) - {MANIFEST})
    if unlisted:
        return f"{unlisted[0]!r} is in the checkpoint but not listed in its {MANIFEST}"
    named = round_of_folder(path)
    if named is not None and manifest.get("round") != named:
        return f"{MANIFEST} says round {manifest.get('round')!r} but the folder is round {named}"
    return None


def _files_under(path: str) -> list[str]:
    """Every file below ``path``, as manifest paths (``/``-separated, relative)."""
    return [
        os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/") for d, _, names in os.walk(path) for f in names
    ]


def list_checkpoints(root: str) -> list[str]:
    """Final checkpoint folders (``root/round-N``, never temp folders), oldest round first.

    Args:
        root: the checkpoints folder; a missing one has no checkpoints.

    Returns:
        Paths (``root`` joined with the folder name), valid or not: see :func:`verify`.
    """
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        m = ROUND_FOLDER.match(entry)
        full = os.path.join(root, entry)
        if m and os.path.isdir(full):
            found.append((int(m.group(1)), full))
    return [p for _, p in sorted(found)]


def latest_valid(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under ``root`` that verifies.

    Args:
        root: the checkpoints folder.

    Returns:
        ``(path or None, skipped)`` where ``skipped`` lists ``(path, reason)`` for each
        newer checkpoint that failed :func:`verify`, newest first (all of them when
        nothing verifies).
    """
    return first_valid(reversed(list_checkpoints(root)))


def first_valid(candidates, check=None) -> tuple[str | None, list[tuple[str, str]]]:
    """The first of ``candidates`` that ``check`` (default :func:`verify`; any function
    returning None or a reason) passes, with ``(candidate, reason)`` for each one before
    it that failed; ``(None, all of them)`` when none passes."""
    check = check or verify
    skipped: list[tuple[str, str]] = []
    for path in candidates:
        reason = check(path)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def prune(root: str, keep: int | None) -> list[str]:
    """Delete old checkpoints and stale temp folders under ``root``.

    Call it only when no :func:`begin`/:func:`commit` is in flight under ``root``:
    every ``.tmp-*`` folder is taken to be left over from a crash.

    Args:
        root: the checkpoints folder.
        keep: how many valid checkpoints to keep, newest first (>= 1); every other
            checkpoint, valid or not, is deleted. None keeps all checkpoints (only temp
            folders go). The newest valid checkpoint is never deleted.

    Returns:
        The deleted paths.
    """
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    if not os.path.isdir(root):
        return []
    deleted: list[str] = []
    for entry in sorted(os.listdir(root)):
        full = os.path.join(root, entry)
        if entry.startswith(_TMP_PREFIX) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
            deleted.append(full)
    if keep is None:
        return deleted
    kept = 0
    # Newest first, verifying only until `keep` valid ones are found: everything older
    # goes regardless, so there is no point hashing it.
    for path in reversed(list_checkpoints(root)):
        if kept < keep and verify(path) is None:
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def resolve_resume(resume_from: str) -> tuple[str, list[tuple[str, str]]]:
    """Turn a ``resume_from`` setting into the checkpoint folder to load.

    Args:
        resume_from: one of
            * a checkpoint folder (holds ``manifest.json`` or is named ``round-N``): that
              one, or if it does not verify, the newest valid one older than it beside it;
            * a run's ``output_dir`` (holds ``checkpoints/``): its newest valid checkpoint;
            * a checkpoints folder (holds ``round-N`` folders): its newest valid one.

    Returns:
        ``(absolute checkpoint path, skipped)`` with ``skipped`` the ``(path, reason)``
        of each checkpoint passed over because it failed :func:`verify`, newest first.

    Raises:
        ConfigError: the path does not exist, holds no checkpoints, or none verifies;
            the message names ``resume_from``, the folder searched and the reasons.
    """
    if not os.path.exists(resume_from):
        raise ConfigError(f"resume_from: {resume_from!r} does not exist")
    if not os.path.isdir(resume_from):
        raise ConfigError(
            f"resume_from: {resume_from!r} is not a folder (expected a checkpoint "
            "folder, a checkpoints folder or a run's output_dir)"
        )
    path = os.path.abspath(resume_from)
    if os.path.isfile(os.path.join(path, MANIFEST)) or round_of_folder(path) is not None:
        return _resume_checkpoint(resume_from, path)
    return _resume_newest(resume_from, path)


def _resume_checkpoint(resume_from: str, path: str) -> tuple[str, list[tuple[str, str]]]:
    """:func:`resolve_resume` of a checkpoint folder: it, or the newest valid one older
    than it beside it."""
    reason = verify(path)
    if reason is None:
        return path, []
    skipped = [(path, reason)]
    root = os.path.dirname(path)
    mine = _round_of_checkpoint(path)
    older = [p for p in list_checkpoints(root) if mine is not None and round_of_folder(p) < mine]
    found, failed = first_valid(reversed(older))
    skipped += failed
    if found is not None:
        return found, skipped
    where = f" or in an older checkpoint beside it in {root!r}" if mine is not None else ""
    raise ConfigError(f"resume_from: {resume_from!r} holds no valid checkpoint{where} ({_reasons(skipped)})")


def _round_of_checkpoint(path: str) -> int | None:
    """The round in a checkpoint folder's name or, not named round-N, in its manifest if
    that is readable."""
    named = round_of_folder(path)
    if named is not None:
        return named
    try:
        return int(read_manifest(path).get("round"))
    except (DataError, TypeError, ValueError):
        return None


def _resume_newest(resume_from: str, path: str) -> tuple[str, list[tuple[str, str]]]:
    """:func:`resolve_resume` of a run's output_dir or a checkpoints folder: the newest
    valid checkpoint in it."""
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    if not list_checkpoints(root):
        raise ConfigError(
            f"resume_from: {resume_from!r} holds no checkpoints (no round-XXXXXXXX folders "
            f"in {root!r}; expected a checkpoint folder, a checkpoints folder or a run's "
            "output_dir)"
        )
    found, skipped = latest_valid(root)
    if found is None:
        raise ConfigError(f"resume_from: {resume_from!r} holds no valid checkpoint in {root!r} ({_reasons(skipped)})")
    return found, skipped


def _reasons(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped)
