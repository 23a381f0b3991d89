"""torch FSDP (``fully_shard``) with moelayers' expert parallelism on GPUs over NCCL: the CPU test's
training step against the dense float64 model (torch's foreach optimizer and clipping paths on CUDA)."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_fsdp import _fsdp_step, check_against_dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_fsdp_training_step_is_the_dense_models_nccl(tmp_path, world, ep):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    check_against_dense(run_distributed(_fsdp_step, world, ep, str(tmp_path / "ckpt"), "cuda", backend="nccl",
                                        timeout=300), world)
