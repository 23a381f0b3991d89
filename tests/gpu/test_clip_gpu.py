"""``moelayers.clip_grad_norm_`` on GPUs over NCCL against the dense float64 model (CPU test's cases)."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_clip import _clipped, check_against_dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_clip_grad_norm_is_the_dense_models_nccl(world, ep):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    check_against_dense(run_distributed(_clipped, world, ep, "cuda", backend="nccl", timeout=300), world)
