"""Checkpoints in a bucket (``s3://``, ``gs://``): the format of :mod:`checkpoint`, without rename.

Object stores cannot rename a folder, so the local recipe (write a temp folder, rename it
into place) becomes: delete the round's old manifest, let every writer upload its files
straight to ``root/round-N/`` (:func:`storage.publish`), then upload the manifest last.
A folder without a manifest is incomplete and never trusted, exactly as on disk; the
manifest lists the SHA-256 the writers computed before uploading.

Verifying a remote checkpoint means hashing its bytes, so :func:`verify` downloads it
into the node-local staging copy first (once per resume or server restart, not per
round), bounded by :func:`fetch`: the listing and the manifest first, then only the files
the manifest lists, within a byte cap. Everything here takes and returns URIs; the actors
that load a checkpoint fetch their own files through :func:`fetch` too
(:func:`staging.read_checked`).
"""

from __future__ import annotations

import contextlib
import os
import shutil

from diloco_ray.errors import ConfigError, first_line
from diloco_ray.persist import checkpoint, storage
from diloco_ray.persist.manifest import (
    MANIFEST,
    MANIFEST_MAX_BYTES,
    manifest_text,
    open_manifest,
    read_manifest,
    table_problem,
)

# The most a resume (or a server restart) downloads to verify one bucket checkpoint: the
# fp32 weights, the outer optimizer's state (1-2x the weights) and every replica rank's
# inner optimizer state (AdamW: 2x its share of the weights) make ~3 TB for a 70B model
# trained by 4 replicas; 8 TiB is past any such run, and the staging disk's free space
# bounds a download further. A prefix filled with junk stops here, not on a full disk.
MAX_BYTES = 8 << 40
MAX_BYTES_ENV = "DILOCO_RAY_MAX_CHECKPOINT_BYTES"


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


def max_bytes() -> int:
    """The most one bucket checkpoint may hold to be downloaded: :data:`MAX_BYTES`, or
    ``$DILOCO_RAY_MAX_CHECKPOINT_BYTES`` when set.

    Raises:
        ConfigError: the variable is not a whole number >= 1.
    """
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return MAX_BYTES
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{MAX_BYTES_ENV}: {text!r} is not allowed; expected a whole number of bytes >= 1")
    return value


def fetch(uri: str, names: list[str] | None = None) -> tuple[str, str | None]:
    """Download the files of checkpoint ``uri`` that its manifest lists into the staging
    copy, bounded: one listing and the manifest (capped) come first, and nothing more is
    downloaded when the manifest names a path outside the folder, a file the listing lacks,
    or more bytes than :func:`max_bytes` or the staging disk's free space allow. Each file
    is downloaded at the size the listing gave, never more.

    Args:
        uri: a checkpoint folder in a bucket.
        names: None: every listed file, into a fresh copy (the driver's check; an object
            the manifest does not list fails it). Else only those of ``names`` it lists
            (an actor's own files, beside what other actors of its node fetched); a name
            it does not list is removed from the copy, so the caller finds it missing.

    Returns:
        ``(staging folder, None)``, or ``(staging folder, one-line reason)`` when refused.
    """
    mirror = storage.Mirror(uri)
    listing = mirror.sizes(mirror.local)
    if names is None:
        shutil.rmtree(mirror.local, ignore_errors=True)
    wanted, reason = _plan(mirror, listing, names)
    if reason is not None:
        return mirror.local, reason
    for rel, size in wanted.items():
        try:
            mirror.download(os.path.join(mirror.local, *rel.split("/")), size=size)
        except OSError as exc:
            return mirror.local, f"cannot download {rel!r}: {first_line(exc)}"
    return mirror.local, None


def _plan(mirror: storage.Mirror, listing: dict[str, int], names: list[str] | None) -> tuple[dict, str | None]:
    """``({relative path: bytes} to download, None)`` for :func:`fetch`, or ``({}, why
    nothing may be)``, from the remote ``listing`` and the manifest (downloaded here)."""
    if MANIFEST not in listing:
        return {}, f"no {MANIFEST} (incomplete checkpoint)"
    if listing[MANIFEST] > MANIFEST_MAX_BYTES:
        return {}, f"{MANIFEST} holds {listing[MANIFEST]:,} bytes, more than a manifest may ({MANIFEST_MAX_BYTES:,})"
    try:
        mirror.download(os.path.join(mirror.local, MANIFEST), size=listing[MANIFEST])
    except OSError as exc:
        return {}, f"cannot download {MANIFEST}: {first_line(exc)}"
    manifest, reason = open_manifest(mirror.local)
    reason = reason or table_problem(manifest)
    if reason is not None:
        return {}, reason
    files = manifest["files"]
    unlisted = sorted(set(listing) - set(files) - {MANIFEST})
    if names is None and unlisted:
        return {}, f"{unlisted[0]!r} is in the checkpoint but not listed in its {MANIFEST}"
    for name in names or ():
        if name not in files:  # a stale copy from an earlier write of this round must not be loaded
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(mirror.local, *name.split("/")))
    chosen = [rel for rel in files if names is None or rel in names]
    missing = [rel for rel in chosen if rel not in listing]
    if missing:
        return {}, f"missing file {missing[0]!r}"
    wanted = {rel: listing[rel] for rel in chosen}
    return wanted, _too_big(sum(wanted.values()), mirror.local)


def _too_big(total: int, local: str) -> str | None:
    """Why ``total`` bytes may not be downloaded into the staging folder ``local``, or None."""
    cap = max_bytes()
    if total > cap:
        return f"its files hold {total:,} bytes, more than the {cap:,} a checkpoint may ({MAX_BYTES_ENV})"
    free = shutil.disk_usage(_existing(local)).free
    if total > free:
        return f"its files hold {total:,} bytes, more than the {free:,} free where it is staged ({local})"
    return None


def _existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (the disk it will be on)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def verify(uri: str) -> str | None:
    """None when the checkpoint at ``uri`` is complete and intact, else a one-line reason
    (see :func:`checkpoint.verify`); downloads what its manifest lists (:func:`fetch`) to
    check the hashes."""
    local, reason = fetch(uri)
    if reason is not None:
        return reason
    reason = checkpoint.verify(local)
    if reason is None and round_of(uri) is not None:
        # The staging folder is not named round-N, so check the name here.
        said = read_manifest(local).get("round")
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
    storage.Mirror(uri).write_bytes(MANIFEST, manifest_text(round, meta, files).encode())
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
