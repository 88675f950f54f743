"""Remote run folders: ``output_dir`` as ``s3://bucket/prefix`` or ``gs://bucket/prefix``.

This module owns everything that touches an object store, through pyarrow's filesystems
(the same layer Ray Train's ``storage_path`` uses), and nothing above the bytes of a file:

* :func:`is_remote` / :func:`check_uri` tell a remote URI from a local folder and
  validate it offline, so a bad ``output_dir`` fails at config time, not after Ray starts.
* :func:`filesystem` turns a URI into a pyarrow filesystem (cached per process).
* :func:`staging_root` names the node-local folder that mirrors a remote folder; every
  process on every node computes the same path, so ranks agree without talking.
* :class:`Mirror` is one remote folder plus its staging copy. The run writes every file
  locally first (all existing code keeps working on plain paths) and pushes or pulls
  files with :meth:`Mirror.upload` / :meth:`Mirror.download`. Object stores have no
  rename, so atomicity comes from order instead: :meth:`Mirror.upload_files` sends a
  manifest *after* the files it lists, and readers trust only what a manifest lists.

Credentials and endpoints come from the environment exactly as pyarrow reads them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, Google application
default credentials, ...); never from the URI, which ends up in logs and config.yaml.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Iterable, Iterator
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from diloco_ray.errors import ConfigError

if TYPE_CHECKING:  # pyarrow is imported lazily: local-only runs never pay for it
    import pyarrow.fs

__all__ = ["REMOTE_SCHEMES", "is_remote", "check_uri", "filesystem", "staging_root", "Mirror", "for_output_dir"]

REMOTE_SCHEMES = ("s3", "gs")
# pyarrow also accepts "gcs://" for Google Cloud Storage; we read it as "gs://".
_ALIASES = {"gcs": "gs"}
_ALLOWED = "a local folder, s3://bucket/path or gs://bucket/path"

# The query options pyarrow 26's FileSystem.from_uri accepts per scheme (anything else it
# rejects with "Unexpected query parameter"); checked here so the error names the field.
_QUERY_OPTIONS = {
    "s3": (
        "region",
        "scheme",
        "endpoint_override",
        "allow_bucket_creation",
        "allow_bucket_deletion",
        "tls_ca_file_path",
        "tls_verify_certificates",
    ),
    "gs": ("scheme", "endpoint_override", "retry_limit_seconds", "project_id"),
}
# Bucket names on S3 and GCS are letters, digits, dots, dashes (GCS: underscores too).
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_CHUNK = 8 << 20  # bytes per read/write when streaming a file: few calls, bounded memory
_PROBE = ".diloco-ray-probe"
# How pyarrow reports a missing S3 bucket: on a write, and on the region lookup of from_uri.
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|Bucket '[^']*' not found")


# ----------------------------------------------------------------------------- URIs


def is_remote(path: str | None) -> bool:
    """Whether ``path`` names a folder on an object store rather than a local folder.

    Args:
        path: an ``output_dir``-like value; ``None`` and local paths give False.

    Returns:
        True for ``s3://...``, ``gs://...`` and ``gcs://...`` (any letter case).
    """
    if not isinstance(path, str) or "://" not in path:
        return False
    scheme = path.split("://", 1)[0].lower()
    return scheme in REMOTE_SCHEMES or scheme in _ALIASES


def redact(uri: str) -> str:
    """``uri`` with any credentials (``scheme://key:secret@bucket``) replaced by ``***``,
    for messages: a secret must never reach a terminal, a log or metrics.jsonl."""
    head, sep, rest = uri.partition("://")
    if not sep:
        return uri
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{head}{sep}{netloc}{slash}{path}"


def check_uri(field: str, uri: str) -> None:
    """Validate ``uri`` as a run folder without touching the network.

    A value without ``://`` is a local folder and passes (local paths are checked where
    they are created). A remote URI must be ``s3://bucket[/path]`` or
    ``gs://bucket[/path]`` (``gcs://`` too), with no credentials, port or fragment, no
    empty, ``.`` or ``..`` path segment, and no query option pyarrow would not take.

    Args:
        field: the config field the value came from; every message starts with it.
        uri: the value to check.

    Raises:
        ConfigError: naming ``field``, the value and what is allowed.
    """
    if not isinstance(uri, str):
        raise ConfigError(f"{field}: expected a string ({_ALLOWED}), got {type(uri).__name__}")
    if "://" not in uri:
        # "s3:bucket" or "s3:/bucket" would otherwise become a local folder named "s3:...".
        head = uri.split(":", 1)[0].lower() if ":" in uri else ""
        if head in REMOTE_SCHEMES or head in _ALIASES:
            raise ConfigError(f"{field}: {redact(uri)!r} is not a valid URI; expected {head}://bucket/path")
        return
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "file":
        raise ConfigError(
            f"{field}: {redact(uri)!r} is not allowed; expected {_ALLOWED} "
            "(write a local folder as a plain path, without file://)"
        )
    if not is_remote(uri):
        raise ConfigError(f"{field}: {redact(uri)!r} is not allowed; expected {_ALLOWED}")
    if any(c.isspace() or ord(c) < 32 for c in uri):
        # pyarrow's URI parser refuses them; spaces in object names must be %20-encoded.
        raise ConfigError(
            f"{field}: {redact(uri)!r} contains whitespace or control characters; "
            f"expected {_ALLOWED} (encode a space as %20)"
        )
    parts = urlsplit(uri)
    canonical = _ALIASES.get(scheme, scheme)
    if not parts.netloc:
        raise ConfigError(f"{field}: {redact(uri)!r} has no bucket; expected {canonical}://bucket/path")
    if "@" in parts.netloc:
        # pyarrow would take "key:secret@bucket", but the URI is logged and saved in config.yaml.
        raise ConfigError(
            f"{field}: {redact(uri)!r} holds credentials; put them in the environment "
            f"(e.g. AWS_ACCESS_KEY_ID / GOOGLE_APPLICATION_CREDENTIALS), not in the URI"
        )
    if not _BUCKET.match(parts.netloc):
        raise ConfigError(
            f"{field}: {redact(uri)!r} has an invalid bucket name {parts.netloc!r}; expected "
            f"{canonical}://bucket/path with letters, digits, '.', '-' or '_' in the "
            "bucket name (set a custom endpoint with AWS_ENDPOINT_URL, not a port)"
        )
    if parts.fragment or uri.endswith("#"):
        raise ConfigError(
            f"{field}: {redact(uri)!r} has a '#' fragment, which is not allowed; expected {canonical}://bucket/path"
        )
    inner = parts.path[1:].rstrip("/")  # a trailing slash is fine, "bucket//p" is not
    segments = inner.split("/") if inner else []
    if any(s in ("", ".", "..") for s in (unquote(s) for s in segments)):
        raise ConfigError(
            f"{field}: {redact(uri)!r} has an empty, '.' or '..' path segment; expected {canonical}://bucket/path"
        )
    allowed = _QUERY_OPTIONS[canonical]
    for key, _ in parse_qsl(parts.query, keep_blank_values=True):
        if key not in allowed:
            raise ConfigError(
                f"{field}: {redact(uri)!r} has query option {key!r}, which is not allowed; "
                f"{canonical}:// URIs take only {', '.join(allowed)}"
            )


class _Parts:
    """A checked remote URI split into what the rest of the module needs."""

    def __init__(self, uri: str, field: str):
        check_uri(field, uri)
        if not is_remote(uri):
            raise ConfigError(
                f"{field}: {redact(uri)!r} is not a remote URI; expected s3://bucket/path or gs://bucket/path"
            )
        parts = urlsplit(uri)
        scheme = uri.split("://", 1)[0].lower()
        self.scheme = _ALIASES.get(scheme, scheme)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")  # still %-encoded, as in the URI
        self.query = parts.query
        # One spelling per remote folder: lower-case scheme, gcs -> gs, no trailing slash.
        self.uri = (
            f"{self.scheme}://{self.bucket}"
            + (f"/{self.prefix}" if self.prefix else "")
            + (f"?{self.query}" if self.query else "")
        )
        # The path inside the filesystem, as pyarrow's from_uri gives it (%-decoded).
        self.path = unquote(f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket)

    def endpoint(self) -> str | None:
        """The endpoint pyarrow will talk to when it is not the provider's default."""
        query = dict(parse_qsl(self.query))
        if query.get("endpoint_override"):
            return query["endpoint_override"]
        if self.scheme == "s3":
            # The AWS SDK inside pyarrow reads these itself; we only need them for the
            # cache key and for error messages. The S3-specific one wins, as in the SDK.
            return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        return None

    def endpoint_text(self) -> str:
        if self.endpoint():
            return self.endpoint()
        return "the default AWS S3 endpoint" if self.scheme == "s3" else "the default Google Cloud Storage endpoint"


# ----------------------------------------------------------------------------- filesystems

_FILESYSTEMS: dict[tuple, "pyarrow.fs.FileSystem"] = {}
_FS_LOCK = threading.Lock()


def filesystem(uri: str) -> tuple["pyarrow.fs.FileSystem", str]:
    """The pyarrow filesystem for a remote URI and the path inside it.

    Uses ``pyarrow.fs.FileSystem.from_uri``, which already honours ``AWS_ENDPOINT_URL_S3``
    / ``AWS_ENDPOINT_URL`` (path-style requests, http or https from the URL) and the AWS
    region/credential variables, so a local S3 server such as moto or MinIO works with
    no extra code. Filesystems are cached per (scheme, bucket, endpoint, query options)
    in the process: building an S3 one costs a HeadBucket request to find the bucket's
    region (even when ``AWS_DEFAULT_REGION`` is set; a ``?region=`` option skips it).
    Building a GCS one needs neither network nor credentials.

    Args:
        uri: ``s3://bucket[/path]`` or ``gs://bucket[/path]``.

    Returns:
        ``(fs, path)`` with ``path`` like ``"bucket/path"``: no scheme, no trailing slash.

    Raises:
        ConfigError: ``uri`` is not a valid remote URI (see :func:`check_uri`).
        OSError: pyarrow could not build the filesystem (e.g. the S3 region lookup failed).
    """
    parts = _Parts(uri, "uri")
    return _filesystem(parts), parts.path


def _filesystem(parts: _Parts) -> "pyarrow.fs.FileSystem":
    key = (parts.scheme, parts.bucket, parts.endpoint(), parts.query)
    with _FS_LOCK:
        fs = _FILESYSTEMS.get(key)
    if fs is None:
        import pyarrow.fs as pafs

        # Outside the lock: the region lookup is a network round trip. Two threads racing
        # here both build one; the first stored wins and the other is dropped.
        fs, _ = pafs.FileSystem.from_uri(parts.uri)
        with _FS_LOCK:
            fs = _FILESYSTEMS.setdefault(key, fs)
    return fs


# ----------------------------------------------------------------------------- staging


def staging_root(uri: str) -> str:
    """The node-local folder that mirrors remote folder ``uri``; not created here.

    ``$DILOCO_RAY_STAGING`` if set, else ``<tempfile.gettempdir()>/diloco-ray-staging``,
    then one subfolder per remote folder: a readable ``scheme-bucket-prefix`` (sanitised,
    shortened) plus the first 12 hex digits of the SHA-1 of the URI, so two different
    remote folders never share a staging folder. Spellings of the same folder
    (``gcs://`` vs ``gs://``, a trailing slash) share one. Deterministic: every process
    with the same environment (``DILOCO_RAY_STAGING``, ``TMPDIR``) gets the same path.

    Args:
        uri: ``s3://bucket[/path]`` or ``gs://bucket[/path]``.

    Raises:
        ConfigError: ``uri`` is not a valid remote URI.
    """
    parts = _Parts(uri, "output_dir")
    base = os.environ.get("DILOCO_RAY_STAGING") or os.path.join(tempfile.gettempdir(), "diloco-ray-staging")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{parts.scheme}-{parts.bucket}-{unquote(parts.prefix)}")
    readable = readable.strip("._-")[:80] or parts.scheme  # never "." / ".." / hidden / too long
    digest = hashlib.sha1(parts.uri.encode("utf-8")).hexdigest()[:12]
    return os.path.join(os.path.abspath(base), f"{readable}-{digest}")


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

    # --- paths

    def _relative(self, path: str) -> str:
        """``path`` as a '/'-separated path relative to ``self.local`` ('' for the root)."""
        p = os.fspath(path)
        if "://" in p:
            # A remote URI under ours is accepted; anything else would otherwise be joined
            # onto self.local as a nonsense local path such as "<local>/s3:/b/x".
            base = self.uri.split("?", 1)[0]
            plain = p.split("?", 1)[0]
            if plain == base:
                return ""
            if plain.startswith(base + "/"):
                return unquote(plain[len(base) + 1 :]).strip("/")
            raise ValueError(f"{p!r} is not under {self.uri!r}")
        full = os.path.normpath(p if os.path.isabs(p) else os.path.join(self.local, p))
        rel = os.path.relpath(full, self.local)
        if _outside(rel):
            # The same folder reached through a symlink (e.g. /tmp -> /private/tmp).
            rel = os.path.relpath(os.path.realpath(full), os.path.realpath(self.local))
        if _outside(rel):
            raise ValueError(f"{p!r} is outside the staging folder {self.local!r} of {self.uri!r}")
        return "" if rel == os.curdir else rel.replace(os.sep, "/")

    def _remote_path(self, path: str) -> str:
        """The path inside the filesystem for local ``path``."""
        rel = self._relative(path)
        return f"{self._parts.path}/{rel}" if rel else self._parts.path

    def remote(self, path: str) -> str:
        """The full remote URI of a local path.

        Args:
            path: a path under ``self.local``, or relative to it.

        Returns:
            ``self.uri`` + ``/`` + the relative path (%-encoded; query options kept at the end).

        Raises:
            ValueError: ``path`` is outside ``self.local``.
        """
        rel = self._relative(path)
        base, sep, query = self.uri.partition("?")
        return (f"{base}/{quote(rel, safe='/')}" if rel else base) + sep + query

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
        late = [f for p in last for f in self._local_files(p)]
        late_set = {rel for _, rel in late}
        early = [(f, rel) for p in paths for f, rel in self._local_files(p) if rel not in late_set]
        sent, done = 0, set()
        with self._bucket_errors():
            for local, rel in early + late:
                if rel in done:
                    continue
                done.add(rel)
                sent += self._put_file(local, self._remote_path(rel))
        return sent

    def _local_files(self, path: str) -> list[tuple[str, str]]:
        """(absolute local file, relative path) for a file, or a folder's files sorted."""
        rel = self._relative(path)
        full = os.path.join(self.local, *rel.split("/")) if rel else self.local
        if os.path.isfile(full):
            return [(full, rel)]
        if not os.path.isdir(full):
            raise FileNotFoundError(f"cannot upload {full!r}: no such file or folder")
        found = []
        for root, dirs, files in os.walk(full):
            dirs.sort()
            for name in files:
                f = os.path.join(root, name)
                found.append((f, os.path.relpath(f, self.local).replace(os.sep, "/")))
        return sorted(found, key=lambda item: item[1])

    def _put_file(self, local: str, remote: str) -> int:
        """Stream one local file to ``remote`` (a path inside ``self.fs``); bytes sent."""
        sent = 0
        # compression=None: pyarrow's default "detect" would gzip anything named *.gz.
        with open(local, "rb") as src, self.fs.open_output_stream(remote, compression=None) as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                sent += len(chunk)
        return sent

    def download(self, path: str) -> bool:
        """Copy a remote file, or a folder recursively, to its local path, overwriting.

        Each file is written to a hidden temporary name beside its target and renamed
        into place, so a crash never leaves a partial file under the real name. Local
        files with no remote counterpart are left alone.

        Args:
            path: the local path (under ``self.local``, or relative to it) to fill.

        Returns:
            False if nothing exists at the remote path, else True.

        Raises:
            OSError: a transfer failed, as pyarrow raised it.
        """
        import pyarrow.fs as pafs

        rel = self._relative(path)
        target = os.path.join(self.local, *rel.split("/")) if rel else self.local
        remote = self._remote_path(rel)
        info = self.fs.get_file_info(remote)
        if info.type == pafs.FileType.NotFound:
            return False
        if info.type == pafs.FileType.File:
            try:
                self._get_file(remote, target, info.size)
            except FileNotFoundError:  # deleted between the two requests
                return False
            return True
        files = [
            i for i in self.fs.get_file_info(pafs.FileSelector(remote, recursive=True)) if i.type == pafs.FileType.File
        ]
        for item in sorted(files, key=lambda i: i.path):
            rel = item.path[len(remote) :].strip("/")
            local = os.path.normpath(os.path.join(target, *rel.split("/")))
            if _outside(os.path.relpath(local, target)):  # a key with ".." in it
                raise ValueError(f"remote object {item.path!r} maps outside {target!r}")
            self._get_file(item.path, local, item.size)
        os.makedirs(target, exist_ok=True)
        return True

    def _get_file(self, remote: str, local: str, size: int | None) -> None:
        """Stream one remote file to ``local`` through a temporary name."""
        folder, name = os.path.split(local)
        os.makedirs(folder, exist_ok=True)
        # Unique per process and call: several processes of a node may fetch the same file.
        tmp = os.path.join(folder, f".{name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        got = 0
        try:
            with self.fs.open_input_stream(remote, compression=None) as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    got += len(chunk)
            if size is not None and size >= 0 and got != size:
                raise OSError(f"downloaded {got} bytes of {remote!r}, expected {size}")
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    # --- remote-only operations

    def exists(self, path: str) -> bool:
        """Whether a file or folder exists at the remote counterpart of ``path``.

        Args:
            path: a path under ``self.local`` (or relative to it).
        """
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._remote_path(path)).type != pafs.FileType.NotFound

    def listdir(self, path: str) -> list[str]:
        """Names directly under the remote counterpart of folder ``path``.

        Args:
            path: a path under ``self.local`` (or relative to it).

        Returns:
            Sorted names (not paths) of files and folders; [] if the folder does not exist
            (or is a file).
        """
        import pyarrow.fs as pafs

        remote = self._remote_path(path)
        infos = self.fs.get_file_info(pafs.FileSelector(remote, allow_not_found=True, recursive=False))
        return sorted({i.path[len(remote) :].strip("/") for i in infos} - {""})

    def delete(self, path: str) -> None:
        """Delete the remote counterpart of ``path``: a file, or a folder recursively.

        A missing path is fine. Deleting the Mirror's root when it is a whole bucket
        empties the bucket but never deletes it. Note pyarrow's S3 filesystem leaves an
        empty "folder/" marker object for the parent, so the parent still exists.

        Args:
            path: a path under ``self.local`` (or relative to it).
        """
        import pyarrow.fs as pafs

        remote = self._remote_path(path)
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
            with self.fs.open_input_stream(self._remote_path(path), compression=None) as src:
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
            self._write(self._remote_path(path), data)

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
        info = self.fs.get_file_info(self._remote_path(path))
        return info.mtime.timestamp() if info.mtime is not None else None

    def check_writable(self) -> None:
        """Write and delete a probe object ``<uri>/.diloco-ray-probe``.

        Run before starting Ray, so a missing bucket, a wrong endpoint or missing write
        permission fails in one line instead of inside the first checkpoint.

        Raises:
            ConfigError: naming ``output_dir``, the bucket, the endpoint and pyarrow's reason.
        """
        import pyarrow

        remote = self._remote_path(_PROBE)
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


def _outside(rel: str) -> bool:
    return rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel)


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
