"""Writing and reading the library's npz files: atomically, readable by others, with clear errors.

Every file the library writes (traces, plans, placements, latency curves, run outputs) goes through
:func:`atomic_write`: a temporary file in the destination folder, then ``os.replace``, so a reader
sees the old file or the new one and never half of one; on failure the destination is untouched.
Every npz it reads goes through :func:`read_npz`, so an unreadable or foreign file is a
``ValueError`` that names the path.
"""

from __future__ import annotations

import errno
import os
import secrets
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["FILE_KINDS", "FileKind", "atomic_write", "check_format_version", "file_mode", "fsync_file", "fsync_folder",
           "read_npz", "refuse_other_kind", "warn_unknown_entries"]

# What a damaged zip member or .npy header raises while it is read (an encrypted member: RuntimeError,
# an unknown compression method: NotImplementedError).
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError, RuntimeError, NotImplementedError,
                MemoryError)
#: deflate expands at most about 1032:1; a member claiming more than this per compressed byte lies
_MAX_DEFLATE_RATIO = 1100


def _proc_umask() -> int | None:
    """The umask from ``/proc/self/status`` (Linux), or ``None`` where it is not there."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _umask_at_import() -> int:
    umask = _proc_umask()
    if umask is None:  # no /proc: read it once, here, not each time a file is written
        umask = os.umask(0o022)
        os.umask(umask)
    return umask


_UMASK_AT_IMPORT = _umask_at_import()


def file_mode() -> int:
    """The permissions of a plain ``open()`` under the current umask (``mkstemp`` would give 0600).

    Never calls ``os.umask``, which sets the umask to read it: for a moment, every thread of the
    process would create files with the wrong permissions. Without ``/proc``, the umask at import.
    """
    umask = _proc_umask()
    return 0o666 & ~(_UMASK_AT_IMPORT if umask is None else umask)


def temp_stem(name: str) -> str:
    """The part of a file name that its temporary files carry (``.<stem>.<random>.tmp``): its first
    characters within 64 bytes (a name from ``os.listdir`` may hold undecodable bytes: kept)."""
    stem = name
    while len(os.fsencode(stem)) > 64:
        stem = stem[:-1]
    return stem


def _create_temp(folder: Path, name: str = "") -> tuple[int, Path]:
    """Create a new empty file in ``folder`` with the permissions of a plain ``open()``, named
    ``.<name>.<random>.tmp`` after the destination ``name`` (its first 64 bytes: the name may be near
    the file system's 255-byte limit), so that one left by a killed run says whose it was."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    stem = temp_stem(name)
    for _ in range(100):
        tmp = folder / f".{stem}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp  # the kernel applies the umask
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: cannot create a temporary file")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, fsync: bool = True) -> Path:
    """Write ``path`` all or nothing: ``write(f)`` fills a temporary file beside it, then it replaces ``path``.

    Like a plain ``open(path, "wb")``, a new file gets ``0o666 & ~umask``, an existing file keeps
    its permission bits (one this process may not write, e.g. made read-only to keep it, is
    refused), and a symbolic link is written through (its target is replaced, the link stays).

    Args:
        path: destination; its folder must exist.
        write: writes the content to the binary file object it is given.
        fsync: flush the content to disk before the rename, and the folder after it, so that a
            crash or a power cut just after leaves the new file or the old one, never an empty one
            (a few ms; ``False`` for scratch files).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        FileNotFoundError: the folder does not exist.
        IsADirectoryError: ``path`` is a folder (refused before anything is written).
        PermissionError: ``path`` exists and may not be written (refused before anything is written).
        OSError: the folder is not writable and the like, naming ``path`` (not the temporary file).
    """
    path = Path(path)
    dest = Path(os.path.realpath(path)) if path.is_symlink() else path
    if not dest.parent.is_dir():
        raise FileNotFoundError(f"{path}: directory {dest.parent} does not exist")
    if dest.is_dir():
        raise IsADirectoryError(f"{path} is a directory: cannot write a file there")
    try:
        mode = os.stat(dest).st_mode & 0o777
    except FileNotFoundError:
        mode = None
    if mode is not None and not os.access(dest, os.W_OK):  # open() would refuse it; a rename would not
        raise PermissionError(errno.EACCES, f"{path}: the file may not be written (mode {mode:#o}): not replaced")
    try:
        fd, tmp = _create_temp(dest.parent, dest.name)
    except OSError as e:
        raise _naming(e, path) from e
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)
                write(f)
                if fsync:
                    f.flush()
                    _flush(f.fileno())
        except OSError as e:  # a full disk, a quota, an I/O error: told about the caller's file
            if e.filename is not None and e.filename not in (str(tmp), tmp):  # another file's error: its own
                raise
            raise _naming(e, path) from e
        try:
            os.replace(tmp, dest)
        except OSError as e:
            raise _naming(e, path) from e
        if fsync:  # the rename itself lives in the folder
            fsync_folder(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


#: fsync errors of a file system or a descriptor that cannot flush (not a failure of the disk): passed
#: over (EBADF: Windows flushes a file open for writing only; EROFS: a read-only mount)
_CANNOT_FLUSH = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EROFS})


def _flush(fd: int) -> None:
    """``os.fsync(fd)``, passing over a file system that cannot flush (:data:`_CANNOT_FLUSH`)."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _CANNOT_FLUSH:
            raise


def fsync_file(path: str | os.PathLike) -> None:
    """Flush the content of the file at ``path`` (written by other code: ``np.savez``, a plot) to disk.

    Raises:
        OSError: the disk failed to take it (EIO, a full disk found late), naming ``path``; a file
            system that cannot flush (EINVAL) is passed over.
    """
    try:
        fd = os.open(path, os.O_RDWR)  # (Windows flushes only a file open for writing)
    except OSError:  # a read-only file or mount, a running program: flushed as far as a reader can
        fd = os.open(path, os.O_RDONLY)
    try:
        _flush(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)


def fsync_folder(folder: str | os.PathLike) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk (where the platform can: not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _said(exc: BaseException) -> str:
    """What ``exc`` says, or what it is where it says nothing (a file cut short gives a bare EOFError)."""
    if str(exc):
        return str(exc)
    if isinstance(exc, (EOFError, zipfile.BadZipFile)):
        return f"{type(exc).__name__}: the file ends early; was it cut short, or changed while it was read?"
    return type(exc).__name__


def _naming(error: OSError, path: Path) -> OSError:
    """``error`` told about ``path`` (the caller's file) instead of the temporary file beside it (an
    ``OSError`` of the errno's own class: ``FileNotFoundError``, ``PermissionError``, ...)."""
    if error.errno is None:
        return error
    return OSError(error.errno, f"{path}: cannot write ({error.strerror})")


def _read_member(zf: zipfile.ZipFile, name: str) -> np.ndarray:
    """The array of the ``.npy`` member ``name``, its header checked against the member's size first
    (a damaged header could otherwise claim terabytes)."""
    if not name.endswith(".npy"):
        raise ValueError("not a .npy array")
    with zf.open(name) as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        header_size = f.tell()
    if dtype.hasobject:
        raise ValueError("holds pickled Python objects")
    info = zf.getinfo(name)
    expected = header_size + int(np.prod(shape, dtype=object)) * dtype.itemsize
    if expected != info.file_size:
        raise ValueError(f"its header claims shape {shape} of {dtype} ({expected} bytes with the header) "
                         f"but the member holds {info.file_size} bytes")
    # the zip's size field is as easy to damage as the header: bound it by the bytes really stored
    stored = info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size
    deflated = (info.compress_type == zipfile.ZIP_DEFLATED
                and info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 1024)
    if stored or deflated:
        raise ValueError(f"it claims {info.file_size} bytes from {info.compress_size} stored bytes, "
                         "more than its compression can give")
    with zf.open(name) as f:
        arr = np.lib.format.read_array(f, allow_pickle=False)
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))  # torch takes native order only


def _entries_recorded(path: Path) -> int | None:
    """The member count of the zip's end-of-central-directory record (``None``: no such record in
    the last 64 KiB, or a zip64 archive, whose 16-bit field does not hold the count)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    count = int.from_bytes(tail[at + 10:at + 12], "little")
    return None if count == 0xFFFF else count


def read_npz(path: str | os.PathLike, what: str) -> dict[str, np.ndarray]:
    """Every array of the npz archive at ``path`` (``allow_pickle=False``).

    Args:
        path: the file.
        what: what the file should be, for messages (e.g. ``"latency curve file"``).

    Returns:
        name -> array, one per ``NAME.npy`` member.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IsADirectoryError: ``path`` is a folder.
        PermissionError: ``path`` may not be read (names it).
        ValueError: not a readable npz archive (a ``.npy`` file, a damaged zip or ``.npy`` header,
            sizes the stored bytes cannot hold, pickled objects, a member that is not a ``.npy``
            array, not a regular file), naming ``path`` (and the member).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: {what} not found")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a {what}")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file (a pipe or a device?), not a {what}")
    with open(path, "rb") as f:
        head = f.read(6)
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):  # np.load takes anything else for a pickle, and says so
        raise ValueError(f"{path}: not an npz archive (it starts with {head!r}); a {what} is an npz of named arrays")
    try:
        data = np.load(path, allow_pickle=False)
    except _READ_ERRORS as exc:
        raise ValueError(f"{path}: not a readable npz {what} ({_said(exc)})") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: not an npz archive but a single array (a {what} is an npz of named arrays)")
    arrays = {}
    with data:
        listed, recorded = len(data.zip.infolist()), _entries_recorded(path)
        if recorded is not None and listed != recorded:  # zipfile stops listing at a damaged entry, silently
            raise ValueError(f"{path}: damaged zip directory: it lists {listed} of the {recorded} members its end "
                             f"record counts (optional fields would go missing); not a readable npz {what}")
        for name in data.zip.namelist():
            try:
                arrays[name.removesuffix(".npy")] = _read_member(data.zip, name)
            except _READ_ERRORS as exc:
                raise ValueError(f"{path}: cannot read member {name!r} of this {what} ({_said(exc)})") from exc
    return arrays


@dataclass(frozen=True)
class FileKind:
    """One kind of npz file the library writes: entries every file of the kind has had in every
    format, what it is and how it is used (for the message that tells a reader it got one)."""

    keys: tuple[str, ...]
    description: str
    use: str


#: the library's npz files, by the entries that tell them apart (a plan.py run dir holds three kinds)
FILE_KINDS = {
    "trace": FileKind(("topk_ids", "token_ids", "seq_offsets"), "a routing trace",
                      "read it with moelayers.trace.load_trace, or pass it to a recipe as trace.path=FILE"),
    "semantic_plan": FileKind(("token_rank", "token_conf", "ngram_rank"), "a semantic plan (plan.py's plan.npz)",
                              "read it with SemanticPlan.load, or pass it to serve.py or bench.py as layer=semantic "
                              "layer.plan_path=FILE"),
    "assignment": FileKind(("expert_rank", "token_rank", "seq_offsets"), "plan.py's assignment.npz",
                           "pass it to serve.py as layer.placement_path=FILE (bench.py times the default placement)"),
    "placement": FileKind(("phy2log", "num_experts"), "a placement file (ExpertPlacement.save)",
                          "read it with ExpertPlacement.load, or pass it to serve.py as layer.placement_path=FILE"),
    "curves": FileKind(("rows", "latency_s"), "a latency curve file (profile.py's or plan.py's curves.npz)",
                       "read it with LatencyCurves.load, or pass it to a recipe as curves.path=FILE"),
}


def refuse_other_kind(arrays: dict[str, np.ndarray], path: str | os.PathLike, what: str,
                      kinds: tuple[str, ...]) -> None:
    """Refuse a file that is another of :data:`FILE_KINDS` than the reader's ``kinds`` (plan.py's
    ``plan.npz`` handed to a placement reader), naming what it is and what reads it, before its
    version or fields are looked at: those would say "newer format" or "missing fields" of it.

    Raises:
        ValueError: the file has every entry of another kind and not those of any of ``kinds``.
    """
    present = set(arrays)
    if any(set(FILE_KINDS[k].keys) <= present for k in kinds):
        return
    for name, kind in FILE_KINDS.items():
        if name not in kinds and set(kind.keys) <= present:
            raise ValueError(f"{path}: not a {what} but {kind.description}: {kind.use} (its entries: "
                             f"{sorted(present)})")


def check_format_version(arrays: dict[str, np.ndarray], path: str | os.PathLike, what: str, reads: int,
                         kinds: tuple[str, ...] = ()) -> int:
    """The layout version of a file read by :func:`read_npz` (its ``format_version`` entry; 1 where it
    has none, as files written before the entry existed), checked before anything else in it, so that
    a file of a newer moelayers is told as such and not as a file with unknown or missing fields.

    Args:
        arrays: the file's arrays (left as they are).
        path: the file, for messages.
        what: what the file is, for messages (e.g. ``"placement file"``).
        reads: the newest version this code reads.
        kinds: the :data:`FILE_KINDS` the reader reads: a file of another kind is told as such first
            (:func:`refuse_other_kind`; its version is another layout's).

    Raises:
        ValueError: a file of another kind, an entry that is not a positive integer scalar, or a
            version newer than ``reads``.
    """
    if kinds:
        refuse_other_kind(arrays, path, what, kinds)
    if "format_version" not in arrays:
        return 1
    entry = arrays["format_version"]
    if entry.ndim != 0 or entry.dtype.kind not in "iu" or int(entry) < 1:
        raise ValueError(f"{path}: this {what}'s format_version must be a positive integer scalar, got {entry!r}")
    version = int(entry)
    if version > reads:
        from moelayers import __version__

        raise ValueError(f"{path}: this {what} is of format {version}, written by a newer moelayers; this one "
                         f"({__version__}) reads formats up to {reads}: upgrade moelayers to read it")
    return version


def warn_unknown_entries(arrays: dict[str, np.ndarray], expected: str, known: tuple[str, ...] | list[str],
                         path: str | os.PathLike, kind: str) -> list[str]:
    """Warn (once a job: on rank 0 of an initialised process group) about the entries of a file that
    files of its ``kind`` do not have (``format_version`` aside) and that its reader ignores, e.g. a
    recorder's metadata or what a newer moelayers added without changing the format.

    Args:
        arrays: the file's arrays.
        expected: what files of the kind hold, for the message.
        known: the entries the reader uses.
        path: the file, for messages.
        kind: e.g. ``"placement files"``.

    Returns:
        The ignored names, sorted.
    """
    unknown = sorted(set(arrays) - set(known) - {"format_version"})
    if unknown:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_rank() > 0):
            warnings.warn(f"{path}: ignoring key(s) {unknown} that {kind} do not have (expected {expected})",
                          UserWarning, stacklevel=3)
    return unknown
