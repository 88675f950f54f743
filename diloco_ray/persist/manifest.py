"""A checkpoint's ``manifest.json``: its text, reading it within bounds, and checking files against it.

The manifest is what makes a folder (or a bucket prefix) a checkpoint: it lists every file
with its SHA-256 and is written last. This module owns its format and what it vouches for,
and nothing about where checkpoints live or which one to resume from
(:mod:`diloco_ray.persist.checkpoint`, :mod:`diloco_ray.persist.cloud_checkpoint`):

* :func:`open_manifest` reads one, refusing a file too big to be a manifest;
  :func:`table_problem` refuses a file table that is not relative paths inside the folder,
  before anything it names is read or downloaded;
* :func:`first_bad_file` re-hashes listed files;
* :func:`check_read` is the check an actor runs on the files it is about to load: the
  driver verified the checkpoint once, but a shared folder or a bucket can change between
  that check and an actor's read on another node.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Mapping

from diloco_ray.errors import DataError
from diloco_ray.persist.state_files import FORMAT, _read_json, sha256_file

MANIFEST = "manifest.json"
# A manifest is one JSON line per file (~100 bytes: a path and a 64-digit hash); a
# checkpoint holds four files per server and two per replica rank, so even 10,000 ranks
# make under 2 MiB. Anything bigger is not a manifest, and is not read into memory.
MANIFEST_MAX_BYTES = 16 << 20


def manifest_text(round: int, meta: dict, files: Mapping[str, str]) -> str:
    """The ``manifest.json`` of a checkpoint of ``round``: ``meta`` and the SHA-256 of
    every file (relative path with ``/`` -> hex digest)."""
    return json.dumps(
        {"format": FORMAT, "round": round, "meta": meta, "files": dict(sorted(files.items()))},
        allow_nan=False,
        indent=1,
    )


def read_manifest(path: str) -> dict:
    """The parsed ``manifest.json`` of the checkpoint folder ``path``.

    Args:
        path: a checkpoint folder (or its ``manifest.json``).

    Raises:
        DataError: no manifest, or it is not a JSON object.
    """
    file = path if os.path.basename(path) == MANIFEST else os.path.join(path, MANIFEST)
    doc = _read_json(file, what="checkpoint manifest")
    if not isinstance(doc, dict):
        raise DataError(f"checkpoint manifest {file!r} is not a JSON object")
    return doc


def open_manifest(path: str) -> tuple[dict, None] | tuple[None, str]:
    """``(manifest, None)`` when the folder holds a readable manifest of our format, else
    ``(None, why not)``."""
    if not os.path.isdir(path):
        return None, "not a folder"
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        return None, f"no {MANIFEST} (incomplete checkpoint)"
    try:
        size = os.path.getsize(file)
        if size > MANIFEST_MAX_BYTES:
            return None, f"{MANIFEST} holds {size:,} bytes, more than a manifest may ({MANIFEST_MAX_BYTES:,})"
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{MANIFEST} cannot be read: {exc}"
    except json.JSONDecodeError as exc:
        return None, f"{MANIFEST} is not valid JSON ({exc.msg} at line {exc.lineno})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        return None, f"{MANIFEST} has unsupported format {got!r} (expected {FORMAT})"
    return manifest, None


def table_problem(manifest: dict) -> str | None:
    """Why the manifest's ``files`` table cannot be trusted before a byte of the files is
    read, or None: it must map relative paths inside the folder (no absolute path, no
    ``..``) to digests, and list at least one file."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return f"{MANIFEST} has no valid 'files' table"
    if not files:
        return f"{MANIFEST} lists no files (a checkpoint lists every file it holds)"
    for rel in files:
        parts = rel.split("/")
        if not rel or os.path.isabs(rel) or "\\" in rel or any(p in ("", ".", "..") for p in parts):
            return f"{MANIFEST} lists an unsafe path {rel!r} (expected a relative path inside the checkpoint)"
    return None


def first_bad_file(path: str, files: Mapping[str, str]) -> str | None:
    """The first of ``files`` (paths checked by :func:`table_problem`) that is missing,
    unreadable or not its SHA-256 in the folder ``path``, or None."""
    for rel, digest in files.items():
        full = os.path.join(path, *rel.split("/"))
        if not os.path.isfile(full):
            return f"missing file {rel!r}"
        try:
            actual = sha256_file(full)
        except OSError as exc:
            return f"cannot read {rel!r}: {exc}"
        if actual != digest:
            return f"checksum mismatch for {rel!r}"
    return None


def check_read(folder: str, names: Iterable[str], where: str) -> None:
    """Re-check files of the checkpoint in ``folder`` against its manifest right before
    they are loaded: each of ``names`` the manifest lists must hash to its digest, and one
    it does not list must not be there (an absent one is the caller's "no such state" to
    handle). Loading follows at once; the window left is this hashing, not the time since
    the driver verified the checkpoint.

    Args:
        folder: the local checkpoint folder, or a bucket checkpoint's staging copy.
        names: ``/``-separated paths relative to ``folder``.
        where: the checkpoint as the run names it (its folder or URI), for the message.

    Raises:
        DataError: one line naming the checkpoint and the file.
    """
    manifest, reason = open_manifest(folder)
    reason = reason or table_problem(manifest)
    if reason is None:
        files = manifest["files"]
        names = list(names)
        unlisted = [n for n in names if n not in files and os.path.lexists(os.path.join(folder, *n.split("/")))]
        if unlisted:
            reason = f"{unlisted[0]!r} is not listed in its {MANIFEST}"
        else:
            reason = first_bad_file(folder, {n: files[n] for n in names if n in files})
    if reason is not None:
        raise DataError(f"checkpoint {where}: {reason}; refused as it was about to be loaded")
