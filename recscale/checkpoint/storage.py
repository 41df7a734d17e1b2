"""Where checkpoint bytes go: a small interface so object stores can plug in; local files first.

Paths are '/'-separated and relative to the storage root. A checkpoint is written under a
temporary name and made visible by ``commit`` (an atomic rename on a filesystem; an object store
would write the manifest last and treat its presence as the commit).
"""

from __future__ import annotations

import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)


class Storage(ABC):
    """The operations the checkpoint writer, reader and retention need, nothing more."""

    @abstractmethod
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """Context manager yielding a binary stream; the file is durable (fsynced) on exit."""

    @abstractmethod
    def write_atomic(self, path: str, data: bytes) -> None:
        """Readers see the old content or ``data``, never part of it."""

    @abstractmethod
    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes from ``offset`` (to the end when None)."""

    @abstractmethod
    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""

    @abstractmethod
    def list_dirs(self, path: str = "") -> list[str]:
        """Names of the entries directly under ``path`` that are directories."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def commit(self, tmp_dir: str, final_dir: str) -> None:
        """Make ``tmp_dir`` visible as ``final_dir`` in one step; an existing ``final_dir`` is
        never replaced (FileExistsError)."""

    @abstractmethod
    def delete_dir(self, path: str) -> None:
        """Remove a directory and everything in it (missing is fine)."""

    @abstractmethod
    def make_dir(self, path: str) -> None: ...

    def describe(self, path: str = "") -> str:
        return path


class LocalStorage(Storage):
    """A directory on a local or shared (network) filesystem."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def describe(self, path: str = "") -> str:
        return str(self._p(path))

    @contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        p = self._p(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes) -> None:
        p = self._p(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(p.parent)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self._p(path), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    def size(self, path: str) -> int | None:
        try:
            return self._p(path).stat().st_size
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def list_dirs(self, path: str = "") -> list[str]:
        p = self._p(path)
        if not p.is_dir():
            return []
        return sorted(e.name for e in p.iterdir() if e.is_dir())

    def commit(self, tmp_dir: str, final_dir: str) -> None:
        src, dst = self._p(tmp_dir), self._p(final_dir)
        # A checkpoint directory is never replaced: another checkpoint may name it as its base.
        # (rename() would replace an empty directory silently, so check first; one writer per run folder.)
        if dst.exists():
            raise FileExistsError(f"{dst} already exists; a checkpoint directory is never overwritten")
        os.rename(src, dst)
        _fsync_dir(dst.parent)

    def delete_dir(self, path: str) -> None:
        # A folder that cannot be removed costs disk space, not correctness: say so, go on.
        def report(_func, name, exc_info) -> None:
            log.warning("checkpoint storage: could not delete %s: %s", name, exc_info[1])

        if self._p(path).exists():
            shutil.rmtree(self._p(path), onerror=report)

    def make_dir(self, path: str) -> None:
        self._p(path).mkdir(parents=True, exist_ok=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: fsync the directory that holds it (where the OS allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        log.warning("checkpoint storage: cannot open folder %s to make a rename durable: %s", path, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on folders; the rename itself happened
        log.warning("checkpoint storage: fsync of folder %s failed, a crash now may undo its last rename: %s", path, e)
    finally:
        os.close(fd)
