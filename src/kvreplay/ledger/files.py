"""Writes a run folder can trust: whole files replaced atomically, and a failed write
said as the user's one sentence."""

from __future__ import annotations

from pathlib import Path

from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import replace_file


def disk_error(path: Path, exc: OSError) -> KvreplayError:
    """A failed write (a full disk, a read-only folder) as the user's one sentence."""
    return KvreplayError(
        f"Cannot write {path} ({exc.strerror or exc}); fix that and rerun the same command "
        "to resume."
    )


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a new file beside it, fsync, rename (:func:`replace_file`): a reader never
    sees half a file, a failed write leaves neither half a file nor the new one, and a
    name that was a link is replaced, never written through."""
    try:
        replace_file(path, data)
    except OSError as exc:
        raise disk_error(path, exc) from exc


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, text.encode("utf-8"))
