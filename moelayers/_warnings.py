"""Warnings that name the caller's line: the first frame outside moelayers and torch (a layer's
warning may be raised under torch's decorators and hooks, e.g. ``load_state_dict``)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_INTERNAL = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first calling frame outside moelayers and torch."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called warn_caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
