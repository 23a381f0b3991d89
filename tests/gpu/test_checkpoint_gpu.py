"""torch distributed checkpointing through ``moelayers.checkpoint`` on 2 GPUs over NCCL: the CPU
test's save, load into other placements and expert-parallel sizes, and resume, on CUDA in float32."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_checkpoint import _save_and_resume

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def test_dcp_checkpoint_resumes_training_in_any_placement_and_expert_parallel_size_nccl(tmp_path):
    """Loaded bit for bit in every layout (checked on the ranks); three more float32 Adam steps stay
    within 1e-5 of the uninterrupted run (another layout sums the tokens in another order)."""
    results = run_distributed(_save_and_resume, 2, str(tmp_path / "ckpt"), "cuda", torch.float32, backend="nccl",
                              timeout=300)
    for errors in results:
        assert len(errors) == 5
        print({f"ep{ep}/{place}": f"{err:.1e}" for (ep, place), err in errors.items()})
        for case, err in errors.items():
            assert err < 1e-5, (case, err)
