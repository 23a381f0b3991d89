"""Where autograd is, for the layers' hooks and the trace recorder."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd is running a backward (where activation checkpointing re-runs forwards)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
