"""Remote URIs (``s3://bucket/prefix``, ``gs://bucket/prefix``): telling them from local
folders, validating them offline, opening their filesystems, and naming their staging copy.

A bad ``output_dir`` fails at config time with a message naming the field, not after Ray
starts. Filesystems are pyarrow's (the layer Ray Train's ``storage_path`` uses), imported
lazily and cached per process. Every process on every node computes the same staging path
for a URI, so ranks agree on it without talking; the staging base is the user's own
(``~/.cache/diloco-ray/staging``, mode 0700, refused when anyone else can reach it).
:mod:`diloco_ray.persist.storage` is the API callers use; this module is what it stands on.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from diloco_ray import files
from diloco_ray.errors import ConfigError

if TYPE_CHECKING:  # pyarrow is imported lazily: local-only runs never pay for it
    import pyarrow.fs

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
        _check_local(field, uri)
        return
    _check_scheme(field, uri)
    parts = urlsplit(uri)
    scheme = uri.split("://", 1)[0].lower()
    canonical = _ALIASES.get(scheme, scheme)
    _check_bucket(field, uri, parts.netloc, canonical)
    _check_path(field, uri, parts, canonical)
    _check_query(field, uri, parts.query, canonical)


def _check_local(field: str, uri: str) -> None:
    """A value without ``://`` is a local folder, unless it is a remote URI misspelt."""
    # "s3:bucket" or "s3:/bucket" would otherwise become a local folder named "s3:...".
    head = uri.split(":", 1)[0].lower() if ":" in uri else ""
    if head in REMOTE_SCHEMES or head in _ALIASES:
        raise ConfigError(f"{field}: {redact(uri)!r} is not a valid URI; expected {head}://bucket/path")


def _check_scheme(field: str, uri: str) -> None:
    """A URI's scheme is one of ours, and it has no whitespace or control character."""
    if uri.split("://", 1)[0].lower() == "file":
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


def _check_bucket(field: str, uri: str, netloc: str, canonical: str) -> None:
    """The part after ``scheme://`` is a bucket name alone: no credentials, no port."""
    if not netloc:
        raise ConfigError(f"{field}: {redact(uri)!r} has no bucket; expected {canonical}://bucket/path")
    if "@" in netloc:
        # pyarrow would take "key:secret@bucket", but the URI is logged and saved in config.yaml.
        raise ConfigError(
            f"{field}: {redact(uri)!r} holds credentials; put them in the environment "
            f"(e.g. AWS_ACCESS_KEY_ID / GOOGLE_APPLICATION_CREDENTIALS), not in the URI"
        )
    if not _BUCKET.match(netloc):
        raise ConfigError(
            f"{field}: {redact(uri)!r} has an invalid bucket name {netloc!r}; expected "
            f"{canonical}://bucket/path with letters, digits, '.', '-' or '_' in the "
            "bucket name (set a custom endpoint with AWS_ENDPOINT_URL, not a port)"
        )


def _check_path(field: str, uri: str, parts: SplitResult, canonical: str) -> None:
    """No ``#`` fragment, and no empty, ``.`` or ``..`` path segment."""
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


def _check_query(field: str, uri: str, query: str, canonical: str) -> None:
    """Only the query options pyarrow takes for the scheme."""
    allowed = _QUERY_OPTIONS[canonical]
    for key, _ in parse_qsl(query, keep_blank_values=True):
        if key not in allowed:
            raise ConfigError(
                f"{field}: {redact(uri)!r} has query option {key!r}, which is not allowed; "
                f"{canonical}:// URIs take only {', '.join(allowed)}"
            )


_OFF = ("false", "0", "no", "off")


def loosened(uri: str) -> list[str]:
    """What ``uri``'s query options loosen, one phrase each: TLS certificate checks off,
    plain HTTP, or another endpoint than the provider's (all legitimate for a local
    MinIO, and exactly what a hostile config would set to read a run's traffic)."""
    found = []
    for key, value in parse_qsl(urlsplit(uri).query, keep_blank_values=True):
        if key == "tls_verify_certificates" and value.lower() in _OFF:
            found.append(f"turns TLS certificate checks off ({key}={value})")
        elif key == "scheme" and value.lower() == "http":
            found.append("sends over plain HTTP, unencrypted (scheme=http)")
        elif key == "endpoint_override":
            found.append(f"sends to the endpoint {value!r}, not the provider's")
    return found


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
    """The node-local folder that mirrors remote folder ``uri``; not created here (its
    base, :func:`staging_base`, is).

    :func:`staging_base`, then one subfolder per remote folder: a readable
    ``scheme-bucket-prefix`` (sanitised, shortened) plus the first 12 hex digits of the
    SHA-1 of the URI, so two different remote folders never share a staging folder.
    Spellings of the same folder (``gcs://`` vs ``gs://``, a trailing slash) share one.
    Deterministic: every process of the same user with the same environment
    (``DILOCO_RAY_STAGING``, ``XDG_CACHE_HOME``, ``HOME``) gets the same path.

    Args:
        uri: ``s3://bucket[/path]`` or ``gs://bucket[/path]``.

    Raises:
        ConfigError: ``uri`` is not a valid remote URI, or the staging base is not a
            private folder of this user (see :func:`staging_base`).
    """
    parts = _Parts(uri, "output_dir")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{parts.scheme}-{parts.bucket}-{unquote(parts.prefix)}")
    readable = readable.strip("._-")[:80] or parts.scheme  # never "." / ".." / hidden / too long
    digest = hashlib.sha1(parts.uri.encode("utf-8")).hexdigest()[:12]
    return os.path.join(staging_base(), f"{readable}-{digest}")


# Bases found private in this process: staging_root is called for every Mirror, so each
# base is created and checked once per process. Only its existence is looked at again: a
# base removed meanwhile (a cleaned cache) is made anew, 0700, not left to the os.makedirs
# of a staging folder inside it, which would make it with the umask's mode.
_PRIVATE_BASES: set[str] = set()
_BASE_LOCK = threading.Lock()


def staging_base() -> str:
    """The folder all of this user's staging copies live in, created (mode 0700) if missing.

    ``$DILOCO_RAY_STAGING`` if set, else ``$XDG_CACHE_HOME/diloco-ray/staging``, else
    ``~/.cache/diloco-ray/staging``: per user, never a fixed name in the shared temp
    folder, where another user could create it first and read or swap what a run stages.

    Raises:
        ConfigError: one line naming the folder, when it is a symbolic link, not a folder,
            not owned by this user, or open to group or others (mode & 0o077), or cannot
            be created; and what to do about it.
    """
    base = os.path.abspath(os.environ.get("DILOCO_RAY_STAGING") or _default_base())
    with _BASE_LOCK:
        if base not in _PRIVATE_BASES or not os.path.isdir(base):
            _make_private(base)
            _PRIVATE_BASES.add(base)
    return base


def _default_base() -> str:
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):  # the XDG spec: a relative value is invalid and ignored
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "diloco-ray", "staging")


def _make_private(base: str) -> None:
    """Create ``base`` 0700 unless it exists, then check it is this user's alone."""
    advice = "set DILOCO_RAY_STAGING to a folder of your own with mode 0700"
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass  # checked below, whoever made it
    except OSError as e:
        raise ConfigError(f"staging folder '{base}' cannot be created ({e.strerror}); {advice}") from None
    info = os.lstat(base)
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.getuid():
        problem = f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, open to other users"
        advice = f"run chmod 700 '{base}', or {advice}"
    else:
        return
    raise ConfigError(f"staging folder '{base}' {problem}; {advice}")


# ----------------------------------------------------------------------------- streaming
_CHUNK = 8 << 20  # bytes per read/write when streaming a file: few calls, bounded memory


def put_file(fs: "pyarrow.fs.FileSystem", local: str, remote: str) -> int:
    """Stream one local file to ``remote`` (a path inside ``fs``); bytes sent."""
    sent = 0
    # compression=None: pyarrow's default "detect" would gzip anything named *.gz.
    with open(local, "rb") as src, fs.open_output_stream(remote, compression=None) as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
            sent += len(chunk)
    return sent


def get_file(fs: "pyarrow.fs.FileSystem", remote: str, local: str, size: int | None) -> None:
    """Stream one remote file to ``local`` through a temporary name; with ``size``, a
    file of another length is refused, and no more than ``size`` + one chunk is written."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    got = 0
    # A temp name unique per call (several processes of a node may fetch the same file),
    # removed if the download fails; a link at ``local`` is replaced, not written through.
    with files.replacing(local) as dst, fs.open_input_stream(remote, compression=None) as src:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
            got += len(chunk)
            if size is not None and size >= 0 and got > size:  # grew since it was listed
                break
        if size is not None and size >= 0 and got != size:
            what = f"more than {size}" if got > size else f"{got}"
            raise OSError(f"downloaded {what} bytes of {remote!r}, expected {size}")
