"""Writes a run folder can trust: whole files replaced atomically, and a failed write
said as the user's one sentence."""

from __future__ import annotations

import os
from pathlib import Path

from kvreplay.core.errors import KvreplayError


def disk_error(path: Path, exc: OSError) -> KvreplayError:
    """A failed write (a full disk, a read-only folder) as the user's one sentence."""
    return KvreplayError(
        f"Cannot write {path} ({exc.strerror or exc}); fix that and rerun the same command "
        "to resume."
    )


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file, fsync, rename: a reader never sees half a file, and a
    failed write leaves neither half a file nor the temporary one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise disk_error(path, exc) from exc


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, text.encode("utf-8"))
