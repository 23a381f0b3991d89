"""Writing and reading the library's npz files: atomically, readable by others, with clear errors.

Every file the library writes (traces, plans, placements, latency curves, run outputs) goes through
:func:`atomic_write`: a temporary file in the destination folder, then ``os.replace``, so a reader
sees the old file or the new one and never half of one; on failure the destination is untouched.
Every npz it reads goes through :func:`read_npz`, so an unreadable or foreign file is a
``ValueError`` that names the path.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["atomic_write", "file_mode", "read_npz"]


def file_mode() -> int:
    """The permissions of a plain ``open()`` under the current umask (``mkstemp`` would give 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = False) -> Path:
    """Write ``path`` all or nothing: ``write(f)`` fills a temporary file beside it, then it replaces ``path``.

    Args:
        path: destination; its folder must exist.
        write: writes the content to the binary file object it is given.
        fsync: flush the content to disk before the rename (for files that must survive a crash).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        FileNotFoundError: the folder does not exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """Every array of the npz archive at ``path`` (``allow_pickle=False``).

    Args:
        path: the file.
        what: what the file should be, for messages (e.g. ``"latency curve file"``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a readable npz archive (a ``.npy`` file, a damaged zip, pickled objects),
            naming ``path``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: {what} not found")
    try:
        data = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable npz {what} ({exc})") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: not an npz archive but a single array (a {what} is an npz of named arrays)")
    try:
        with data:
            return {k: data[k] for k in data.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: cannot read the arrays of this {what} ({exc})") from exc
