"""One writer per run folder: an exclusive OS lock (``flock``) on ``<run>/.kvreplay.lock``.

The kernel drops the lock when the process holding it exits, however it exits, so a
crashed run never leaves a folder stuck; the empty lock file itself stays, harmlessly.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from kvreplay.core.errors import KvreplayError

LOCK_FILE = ".kvreplay.lock"
# Never through a link planted under the name (it would create or lock a file elsewhere),
# never waiting on a FIFO.
FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class RunLock:
    """Held from before a run's first write until the run ends."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or refuse at once; a refusal writes nothing into the folder."""
        if self._fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_FILE, FLAGS, 0o644)
        except OSError as exc:
            raise KvreplayError(
                f"The output folder {self.run_dir} is not writable, or its {LOCK_FILE} is a "
                "link or a FIFO."
            ) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise KvreplayError(f"{self.run_dir / LOCK_FILE} is not a regular file; remove it.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise KvreplayError(
                f"Another kvreplay process is writing to {self.run_dir}; wait for it to end "
                "(a rerun then resumes) or use another --out folder."
            ) from exc
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
