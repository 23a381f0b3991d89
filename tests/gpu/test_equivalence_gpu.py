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


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", [c["name"] for c in case_list(4) if c.get("ep")])
def test_vanilla_matches_reference_in_expert_parallel_groups_smaller_than_the_world_gpu(case):
    """Two expert-parallel groups of 2 GPUs in a world of 4 (NCCL subgroups; CUDA graphs in capacity mode)."""
    if 4 not in _world_sizes():
        pytest.skip("needs 4 GPUs")
    for rank, res in enumerate(_results_for(4)):
        assert res[case] is None, f"world 4, rank {rank}: {res[case]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,ep", [(2, None), (4, 2)])
def test_ddp_with_reduce_expert_grads_gpu(world, ep):
    """torch DDP over NCCL with the experts left to ml.reduce_expert_grads (expert-parallel groups of the
    world, or two groups of 2 GPUs): the gradients of the reference's mean loss."""
    from moelayers.testing import run_distributed
    from tests.distributed.test_wrappers import _ddp

    if world not in _world_sizes():
        pytest.skip(f"needs {world} GPUs")
    assert run_distributed(_ddp, world, ep, "cuda", backend="nccl", timeout=240) == [[]] * world


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


def test_graphed_layer_with_several_capacities():
    """One graph per capacity, each captured the first time a forward fits it best; replays in any
    order give every forward the output of the reference on the experts it chose, the same bits as
    that size's first replay, and the routing of its own rows."""
    import moelayers as ml
    from moelayers.testing import check_close

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=(4, 16, 64), cuda_graph=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=gen).to(torch.bfloat16)
    w = layer.export_full_weights()
    w64 = [t.double() for t in w]
    first = {}
    with torch.no_grad():
        for rows in (3, 10, 64, 4, 16, 33, 3, 10, 1):
            y = layer(x[:rows])
            ids = layer.last_topk_ids.clone()
            assert ids.shape == (rows, 2) and layer.dispatcher.capacity == min(c for c in (4, 16, 64) if c >= rows)
            ref = ml.reference.moe_forward(x[:rows].double(), *w64, cfg.replace(params_dtype=torch.float64), topk_ids=ids)
            low = ml.reference.moe_forward(x[:rows], *w, cfg, topk_ids=ids)
            assert check_close(f"{rows} rows", y, ref, low) is None
            if rows in first:
                assert torch.equal(y, first[rows]), rows
            first[rows] = y
    assert sorted(layer._graphed) == [4, 16, 64]
    layer.release_graphs()
    assert layer._graphed == {}
    # beyond the largest size with beyond_capacity='exact': an exact forward, then the graphs again
    beyond = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=(4, 16), cuda_graph=True,
                           beyond_capacity="exact")
    beyond.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for rows in (10, 64, 3, 40, 10):
            y = beyond(x[:rows])
            assert beyond.last_capacity == (None if rows > 16 else min(c for c in (4, 16) if c >= rows))
            assert torch.equal(y, first[rows]) if rows in (10, 3) else y.shape == (rows, 256)
            ids = beyond.last_topk_ids.clone()
            ref = ml.reference.moe_forward(x[:rows].double(), *w64, cfg.replace(params_dtype=torch.float64), topk_ids=ids)
            assert check_close(f"{rows} rows beyond", y, ref, ml.reference.moe_forward(x[:rows], *w, cfg, topk_ids=ids)) is None
    assert sorted(beyond._graphed) == [4, 16]
    beyond.release_graphs()


def test_layers_sharing_one_graph_pool():
    """Two layers whose graphs (three sizes each) share one memory pool compute what two layers of
    their own pools do, bit for bit, whatever the order of the sizes; the shared pool reserves less."""
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)

    def model():
        return torch.nn.Sequential(*[ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda",
                                                   capacity=(4, 16, 64), cuda_graph=True, seed=i) for i in range(2)])

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=gen).to(torch.bfloat16)
    reserved, outs = [], []
    for share in (False, True):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        m = model()
        if share:
            pool = ml.share_graph_pool(m)
            assert pool is not None and all(layer.graph_pool == pool for layer in m)
        right_after = {}  # each layer's routing copied as its forward returns
        for i, layer in enumerate(m):
            layer.register_forward_hook(lambda mod, a, y, i=i: right_after.__setitem__(i, mod.last_topk_ids.clone()))
        outs.append([])
        with torch.no_grad():
            for rows in (3, 64, 10, 1, 40, 16):
                outs[-1].append(m(x[:rows]))
                # read after the whole model: another layer's replay in the pool did not overwrite it
                assert all(torch.equal(layer.last_topk_ids, right_after[i]) for i, layer in enumerate(m))
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved() - before)
        assert all(sorted(layer._graphed) == [4, 16, 64] for layer in m)
        for layer in m:
            layer.release_graphs()
        del m
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert reserved[1] < reserved[0], reserved


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


def test_graph_captured_under_inference_mode_replays_outside_it():
    """The graph's static inputs were made at the first forward: under torch.inference_mode() they were
    inference tensors, and a replay under torch.no_grad() failed copying the input into them."""
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=16, cuda_graph=True, seed=3)
    x = torch.randn(10, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)  # capture
    with torch.no_grad():
        assert torch.equal(layer(x), y)
    layer.release_graphs()


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


def _error_of_graphed_forwards(forwards) -> str:
    """``forwards(layer, x, dev)`` on a 2-rank CUDA-graph layer (bf16, capacity 16) and this rank's
    random ``x [8, 256]``, under no_grad: ``"no error"`` or the ``ValueError``'s message."""
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), device=dev, capacity=16, cuda_graph=True)
    rank = torch.distributed.get_rank()
    x = torch.randn(8, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(rank)).to(torch.bfloat16)
    try:
        with torch.no_grad():
            forwards(layer, x, dev)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        layer.release_graphs()


def _forced_on_one_graphed_rank(rank: int, world: int) -> str:
    """Rank 0 forces routing on a CUDA-graph layer, rank 1 does not: rank 0 used to raise before the
    exchange and leave rank 1 waiting in it; now both raise."""

    def forwards(layer, x, dev):
        layer(x)  # capture on both
        if rank == 0:
            layer.force_routing(torch.zeros(8, 2, dtype=torch.int64, device=dev))
        layer(x)

    return _error_of_graphed_forwards(forwards)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_forced_routing_on_one_graphed_rank_raises_on_both():
    out = run_distributed(_forced_on_one_graphed_rank, 2, backend="nccl", timeout=240)
    assert "cuda_graph layers do not take forced routing" in out[0]
    assert out[1] != "no error", out


def _refusals_on_a_graphed_layer(rank: int, world: int) -> dict:
    """Rank 0's input is refused on a CUDA-graph layer (1) on its very first forward, before any
    capture, and (3) after the capture; rank 1's is fine both times. Each time both ranks must raise
    (the refusal used to run the eager exchange while rank 1 captured: different collectives, rank 1
    left waiting), and (2, 4) the next good forward on both must serve the reference's output with
    the statistics of an eager layer (after a refusal, the flags and counts read stayed the eager
    forward's: rank 0 raised again on every later forward)."""
    import moelayers as ml
    from moelayers.testing import check_close

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    groups = ml.ParallelGroups.from_world()
    layer = ml.VanillaMoE(cfg, groups, device=dev, capacity=16, cuda_graph=True, seed=5)
    eager = ml.VanillaMoE(cfg, groups, device=dev, capacity=16, cuda_graph=False, seed=5)
    x = torch.randn(8, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(rank)).to(torch.bfloat16)
    out = {}

    def attempt(step, bad):
        try:
            layer(bad if rank == 0 else x)
            out[step] = "no error"
        except (TypeError, ValueError) as e:
            out[step] = str(e)

    def good(step):
        y = layer(x)
        ids = layer.last_topk_ids.clone()
        w = layer.export_full_weights()
        ref = ml.reference.moe_forward(x.double(), *(t.double() for t in w), cfg.replace(params_dtype=torch.float64),
                                       topk_ids=ids)
        out[step] = check_close(f"step {step}", y, ref, ml.reference.moe_forward(x, *w, cfg, topk_ids=ids))
        eager(x)
        out[f"{step} stats"] = (layer.last_stats.pairs_sent == eager.last_stats.pairs_sent
                                and layer.last_stats.rows_sent == eager.last_stats.rows_sent)

    try:
        with torch.no_grad():
            attempt(1, x.float())          # refused before any capture
            good(2)
            good("2b")
            attempt(3, x[:, :128])         # refused after the capture
            good(4)
        return out
    finally:
        layer.release_graphs()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_refused_input_on_one_graphed_rank_before_and_after_capture():
    out = run_distributed(_refusals_on_a_graphed_layer, 2, backend="nccl", timeout=240)
    assert "x has dtype torch.float32" in out[0][1], out[0]
    for step in (1, 3):
        assert "the layer refused the input of expert-parallel rank(s) [0]" in out[1][step], (step, out[1])
    for rank, res in enumerate(out):
        for step in (2, "2b", 4):
            assert res[step] is None, (rank, step, res[step])
            assert res[f"{step} stats"], (rank, step)


def _graph_conditions_differ(rank: int, world: int) -> str:
    """Rank 1 has the Triton kernels switched off: it cannot capture, rank 0 can."""
    import os

    if rank == 1:
        os.environ["MOELAYERS_DISABLE_TRITON"] = "1"
    return _error_of_graphed_forwards(lambda layer, x, dev: layer(x))


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_that_cannot_capture_makes_every_rank_raise():
    """The capture conditions were checked on each rank alone: the rank that failed them raised while
    the other went into the capture's collectives and waited for it."""
    out = run_distributed(_graph_conditions_differ, 2, backend="nccl", timeout=240)
    assert "another expert-parallel rank cannot capture the CUDA graph" in out[0], out
    assert "MOELAYERS_DISABLE_TRITON=1 turns them off" in out[1], out


def test_graph_layer_needs_the_fast_grouped_mm():
    """torch._grouped_mm reads its offsets on the host outside its fast path (float32 here): the
    capture used to fail inside CUDA with "operation not permitted when stream is capturing"."""
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.float32)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=16, cuda_graph=True,
                          expert_backend="grouped_mm")
    assert not layer.experts.sync_free(torch.zeros(1, 256, device="cuda"))
    with torch.no_grad(), pytest.raises(ValueError, match="cuda_graph=True needs the grouped-GEMM experts"):
        layer(torch.randn(4, 256, device="cuda"))
    with torch.no_grad():  # eager, the fallback serves
        eager = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=16,
                              expert_backend="grouped_mm")
        x = torch.randn(4, 256, device="cuda")
        y = eager(x)
        ref = ml.reference.moe_forward(x, *eager.export_full_weights(), cfg, topk_ids=eager.last_topk_ids)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("triton", ["on", "off"])
def test_layer_on_a_device_that_is_not_current(triton, monkeypatch):
    """A layer on cuda:1 while cuda:0 is current: Triton launched its kernels on the current device
    (an error), and the CUDA graph was captured on the current device's stream (its kernels on
    cuda:1 not recorded)."""
    import moelayers as ml
    from moelayers.testing import check_close

    if triton == "off":
        monkeypatch.setenv("MOELAYERS_DISABLE_TRITON", "1")
    torch.cuda.set_device(0)
    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=128, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda:1").manual_seed(0)
    for kwargs in ({}, {"capacity": 16}, {"capacity": 16, "cuda_graph": True}):
        layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda:1", seed=2, **kwargs)
        if triton == "off" and "cuda_graph" in kwargs:  # the references sync: a clear error, not a failed capture
            with torch.no_grad(), pytest.raises(ValueError, match="MOELAYERS_DISABLE_TRITON=1 turns them off"):
                layer(torch.randn(10, 256, device="cuda:1", generator=gen).to(torch.bfloat16))
            continue
        try:
            with torch.no_grad():
                for _ in range(3):  # capture, then replays of other inputs
                    x = torch.randn(10, 256, device="cuda:1", generator=gen).to(torch.bfloat16)
                    y = layer(x)
                    ids, w = layer.last_topk_ids.clone(), layer.export_full_weights()
                    ref = ml.reference.moe_forward(x.double(), *(t.double() for t in w),
                                                   cfg.replace(params_dtype=torch.float64), topk_ids=ids)
                    assert check_close(f"{kwargs} on cuda:1", y, ref,
                                       ml.reference.moe_forward(x, *w, cfg, topk_ids=ids)) is None
            assert torch.cuda.current_device() == 0
        finally:
            layer.release_graphs()


def _default_device_under_nccl(rank: int, world: int) -> str:
    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    return str(ml.VanillaMoE(cfg, ml.ParallelGroups.from_world()).router.weight.device)


@pytest.mark.timeout(300)
def test_one_nccl_rank_builds_the_layer_on_its_gpu():
    """torchrun --nproc_per_node=1 with NCCL: the layer used to land on the CPU (no EP group of one)."""
    assert run_distributed(_default_device_under_nccl, 1, backend="nccl", timeout=240) == ["cuda:0"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "cuda_graph"])
def test_compiled_model_matches_eager_on_cuda(graphed):
    """A model compiled with inductor around our layer (run eagerly, see tests/unit/test_compile.py),
    on CUDA in bf16, also around a CUDA-graph layer."""
    import moelayers as ml
    from tests.unit.test_compile import H, Block

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.bfloat16)
    kwargs = dict(capacity=16, cuda_graph=True) if graphed else {}
    model = Block(ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", seed=1, **kwargs))
    model.inp.to("cuda", torch.bfloat16)
    model.out.to("cuda", torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for t in (5, 9, 13):
            x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x))
    model.moe.release_graphs()
    torch._dynamo.reset()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_layer_cast_on_one_rank_raises_on_every_rank_nccl(dispatcher):
    """One rank's layer cast to bf16: ValueError on both ranks over NCCL (no hang, no garbage rows)."""
    from tests.unit.test_bad_input import NAMED_CAST, _cast_on_one_rank

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for out in run_distributed(_cast_on_one_rank, 2, dispatcher, "cuda", backend="nccl", timeout=150):
        assert NAMED_CAST in out["forward"], out["forward"]  # the settings gathered over NCCL too
        assert "hold the layer in different dtypes" in out["load"], out["load"]
