"""torch distributed checkpointing through ``moelayers.checkpoint`` on 2 GPUs over NCCL: the CPU
test's save, load into other placements and expert-parallel sizes, and resume, on CUDA in float32."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_checkpoint import _resume_in_saved_placement, _save_and_resume

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


def test_dcp_checkpoint_resumes_in_the_saved_placement_nccl(tmp_path):
    """The CPU test's move into the saved placement after loading, over NCCL (float64 on CUDA): the
    slots and Adam's moments bit for bit, three more steps exactly the uninterrupted run's."""
    for out in run_distributed(_resume_in_saved_placement, 2, str(tmp_path / "ckpt"), "cuda", backend="nccl",
                               timeout=300):
        assert out["placement"] and out["bit_for_bit"], out
        assert out["resumed"] == 0.0, out["resumed"]
