"""The progress bars of the planners and recipes: tqdm, drawn for a terminal or for a log.

On a terminal (or in a notebook) a bar redraws as tqdm does. Where stderr is a file or a pipe (a
log, CI, ``| tee``), each redraw is another line: the bar is drawn at most every
:data:`LOG_INTERVAL_S` seconds (and at its end), and a bar nested under another (one serve run of a
comparison) is not drawn at all, since its cursor moves (``ESC[A``) only make sense on a terminal.

Our bars write under a thread lock where tqdm has made none yet, not its default multiprocessing
one: the bars of a recipe live in one process (rank 0's), and a rank killed when a run stops (Ctrl-C,
another rank's error) would leave that semaphore behind ("resource_tracker: ... leaked semaphore").
The lock is set on a subclass of our own: the user's tqdm class keeps its lock (``process_map``
sends it to spawned workers, which a thread lock cannot reach).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

#: seconds between two redraws of a bar whose stderr is not a terminal
LOG_INTERVAL_S = 30.0

_BAR_CLASSES: dict[type, type] = {}  # tqdm.auto's class -> our subclass of it with a thread lock


def _bar_class(tqdm: type) -> type:
    """``tqdm`` with a thread lock where it has no lock yet (see the module docstring), as a subclass."""
    if tqdm not in _BAR_CLASSES:
        bar = type("MoelayersBar", (tqdm,), {})
        if not hasattr(tqdm, "_lock") and hasattr(tqdm, "set_lock"):  # (a stand-in class has no lock to set)
            bar.set_lock(threading.RLock())
        _BAR_CLASSES[tqdm] = bar
    return _BAR_CLASSES[tqdm]


def _usable(stream: Any) -> bool:
    """Whether ``stream`` can be written: not ``None`` (Python's stderr when fd 2 is closed) and open."""
    if stream is None:
        return False
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is one): no descriptor, a StringIO
        return not getattr(stream, "closed", False)
    try:  # (an empty write: fd 2 closed at start (2>&-) fails, or is a file opened since for reading)
        os.write(fd, b"")
        return True
    except OSError:
        return False


def progress_bar(iterable: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "it",
                 nested: bool = False, leave: bool = True) -> Any:
    """A tqdm bar on stderr over ``iterable`` (or, with ``None``, one updated by hand up to ``total``).

    Args:
        desc, total, unit, leave: as tqdm's.
        nested: drawn on the line under another bar (``position=1``, not left behind); not drawn
            where stderr is not a terminal.

    Without a usable stderr (closed: ``2>&-``) nothing is drawn and the work goes on.
    """
    from tqdm.auto import tqdm

    notebook = any(c.__module__.startswith("tqdm.notebook") for c in tqdm.__mro__)  # (tqdm.auto's class in a kernel)
    if not notebook and not _usable(sys.stderr):
        return _bar_class(tqdm)(iterable, desc=desc, total=total, unit=unit, disable=True)
    to_log = not sys.stderr.isatty() and not notebook
    pacing = {"mininterval": LOG_INTERVAL_S, "maxinterval": LOG_INTERVAL_S} if to_log else {}
    return _bar_class(tqdm)(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=leave and not nested,
                            position=1 if nested else None, disable=nested and to_log, **pacing)
