"""Test-session set-up: without CUDA, Triton kernels run under the interpreter.

Triton decides interpreter vs native when a kernel is decorated (at import), so this must happen
before anything imports moelayers.kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
