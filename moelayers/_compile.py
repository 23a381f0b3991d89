"""Our layers' forwards run eagerly under ``torch.compile`` (one graph break per layer; the model
around them compiles): they are host-synchronised and data-dependent, and inductor lost writes into
the all-to-all buffer when it traced them. ``torch.compiler.disable`` applied at import would import
dynamo with moelayers (about 0.8 s in every process); :func:`eager_under_compile` wraps the forward
in it on the first call under compilation instead."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

#: a function type kept through a decorator (type checkers see the wrapped signature)
F = TypeVar("F", bound=Callable[..., Any])

_DISABLED: dict[Callable, Callable] = {}


_REASON = ("moelayers layers run eagerly under torch.compile (host-synchronised, data-dependent collectives): one "
           "graph break per layer, so fullgraph=True cannot take a model with them")


def _disabled(fn: Callable) -> Callable:
    if fn not in _DISABLED:
        try:
            _DISABLED[fn] = torch.compiler.disable(fn, reason=_REASON)
        except TypeError:  # torch before 2.8 takes no reason
            _DISABLED[fn] = torch.compiler.disable(fn)
    return _DISABLED[fn]


def eager_under_compile(fn: F) -> F:
    """``fn`` as it is in eager code; under ``torch.compile``, ``torch.compiler.disable(fn)`` (the
    same signature for type checkers and IDEs)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return _disabled(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(F, wrapper)


def cached_tensor(cache: dict, key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` (a tensor or a tuple of tensors) on first use. What is made
    while something traces the forward (``torch.export``'s or a ``FakeTensorMode``'s fake tensors,
    ``torch.func``'s and functionalization's wrappers) is used but not kept: every later eager forward
    would get it."""
    value = cache.get(key)
    if value is None:
        value = make()
        if all(_plain(t) for t in (value if isinstance(value, tuple) else (value,))):
            cache[key] = value
    return value


def _plain(t: torch.Tensor) -> bool:
    """An ordinary eager tensor: no subclass (fake tensors), no functorch or functionalization wrapper."""
    if type(t) is not torch.Tensor or torch._is_functional_tensor(t):
        return False
    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return wrapped is None or not wrapped(t)
