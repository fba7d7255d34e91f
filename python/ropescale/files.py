"""Writing outputs whole or not at all, with the user's umask, and checking them before the work.

Every command that writes a file or a folder (``extend``'s model directory and GGUF, RULER's prompt cache, tables
and plots) goes through here, so that Ctrl-C, a full disk or a refused run leaves nothing half-written behind, and
a destination that cannot be written is a usage error before hours of work, not a traceback after them:

- :func:`atomic_file` / :func:`atomic_directory`: the output is written under a hidden temporary name beside the
  destination (same file system) and renamed into place at the end; on any exception (``KeyboardInterrupt``
  included) the temporary is removed and the destination never appears.
- The result has the mode a plain ``open()`` / ``mkdir`` would give (0666 / 0777 less the umask), not
  ``tempfile``'s 0600 / 0700.
- :func:`check_new_path` / :func:`check_writable_file` / :func:`check_writable_directory`: ``ValueError`` with a
  message a user can act on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["umask", "atomic_file", "atomic_directory", "check_new_path", "check_writable_file",
           "check_writable_directory"]


def umask() -> int:
    """The process's umask (read without changing it where /proc tells it; else set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


@contextlib.contextmanager
def atomic_file(dst: str | Path, *, overwrite: bool = True) -> Iterator[Path]:
    """Yields a temporary path beside ``dst`` to write; renames it to ``dst`` (mode 0666 less the umask) when the
    block ends without an exception, removes it otherwise. ``overwrite=False``: an existing ``dst`` is a
    FileExistsError before anything is written, and the rename never replaces one that appeared meanwhile."""
    dst = Path(dst)
    if not overwrite and (dst.exists() or dst.is_symlink()):
        raise FileExistsError(f"{dst} exists: ropescale never overwrites it (remove it, or pick another name)")
    handle, part = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(handle)
    part = Path(part)
    try:
        yield part
        os.chmod(part, 0o666 & ~umask())
        if overwrite:
            os.replace(part, dst)
        else:
            os.link(part, dst)  # fails if dst appeared meanwhile: never replaces a file
            part.unlink()
    except BaseException:
        part.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(dst: str | Path) -> Iterator[Path]:
    """Yields a new empty temporary folder beside ``dst`` to fill; renames it to ``dst`` (mode 0777 less the umask)
    when the block ends without an exception, removes it and everything in it otherwise. ``dst`` must not exist
    (FileExistsError), now or at the rename."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(f"{dst} already exists: ropescale writes a new directory and never overwrites")
    part = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent))
    try:
        yield part
        os.chmod(part, 0o777 & ~umask())
        if dst.exists() or dst.is_symlink():  # made meanwhile: rename(2) would replace an empty folder
            raise FileExistsError(f"{dst} appeared while it was being written: left as it is")
        os.rename(part, dst)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise


def _writable_folder(folder: Path, what: str) -> None:
    if not folder.exists():
        raise ValueError(f"{what}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{what}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: the folder {folder} is not writable")


def check_new_path(path: str | Path, what: str) -> Path:
    """``path`` may be created: it does not exist and its parent is a writable folder. ValueError otherwise."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        raise ValueError(f"{what}: {path} already exists (ropescale never overwrites it: remove it, or pick another "
                         "name)")
    _writable_folder(path.absolute().parent, what)
    return path


def check_writable_file(path: str | Path, what: str) -> Path:
    """``path`` can be written (created or replaced): not a folder, in a writable folder. ValueError otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what}: {path} is a folder, not a file")
    _writable_folder(path.absolute().parent, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what}: {path} is not writable")
    return path


def check_writable_directory(path: str | Path, what: str) -> Path:
    """``path`` is a writable folder, or can be made as one (its nearest existing ancestor is a writable folder).
    ValueError otherwise."""
    path = Path(path).absolute()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{what}: {path} is a file, not a folder")
        _writable_folder(path, what)
        return path
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{what}: {ancestor} is a file, so {path} cannot be made")
    _writable_folder(ancestor, what)
    return path
