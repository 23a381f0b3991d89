"""VariabilityAwareMoE on 2 GPUs (and 4 where the machine has them) with NCCL: the scenarios of tests/distributed/test_variability.py
(moves, bad input, staging fault, recorder + replan, auto replan), a move of a CUDA-graph layer,
and the measured (CUDA-event) variability emulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed
from tests.distributed.test_variability import SCENARIOS, Ctx, StubPlanner, _permuted, check_results, run_scenarios

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_two = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
WORLD = 2
_results: dict[int, list[dict]] = {}


def _results_nccl(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_distributed(run_scenarios, world, "cuda", backend="nccl", timeout=300)
    return _results[world]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("name", SCENARIOS)
def test_variability_layer_nccl(world, name):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    check_results(_results_nccl(world), name, world)


def _graph_worker(rank: int, world: int) -> list[str]:
    """A bf16 capacity layer replayed from a CUDA graph: moves and replan drop the graph; outputs
    equal the reference before and after."""
    ctx = Ctx(rank, world, "cuda", torch.bfloat16)
    e = ctx.e
    layer = ctx.layer(_permuted(e, world, 1), capacity=16, cuda_graph=True, record_loads=False)
    errors = [ctx.check("graph start", layer)]
    if not layer._graphed:
        errors.append("no CUDA graph was captured")
    layer.apply_placement(_permuted(e, world, 2))
    if layer._graphed:
        errors.append("apply_placement kept the old CUDA graph")
    errors.append(ctx.check("graph after move", layer, salt=1))
    errors.append(ctx.check_weights("graph after move", layer))
    layer.planner = StubPlanner(world)
    layer.curves = object()  # the stub ignores the curves
    layer.replan(loads=torch.ones(4, e, dtype=torch.int64))
    errors.append(ctx.check("graph after replan", layer, salt=2))
    layer.release_graphs()
    return [m for m in errors if m]


@needs_two
@pytest.mark.timeout(600)
def test_cuda_graph_layer_moves_nccl():
    for rank, errors in enumerate(run_distributed(_graph_worker, WORLD, backend="nccl", timeout=300)):
        assert errors == [], f"rank {rank}: {errors}"


def test_cuda_graph_layer_records_loads_and_replans():
    """One GPU: a CUDA-graph layer exposes its routing (a copy of the graph's output), so it records
    its loads and re-plans by itself (at world size 1 the plan cannot move anything; the 2-GPU test
    above moves a graphed layer), and outputs stay exact."""
    ctx = Ctx(0, 1, "cuda", torch.bfloat16)
    eager = ctx.layer(capacity=32, record_loads=False)  # the same padded shapes, eager
    layer = ctx.layer(capacity=32, cuda_graph=True, auto_replan=True, window=2, planner=StubPlanner(1))
    errors, replans = [], []
    for step in range(4):
        errors.append(ctx.check(f"graph step {step}", layer, salt=step))
        if step == 0 and not layer._graphed:
            errors.append("no CUDA graph was captured")
        ctx.forward(eager, salt=step)
        if not torch.equal(layer.last_topk_ids, eager.last_topk_ids):
            errors.append(f"step {step}: the graph's routing differs from the eager layer's")
        want = torch.bincount(eager.last_topk_ids.flatten().cpu(), minlength=ctx.e)
        if not torch.equal(layer.window_loads()[-1], want):
            errors.append(f"step {step}: recorded {layer.window_loads()[-1].tolist()}, routed {want.tolist()}")
        replans.append(layer.num_replans)
    assert replans == [0, 1, 1, 1], replans
    assert [m for m in errors if m] == []
    layer.release_graphs()


def test_curve_emulation_starts_its_clock_after_the_queued_work():
    """Curve mode pads the compute to the curve's latency; on CUDA its clock started while work
    queued before the compute (here a 50+ ms sleep kernel) was still running, which the padding then
    counted as compute: nothing was added. (In a layer's forward a host sync before the experts
    often hid it; the experts called directly, on the sync-free grouped GEMM, do not.)"""
    from moelayers.emulation import emulate_variability
    from moelayers.planning.gem import LatencyCurves

    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda")
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((8,), 4, dtype=torch.int64, device="cuda")
    assert layer.experts.sync_free(x)
    curves = LatencyCurves.preset("none", 1)
    target = 0.02
    emu = emulate_variability(layer, mode="curve", curves=curves, time_scale=target / curves(np.array([32]))[0],
                              wait="sleep")
    with torch.no_grad():
        layer.experts(x, counts)  # warm
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1e8))  # ~50-70 ms on the GPU, queued before the compute
        layer.experts(x, counts)
    assert emu.last_rows == 32
    assert emu.last_added_s > 0.5 * target, emu.last_added_s
    emu.remove()


def test_profile_times_experts_that_a_cuda_graph_cannot_capture():
    """recipes/profile.py captured every expert call in a CUDA graph: the loop backend (any GPU
    other than sm90/sm100, or H, F not multiples of 8) reads its counts on the host and failed."""
    from moelayers import GroupedExperts
    from recipes.profile import _time_rows

    dev = torch.device("cuda")
    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    counts = torch.full((4,), 64, dtype=torch.int64, device=dev)
    with torch.inference_mode():
        for backend in ("loop", "auto"):
            experts = GroupedExperts(4, 256, 128, backend=backend, dtype=torch.bfloat16, device=dev)
            assert experts.sync_free(x) is (backend == "auto" and torch.cuda.get_device_capability()[0] in (9, 10))
            seconds = _time_rows(experts, x, counts, dev, warmup=1, reps=3)
            assert 0 < seconds < 1, (backend, seconds)


def test_measured_emulation_on_cuda(monkeypatch):
    import moelayers.emulation as emulation

    waits = []
    real_wait = emulation._wait
    monkeypatch.setattr(emulation, "_wait", lambda seconds, how: (waits.append(seconds), real_wait(seconds, how)))
    emulate_variability = emulation.emulate_variability
    cfg = ml.MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda")
    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = layer(x)
        emu = emulate_variability(layer, 2.0)
        y = layer(x)
    assert torch.equal(y, y_ref)
    assert emu.calls == 1 and emu.compute_s > 0
    assert emu.added_s == pytest.approx(emu.compute_s, rel=1e-6)
    assert waits == [emu.added_s]  # the forward really waited
    emu.remove()
    assert np.isfinite(emu.added_s)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("wrap", ["reentrant", "non_reentrant"])
def test_checkpointing_a_variability_layer_nccl(wrap):
    """tests/distributed/test_wrappers.py on 2 GPUs: the backward's recomputation (on autograd's device
    thread) records no second step and runs no re-plan."""
    from tests.distributed.test_wrappers import _variability_steps

    plain = run_distributed(_variability_steps, 2, "none", "cuda", backend="nccl", timeout=240)
    wrapped = run_distributed(_variability_steps, 2, wrap, "cuda", backend="nccl", timeout=240)
    for ranks in (plain, wrapped):
        assert [[s[0] for s in steps] for steps in ranks] == [[1, 2, 3]] * 2
    assert [steps[-1] for steps in wrapped] == [steps[-1] for steps in plain]
