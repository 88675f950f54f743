"""How an actor writes or reads files of a folder that may live in a bucket.

Actors (the parameter server, rank 0 of a replica) are handed a *folder*: a local path,
or an ``s3://``/``gs://`` URI. They never branch on which: they write into
:func:`scratch` (the folder itself, or its node-local staging copy), then
:func:`publish` what they wrote (nothing to do locally; upload, hash and free the disk
for a URI); to read a checkpoint, they :func:`read_checked` the files they need first
(downloaded when in a bucket, and checked against its manifest either way). The staging copy
of a URI is the same path on every node (:func:`storage.staging_root`, inside the user's
private staging base), so no actor needs to know where another one runs.
"""

from __future__ import annotations

import os
import shutil

from diloco_ray.persist import storage


def scratch(folder: str) -> str:
    """The local folder to write ``folder``'s files into: ``folder`` itself (as it is),
    or a URI's staging copy (created)."""
    if not storage.is_remote(folder):
        return folder
    local = storage.Mirror(folder).local
    os.makedirs(local, exist_ok=True)
    return local


def publish(folder: str, names: list[str]) -> dict[str, str]:
    """Make the files ``names`` (relative to ``folder``, ``/``-separated) written into
    :func:`scratch` available at ``folder``.

    Returns:
        ``{name: sha256}`` for a URI (the checkpoint manifest's entries, hashed before
        the upload so the manifest vouches for what left this node), ``{}`` for a local
        folder (its checkpoint commit hashes the files itself).
    """
    if not storage.is_remote(folder):
        return {}
    from diloco_ray.persist.checkpoint import sha256_file

    mirror = storage.Mirror(folder)
    paths = [os.path.join(mirror.local, *name.split("/")) for name in names]
    hashes = {name: sha256_file(path) for name, path in zip(names, paths)}
    mirror.upload_files(paths)
    for path in paths:
        os.remove(path)  # uploaded: a node's disk should not fill with every checkpoint
    return hashes


def publish_tree(folder: str) -> None:
    """Upload everything written into :func:`scratch` of ``folder`` (a model folder),
    then free the local copy. No-op for a local folder."""
    if storage.is_remote(folder):
        mirror = storage.Mirror(folder)
        mirror.upload(mirror.local)
        shutil.rmtree(mirror.local, ignore_errors=True)


def read_checked(folder: str, names: list[str]) -> str:
    """The local folder holding ``names`` of checkpoint ``folder``, each re-checked against
    the checkpoint's manifest right before the caller loads it: the folder itself, or a
    bucket's staging copy after downloading them (:func:`cloud_checkpoint.fetch`: only what
    the manifest lists, at its listed size). The driver verified the checkpoint, but on
    another node and maybe minutes ago; a shared folder or a bucket may have changed since.
    A name the checkpoint does not hold stays missing, so the caller's own "no such file"
    handling applies.

    Raises:
        DataError: one line naming the checkpoint and the file that does not match.
    """
    from diloco_ray.errors import DataError
    from diloco_ray.persist import cloud_checkpoint, manifest

    local = folder
    if storage.is_remote(folder):
        local, reason = cloud_checkpoint.fetch(folder, names)
        if reason is not None:
            raise DataError(f"checkpoint {storage.redact(folder)}: {reason}; refused as it was about to be loaded")
    manifest.check_read(local, names, storage.redact(folder))
    return local
