"""Write a file so that readers see the old content or the new, never half of it; and check an
output path before the work that produces it starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the option and the fix."""


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``. The file
    gets the permissions a plain ``open()`` would give it (an existing file keeps its own), not
    the owner-only ones of a temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def check_output_file(path: str | os.PathLike[str], what: str) -> None:
    """Raise OutputPathError unless ``path`` can be written as a file: not a directory, and its
    folder exists as a writable directory or can be created. ``what`` names the option."""
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{what} '{p}' is a directory; give a file name in it, e.g. '{p / 'out.json'}'")
    _check_parent(p, what)


def check_output_dir(path: str | os.PathLike[str], what: str) -> None:
    """Raise OutputPathError unless ``path`` is a directory or can be created as one."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{what} '{p}' is a file; give a directory")
    if not p.exists():
        _check_parent(p, what)
    elif (why := _cannot_create_in(p)) is not None:
        raise OutputPathError(f"{what} '{p}': the directory is not writable ({why}); give another one")


def _check_parent(p: Path, what: str) -> None:
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(f"{what} '{p}': '{parent}' is a file, not a directory; give a path in a directory")
    if (why := _cannot_create_in(parent)) is not None:
        raise OutputPathError(f"{what} '{p}': cannot write in '{parent}' ({why}); give a writable path")


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` (None: it can). Tried, since permission bits do
    not tell: root ignores them, and a read-only or special file system refuses whatever they say."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return "permission denied"
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__
