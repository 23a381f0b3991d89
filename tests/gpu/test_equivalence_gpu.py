"""The equivalence suite on GPUs with NCCL: 1 GPU in-process, then every GPU of the machine."""

import pytest
import torch

from moelayers.testing import run_distributed
from tests.equivalence_cases import case_list, run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CASES = [c["name"] for c in case_list(2)]


def _world_sizes():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({w for w in (2, 4, 8, n) if 2 <= w <= n})


_results = {}


def _results_for(world):
    if world not in _results:
        if world == 1:
            _results[world] = [run_cases(0, 1, "cuda")]
        else:
            _results[world] = run_distributed(run_cases, world, "cuda", backend="nccl", timeout=900)
    return _results[world]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [1] + _world_sizes())
@pytest.mark.parametrize("case", CASES)
def test_vanilla_matches_reference_gpu(world, case):
    for rank, res in enumerate(_results_for(world)):
        assert res[case] is None, f"world {world}, rank {rank}: {res[case]}"


def test_graphed_layer_overflow_raises_and_recovers():
    """More tokens than the capacity on the graph path: a clear error (the flag travels through the
    captured exchange), and the graph keeps serving correct outputs afterwards."""
    import moelayers as ml
    from moelayers.testing import check_close

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=16, cuda_graph=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(20, 256, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        layer(x[:4])  # capture
        with pytest.raises(ValueError, match=r"capacity of 16 per rank on expert-parallel rank\(s\) \[0\] \(20 tokens"):
            layer(x)
        y = layer(x[:10])
    ids = layer.last_topk_ids.clone()  # on the experts the layer chose: a router near-tie cannot loosen the check
    w64 = [w.double() for w in layer.export_full_weights()]
    ref = ml.reference.moe_forward(x[:10].double(), *w64, cfg.replace(params_dtype=torch.float64), topk_ids=ids)
    low = ml.reference.moe_forward(x[:10], *layer.export_full_weights(), cfg, topk_ids=ids)
    assert check_close("graph after overflow", y, ref, low) is None
    layer.release_graphs()


def test_graphed_layer_after_a_device_round_trip_and_deferred_init():
    """A captured graph read the old weights' addresses after ``.cpu()`` / ``.cuda()`` (it was kept:
    only a dtype change dropped it); a layer built under ``torch.device("meta")`` and materialised on
    the GPU serves like one built there."""
    import moelayers as ml
    from moelayers.testing import check_close

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=16, cuda_graph=True, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(10, 256, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        layer(x)  # capture
        layer.cpu()
        layer.cuda()
        torch.cuda.empty_cache()
        torch.empty(1 << 26, device="cuda").fill_(float("nan"))  # reuse the freed memory
        y = layer(x)
    ids = layer.last_topk_ids.clone()
    w = layer.export_full_weights()
    ref = ml.reference.moe_forward(x.double(), *(t.double() for t in w), cfg.replace(params_dtype=torch.float64),
                                   topk_ids=ids)
    assert check_close("graph after .cpu().cuda()", y, ref, ml.reference.moe_forward(x, *w, cfg, topk_ids=ids)) is None
    with torch.device("meta"):
        lazy = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), capacity=16, cuda_graph=True, seed=3)
    lazy.to_empty(device="cuda")
    lazy.reset_parameters()
    with torch.no_grad():
        assert torch.equal(lazy(x), y)
    layer.release_graphs()
    lazy.release_graphs()


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_float16_partial_sums_do_not_overflow_nccl(dispatcher):
    """tests/distributed/test_vanilla_equivalence.py's float16 case on 2 GPUs (the Triton combine
    reads float32 partial sums into a float16 output there)."""
    from tests.distributed.test_vanilla_equivalence import _fp16_partial_sums

    for rank, (y, ref) in enumerate(run_distributed(_fp16_partial_sums, 2, dispatcher, "cuda", backend="nccl",
                                                    timeout=240)):
        assert torch.isfinite(y).all(), (rank, y[:, 0])
        torch.testing.assert_close(y, ref, rtol=2e-3, atol=1e-3)


def _forced_on_one_graphed_rank(rank: int, world: int) -> str:
    """Rank 0 forces routing on a CUDA-graph layer, rank 1 does not: rank 0 used to raise before the
    exchange and leave rank 1 waiting in it; now both raise."""
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), device=dev, capacity=16, cuda_graph=True)
    x = torch.randn(8, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(rank)).to(torch.bfloat16)
    try:
        with torch.no_grad():
            layer(x)  # capture on both
            if rank == 0:
                layer.force_routing(torch.zeros(8, 2, dtype=torch.int64, device=dev))
            layer(x)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        layer.release_graphs()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_forced_routing_on_one_graphed_rank_raises_on_both():
    out = run_distributed(_forced_on_one_graphed_rank, 2, backend="nccl", timeout=240)
    assert "cuda_graph layers do not take forced routing" in out[0]
    assert out[1] != "no error", out


def _default_device_under_nccl(rank: int, world: int) -> str:
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    return str(ml.VanillaMoE(cfg, ml.ParallelGroups.from_world()).router.weight.device)


@pytest.mark.timeout(300)
def test_one_nccl_rank_builds_the_layer_on_its_gpu():
    """torchrun --nproc_per_node=1 with NCCL: the layer used to land on the CPU (no EP group of one)."""
    assert run_distributed(_default_device_under_nccl, 1, backend="nccl", timeout=240) == ["cuda:0"]
