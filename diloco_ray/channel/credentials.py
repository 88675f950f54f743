"""The channel's credentials: the bearer token and the TLS files, read where a user puts them.

The token is read from an environment variable or a file, never from the config, so that
it never lands in ``config.yaml``, a log line or a record; only its source (the variable's
name or the file's path) is configuration. Comparisons are constant-time. The TLS files are
PEM: the home serves a certificate and its key, and a region trusts a CA certificate.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from typing import Optional

from diloco_ray.errors import UserInputError

TOKEN_ENV = "DILOCO_CHANNEL_TOKEN"  # where the token is read from when nothing else is named


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
    """The token from ``token_file`` if one is named, else from the environment variable
    ``token_env`` (default :data:`TOKEN_ENV`). A missing or empty token is one clear error."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as e:
            raise UserInputError(f"channel token file {token_file}: {e.strerror or e}") from None
        if not secret:
            raise UserInputError(f"channel token file {token_file} is empty")
        return Token(secret, token_file)
    name = token_env or TOKEN_ENV
    secret = os.environ.get(name, "").strip()
    if not secret:
        raise UserInputError(f"no channel token: set the environment variable {name} (or name a token file)")
    return Token(secret, f"${name}")


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
