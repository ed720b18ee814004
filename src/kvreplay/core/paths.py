"""Paths the user names, checked before anything reads or writes them.

A name the file system cannot hold raises from ``Path.exists`` (or from the first write
below a folder that does not exist yet); reading a FIFO blocks until someone writes to
it; and ``Path("")`` is the current folder. Each becomes one sentence instead of a
traceback, a hang or a run written where nobody asked. And a name already taken in a
folder kvreplay did not make (a run folder from elsewhere, a repro pack) may be a symlink
or a hard link to a file kvreplay must not touch: a file is written under a new name
beside it and renamed over it, never written through it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from kvreplay.core.errors import KvreplayError

FALLBACK_NAME_MAX = 255


def shown_path(path: Path | str) -> str:
    """A path as a sentence names it: its first 80 characters."""
    text = str(path)
    return text if len(text) <= 80 else text[:80] + "..."


def _name_max(path: Path) -> int:
    """The longest name (in bytes) the file system that would hold ``path`` allows."""
    existing = path.absolute()
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return FALLBACK_NAME_MAX


def name_problem(path: Path) -> str | None:
    """Why the file system cannot hold or look up ``path``, or None when it can."""
    if "\0" in str(path):
        return "it holds a NUL byte"
    limit = _name_max(path)
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            return f"a name in it is longer than the file system's {limit} bytes"
    try:
        path.stat()
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return exc.strerror
    return None


def check_name(path: Path, what: str) -> Path:
    """Refuse a path the file system cannot hold, naming ``what`` it is."""
    problem = name_problem(path)
    if problem:
        raise KvreplayError(f"{what} {shown_path(path)} cannot be used: {problem}.")
    return path


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """A regular file's bytes (see :func:`open_regular`); past ``limit`` bytes, an
    OSError (EFBIG) instead of a read that could take all of memory."""
    with open_regular(path) as handle:
        data = handle.read() if limit is None else handle.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def open_regular(path: Path) -> BinaryIO:
    """A regular file opened for reading in binary; anything else (a FIFO, a device, a
    socket, a folder) is refused as an OSError whose strerror callers already turn into
    their sentence. The file is opened without blocking and what was opened is checked,
    so a FIFO put in its place after a check cannot hang the read."""
    if path.exists() and not path.is_file():  # a socket cannot even be opened
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


def _new_file(folder: Path, name: str) -> tuple[int, Path]:
    """A new file (never an existing one, never through a symlink) with a random name
    beside ``name`` in ``folder``, opened for writing with the umask's permissions."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        path = folder / f".{name[:180]}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path``: a new file beside it, fsynced, renamed over it. A reader
    never sees half a file, and what the name held before (a symlink, a hard link to
    another file) is replaced, never written through. A failed write leaves the old file
    and no new one, and raises OSError."""
    fd, tmp = _new_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def probe_folder(folder: Path) -> None:
    """Make and remove a new file in ``folder``: whether a write there can succeed, asked
    before any work (a folder of /proc or /sys answers ``os.access`` yes to root); raises
    OSError when it cannot."""
    fd, path = _new_file(folder, "kvreplay-probe")
    os.close(fd)
    path.unlink()
