"""Checkpoints in a bucket (``s3://``, ``gs://``): the format of :mod:`checkpoint`, without rename.

Object stores cannot rename a folder, so the local recipe (write a temp folder, rename it
into place) becomes: delete the round's old manifest, let every writer upload its files
straight to ``root/round-N/`` (:func:`storage.publish`), then upload the manifest last.
A folder without a manifest is incomplete and never trusted, exactly as on disk; the
manifest lists the SHA-256 the writers computed before uploading.

Verifying a remote checkpoint means hashing its bytes, so :func:`verify` downloads it
into the node-local staging copy first (once per resume or server restart, not per
round). Everything here takes and returns URIs; the actors that load a checkpoint fetch
their own files (:func:`storage.localize`).
"""

from __future__ import annotations

import shutil

from diloco_ray.errors import ConfigError
from diloco_ray.persist import checkpoint, storage

MANIFEST = checkpoint.MANIFEST


def _join(uri: str, name: str) -> str:
    return f"{uri.rstrip('/')}/{name}"


def round_of(uri: str):
    """The round in a ``.../round-N`` URI, else None."""
    return checkpoint.round_of_folder(uri.rstrip("/"))


def list_checkpoints(root: str) -> list[str]:
    """URIs of the ``round-N`` folders under ``root``, oldest round first (valid or not)."""
    mirror = storage.Mirror(root)
    names = [n for n in mirror.listdir(mirror.local) if checkpoint.ROUND_FOLDER.match(n)]
    return [_join(root, n) for n in sorted(names, key=lambda n: int(n.split("-")[1]))]


def fetch(uri: str) -> str:
    """Download the checkpoint folder ``uri`` into a fresh staging copy; its local path."""
    mirror = storage.Mirror(uri)
    shutil.rmtree(mirror.local, ignore_errors=True)
    mirror.download(mirror.local)
    return mirror.local


def verify(uri: str) -> str | None:
    """None when the checkpoint at ``uri`` is complete and intact, else a one-line reason
    (see :func:`checkpoint.verify`); downloads it to check the hashes."""
    mirror = storage.Mirror(uri)
    if not mirror.exists(MANIFEST):
        return f"no {MANIFEST} (incomplete checkpoint)"
    local = fetch(uri)
    reason = checkpoint.verify(local)
    if reason is None and round_of(uri) is not None:
        # The staging folder is not named round-N, so check the name here.
        said = checkpoint.read_manifest(local).get("round")
        if said != round_of(uri):
            return f"{MANIFEST} says round {said!r} but the folder is round {round_of(uri)}"
    return reason


def latest_valid(root: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under ``root`` that verifies, and ``(uri, reason)`` for each
    newer one passed over (see :func:`checkpoint.latest_valid`)."""
    return checkpoint.first_valid(reversed(list_checkpoints(root)), verify)


def resolve_resume(resume_from: str) -> tuple[str, list[tuple[str, str]]]:
    """A ``resume_from`` URI -> the checkpoint URI to load, as
    :func:`checkpoint.resolve_resume` does for folders: a ``round-N`` URI (or an older
    valid one beside it), or a run's ``output_dir`` / a checkpoints folder (its newest
    valid one)."""
    storage.check_uri("resume_from", resume_from)
    resume_from = resume_from.rstrip("/")
    mine = round_of(resume_from)
    if mine is not None or storage.Mirror(resume_from).exists(MANIFEST):
        parent = resume_from.rsplit("/", 1)[0]
        candidates = [resume_from] + [
            u for u in reversed(list_checkpoints(parent)) if mine is not None and round_of(u) < mine
        ]
    else:
        nested = _join(resume_from, "checkpoints")
        root = nested if list_checkpoints(nested) else resume_from
        candidates = list(reversed(list_checkpoints(root)))
        if not candidates:
            raise ConfigError(
                f"resume_from: {resume_from!r} holds no checkpoints (no round-XXXXXXXX folders; "
                "expected a checkpoint folder, a checkpoints folder or a run's output_dir)"
            )
    found, skipped = checkpoint.first_valid(candidates, verify)
    if found is not None:
        return found, skipped
    raise ConfigError(
        f"resume_from: {resume_from!r} holds no valid checkpoint ("
        + "; ".join(f"{u.rsplit('/', 1)[-1]}: {r}" for u, r in skipped)
        + ")"
    )


def begin(root: str, round: int) -> str:
    """The URI the checkpoint of ``round`` is written to. A manifest left there by an
    earlier write of the same round is deleted first, so it cannot vouch for a mix of
    old and new files if this write is cut short."""
    uri = _join(root, checkpoint.round_folder_name(round))
    storage.Mirror(uri).delete(MANIFEST)
    return uri


def commit(uri: str, round: int, meta: dict, files: dict[str, str]) -> str:
    """Seal the checkpoint at ``uri``: upload its manifest (``files``: relative path ->
    SHA-256, as the writers reported them) after every file is in place."""
    storage.Mirror(uri).write_bytes(MANIFEST, checkpoint.manifest_text(round, meta, files).encode())
    return uri


def prune(root: str, keep: int | None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (complete:
    the manifest is there; hashing every one would download it). Returns the URIs gone."""
    if keep is None:
        return []
    deleted, kept = [], 0
    for uri in reversed(list_checkpoints(root)):
        mirror = storage.Mirror(uri)
        if kept < keep and mirror.exists(MANIFEST):
            kept += 1
            continue
        mirror.delete(mirror.local)
        deleted.append(uri)
    return deleted
