"""Remote run folders: ``output_dir`` as ``s3://bucket/prefix`` or ``gs://bucket/prefix``.

This module owns everything that touches an object store, through pyarrow's filesystems
(the same layer Ray Train's ``storage_path`` uses), and nothing above the bytes of a file:

* :func:`is_remote` / :func:`check_uri` tell a remote URI from a local folder and
  validate it offline; :func:`filesystem` turns a URI into a pyarrow filesystem;
  :func:`staging_root` names the node-local folder that mirrors a remote folder, inside
  the user's private :func:`staging_base` (these live in :mod:`diloco_ray.persist.uris`;
  this module is the one API callers use).
* :class:`Mirror` is one remote folder plus its staging copy. The run writes every file
  locally first (all existing code keeps working on plain paths) and pushes or pulls
  files with :meth:`Mirror.upload` / :meth:`Mirror.download`; where a file lies on either
  side is :class:`~diloco_ray.persist.mirror_paths.MirrorPaths`. Object stores have no
  rename, so atomicity comes from order instead: :meth:`Mirror.upload_files` sends a
  manifest *after* the files it lists, and readers trust only what a manifest lists.

Credentials and endpoints come from the environment exactly as pyarrow reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, Google application
default credentials, ...); never from the URI, which ends up in logs and config.yaml.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from typing import TYPE_CHECKING, Iterable, Iterator

from diloco_ray.errors import ConfigError
from diloco_ray.persist.mirror_paths import MirrorPaths
from diloco_ray.persist.uris import (
    REMOTE_SCHEMES,
    _filesystem,
    _Parts,
    check_uri,
    filesystem,
    get_file,
    is_remote,
    put_file,
    redact,
    staging_base,
    staging_root,
)

if TYPE_CHECKING:  # pyarrow is imported lazily: local-only runs never pay for it
    import pyarrow.fs

__all__ = [
    "REMOTE_SCHEMES",
    "is_remote",
    "check_uri",
    "redact",
    "filesystem",
    "staging_base",
    "staging_root",
    "Mirror",
    "for_output_dir",
]

_PROBE = ".diloco-ray-probe"
# How pyarrow reports a missing S3 bucket: on a write, and on the region lookup of from_uri.
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|Bucket '[^']*' not found")


# ----------------------------------------------------------------------------- Mirror


class Mirror:
    """A remote folder and its node-local staging copy.

    Paths given to its methods are LOCAL paths under ``self.local`` (or relative paths,
    taken relative to ``self.local``); the remote counterpart is the same relative path
    under ``self.uri``. The filesystem is built on first use, so constructing a Mirror
    (and pickling it to another process) never touches the network.

    Attributes:
        uri: the remote folder, normalised (lower-case scheme, ``gs://`` for ``gcs://``,
            no trailing slash; query options kept).
        local: absolute path of the staging folder (may not exist yet).
    """

    def __init__(self, uri: str, local: str | None = None):
        """
        Args:
            uri: ``s3://bucket[/path]`` or ``gs://bucket[/path]``, checked with
                ``check_uri("output_dir", uri)``.
            local: the staging folder; defaults to :func:`staging_root` of ``uri``.

        Raises:
            ConfigError: ``uri`` is not a valid remote URI.
        """
        self._parts = _Parts(uri, "output_dir")
        self.uri = self._parts.uri
        self.local = os.path.abspath(os.fspath(local) if local is not None else staging_root(uri))
        self.paths = MirrorPaths(self.uri, self._parts.path, self.local)

    def __repr__(self) -> str:
        return f"Mirror({self.uri!r}, local={self.local!r})"

    @property
    def fs(self) -> "pyarrow.fs.FileSystem":
        """The pyarrow filesystem, built on first use and cached process-wide.

        Looked up in :func:`filesystem`'s cache on every access rather than kept on the
        Mirror: the cache key holds the endpoint, so a changed ``AWS_ENDPOINT_URL`` is
        honoured, and a pickled Mirror carries no filesystem to another process.
        """
        return _filesystem(self._parts)

    def remote(self, path: str) -> str:
        """The full remote URI of a local path (under ``self.local``, or relative to it).

        Raises:
            ValueError: ``path`` is outside ``self.local``.
        """
        return self.paths.remote_uri(path)

    # --- transfers

    def upload(self, path: str) -> int:
        """Copy a local file, or a folder recursively, to the remote, overwriting.

        Files of a folder go in sorted order of their relative paths. Empty folders are
        not represented (object stores have no folders).

        Args:
            path: a file or folder under ``self.local`` (or relative to it).

        Returns:
            Bytes sent.

        Raises:
            FileNotFoundError: ``path`` does not exist locally.
            ConfigError: the bucket does not exist.
            OSError: any other failure, as pyarrow raised it.
        """
        return self.upload_files([path])

    def upload_files(self, paths: Iterable[str], last: Iterable[str] = ()) -> int:
        """Upload several files (or folders), sending those in ``last`` after all others.

        An object store has no rename, so a reader can see a manifest before the files
        it lists unless the manifest is written last; ``last`` is for that. A path in
        both lists is sent once, at the end.

        Args:
            paths: files or folders under ``self.local``, sent in the order given
                (a folder's files in sorted order).
            last: files or folders sent after everything in ``paths``, in this order.

        Returns:
            Bytes sent.

        Raises:
            FileNotFoundError: a path does not exist locally.
            ConfigError: the bucket does not exist.
            OSError: any other failure, as pyarrow raised it.
        """
        late = [f for p in last for f in self.paths.local_files(p)]
        late_set = {rel for _, rel in late}
        early = [(f, rel) for p in paths for f, rel in self.paths.local_files(p) if rel not in late_set]
        sent, done = 0, set()
        with self._bucket_errors():
            for local, rel in early + late:
                if rel in done:
                    continue
                done.add(rel)
                sent += put_file(self.fs, local, self.paths.remote_path(rel))
        return sent

    def download(self, path: str, size: int | None = None) -> bool:
        """Copy a remote file, or a folder recursively, to its local path, overwriting.

        Each file is written to a hidden temporary name beside its target and renamed
        into place, so a crash never leaves a partial file under the real name. Local
        files with no remote counterpart are left alone.

        Args:
            path: the local path (under ``self.local``, or relative to it) to fill.
            size: for a file, the bytes a listing said it holds: another size is refused
                before the transfer, and the transfer stops past it (the object may be
                replaced in between), so no more than that is ever written.

        Returns:
            False if nothing exists at the remote path, else True.

        Raises:
            OSError: a transfer failed, as pyarrow raised it.
        """
        import pyarrow.fs as pafs

        rel = self.paths.relative(path)
        target, remote = self.paths.local_path(rel), self.paths.remote_path(rel)
        info = self.fs.get_file_info(remote)
        if info.type == pafs.FileType.NotFound:
            return False
        if info.type == pafs.FileType.File:
            if size is not None and info.size != size:
                raise OSError(f"{self.remote(rel)} holds {info.size} bytes, not the {size} listed")
            try:
                get_file(self.fs, remote, target, info.size if size is None else size)
            except FileNotFoundError:  # deleted between the two requests
                return False
            return True
        self._download_folder(remote, target)
        return True

    def _download_folder(self, remote: str, target: str) -> None:
        """Copy every file below the remote folder ``remote`` to its place under ``target``."""
        import pyarrow.fs as pafs

        files = [
            i for i in self.fs.get_file_info(pafs.FileSelector(remote, recursive=True)) if i.type == pafs.FileType.File
        ]
        for item in sorted(files, key=lambda i: i.path):
            local = self.paths.under(target, item.path[len(remote) :].strip("/"))
            get_file(self.fs, item.path, local, item.size)
        os.makedirs(target, exist_ok=True)

    # --- remote-only operations

    def exists(self, path: str) -> bool:
        """Whether a file or folder exists at the remote counterpart of ``path``.

        Args:
            path: a path under ``self.local`` (or relative to it).
        """
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.paths.remote_path(path)).type != pafs.FileType.NotFound

    def listdir(self, path: str) -> list[str]:
        """Names directly under the remote counterpart of folder ``path``.

        Args:
            path: a path under ``self.local`` (or relative to it).

        Returns:
            Sorted names (not paths) of files and folders; [] if the folder does not exist
            (or is a file).
        """
        import pyarrow.fs as pafs

        remote = self.paths.remote_path(path)
        infos = self.fs.get_file_info(pafs.FileSelector(remote, allow_not_found=True, recursive=False))
        return sorted({i.path[len(remote) :].strip("/") for i in infos} - {""})

    def sizes(self, path: str) -> dict[str, int]:
        """Bytes of every file below the remote counterpart of folder ``path``, by its
        ``/``-separated path relative to that folder; {} if nothing is there. One listing,
        no download: what a reader checks before deciding to fetch anything."""
        import pyarrow.fs as pafs

        remote = self.paths.remote_path(path)
        infos = self.fs.get_file_info(pafs.FileSelector(remote, allow_not_found=True, recursive=True))
        return {i.path[len(remote) :].strip("/"): i.size for i in infos if i.type == pafs.FileType.File}

    def delete(self, path: str) -> None:
        """Delete the remote counterpart of ``path``: a file, or a folder recursively.

        A missing path is fine. Deleting the Mirror's root when it is a whole bucket
        empties the bucket but never deletes it. Note pyarrow's S3 filesystem leaves an
        empty "folder/" marker object for the parent, so the parent still exists.

        Args:
            path: a path under ``self.local`` (or relative to it).
        """
        import pyarrow.fs as pafs

        remote = self.paths.remote_path(path)
        info = self.fs.get_file_info(remote)
        try:
            if info.type == pafs.FileType.File:
                self.fs.delete_file(remote)
            elif info.type == pafs.FileType.Directory:
                if "/" in remote:
                    self.fs.delete_dir(remote)
                else:  # delete_dir on a bare bucket would try to delete the bucket
                    self.fs.delete_dir_contents(remote, missing_dir_ok=True)
        except FileNotFoundError:  # deleted by someone else in between
            pass

    def read_bytes(self, path: str) -> bytes | None:
        """The content of a remote file.

        Args:
            path: a path under ``self.local`` (or relative to it).

        Returns:
            The bytes, or None if the file does not exist.
        """
        try:
            with self.fs.open_input_stream(self.paths.remote_path(path), compression=None) as src:
                return src.read()
        except FileNotFoundError:
            return None

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to the remote counterpart of ``path`` (not to the local copy).

        Args:
            path: a path under ``self.local`` (or relative to it).
            data: the whole content.

        Raises:
            ConfigError: the bucket does not exist.
        """
        with self._bucket_errors():
            self._write(self.paths.remote_path(path), data)

    def _write(self, remote: str, data: bytes) -> None:
        with self.fs.open_output_stream(remote, compression=None) as dst:
            dst.write(data)

    def mtime(self, path: str) -> float | None:
        """Modification time of a remote file, in seconds since the epoch.

        Object stores keep it to the second (S3) or millisecond (GCS).

        Args:
            path: a path under ``self.local`` (or relative to it).

        Returns:
            The time, or None if nothing is there or it is a folder (folders have none).
        """
        info = self.fs.get_file_info(self.paths.remote_path(path))
        return info.mtime.timestamp() if info.mtime is not None else None

    def check_writable(self) -> None:
        """Write and delete a probe object ``<uri>/.diloco-ray-probe``.

        Run before starting Ray, so a missing bucket, a wrong endpoint or missing write
        permission fails in one line instead of inside the first checkpoint.

        Raises:
            ConfigError: naming ``output_dir``, the bucket, the endpoint and pyarrow's reason.
        """
        import pyarrow

        remote = self.paths.remote_path(_PROBE)
        try:
            self._write(remote, b"diloco-ray write probe\n")
            self.fs.delete_file(remote)
        except (OSError, pyarrow.ArrowException) as exc:
            raise ConfigError(self._bucket_message(exc)) from exc

    def _bucket_message(self, exc: BaseException) -> str:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return (
            f"output_dir: bucket {self._parts.bucket!r} does not exist or is not reachable at "
            f"{self._parts.endpoint_text()}: {reason}"
        )

    @contextlib.contextmanager
    def _bucket_errors(self) -> Iterator[None]:
        """Turn pyarrow's missing-bucket OSError into a ConfigError; let the rest through."""
        try:
            yield
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) or not _NO_BUCKET.search(str(exc)):
                raise
            raise ConfigError(self._bucket_message(exc)) from exc


_MIRRORS: dict[str, Mirror] = {}
_MIRRORS_LOCK = threading.Lock()


def for_output_dir(output_dir: str) -> Mirror | None:
    """The process's Mirror for a remote ``output_dir``, or None for a local one.

    Args:
        output_dir: the run folder as configured.

    Returns:
        One shared :class:`Mirror` per (normalised) URI per process, staged under
        :func:`staging_root`; None when ``output_dir`` is a local folder.

    Raises:
        ConfigError: ``output_dir`` looks remote but is not a valid URI.
    """
    if not is_remote(output_dir):
        return None
    key = _Parts(output_dir, "output_dir").uri
    with _MIRRORS_LOCK:
        mirror = _MIRRORS.get(key)
        if mirror is None:
            mirror = _MIRRORS[key] = Mirror(key)
        return mirror
