"""One process, inference, ``check_finite=False`` or ``'deferred'``: the layer's forward makes no host
sync (the all-to-all dispatcher alone has no split sizes to read), so that the host runs ahead of
the GPU through a model's layers, as in a decode step."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("check", [False, "deferred"])  # deferred: the flag word is read at the next forward
@pytest.mark.parametrize("dtype", [torch.bfloat16])  # (the grouped GEMM; the loop's split sizes are host lists)
def test_no_host_sync_alone_without_the_finite_check(dtype, check):
    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, params_dtype=dtype)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", check_finite=check).eval()
    checked = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda").eval()
    x = torch.randn(16, 256, device="cuda", dtype=dtype)
    with torch.inference_mode():
        layer(x), checked(x)  # (first calls: caches, Triton compiles)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y, again = layer(x), layer(x)  # (deferred: the second reads the first's flag word, copied by then)
            with pytest.raises(RuntimeError, match="synchroniz"):  # (the check reads the flag: one sync)
                checked(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, checked(x)) and torch.equal(again, y)
    if check == "deferred":  # a NaN batch's error comes at the next forward
        bad = x.clone()
        bad[3, 5] = float("nan")
        with torch.inference_mode():
            layer(bad)
            with pytest.raises(ValueError, match=r"its last forward, whose output was returned already .*NaN or inf"):
                layer(x)


def test_graphed_replays_with_the_deferred_check_make_no_host_sync():
    """``check_finite='deferred'``: a graphed decode step reads no flag after its replay (the one host
    sync per layer of the NaN check); a NaN batch's error comes at the next forward; outputs are the
    checked layer's, bit for bit."""
    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=16, top_k=4, params_dtype=torch.bfloat16)
    kw = dict(device="cuda", capacity=(16, 64), cuda_graph=True)
    deferred = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), check_finite="deferred", **kw).eval()
    checked = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), **kw).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=gen).to(torch.bfloat16)
    bad = x[:9].clone()
    bad[4, 7] = float("nan")
    with torch.inference_mode():
        for rows in (9, 40, 9, 40):  # capture both sizes (first forwards, warm-ups)
            assert torch.equal(deferred(x[:rows]), checked(x[:rows]))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ys = [deferred(x[:rows]) for rows in (9, 12, 40, 9)]
            deferred(bad)  # its output is returned: its flags are read at the next forward
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for y, rows in zip(ys, (9, 12, 40, 9)):
            assert torch.equal(y, checked(x[:rows])), rows
        with pytest.raises(ValueError, match=r"its last forward, whose output was returned already .*NaN or inf"):
            deferred(x[:9])
        assert torch.equal(deferred(x[:9]), checked(x[:9]))
        deferred(bad)
        with pytest.raises(ValueError, match=r"NaN or inf"):
            ml.check_pending(deferred)
