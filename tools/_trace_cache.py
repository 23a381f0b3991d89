"""Synthetic traces cached on disk under a name that changes with what made them.

The yardsticks regenerate a regime's trace only when its arguments or the code that could make it
changed (the package and the calling script: the tiny-decoder regimes route through the layers): a
cache keyed by the regime's name alone kept scoring traces made by older settings (after a
``tools/calibrate_trace.py --fit`` or a change of a regime), without a word.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import moelayers
from moelayers.trace import RoutingTrace, load_trace, save_trace


def cached_trace(cache: Path, stem: str, arguments: dict, make: Callable[[], RoutingTrace]) -> RoutingTrace:
    """``cache/<stem>_<key>.npz`` if it exists, else ``make()`` written there; ``key`` hashes
    ``arguments`` (JSON), the source of every module of the package and the file ``make`` is in."""
    h = hashlib.blake2b(json.dumps(arguments, sort_keys=True, default=repr).encode(), digest_size=6)
    package = Path(moelayers.__file__).parent  # the one imported (PYTHONPATH may name another tree)
    for source in [*sorted(package.rglob("*.py")), Path(inspect.getsourcefile(make))]:
        h.update(source.read_bytes())
    path = Path(cache) / f"{stem}_{h.hexdigest()}.npz"
    if path.is_file():
        return load_trace(path)
    trace = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, path)
    return trace
