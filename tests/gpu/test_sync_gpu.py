"""One process, inference, ``check_finite=False``: the layer's forward makes no host sync (the
all-to-all dispatcher alone has no split sizes to read), so that the host runs ahead of the GPU
through a model's layers, as in a decode step."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # (the grouped GEMM; the loop's split sizes are host lists)
def test_no_host_sync_alone_without_the_finite_check(dtype):
    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, params_dtype=dtype)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", check_finite=False).eval()
    checked = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda").eval()
    x = torch.randn(16, 256, device="cuda", dtype=dtype)
    with torch.inference_mode():
        layer(x), checked(x)  # (first calls: caches, Triton compiles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x)
            with pytest.raises(RuntimeError, match="synchroniz"):  # (the check reads the flag: one sync)
                checked(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, checked(x))
