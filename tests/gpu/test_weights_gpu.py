"""On GPUs: ``check_weights`` and ``forward_tp``'s agreement on dtype and autograd over NCCL (the CPU
tests' workers), and ``torch._grouped_mm`` experts following CUDA autocast as the loop does."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed
from tests.distributed.test_layers_strict import _copies_that_differ, check_copies
from tests.distributed.test_semantic import _tp_ranks_whose_backward_would_differ, check_tp_backward_refusals

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@needs_two
def test_check_weights_finds_copies_that_differ_nccl():
    check_copies(run_distributed(_copies_that_differ, 2, "cuda", backend="nccl", timeout=180))


@needs_two
def test_forward_tp_ranks_whose_backward_would_differ_raise_together_nccl():
    check_tp_backward_refusals(run_distributed(_tp_ranks_whose_backward_would_differ, 2, "cuda", backend="nccl",
                                               timeout=180))


def test_grouped_mm_experts_follow_cuda_autocast():
    """An fp32 layer under bf16 autocast: backend='grouped_mm' computes its experts in bf16 as the loop
    does (it computed them in fp32: autocast does not cover torch._grouped_mm)."""
    cfg = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, init_std=0.5)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for backend in ("loop", "grouped_mm"):
        layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1, expert_backend=backend, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out[backend] = layer(x)
    with torch.no_grad():
        fp32 = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg, topk_ids=layer.last_topk_ids)
    apart = float((out["grouped_mm"] - out["loop"]).abs().max())
    assert apart < 0.1 * float((out["loop"] - fp32).abs().max()), apart
