"""Where a command writes what the user names (``check --json``, ``--junit``, ``--repro``,
``analyze -o``, ``report --out-dir``, ``items cut-refeed --out``), checked against what
the command reads before any work starts.

A name is not a file: a hard link, a symlink or another spelling reaches a file by a
name that is not its own. So a target is compared with every file of every input (the
run folder, the items, the model, the plan) by device and inode, not by name, and a
folder target is compared with every input folder it could hold or lie in. A target in
a kernel folder (``/proc``, ``/sys``, ``/dev``: ``os.access`` answers yes to root there)
or in a folder that takes no new file is refused too, before the command spends minutes
on work whose result it cannot write. Writes replace a name, never write through it
(:func:`kvreplay.core.paths.replace_file`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvreplay.core.errors import KvreplayError
from kvreplay.core.paths import probe_folder

# Folders that hold the kernel's views, not storage: nothing kvreplay writes belongs there.
SYSTEM_FOLDERS = (Path("/proc"), Path("/sys"), Path("/dev"))
MAX_INPUT_FILES = 100_000  # files of one input folder compared (a model or a run holds few)

Inode = tuple[int, int]


def _inode(path: Path, follow: bool) -> Inode | None:
    try:
        stat = path.stat() if follow else path.lstat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


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
            if path is not None and str(path) and Path(path).exists():
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

    def folder_of(self, path: Path) -> Path | None:
        """The input folder ``path`` lies in or holds (resolved), or None."""
        where = path.resolve()
        for folder in self.folders:
            if where == folder or folder in where.parents or where in folder.parents:
                return folder
        return None


def _refuse(flag: str, path: Path, why: str) -> KvreplayError:
    return KvreplayError(f"{flag} {path} {why}; name another path.")


def check_file_target(flag: str, path: Path, inputs: Inputs) -> None:
    """Refuse, before any work, a file target that is an input under another name, lies
    in an input folder or a kernel folder, is not a regular file, or whose folder takes
    no new file."""
    system = in_system_folder(path)
    if system is not None:
        raise _refuse(flag, path, f"lies in {system}, which holds no files kvreplay writes")
    same = inputs.holding(path)
    if same is not None:
        raise _refuse(flag, path, f"is another name of {same}, which this command reads")
    folder = inputs.folder_of(path.parent.resolve() / path.name)
    if folder is not None:
        raise _refuse(flag, path, f"lies inside {folder}, which this command reads")
    if (path.exists() or path.is_symlink()) and not (path.is_file() or path.is_symlink()):
        raise _refuse(flag, path, "exists and is not a regular file")
    _check_folder_takes_files(flag, path, path.parent)


def check_folder_target(flag: str, path: Path, inputs: Inputs) -> None:
    """Refuse, before any work, a folder target that lies in or holds an input folder,
    lies in a kernel folder, is a file, or whose nearest existing folder takes no new
    file."""
    system = in_system_folder(path)
    if system is not None:
        raise _refuse(flag, path, f"lies in {system}, which holds no files kvreplay writes")
    folder = inputs.folder_of(path)
    if folder is not None:
        raise _refuse(flag, path, f"lies in or holds {folder}, which this command reads")
    if path.exists() and not path.is_dir():
        raise _refuse(flag, path, "exists and is not a folder")
    existing = path
    while not existing.is_dir() and existing != existing.parent:
        existing = existing.parent
    _check_folder_takes_files(flag, path, existing)


def _check_folder_takes_files(flag: str, path: Path, folder: Path) -> None:
    if not folder.is_dir():
        raise KvreplayError(f"Cannot write {flag} {path}: the folder {folder} does not exist.")
    try:
        probe_folder(folder)
    except OSError as exc:
        raise KvreplayError(
            f"Cannot write {flag} {path}: the folder {folder} takes no new file "
            f"({exc.strerror or exc})."
        ) from exc


def check_targets(
    files: dict[str, Path | None], folders: dict[str, Path | None], inputs: Inputs
) -> None:
    """Each file and folder target a command was given (None: not given), checked."""
    for flag, path in files.items():
        if path is not None:
            check_file_target(flag, path, inputs)
    for flag, path in folders.items():
        if path is not None:
            check_folder_target(flag, path, inputs)
