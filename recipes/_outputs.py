"""The recipes' run dir: held by one run at a time, written whole or not at all.

A recipe claims its run dir (:func:`claim_run_dir`) before it starts its ranks, writes its outputs
through :func:`commit_files` (a set of files moved in together once all are written) or
:func:`write_json` (one file, atomically), removes an earlier run's outputs it does not write
(:func:`remove_stale`), and ends on Ctrl-C with one line (:func:`run_recipe`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import math
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from collections.abc import Callable
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # (Windows: run dirs are not held)
    fcntl = None

__all__ = ["RUN_LOCK", "under_torchrun", "writes_outputs", "pipe_safe_output", "run_dir", "claim_run_dir", "recipe_outputs_in", "is_bench_record", "run_recipe",
           "jsonable", "remove_stale", "commit_files", "warn", "write_json"]


def under_torchrun() -> bool:
    """True when ``torchrun`` (or any launcher setting ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``) started us."""
    return all(k in os.environ for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))


def writes_outputs() -> bool:
    """Whether this process writes the run's outputs: not a torchrun rank other than 0."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def run_dir(default: str = ".") -> str:
    """The Hydra run (output) dir, or ``default`` outside a Hydra app."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.output_dir)
    except Exception:  # not inside @hydra.main
        return os.path.abspath(default)


#: the file a run keeps in its run dir while it runs (see claim_run_dir)
RUN_LOCK = ".moelayers-run.lock"


def claim_run_dir(recipe: str) -> str:
    """The run dir (:func:`run_dir`), held by this run until its process exits (or, in a ``-m``
    sweep, until the sweep's next job claims its own dir: one held at a time): a run started into
    the dir of a run still going is refused, since the two would overwrite some of each other's
    files and leave a mix (``hydra.run.dir`` given twice, a script that did not vary it). The hold
    is an exclusive ``flock`` on :data:`RUN_LOCK` (the file names the holder), which the system
    releases when the holder's process ends however it ends, so a killed run holds nothing. Under
    torchrun rank 0 holds it (the others write nothing there). Where it cannot be held (no
    ``fcntl`` on Windows, a file system without locks, another user's lock file) the run goes on
    unheld, with a note saying so.

    Raises:
        RuntimeError: another live run holds the dir (naming it, and how to go on).
        ValueError: the dir holds another recipe's outputs (:func:`recipe_outputs_in`), which this
            run's files would mix with or replace (profile's ``curves.npz`` by plan's copy).
        PermissionError: the dir cannot be created or written into.
    """
    out = run_dir()
    if not writes_outputs():
        return out
    _refuse_another_recipes_dir(out, recipe)
    _refuse_unwritable(out)
    if fcntl is None:
        return out
    lock = Path(out) / RUN_LOCK
    if str(lock) in _HELD:
        return out  # this process holds it already (a recipe's main called again, e.g. a -m sweep's jobs)
    for earlier in list(_HELD):  # an earlier job of a -m sweep (run one after another in this process): done
        _release_run_dir(Path(earlier))
    for _ in range(10):
        fd = None
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (f"another run ({holder.get('recipe', '?')}, process {holder.get('pid', '?')} on "
                   f"{holder.get('host', '?')}, started {holder.get('started', '?')}) is writing into this run dir"
                   if holder else "another run is starting in this run dir just now")
            raise RuntimeError(f"{out}: {who}: wait for it to end, or give this run another hydra.run.dir") from None
        except OSError as exc:  # no locks on this file system (ENOLCK, ENOSYS, ...), another user's lock file
            if fd is not None:
                os.close(fd)
            print(f"note: {out} is not held for this run ({lock}: {exc.strerror or exc}): a second run started "
                  f"into it meanwhile would not be refused", file=sys.stderr, flush=True)
            return out
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the file this one locked was removed by a run that ended meanwhile: lock the new one
    else:
        raise RuntimeError(f"{out}: could not take {lock} (runs starting and ending in this run dir at once)")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "recipe": recipe,
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except OSError as exc:  # a full disk: the run could not write its outputs there either
        try:
            lock.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            os.close(fd)
        raise OSError(exc.errno, f"{out}: cannot write {RUN_LOCK} there ({exc.strerror}): the run's outputs could "
                                 "not be written either") from exc
    _HELD[str(lock)] = fd
    atexit.register(_release_run_dir, lock)
    return out


def _first_key(path: str | os.PathLike) -> str | None:
    """The first key of the JSON object in ``path``, read from its first bytes only (the recipes'
    files start with a key of their own; a large file is not parsed for it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512).decode("utf-8", "replace")
    except OSError:
        return None
    match = re.match(r'\s*\{\s*"([^"\\]*)"', head)
    return match.group(1) if match else None


def _bench_record(path: str | os.PathLike) -> dict | None:
    """The ``recipes/bench.py`` record in ``path`` (a JSON object starting with ``device_name``, as
    every record does, with ``tokens_per_rank`` and ``ms``; a few kB: larger files are not read),
    else ``None``."""
    if not str(path).endswith(".json") or _first_key(path) != "device_name":
        return None
    try:
        if os.path.getsize(path) > 1 << 20:
            return None
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and {"tokens_per_rank", "ms"} <= set(rec) else None


def is_bench_record(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``recipes/bench.py`` record."""
    return _bench_record(path) is not None


def _npz_names(path: Path) -> list[str]:
    """The arrays an npz file holds (its zip directory only), ``[]`` when it is not one."""
    try:
        with zipfile.ZipFile(path) as z:
            return [n[:-4] for n in z.namelist()]
    except (OSError, zipfile.BadZipFile):
        return []


#: a file in a ``bench.save_to`` folder, which keeps the records of every run: not a run dir
BENCH_STORE_MARK = ".moelayers-bench-records"


def recipe_outputs_in(out_dir: str | os.PathLike) -> dict[str, list[str]]:
    """The recipes whose outputs ``out_dir`` holds: ``{recipe: [file names]}``, by the files only
    that recipe writes: serve's ``results.json`` and plan's ``report.json`` (each told by its first
    key, not by its name alone), profile's ``curves.npz`` (with ``device_names``: plan's copy has
    none), bench's records, profiler traces and ``bench.png``, and a ``bench.save_to`` folder
    (``bench.py (save_to)``: :data:`BENCH_STORE_MARK`, or records of more than one run)."""
    folder = Path(out_dir)
    if not folder.is_dir():
        return {}
    names = {p.name for p in folder.iterdir() if p.is_file()}
    records = {n: _bench_record(folder / n) for n in names if n.endswith(".json")}
    records = {n: r for n, r in records.items() if r is not None}
    # records of several runs: a bench.save_to folder (one written before it got its mark), not a run dir
    store = BENCH_STORE_MARK in names or len({(str(r.get("date")), str(r.get("command"))) for r in records.values()}) > 1
    found = {"serve.py": [n for n in ("results.json",) if n in names and _first_key(folder / n) == "throughput_tok_s"],
             "plan.py": [n for n in ("report.json",) if n in names and _first_key(folder / n) == "planner"],
             "profile.py": [n for n in ("curves.npz",) if n in names and "device_names" in _npz_names(folder / n)],
             "bench.py": sorted(n for n in names if n == "bench.png" or (n.startswith("profile_") and n.endswith(
                 "_rank0.json")) or n in records),
             "bench.py (save_to)": sorted(set(records) | ({BENCH_STORE_MARK} & names)) if store else []}
    return {recipe: files for recipe, files in found.items() if files}


def _refuse_unwritable(out: str) -> None:
    """Refuse a run dir this process cannot write into (read-only, another user's) before the run,
    not at its end, when the outputs would have nowhere to go (a journey lost a whole run so)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"{out}: the run dir is a file: give a hydra.run.dir that is a folder (or none yet)")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".moelayers-write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PermissionError(f"{out}: the run dir cannot be written ({exc.strerror or exc}): give a "
                              "hydra.run.dir this run can write into") from None


def _refuse_another_recipes_dir(out: str, recipe: str) -> None:
    """Refuse a run dir that holds another recipe's outputs (a reused ``hydra.run.dir``): the two
    runs' files would mix there, and plan's ``curves.npz`` would replace profile's. A
    ``bench.save_to`` folder is refused to every recipe: a run dir holds one run's files, and a
    bench run removes an earlier run's records from it."""
    held = recipe_outputs_in(out)
    if "bench.py (save_to)" in held:
        raise ValueError(f"{out} is a bench.save_to folder, which keeps the records of every run and configuration "
                         f"(it holds {BENCH_STORE_MARK} or records of several runs): a run dir holds one run's files "
                         "(a bench run there would remove the earlier records): give this run another hydra.run.dir")
    others = {r: files for r, files in held.items() if r != recipe}
    if others:
        held = "; ".join(f"{r}'s {', '.join(files[:3])}{' ...' if len(files) > 3 else ''}" for r, files in others.items())
        raise ValueError(f"{out} holds the outputs of another recipe ({held}): {recipe}'s files would mix with them "
                         "(or replace some of them): give this run another hydra.run.dir, or move those files away")


#: run dir locks this process holds: path -> file descriptor (see claim_run_dir)
_HELD: dict[str, int] = {}


def _read_holder(fd: int) -> dict:
    """The record in a held lock (``{}`` while its holder has not written it yet)."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _release_run_dir(lock: Path) -> None:
    """Remove the lock file, then let it go (removed first: a run that opened this file before it
    was removed, and locks it after, finds it gone and locks a new one)."""
    fd = _HELD.pop(str(lock), None)
    if fd is None:
        return
    try:
        lock.unlink(missing_ok=True)
    except OSError:  # (a file system remounted read-only meanwhile: the lock goes with the descriptor)
        pass
    finally:
        os.close(fd)


#: whether this process has started the run's ranks (:func:`mark_launched`): an error before it is a
#: refused setting, which every rank under torchrun meets alike
_LAUNCHED = {"ranks": False}


def mark_launched() -> None:
    """Called by ``launch`` as the ranks start: errors from here on are the run's own."""
    _LAUNCHED["ranks"] = True


#: Hydra's flags that print something and run nothing (under torchrun, rank 0 prints it)
_PRINT_ONLY_FLAGS = frozenset({"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "-p",
                               "--package"})


class _PipeSafeStream:
    """A text stream whose reader may go away (``recipe | head -2``): after a ``BrokenPipeError`` its
    descriptor points at the null device (or, without one, what is written is dropped), and the run
    goes on (and writes its files) without output."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._dropped = False

    def write(self, text: str) -> int:
        if self._dropped:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._dropped:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())  # (what is still buffered goes there too)
            finally:
                os.close(devnull)
        except (OSError, ValueError):  # (io.UnsupportedOperation is one: no descriptor) drop it here
            self._dropped = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def pipe_safe_output() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`_PipeSafeStream` (once; a closed one, ``None``,
    is left as it is)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeSafeStream):
            setattr(sys, name, _PipeSafeStream(stream))


#: seconds a rank other than 0 waits after telling a refusal before the run started, so that rank 0's
#: full message comes first (see :func:`run_recipe`)
REFUSAL_GRACE_S = 5.0


def run_recipe(main: Callable[[], Any]) -> None:
    """Run a recipe's Hydra ``main``; Ctrl-C ends it with one line instead of a traceback (exit
    status 130, as a shell reports it).

    Under torchrun every rank composes the config and runs the recipe's checks: a refused setting
    is told with its traceback by rank 0 (as Hydra prints it) and as its message alone by each other
    rank (Hydra adds its "Error executing job" line), not the whole traceback once per rank (the other
    ranks then wait :data:`REFUSAL_GRACE_S` before they exit: torchrun stops every rank at the first
    exit, which could stop rank 0 before it printed); an error of the run itself (after the ranks
    started) is told in full by every rank that meets it.
    Ctrl-C's line, ``--help`` and ``--cfg`` come from rank 0.
    """
    rank = int(os.environ.get("RANK", "0")) if under_torchrun() else 0
    pipe_safe_output()  # (`| head`, `2>&1 | head`: the run goes on and writes its files)
    if rank:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing: told below
        if any(a.split("=", 1)[0] in _PRINT_ONLY_FLAGS for a in sys.argv[1:]):  # --help, --cfg job: rank 0 prints
            sys.stdout = open(os.devnull, "w")
    try:
        main()
    except KeyboardInterrupt:
        if not rank:
            print("\ninterrupted: files this run had not finished were not written (each output is written "
                  "whole or not at all; an earlier run's stay where this one did not replace them)",
                  file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as exc:
        if not rank:
            raise
        if _LAUNCHED["ranks"]:
            traceback.print_exc()
        else:  # (the whole message: a setting refused on this rank alone, a file missing on its node, is told here only)
            print(f"rank {rank} stopped before the run started: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
            # torchrun's agent stops every rank at the first exit: rank 0, which refuses a setting of the
            # command line too, is given the time to tell it in full first (a loaded machine let this rank
            # exit before rank 0 had printed); where rank 0 refuses nothing, it waits for this rank anyway
            time.sleep(REFUSAL_GRACE_S)
        sys.exit(1)


def warn(message: str) -> None:
    """A recipe's warning: ``warning: MESSAGE`` on stderr (stdout keeps the tables and notes)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def jsonable(obj: Any) -> Any:
    """Plain-JSON copy: tensors/numpy to lists/scalars, non-finite floats to ``None``, paths to str."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.tolist())
    if hasattr(obj, "tolist") and type(obj).__module__ == "numpy":
        return jsonable(obj.tolist())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, (Path, torch.dtype)):
        return str(obj)
    return str(obj)


def remove_stale(out_dir: str | os.PathLike, outputs: tuple[str, ...], written: Any) -> list[str]:
    """Remove every file of ``outputs`` (all a recipe may write into its run dir) that this run does
    not write (``written``), so that a reused run dir never mixes two runs' files (each one removed
    is named on stdout). Returns the names removed."""
    removed = []
    for name in outputs:
        path = Path(out_dir) / name
        if name not in written and path.exists():
            path.unlink(missing_ok=True)
            removed.append(name)
            print(f"note: removed {path}, an earlier run's output that this run does not write")
    return removed


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold a Ctrl-C (SIGINT) or a SIGTERM (what torchrun sends its workers on Ctrl-C) that comes
    inside the block until it ends, then deliver it as it would have been (``KeyboardInterrupt``, the
    process's end, or the handler set before): for a few file moves that must happen together. Also
    when the block raises (the signal is not lost). Outside the main thread (where no signal
    handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():  # (None: a handler set outside Python, which cannot be put back)
            signal.signal(sig, handler if handler is not None else
                          signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        _deliver(list(dict.fromkeys(caught)))  # each once, in the order they came


def _deliver(signals: list[int]) -> None:
    """Raise each of ``signals`` in turn, the later ones also when an earlier one's handler raises."""
    if signals:
        try:
            signal.raise_signal(signals[0])
        finally:
            _deliver(signals[1:])


def _remove_dead_temporaries(out: Path, names: tuple[str, ...]) -> None:
    """Remove the temporary files (``.NAME.*.tmp``, and ``..NAME.*`` of a writer's own) of ``names`` that a run killed while writing
    them (SIGKILL, SIGTERM) left in ``out``, where this process holds the run dir (no other live
    run writes there): those last written before this process started, so not this run's."""
    import psutil

    from moelayers.files import temp_stem

    if str(out / RUN_LOCK) not in _HELD:  # (unheld: a live run's, whose clock may differ, could be among them)
        return
    started = psutil.Process().create_time()
    for name in names:  # (and the temporaries atomic_write made of those: ``..NAME.*.tmp.*.tmp``)
        stem = temp_stem(name)
        nested = temp_stem("." + stem + ".")
        for tmp in [*out.glob(f".{glob_escape(stem)}.*.tmp"), *out.glob(f".{glob_escape(nested)}*.tmp")]:
            try:
                if tmp.is_file() and tmp.stat().st_mtime < started - 1.0:
                    tmp.unlink()
            except OSError:
                pass  # (gone meanwhile, or not ours to remove)


def _about_temporary(exc: OSError, tmp: Path) -> bool:
    """Whether ``exc`` is about writing ``tmp`` (or a temporary of its own beside it), not another
    file a writer read or wrote (whose error names that file)."""
    return exc.filename is None or Path(exc.filename).parent == tmp.parent and Path(exc.filename).name.startswith(
        (tmp.name, "." + tmp.name[:60]))


def commit_files(out_dir: str | os.PathLike, writers: dict[str, Callable[[Path], None]],
                 stale: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> list[Path]:
    """Write several files into ``out_dir`` all or nothing.

    Every writer first writes a temporary file in ``out_dir``; only when all succeeded are they moved
    to their names with ``os.replace``, in the given order (put the file that marks a finished run
    last). On failure the temporary files are removed and nothing is moved; an output name taken by
    a folder is refused before anything is written. (A failure of ``os.replace`` itself, e.g. a disk
    error mid-way, leaves the files moved before it, never a temporary file.) The ``optional`` files
    (plots: views of the data) are left out with a warning on stderr when their writer raises an
    ``Exception``, and the rest is written: a plot that fails must not lose a finished run. Each
    file is flushed to disk before the moves and the folder after them: a crash or a power cut just
    after a run leaves its files whole (not empty ones in place of an earlier run's).

    Args:
        out_dir: destination folder (created if missing).
        writers: file name -> function writing that file's content to the path it is given.
        stale: other outputs of the same recipe: removed (before the moves) when this run does not
            write them, so that a reused run dir never mixes two runs' files. Name the ``optional``
            files here too: an earlier run's copy of one that fails is removed.
        optional: names of ``writers`` whose failure leaves them out instead of failing the rest.

    Returns:
        The final paths (an optional file that failed is not among them).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folders = [name for name in writers if (out / name).is_dir()]
    if folders:  # found before anything is written, not when the first files have been moved in
        raise IsADirectoryError(f"{out}: {', '.join(folders)} is a directory: cannot write the run's files there")
    from moelayers.files import file_mode, fsync_file, fsync_folder, temp_stem

    _remove_dead_temporaries(out, (*writers, *stale))
    mode = file_mode()
    tmps: dict[str, Path] = {}
    left_out: list[str] = []  # optional files whose writer failed: told once the rest is in
    try:
        for name, write in writers.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{temp_stem(name)}.", suffix=".tmp")
            os.close(fd)
            tmps[name] = Path(tmp)
            try:
                write(tmps[name])
                fsync_file(tmps[name])  # on disk before it replaces an earlier run's file (a crash, a power cut)
            except Exception as exc:
                if name not in optional:
                    if isinstance(exc, OSError) and exc.errno is not None and _about_temporary(exc, tmps[name]):
                        # a full disk: the output named, not its temporary (another file's error stays its own)
                        raise OSError(exc.errno, f"{out / name}: cannot write ({exc.strerror})") from exc
                    raise
                tmps.pop(name).unlink(missing_ok=True)
                left_out.append(f"{out / name} not written ({type(exc).__name__}: {exc}); the run's other files are "
                                "written without it")
                continue
            os.chmod(tmps[name], mode)  # the permissions of a plain open(), not mkstemp's 0600
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    with _interrupts_deferred():  # a Ctrl-C between two moves would leave one run's file beside another's
        moved: list[str] = []
        try:
            removed = remove_stale(out, stale, tmps)
            for name, tmp in tmps.items():
                try:
                    os.replace(tmp, out / name)
                except OSError as exc:
                    if exc.errno is None:
                        raise
                    done = (f"this run's {', '.join(moved)} moved in already" if moved else
                            "nothing of this run moved in")
                    if removed:
                        done += f", the earlier {', '.join(removed)} removed (this run does not write it)"
                    raise OSError(exc.errno, f"{out / name}: cannot move this run's file in ({exc.strerror}); {done}: "
                                             "rerun into this dir or another") from exc
                moved.append(name)
        finally:  # a failed move leaves no temporary file behind (before a held signal ends the process)
            for tmp in tmps.values():
                tmp.unlink(missing_ok=True)
    fsync_folder(out)  # the moves themselves
    for message in left_out:
        warn(message)
    return [out / name for name in tmps]


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``jsonable(obj)`` to ``path`` (parents created), indented, atomically (never half a
    file, even if the run dies while writing); returns the path."""
    from moelayers.files import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n").encode()
    return atomic_write(path, lambda f: f.write(text))
