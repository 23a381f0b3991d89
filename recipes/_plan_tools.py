"""Helpers of ``recipes/plan.py``: the mode constants and all-or-nothing outputs.

The metrics of an assignment (``expert_rank [L, E]`` plus ``token_rank [T, L]``) and the even token
spread of the planners without token scheduling are
:func:`moelayers.planning.semantic_eval.lar_report` and
:func:`~moelayers.planning.semantic_eval.even_token_rank`, re-exported here for the recipe.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


from moelayers.files import file_mode
from moelayers.planning.semantic_eval import even_token_rank, lar_report
from recipes._common import remove_stale

__all__ = ["DP_MAX_RATIO", "MODES", "even_token_rank", "lar_report", "commit_files"]

DP_MAX_RATIO = 1.3  # no rank holds more than this × the mean tokens per rank in dp mode
MODES = ("tp", "dp")


def commit_files(out_dir: str | os.PathLike, writers: dict[str, Callable[[Path], None]],
                 stale: tuple[str, ...] = ()) -> list[Path]:
    """Write several files into ``out_dir`` all or nothing.

    Every writer first writes a temporary file in ``out_dir``; only when all succeeded are they moved
    to their names with ``os.replace``, in the given order (put the file that marks a finished run
    last). On failure the temporary files are removed and nothing is moved; an output name taken by
    a folder is refused before anything is written. (A failure of ``os.replace`` itself, e.g. a disk
    error mid-way, leaves the files moved before it, never a temporary file.)

    Args:
        out_dir: destination folder (created if missing).
        writers: file name -> function writing that file's content to the path it is given.
        stale: other outputs of the same recipe: removed (before the moves) when this run does not
            write them, so that a reused run dir never mixes two runs' files.

    Returns:
        The final paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    folders = [name for name in writers if (out / name).is_dir()]
    if folders:  # found before anything is written, not when the first files have been moved in
        raise IsADirectoryError(f"{out}: {', '.join(folders)} is a directory: cannot write the run's files there")
    mode = file_mode()
    tmps: dict[str, Path] = {}
    try:
        for name, write in writers.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
            os.close(fd)
            tmps[name] = Path(tmp)
            write(tmps[name])
            os.chmod(tmps[name], mode)  # the permissions of a plain open(), not mkstemp's 0600
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    try:
        remove_stale(out, stale, tmps)
        for name, tmp in tmps.items():
            os.replace(tmp, out / name)
    finally:  # a failed move leaves no temporary file behind
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    return [out / name for name in tmps]
