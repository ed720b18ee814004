"""``python -m kvreplay.faults NAME -- ARGS``: run ``kvreplay ARGS`` in this process with
the fault NAME planted (an in-process engine: hf, llamacpp, vllm); ``python -m
kvreplay.faults --list`` lists the faults. A server is started with the fault instead
(``KVREPLAY_FAULT`` and the plugin folder, :mod:`kvreplay.faults.plugin`)."""

from __future__ import annotations

import sys

from kvreplay.core.errors import KvreplayError, exit_plainly
from kvreplay.faults import FAULTS, planted

USAGE = "usage: python -m kvreplay.faults NAME -- KVREPLAY-ARGS... | --list"


def main(argv: list[str]) -> None:
    if argv == ["--list"]:
        for fault in FAULTS:
            print(f"{fault.name}\t{fault.engine}\t{fault.fires}")
        return
    if len(argv) < 2 or argv[1] != "--":
        exit_plainly(USAGE)
    from kvreplay.cli import main as kvreplay

    try:
        with planted(argv[0]):
            kvreplay(args=argv[2:], prog_name="kvreplay")
    except KvreplayError as exc:
        exit_plainly(str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
