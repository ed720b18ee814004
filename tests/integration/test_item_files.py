"""Issue 34, item 8: an item file that is not a regular file (a FIFO blocks the read
until someone writes to it; a device never ends; a socket cannot be opened; a folder
cannot be read) is refused in one sentence, on a new run before the manifest, on a
resume and in an audit, where items.jsonl is read back."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import QUICK, check, invoke, run_args

NOT_REGULAR = "is not a regular file (a FIFO, device, socket or folder would block or fail"


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    bound: list[socket.socket] = []

    def make(path: Path) -> None:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        bound.append(server)

    yield make
    for server in bound:
        server.close()


def _fifo_behind_a_link(path: Path) -> None:
    os.mkfifo(path.with_suffix(".fifo"))
    path.symlink_to(path.with_suffix(".fifo"))


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "folder", "link_to_fifo"])
def test_items_that_are_not_a_regular_file(
    kind: str, tmp_path: Path, tiny_dirs: dict[str, Path], unix_socket: Callable[[Path], None]
) -> None:
    items = tmp_path / "items.jsonl"
    make: dict[str, Callable[[Path], None]] = {
        "fifo": os.mkfifo,
        "socket": unix_socket,
        "folder": Path.mkdir,
        "link_to_fifo": _fifo_behind_a_link,
    }
    if kind == "device":
        items = Path("/dev/zero")
    else:
        make[kind](items)
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"], ("--items", items))
    check(invoke(*args, *QUICK), f"The item file {items} {NOT_REGULAR}", out)
    assert not (out / "manifest.json").exists()


def test_a_run_whose_items_jsonl_became_a_fifo(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    """A resume compares items.jsonl with the contract and an audit reads it back: both
    used to block on a FIFO put there."""
    args, out = run_args("matched", tmp_path, tiny_dirs["qwen2"])
    assert invoke(*args, *QUICK).exit_code == 0
    (out / "items.jsonl").unlink()
    os.mkfifo(out / "items.jsonl")
    rows = (out / "rows.jsonl").read_bytes()
    check(invoke(*args, *QUICK), "items.jsonl cannot be read as the run's frozen items", tmp_path)
    assert (out / "rows.jsonl").read_bytes() == rows
    audit = invoke("audit", out)
    assert audit.exit_code == 1, audit.output
    assert (
        f"items.jsonl: missing or unreadable (The item file {out / 'items.jsonl'}" in audit.output
    )
