"""Triton kernels, each next to its pure-torch reference.

Every kernel ``name`` comes in three flavours:

- ``name_reference``: pure torch, autograd-friendly; the training and CPU path.
- ``name_triton``: the Triton kernel; inference only (no autograd), except
  :func:`unpermute_combine_triton`, which has a Triton backward.
- ``name``: the dispatcher, which picks the Triton kernel when :func:`use_triton` allows it.

Triton is optional: ``HAVE_TRITON`` says whether it imported. Set ``MOELAYERS_DISABLE_TRITON=1``
to force the references everywhere. CPU tests run the kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

TRITON_INSTALL_HINT = "Triton is not installed; install it with `pip install triton` (Linux only)."


def use_triton(t: torch.Tensor, *, differentiable: bool = False) -> bool:
    """Whether a kernel working on ``t`` should take the Triton path.

    True when Triton imported, ``t`` lives on CUDA, ``MOELAYERS_DISABLE_TRITON`` is not ``"1"``,
    and either the kernel is ``differentiable`` or no gradient is wanted for ``t`` (most kernels are
    inference-only; the references are their autograd path).

    Args:
        t: the tensor the kernel reads (e.g. the activations).
        differentiable: the kernel has a backward of its own.
    """
    if not HAVE_TRITON or not t.is_cuda:
        return False
    if os.environ.get("MOELAYERS_DISABLE_TRITON") == "1":
        return False
    return differentiable or not (torch.is_grad_enabled() and t.requires_grad)


def on_device_of(t: torch.Tensor):
    """Context for a kernel launch on ``t``: Triton launches on the *current* CUDA device, so a
    tensor on another one (a layer on ``cuda:1`` while ``cuda:0`` is current) makes its device
    current; a no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def require_triton() -> None:
    """Raise a clear ``ImportError`` when Triton is missing."""
    if not HAVE_TRITON:
        raise ImportError(TRITON_INSTALL_HINT)


# Imported after the flags above: the kernel modules import them from this package.
from moelayers.kernels.dispatch_pack import (  # noqa: E402
    dispatch_pack,
    dispatch_pack_reference,
    dispatch_pack_triton,
)
from moelayers.kernels.permute import permute, permute_reference, permute_triton  # noqa: E402
from moelayers.kernels.unpermute_combine import (  # noqa: E402
    unpermute_combine,
    unpermute_combine_lean,
    unpermute_combine_reference,
    unpermute_combine_triton,
)
from moelayers.kernels.send_layout import send_layout, send_layout_reference, send_layout_triton  # noqa: E402
from moelayers.kernels.shuffle import (  # noqa: E402
    bucket_positions,
    bucket_positions_reference,
    bucket_positions_triton,
    shuffle_rows,
    shuffle_rows_reference,
    shuffle_rows_triton,
)

__all__ = [
    "HAVE_TRITON",
    "use_triton",
    "require_triton",
    "on_device_of",
    "permute",
    "permute_reference",
    "permute_triton",
    "unpermute_combine",
    "unpermute_combine_lean",
    "unpermute_combine_reference",
    "unpermute_combine_triton",
    "dispatch_pack",
    "dispatch_pack_reference",
    "dispatch_pack_triton",
    "send_layout",
    "send_layout_reference",
    "send_layout_triton",
    "shuffle_rows",
    "shuffle_rows_reference",
    "shuffle_rows_triton",
    "bucket_positions",
    "bucket_positions_reference",
    "bucket_positions_triton",
]
