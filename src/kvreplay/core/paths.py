"""Paths the user names, checked before anything reads or writes them.

A name the file system cannot hold raises from ``Path.exists`` (or from the first write
below a folder that does not exist yet); reading a FIFO blocks until someone writes to
it; and ``Path("")`` is the current folder. Each becomes one sentence instead of a
traceback, a hang or a run written where nobody asked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

import click

from kvreplay.core.errors import KvreplayError

FALLBACK_NAME_MAX = 255


def _shown(path: Path | str) -> str:
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
        raise KvreplayError(f"{what} {_shown(path)} cannot be used: {problem}.")
    return path


def read_regular(path: Path) -> bytes:
    """A regular file's bytes (see :func:`open_regular`)."""
    with open_regular(path) as handle:
        return handle.read()


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


class UserPath(click.Path):
    """A ``click.Path`` that refuses an empty value (``Path("")`` is the current folder)
    and a path the file system cannot hold, as a usage error."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty; name a path (. is the current folder)", param, ctx)
        problem = name_problem(Path(value))
        if problem:
            self.fail(f"{_shown(value)} cannot be used: {problem}", param, ctx)
        return super().convert(value, param, ctx)
