"""How diloco-ray writes files and folders under fixed names in a folder that others may
share (``output_dir`` as ``/shared/runs/x``, a sweep's folder): never through a link.

A name such as ``metrics.jsonl`` or ``.diloco-ray.lock`` is known in advance, so anyone who
can write the folder could plant a symbolic link there and have the run append to, lock,
or replace a file of their choosing. The one way the package writes such names is here:

* :func:`open_append` and :func:`open_lock` open with ``O_NOFOLLOW`` and only a regular
  file: a link (or a FIFO, a device) at the name is refused with one line naming it
  (a :class:`~diloco_ray.errors.ConfigError`, exit 2), and nothing is written.
* :func:`write_atomic`, :func:`replacing`, :func:`save_figure` and :func:`open_fresh`
  write a new file under a hidden random name beside the target (created
  ``O_EXCL | O_NOFOLLOW``), then ``os.replace`` it over the name: a link there is
  replaced itself, never followed.
* :func:`replace_folder` does the same for a folder (a model's ``final/``), through a
  hidden temp folder; :func:`leftovers` finds those a crash left behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
from typing import IO, Callable, Iterator, Optional, Union

from diloco_ray.errors import ConfigError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK only for the open itself: opening a FIFO planted at the name for writing would
# otherwise wait forever for a reader. Cleared once the file is known to be a regular one.
_OPEN_FLAGS = _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
_TEMP_TRIES = 100


def open_append(path: str, buffering: int = -1, errors: Optional[str] = None) -> IO[str]:
    """``path`` opened for appending text (created if missing, as ``open(path, "a")``
    would, mode 0666 less the umask), never through a link.

    Args:
        path: the file.
        buffering: as :func:`open`'s (1: flushed line by line).
        errors: as :func:`open`'s (e.g. ``"replace"`` for text from elsewhere).

    Raises:
        ConfigError: one line naming ``path`` when it is a link or not a regular file.
        OSError: any other failure to open it (a missing folder, no permission).
    """
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", buffering=buffering, errors=errors)


def open_lock(path: str, create: bool = True) -> IO[str]:
    """``path`` opened to take a ``flock`` on and to read or write its holder's line
    (text, read-write and created if missing; read-only and not created with ``create``
    False), never through a link.

    Raises:
        ConfigError: one line naming ``path`` when it is a link or not a regular file.
        OSError: any other failure to open it (with ``create`` False: a missing file).
    """
    fd = _open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY)
    return os.fdopen(fd, "r+" if create else "r", errors="replace")


def _open(path: str, flags: int) -> int:
    """``os.open`` of a regular file at ``path`` without following a link there."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, 0o666)
    except OSError:
        # ELOOP for a link, ENXIO for a FIFO nobody reads, ...: say which, in one line.
        what = _not_plain(path)
        if what:
            raise ConfigError(_refusal(path, what)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(_refusal(path, "is not a regular file"))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_plain(path: str) -> Optional[str]:
    """What is wrong with what is at ``path`` for appending or locking, if anything."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def _refusal(path: str, what: str) -> str:
    return (
        f"'{path}' {what}; diloco-ray writes this file itself, only as a plain file and never "
        "through a link: remove it, or choose another folder"
    )


# ----------------------------------------------------------------------------- replacing


def write_atomic(path: str, data: Union[str, bytes], mode: Optional[int] = None) -> None:
    """Put ``data`` (text is written as UTF-8) at ``path`` in one step: readers see the old
    file or the new one, never half of it, and a link at ``path`` is replaced, not followed.

    Args:
        path: the file.
        data: its whole new content.
        mode: the file's permission bits (e.g. ``0o600`` for owner-only); None: 0666 less
            the umask, as ``open(path, "w")`` gives.

    Raises:
        OSError: the write failed (a full disk, say), naming ``path``; nothing is left
            behind and whatever was at ``path`` is untouched.
    """
    with replacing(path, mode) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def save_figure(fig, path: str, **savefig_kwargs) -> None:
    """``fig.savefig`` to ``path`` (format from its suffix, png when it has none) as
    :func:`write_atomic` writes a file."""
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    with replacing(path) as f:
        fig.savefig(f, format=suffix or "png", **savefig_kwargs)


@contextlib.contextmanager
def replacing(path: str, mode: Optional[int] = None) -> Iterator[IO[bytes]]:
    """A binary file to write ``path``'s new content into; put in place of ``path`` when
    the block ends without error, removed when it raises (an ``OSError`` with an errno that
    names no file or the temp file is raised again naming ``path``). ``mode`` as
    :func:`write_atomic`'s."""
    fd, tmp = _temp_file(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp):
            # A write to an open file names no file, and the temp name means nothing to a user.
            raise OSError(e.errno, e.strerror, path) from e
        raise


def open_fresh(path: str) -> IO[str]:
    """A new empty file at ``path``, opened for writing text (``open(path, "w")`` without
    following a link): whatever was at ``path``, a link included, is replaced, not written."""
    fd, tmp = _temp_file(path, None)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return os.fdopen(fd, "w")


def _temp_file(path: str, mode: Optional[int]) -> tuple[int, str]:
    """A new file beside ``path`` under a hidden random name: ``(fd, name)``.

    ``O_EXCL`` makes it ours alone (nothing planted there is opened); unlike
    ``tempfile.mkstemp`` it is created 0666 less the umask, as ``open`` would."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    for _ in range(_TEMP_TRIES):
        tmp = _temp_name(path)
        try:
            fd = os.open(tmp, flags, 0o666 if mode is None else mode)
        except FileExistsError:
            continue
        if mode is not None:
            os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def _temp_name(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")


def leftovers(folder: str, name: str) -> list[str]:
    """The temp files and folders that writes of ``folder/name`` here left behind (a crash,
    a full disk): the hidden ``.NAME.XXXXXXXX.tmp`` entries and nothing else."""
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{8}}\.tmp\Z")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names if pattern.match(n))


def replace_folder(path: str, write: Callable[[str], object]) -> None:
    """Run ``write(tmp)`` into a new hidden folder beside ``path``, then put it in place of
    ``path``: a crash never leaves a half-written folder at ``path`` (only a leftover that
    :func:`leftovers` finds, and that the next write of ``path`` removes), and a link at
    ``path`` is removed, not followed.

    Raises:
        whatever ``write`` raises; the temp folder is removed first.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    for old in leftovers(folder, os.path.basename(os.path.abspath(path))):
        _remove(old)
    tmp = _temp_folder(path)
    try:
        write(tmp)
        _remove(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _temp_folder(path: str) -> str:
    """A new folder beside ``path`` under a hidden random name, 0777 less the umask as
    ``os.makedirs`` gives (``tempfile.mkdtemp`` would make a model folder owner-only)."""
    for _ in range(_TEMP_TRIES):
        tmp = _temp_name(path)
        try:
            os.mkdir(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", path)


def _remove(path: str) -> None:
    """Remove what is at ``path``: a folder with its contents, a link as the link itself."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
