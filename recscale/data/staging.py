"""Where ``recscale data prepare`` writes: a hidden staging folder beside ``--out``, renamed into
place when everything is written, so a failed or killed prepare leaves no half-written output
and a rerun into the same ``--out`` needs no ``--overwrite``."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from recscale.atomic import OutputPathError, check_output_dir
from recscale.data.errors import shown
from recscale.data.prepared import MANIFEST


def check_out(out: Path, overwrite: bool) -> None:
    """Before any work: ``--out`` must be a directory (or creatable as one) next to which a
    folder can be written, empty unless ``--overwrite``."""
    check_output_dir(out, "--out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        what = "a prepared dataset" if (out / MANIFEST).exists() else "files"
        raise FileExistsError(f"--out: '{out}' already holds {what}; pass --overwrite to replace it")


def staging(out: Path) -> Path:
    """A new, empty hidden folder that everything is written into and that becomes ``out`` at
    the end: a sibling of ``out``, or inside it when ``out`` is a mount point (which cannot be
    renamed); a failed prepare leaves nothing at ``--out``."""
    where = out if _is_mount(out) else out.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=where))
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # a plain folder's permissions, not mkdtemp's owner-only ones
    except OSError as e:
        raise OutputPathError(f"--out '{out}': cannot create a folder in '{where}' ({e.strerror}); "
                              "give a writable path") from None
    return tmp


def publish(tmp: Path, out: Path) -> None:
    """Make the finished folder ``out``. A sibling is renamed to ``out``; an earlier ``out``
    (empty, or replaced with ``--overwrite``) is moved aside first and deleted after. Inside a
    mount point, the old entries are deleted (the manifest first) and the new ones moved up (the
    manifest last): a reader never takes a half-moved folder for a finished one."""
    if tmp.parent == out:
        _clear(out, keep=tmp)
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == MANIFEST):
            os.rename(p, out / p.name)
        tmp.rmdir()
        return
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old)  # onto the new empty folder
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _is_mount(out: Path) -> bool:
    return out.is_dir() and os.path.ismount(out)


def _clear(out: Path, keep: Path) -> None:
    (out / MANIFEST).unlink(missing_ok=True)  # first: the folder is no finished dataset from here on
    for p in out.iterdir():
        if p == keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG)


def write_error(e: OSError, out: Path) -> OutputPathError | None:
    """A one-line error for a failed write into the output (a full disk, most often); None for
    other errors. Arrow's write errors carry the reason in the text, not always the errno."""
    text = str(e)
    full = e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text or "quota" in text.lower()
    if not full and e.errno not in WRITE_ERRNOS:
        return None
    reason = "no space left on the device" if full else (e.strerror or text)
    return OutputPathError(f"--out '{out}': writing the prepared data failed: {shown(reason, 120)[1:-1]}; "
                           f"nothing was kept; {'free space or ' if full else ''}choose another --out")
