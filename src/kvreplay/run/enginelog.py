"""Where an engine's own log goes while a check runs: into ``engine.log`` in the check's
run folder, so that what a CI log shows of a check is its verdict (``-v`` leaves the
engine's log on the terminal). vLLM, llama.cpp and torch write from Python and from C
to the process's standard output and error, so both file descriptors are redirected
for the duration of the run; the log is kept once the run folder exists (a check refused
before it writes leaves nothing behind), appended through the output writer
(:func:`kvreplay.core.outputs.append_output`: a regular file of that name only, never a
link, a hard link or a FIFO planted in the folder, which the check refuses before it
runs)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvreplay.core.outputs import append_output
from kvreplay.ledger import ENGINE_LOG, MANIFEST


@contextmanager
def engine_log(out: Path, verbose: bool) -> Iterator[None]:
    """Standard output and error go to ``out/engine.log`` inside the block (appended, so
    a resumed check keeps the log of each attempt; nothing when the engine said
    nothing), unless ``verbose``."""
    if verbose:
        yield
        return
    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            if (out / MANIFEST).is_file() and log.tell():
                log.seek(0)
                append_output(out / ENGINE_LOG, log)


def run_line(out: Path, verbose: bool) -> str:
    """A check's last line: its run folder, how to audit it, and where the engine's log
    went (nothing when it is on the terminal or the engine said nothing)."""
    log = out / ENGINE_LOG
    said = f"; the engine's own log is {log}" if log.is_file() and not verbose else ""
    return f"check run: {out} (kvreplay audit {out} re-executes it{said})"
