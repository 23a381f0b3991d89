"""One call at a time per layer: forwards (and moves) of one layer from several threads take turns.

A layer keeps per-forward state on itself: forced routing, the router's and the dispatcher's flags
(NaN/inf logits, overflow), ``last_stats`` / ``last_topk_ids``, a variability layer's load window.
Two threads in one layer's forward at once read each other's (a NaN input returned without the
error, a clean one refused, loads lost from the window), so :func:`one_at_a_time` makes them take
turns on the layer's re-entrant lock (a method calling another of the same layer keeps its turn).
Different layers, and different layer objects of one model, run in parallel as before.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, cast

from moelayers._compile import F

#: guards the first creation of a layer's lock (two threads must not each make one)
_CREATING = threading.Lock()


def turn_of(layer: Any) -> threading.RLock:
    """The layer's re-entrant lock, made on first use (a deep copy or an unpickled layer starts
    without one: ``_fresh_on_copy`` gives ``None``)."""
    turn = layer.__dict__.get("_turn")
    if turn is None:
        with _CREATING:
            turn = layer.__dict__.get("_turn")
            if turn is None:
                turn = layer.__dict__["_turn"] = threading.RLock()
    return cast(threading.RLock, turn)


def one_at_a_time(method: F) -> F:
    """``method`` of a layer, run holding the layer's turn (see the module docstring). Apply it
    under ``eager_under_compile``: the lock is taken in eager code, never traced."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with turn_of(self):
            return method(self, *args, **kwargs)

    return cast(F, wrapper)
