"""The channel's credentials: each region's bearer token and the TLS files, read where a user puts them.

Every region has tokens of its own. A region reads its token from an environment variable
or a file; the home reads every region's from one file (:class:`RegionTokens`, one
``NAME TOKEN`` line per credential), never from the config, so that no token lands in
``config.yaml``, a log line or a record; only where they are is configuration. The home
tells who is calling by the token alone: a region's name is the one its token is listed
under, whatever the call claims. The home's file is read again whenever it changes, so a
token is added, rotated (two lines for a region while its agent moves to the new one) or
revoked (its line removed: the next call with it is refused) without stopping the run.

A file holding a secret must be a plain file (not a link) that only its owner can read;
anything else is refused with the ``chmod`` that fixes it. Comparisons are constant-time.
The TLS files are PEM: the home serves a certificate and its key, and a region trusts a CA
certificate.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from diloco_ray.errors import UserInputError

TOKEN_ENV = "DILOCO_CHANNEL_TOKEN"  # where the token is read from when nothing else is named
MIN_TOKEN_CHARS = 16  # shorter is guessable; `openssl rand -hex 32` gives 64


@dataclass(frozen=True)
class Token:
    """A bearer token; its ``repr`` never shows the secret.

    Args:
        secret: the token itself.
        source: where it was read from (an environment variable's name, or a file's path).
    """

    secret: str
    source: str

    def __repr__(self) -> str:
        return f"Token(from {self.source})"

    def matches(self, offered: Optional[str]) -> bool:
        """Whether ``offered`` is this token (constant time)."""
        return offered is not None and hmac.compare_digest(offered.encode(), self.secret.encode())


def read_token(token_file: Optional[str] = None, token_env: Optional[str] = None) -> Token:
    """The token from ``token_file`` if one is named (a private file: :func:`read_secret_file`),
    else from the environment variable ``token_env`` (default :data:`TOKEN_ENV`). A missing,
    empty or short token is one clear error."""
    if token_file:
        return Token(_checked(read_secret_file(token_file).strip(), f"channel token file {token_file}"), token_file)
    name = token_env or TOKEN_ENV
    secret = os.environ.get(name, "").strip()
    if not secret:
        raise UserInputError(f"no channel token: set the environment variable {name} (or name a token file)")
    return Token(_checked(secret, f"the environment variable {name}"), f"${name}")


def _checked(secret: str, where: str) -> str:
    if not secret:
        raise UserInputError(f"{where} is empty")
    if len(secret) < MIN_TOKEN_CHARS or any(c.isspace() for c in secret):
        raise UserInputError(
            f"{where}: a token is at least {MIN_TOKEN_CHARS} characters with no spaces (e.g. `openssl rand -hex 32`)"
        )
    return secret


def read_secret_file(path: str) -> str:
    """The text of ``path``, a file holding a secret: a plain file, not a link, that only
    its owner can read or write. Anything else is one error naming the file and the fix."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if os.path.islink(path):
            raise UserInputError(f"{path} is a symbolic link; a secret is read only from a plain file") from None
        raise UserInputError(f"{path}: {e.strerror or e}") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise UserInputError(f"{path} is not a plain file; a secret is read only from one")
        if mode & 0o077:
            raise UserInputError(
                f"{path} can be read by others (mode {stat.S_IMODE(mode):04o}); "
                f"a secret must be its owner's alone: chmod 600 {path}"
            )
        return f.read()


class RegionTokens:
    """The home's list of who may call: every region's tokens, from ``path`` (one
    ``NAME TOKEN`` line per token, ``#`` comments), checked as :func:`read_secret_file`.

    :meth:`region_of` is the region a token belongs to. The file is read again when it
    changes (its size, time or inode), so tokens are added, rotated and revoked while the
    run goes on; an edit that does not parse keeps the tokens read last and says why once.
    Only the tokens' SHA-256 digests are held.

    Args:
        path: the file.
        regions: the run's regions: a line naming another is refused.
        log: where a refused edit is said.
    """

    def __init__(self, path: str, regions: Iterable[str], log: Callable[[str], None] = print):
        self.path, self.regions, self.log = path, set(regions), log
        self._lock = threading.Lock()
        self._seen: Optional[tuple] = None
        self._digests: list[tuple[bytes, str]] = []
        self._reload(raise_errors=True)

    def __repr__(self) -> str:
        return f"RegionTokens(from {self.path})"

    def region_of(self, offered: Optional[str]) -> Optional[str]:
        """The region ``offered`` is a token of (None: no region's). Every listed token is
        compared, in constant time each, whichever matches."""
        if not offered:
            return None
        self._reload(raise_errors=False)
        digest = hashlib.sha256(offered.encode()).digest()
        found = None
        with self._lock:
            for known, region in self._digests:
                if hmac.compare_digest(known, digest):
                    found = region
        return found

    def _reload(self, raise_errors: bool) -> None:
        try:
            info = os.stat(self.path)
            seen = (info.st_size, info.st_mtime_ns, info.st_ino)
        except OSError as e:
            seen = ("missing", str(e))
        if seen == self._seen:
            return
        try:
            digests = self._parse(read_secret_file(self.path))
        except UserInputError as bad:
            if raise_errors:
                raise
            if self._seen != seen:
                self.log(f"channel: the tokens in {self.path} were not read again ({bad}); the last ones hold")
            self._seen = seen
            return
        with self._lock:
            self._digests, self._seen = digests, seen

    def _parse(self, text: str) -> list[tuple[bytes, str]]:
        digests: list[tuple[bytes, str]] = []
        owners: dict[bytes, str] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"channel_tokens_file {self.path}, line {number}"
            parts = line.split()
            if len(parts) != 2:
                raise UserInputError(f"{where}: expected `NAME TOKEN` (a region of the run, then its token)")
            region, secret = parts
            if region not in self.regions:
                raise UserInputError(f"{where}: {region!r} is not one of regions ({', '.join(sorted(self.regions))})")
            digest = hashlib.sha256(_checked(secret, where).encode()).digest()
            if owners.setdefault(digest, region) != region:
                raise UserInputError(f"{where}: this token is also {owners[digest]!r}'s; each region needs its own")
            digests.append((digest, region))
        if not digests:
            raise UserInputError(f"channel_tokens_file {self.path} lists no token")
        return digests


def read_pem(path: Optional[str], what: str) -> bytes:
    """The bytes of PEM file ``path`` (``what`` it is, for the error: "channel_tls_cert")."""
    if not path:
        raise UserInputError(f"{what}: the channel needs this PEM file; none is named")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserInputError(f"{what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise UserInputError(f"{what} {path}: not a PEM file")
    return data
