"""moelayers.integrations.hf on GPUs: HF-like models (tests/unit/test_hf.py's, both expert layouts)
swapped at world 2 over NCCL compute what their blocks computed (float64), and ``hf_weights``
gathers every expert on every rank."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.integrations.hf import swap_moe_blocks
from moelayers.testing import run_distributed
from tests.distributed.test_hf_distributed import _skip_padding, _swap_and_compare, check_swap_results
from tests.unit.test_hf import Model, _Masked, _x

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_swap_at_world_2_nccl():
    check_swap_results(run_distributed(_swap_and_compare, 2, "cuda", backend="nccl", timeout=180))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_skip_padding_at_world_2_nccl():
    for results in run_distributed(_skip_padding, 2, "cuda", backend="nccl", timeout=180):
        assert all(diff < 1e-12 and rows for diff, rows in results), results


@pytest.mark.parametrize("old", [False, True], ids=["fused", "per_expert"])
def test_swap_on_one_gpu(old):
    model = Model("qwen3_moe", norm=True, old=old).eval().cuda()
    x = _x(2, 5).cuda()
    with torch.no_grad():
        expected = model(x)
        swap_moe_blocks(model, ml.ParallelGroups.single())
        assert float((model(x) - expected).abs().max()) < 1e-12
    layer = model.get_submodule("layers.0.mlp")
    assert getattr(layer, "layer", layer).router.weight.is_cuda  # built on the block's device


def test_skip_padding_on_one_gpu():
    plain = _Masked().eval().cuda()
    model = _Masked().eval().cuda()
    model.load_state_dict(plain.state_dict())
    swap_moe_blocks(model, ml.ParallelGroups.single(), token_ids=True, skip_padding=True)
    ids = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]], device="cuda")
    mask = (ids != 0).long()
    with torch.no_grad():
        keep = mask.bool()
        assert float((model(ids, attention_mask=mask)[keep] - plain(ids, attention_mask=mask)[keep]).abs().max()) < 1e-12
    assert model.model.layers[0].mlp.last_input_rows.tolist() == [2, 3, 4, 5, 6, 7]


def test_swap_with_graphs_of_several_capacities_on_one_gpu():
    """``swap_moe_blocks(..., capacity=(4, 16, 64), cuda_graph=True)`` in bf16: calls of 1 to 64
    tokens replay the graph of the capacity they fit and compute what the exact (eager) swap does."""
    exact = Model("qwen3_moe", norm=True).eval().cuda().to(torch.bfloat16)
    graphed = Model("qwen3_moe", norm=True).eval().cuda().to(torch.bfloat16)
    graphed.load_state_dict(exact.state_dict())
    swap_moe_blocks(exact, ml.ParallelGroups.single())
    names = swap_moe_blocks(graphed, ml.ParallelGroups.single(), capacity=(4, 16, 64), cuda_graph=True)
    with torch.no_grad():
        for shape in ((2, 5), (1, 1), (4, 16), (1, 3), (2, 5)):
            x = _x(*shape, seed=sum(shape)).cuda().to(torch.bfloat16)
            diff = float((graphed(x) - exact(x)).abs().max())
            assert diff < 2e-2, (shape, diff)
    layer = graphed.get_submodule(names[0])
    layer = getattr(layer, "layer", layer)
    assert sorted(layer._graphed) == [4, 16, 64]
    for name in names:
        m = graphed.get_submodule(name)
        getattr(m, "layer", m).release_graphs()
