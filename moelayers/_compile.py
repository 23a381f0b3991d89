"""Our layers' forwards run eagerly under ``torch.compile`` (one graph break per layer; the model
around them compiles): they are host-synchronised and data-dependent, and inductor lost writes into
the all-to-all buffer when it traced them. ``torch.compiler.disable`` applied at import would import
dynamo with moelayers (about 0.8 s in every process); :func:`eager_under_compile` wraps the forward
in it on the first call under compilation instead."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

_DISABLED: dict[Callable, Callable] = {}


def _disabled(fn: Callable) -> Callable:
    if fn not in _DISABLED:
        _DISABLED[fn] = torch.compiler.disable(fn)
    return _DISABLED[fn]


def eager_under_compile(fn: Callable) -> Callable:
    """``fn`` as it is in eager code; under ``torch.compile``, ``torch.compiler.disable(fn)``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
