"""The one way a command writes (design: output writer): every file a user names
(``check --json``, ``--junit``, ``--repro``, ``--out``, ``mismatch --json``, ``analyze
-o``, ``report --out-dir``, ``items cut-refeed --out``) and the engine's log in a run
folder, each checked against what the command reads before any work starts, and
written after.

A name is not a file: a hard link, a symlink or another spelling reaches a file by a
name that is not its own. So a target is compared with every file of every input (the
run folder, the items, the model, the plan, the logged rollouts) by device and inode,
not by name, and a folder target is compared with every input folder it could hold or
lie in. A target that is a symbolic link (dangling or not), a hard link of another
file, a device node, a FIFO or a socket is refused: kvreplay writes no output through
anything but a regular file of its own name. A target in a kernel folder (``/proc``,
``/sys``, ``/dev``: ``os.access`` answers yes to root there) or in a folder that takes
no new file is refused too, before the command spends minutes on work whose result it
cannot write. Writes replace a name, never write through it
(:func:`kvreplay.core.paths.replace_file`); the one append (a check's ``engine.log``)
opens only a regular file of that name, never through a link and never blocking.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import probe_folder, replace_file

# Folders that hold the kernel's views, not storage: nothing kvreplay writes belongs there.
SYSTEM_FOLDERS = (Path("/proc"), Path("/sys"), Path("/dev"))
MAX_INPUT_FILES = 100_000  # files of one input folder compared (a model or a run holds few)

Inode = tuple[int, int]


def _inode(path: Path, follow: bool) -> Inode | None:
    try:
        found = path.stat() if follow else path.lstat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _exists(path: Path) -> bool:
    """Whether ``path`` names something (a name the file system cannot hold names
    nothing here; its reader refuses it in its own sentence)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def in_system_folder(path: Path) -> Path | None:
    """The kernel folder ``path`` lies in (as written or resolved), or None."""
    absolute = path.absolute()
    for system in SYSTEM_FOLDERS:
        for candidate in (absolute, path.resolve()):
            if candidate == system or system in candidate.parents:
                return system
    return None


@dataclass
class Inputs:
    """What a command reads: files, and folders whose every file it may read."""

    files: dict[Inode, Path] = field(default_factory=dict)
    folders: list[Path] = field(default_factory=list)

    @classmethod
    def of(cls, paths: Iterable[Path | str | None]) -> Inputs:
        """The inputs among ``paths`` that exist (a built-in item set or an embedded
        model's name is not a path, and a run folder may not exist yet)."""
        found = cls()
        for path in paths:
            if path is not None and str(path) and _exists(Path(path)):
                found.add(Path(path))
        return found

    def add(self, path: Path) -> None:
        """A file, or a folder and every file in it."""
        if path.is_dir():
            self.folders.append(path.resolve())
            self.add_files(path)
        else:
            self._inodes(iter([path]))

    def add_files(self, folder: Path, but: Iterable[str] = ()) -> None:
        """Every file in ``folder`` but those named ``but`` (what the command itself
        writes there), without the folder: a target may lie in it."""
        skipped = set(but)
        self._inodes(
            Path(root) / name
            for root, _, names in os.walk(folder)
            for name in names
            if Path(root, name).relative_to(folder).parts[0] not in skipped
        )

    def _inodes(self, files: Iterator[Path]) -> None:
        for count, file in enumerate(files):
            if count >= MAX_INPUT_FILES:
                break
            for follow in (False, True):  # the link itself and what it points at
                inode = _inode(file, follow)
                if inode is not None:
                    self.files.setdefault(inode, file)

    def holding(self, path: Path) -> Path | None:
        """The input file ``path`` is another name of, or None."""
        for follow in (False, True):
            inode = _inode(path, follow)
            if inode is not None and inode in self.files:
                return self.files[inode]
        return None

    def folder_of(self, path: Path, holds: bool = True) -> Path | None:
        """The input folder ``path`` lies in or (``holds``) holds, resolved, or None."""
        where = path.resolve()
        for folder in self.folders:
            if where == folder or folder in where.parents or (holds and where in folder.parents):
                return folder
        return None


def _refuse(flag: str, path: Path, why: str) -> KvreplayError:
    return KvreplayError(f"{flag} {path} {why}; name another path.")


def target_problem(path: Path, folder: bool = False) -> str | None:
    """Why what is at ``path`` cannot be replaced by an output (a file, or a ``folder``),
    or None (nothing there, or a regular file of that name alone, or a folder)."""
    try:
        found = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there; whether its folder takes files is checked apart
    except OSError as exc:
        return f"cannot be looked up ({exc.strerror or exc})"
    mode = found.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link (kvreplay writes nothing through a link)"
    if stat.S_ISDIR(mode):
        return None if folder else "is a folder"
    if stat.S_ISREG(mode):
        if folder:
            return "exists and is not a folder"
        if found.st_nlink > 1:
            return "is a hard link: the same file has another name elsewhere"
        return None
    kind = (
        "a device node"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
    )
    return f"is {kind}, not a {'folder' if folder else 'regular file'}"


def check_run_folder(path: Path, reads: Iterable[Path | str | None]) -> None:
    """A run folder (``--out``) as an output, before anything is read or written: not a
    link, a device or a file, not in a kernel folder, not in a folder the command reads
    (a model's), and in a folder that takes files (a run folder may hold its inputs: a
    resume reads its own items)."""
    check_folder_target("--out", path, Inputs.of(reads), holds=False)


def check_file_target(flag: str, path: Path, inputs: Inputs) -> None:
    """Refuse, before any work, a file target that is an input under another name, lies
    in an input folder or a kernel folder, is not a regular file of its own name (a
    link, a hard link, a device, a FIFO), or whose folder takes no new file."""
    system = in_system_folder(path)
    if system is not None:
        raise _refuse(flag, path, f"lies in {system}, which holds no files kvreplay writes")
    same = inputs.holding(path)
    if same is not None:
        raise _refuse(flag, path, f"is another name of {same}, which this command reads")
    folder = inputs.folder_of(path.parent.resolve() / path.name)
    if folder is not None:
        raise _refuse(flag, path, f"lies inside {folder}, which this command reads")
    problem = target_problem(path)
    if problem is not None:
        raise _refuse(flag, path, problem)
    _check_folder_takes_files(flag, path, path.parent)


def check_folder_target(flag: str, path: Path, inputs: Inputs, holds: bool = True) -> None:
    """Refuse, before any work, a folder target that lies in or (``holds``: a target
    whose subfolders are written) holds an input folder, lies in a kernel folder, is a
    link or anything but a folder, or whose nearest existing folder takes no new file."""
    system = in_system_folder(path)
    if system is not None:
        raise _refuse(flag, path, f"lies in {system}, which holds no files kvreplay writes")
    folder = inputs.folder_of(path, holds)
    if folder is not None:
        raise _refuse(flag, path, f"lies in or holds {folder}, which this command reads")
    problem = target_problem(path, folder=True)
    if problem is not None:
        raise _refuse(flag, path, problem)
    existing = path  # the nearest folder that exists, which must take the new ones
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    _check_folder_takes_files(flag, path, existing)


def _check_folder_takes_files(flag: str, path: Path, folder: Path) -> None:
    if not folder.is_dir():
        missing = "is not a folder, so it is not writable" if folder.exists() else "does not exist"
        raise KvreplayError(f"Cannot write {flag} {path}: {folder} {missing}.")
    try:
        probe_folder(folder)
    except OSError as exc:
        raise KvreplayError(
            f"Cannot write {flag} {path}: the folder {folder} takes no new file "
            f"({exc.strerror or exc})."
        ) from exc


@dataclass
class Outputs:
    """One command's outputs: what it reads (``inputs``) and each target it was given,
    checked when named, before any work (no two flags naming one path)."""

    inputs: Inputs
    named: dict[Path, str] = field(default_factory=dict)

    @classmethod
    def reading(cls, *paths: Path | str | None, run: Path | None = None) -> Outputs:
        """The outputs of a command that reads ``paths`` (those that exist) and writes
        the run folder ``run`` (it may not exist yet; no other output lies in it)."""
        found = cls(Inputs.of((*paths, run)))
        if run is not None and run.resolve() not in found.inputs.folders:
            found.inputs.folders.append(run.resolve())
        return found

    def _once(self, flag: str, path: Path) -> None:
        where = path.parent.resolve() / path.name
        if where in self.named:
            raise KvreplayError(f"{flag} and {self.named[where]} name the same path {path}.")
        self.named[where] = flag

    def file(self, flag: str, path: Path | None) -> None:
        """A file target (None: not given), checked now."""
        if path is not None:
            self._once(flag, path)
            check_file_target(flag, path, self.inputs)

    def folder(self, flag: str, path: Path | None) -> None:
        """A folder target (None: not given), checked now."""
        if path is not None:
            self._once(flag, path)
            check_folder_target(flag, path, self.inputs)


def write_output(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path``, a target checked before the work: a new file renamed
    over the name (:func:`replace_file`), after the name is checked again (a link or a
    FIFO planted while the work ran is refused, never written through)."""
    problem = target_problem(path)
    if problem is not None:
        raise KvreplayError(f"Cannot write {path}: it {problem}.")
    try:
        replace_file(path, data)
    except OSError as exc:
        raise KvreplayError(f"Cannot write {path} ({exc.strerror or exc}).") from exc


def check_appendable(path: Path) -> None:
    """Refuse, before any work, a file kvreplay will append to (a check's ``engine.log``)
    that is not a regular file of its own name."""
    problem = target_problem(path)
    if problem is not None:
        raise KvreplayError(f"{path} {problem}; remove it or use a new --out folder.")


def append_output(path: Path, source: BinaryIO) -> None:
    """Append what ``source`` holds to ``path``: opened only if it is a regular file of
    its own name (or made new), never through a link (``O_NOFOLLOW``), and never
    waiting on a FIFO (``O_NONBLOCK``); anything else is refused in one sentence."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        why = (
            "is a symbolic link"
            if exc.errno == errno.ELOOP
            else "is a FIFO"
            if exc.errno == errno.ENXIO
            else exc.strerror or str(exc)
        )
        raise KvreplayError(f"Cannot write {path}: it {why}.") from exc
    with os.fdopen(fd, "ab") as kept:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink > 1:
            raise KvreplayError(f"Cannot write {path}: it is not a regular file of its own.")
        shutil.copyfileobj(source, kept)
