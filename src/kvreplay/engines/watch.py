"""What a supervising process reads when the process it watches dies by a signal (design:
a crash is a sentence): which engine it ran and which row it was on. An engine's native
code (llama.cpp, vLLM's CPU kernels, torch) can take the whole process down with it, and a
dead process says nothing, so the command runs in a child (:mod:`kvreplay.run.supervise`)
that notes here, before each unit, what it is about to run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

WATCH = "KVREPLAY_WATCH"  # the environment variable naming the watch file


def note(backend: str, run_dir: str, key: str) -> None:
    """Record the unit about to run, when a supervisor watches this process (a small
    file replaced whole, so a death mid-write leaves the previous note)."""
    path = os.environ.get(WATCH)
    if not path:
        return
    staged = f"{path}.{os.getpid()}"
    Path(staged).write_text(json.dumps({"engine": backend, "run": run_dir, "row": key}))
    os.replace(staged, path)


def last(path: Path) -> dict[str, Any]:
    """The last note written to ``path`` (empty when none was)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
