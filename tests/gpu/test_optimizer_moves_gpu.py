"""``apply_placement(p, optimizer=opt)`` on 2 GPUs over NCCL: the CPU test's moves in training."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_optimizer_moves import _move_in_training, check_moves

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def test_apply_placement_moves_the_optimizer_state_with_the_weights_nccl():
    check_moves(run_distributed(_move_in_training, 2, "cuda", backend="nccl", timeout=300))
