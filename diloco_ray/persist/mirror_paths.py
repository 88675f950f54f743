"""Where a file of a mirrored run folder lies on each side: its local path under the
staging folder and its counterpart under the remote folder.

:class:`MirrorPaths` is the path arithmetic every :class:`~diloco_ray.persist.storage.Mirror`
operation starts from, and nothing else: a local path (absolute, or relative to the staging
folder) or a remote URI under the run's own is taken to one ``/``-separated relative path,
and from it to the path inside the filesystem, the remote URI and the local file. A path
outside the staging folder, or a remote key that would map outside it, is refused rather
than joined into a nonsense path. No I/O but the walk of a local folder to upload.
"""

from __future__ import annotations

import os
from urllib.parse import quote, unquote


class MirrorPaths:
    """The two sides of one mirrored folder.

    Args:
        uri: the remote folder, normalised (no trailing slash; query options kept).
        remote_root: that folder's path inside its filesystem (bucket and prefix).
        local: the staging folder, absolute.
    """

    def __init__(self, uri: str, remote_root: str, local: str):
        self.uri, self.remote_root, self.local = uri, remote_root, local

    def relative(self, path: str) -> str:
        """``path`` as a '/'-separated path relative to the staging folder ('' for the root).

        Raises:
            ValueError: ``path`` is outside the staging folder, or a URI not under ours.
        """
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
        if outside(rel):
            # The same folder reached through a symlink (e.g. /tmp -> /private/tmp).
            rel = os.path.relpath(os.path.realpath(full), os.path.realpath(self.local))
        if outside(rel):
            raise ValueError(f"{p!r} is outside the staging folder {self.local!r} of {self.uri!r}")
        return "" if rel == os.curdir else rel.replace(os.sep, "/")

    def remote_path(self, path: str) -> str:
        """The path inside the filesystem for local ``path``."""
        rel = self.relative(path)
        return f"{self.remote_root}/{rel}" if rel else self.remote_root

    def remote_uri(self, path: str) -> str:
        """The full remote URI of local ``path``: the folder's URI, ``/``, the relative path
        (%-encoded), and the URI's query options at the end."""
        rel = self.relative(path)
        base, sep, query = self.uri.partition("?")
        return (f"{base}/{quote(rel, safe='/')}" if rel else base) + sep + query

    def local_path(self, path: str) -> str:
        """The local file or folder of ``path`` under the staging folder."""
        rel = self.relative(path)
        return os.path.join(self.local, *rel.split("/")) if rel else self.local

    def local_files(self, path: str) -> list[tuple[str, str]]:
        """(absolute local file, relative path) for a file, or a folder's files sorted.

        Raises:
            FileNotFoundError: nothing is there.
        """
        full = self.local_path(path)
        if os.path.isfile(full):
            return [(full, self.relative(full))]
        if not os.path.isdir(full):
            raise FileNotFoundError(f"cannot upload {full!r}: no such file or folder")
        found = []
        for root, dirs, files in os.walk(full):
            dirs.sort()
            for name in files:
                f = os.path.join(root, name)
                found.append((f, os.path.relpath(f, self.local).replace(os.sep, "/")))
        return sorted(found, key=lambda item: item[1])

    def under(self, target: str, rel: str) -> str:
        """The local path of ``rel`` (a remote key below a downloaded folder) under
        ``target``.

        Raises:
            ValueError: the key would map outside ``target`` (one with ".." in it).
        """
        local = os.path.normpath(os.path.join(target, *rel.split("/")))
        if outside(os.path.relpath(local, target)):
            raise ValueError(f"remote object {rel!r} maps outside {target!r}")
        return local


def outside(rel: str) -> bool:
    """Whether the relative path ``rel`` leaves the folder it is relative to."""
    return rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel)
