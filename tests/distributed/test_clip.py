"""``moelayers.clip_grad_norm_`` against the dense float64 model's ``torch.nn.utils.clip_grad_norm_``
(gloo, worlds 2 and 4, replicated experts, expert data parallelism)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moelayers as ml
from moelayers.testing import redraw_near_ties, run_distributed
from tests.distributed.test_training_paths import _placement, _weights64

H, F, E, K = 16, 8, 8, 2
NORMS = (2.0, 1.0, float("inf"))
MAX_NORM = 1e-3  # well below every norm here: the clipping acts


def _cfg() -> ml.MoEConfig:
    return ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=torch.float64)


def _pre() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(H, H, dtype=torch.float64)


def _inputs(world: int) -> list[torch.Tensor]:
    router = _weights64(E)[0]
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(10 + r)
        draw = lambda n, g=g: torch.randn(n, H, generator=g, dtype=torch.float64)  # noqa: E731
        out.append(redraw_near_ties(draw(5 + r), router, K, draw))  # (tokens behind `pre`: near-ties are harmless)
    return out


def _clipped(rank: int, world: int, ep: int, device: str = "cpu") -> dict:
    """Each norm: backward, DDP's mean over the world, then clip (also on GPUs, tests/gpu)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    model = nn.Sequential(_pre(), ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(ep=ep),
                                                placement=_placement("replicas", E, ep), seed=1)).to(device)
    model[1].load_full_weights(*(w.to(device) for w in _weights64(E)))
    x = _inputs(world)[rank].to(device)
    out = {}
    for norm_type in NORMS:
        model.zero_grad()
        model(x).pow(2).sum().backward()
        for p in (*model[0].parameters(), model[1].router.weight):
            dist.all_reduce(p.grad)
            p.grad /= world
        ml.reduce_expert_grads(model)
        naive = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        norm = ml.clip_grad_norm_(model, MAX_NORM, norm_type)
        out[norm_type] = {"norm": float(norm), "naive": float(naive), "pre": model[0].weight.grad.cpu(),
                          "router": model[1].router.weight.grad.cpu(),
                          **{k: g.cpu() for k, g in zip(("w13", "w2"), model[1].expert_grads_full())}}
    return out


def _dense(world: int, norm_type: float, max_norm: float) -> dict:
    pre = _pre()
    weights = [w.clone().requires_grad_() for w in _weights64(E)]
    loss = sum(ml.reference.moe_forward(pre(x), *weights, _cfg()).pow(2).sum() for x in _inputs(world)) / world
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([*pre.parameters(), *weights], max_norm, norm_type)
    return {"norm": float(norm), "pre": pre.weight.grad, **dict(zip(("router", "w13", "w2"), (w.grad for w in weights)))}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_clip_grad_norm_is_the_dense_models(world, ep):
    """Replicated experts, an empty slot, and (4, 2) two expert-parallel groups: every rank finds
    the dense model's norm (2-, 1- and inf-norm) and clips to its gradients; torch's
    clip_grad_norm_ on a rank's parameters finds another 2- and 1-norm on each rank."""
    check_against_dense(run_distributed(_clipped, world, ep, timeout=240), world)


def check_against_dense(results: list[dict], world: int) -> None:
    for norm_type in NORMS:
        if norm_type != float("inf"):  # (the largest entry may lie in the weights every rank shares)
            assert len({r[norm_type]["naive"] for r in results}) > 1, "the ranks' own norms agree: nothing is checked"
        dense = _dense(world, norm_type, MAX_NORM)
        assert dense["norm"] > 10 * MAX_NORM
        for rank, got in enumerate(results):
            assert got[norm_type]["norm"] == pytest.approx(dense["norm"], rel=1e-12), (rank, norm_type)
            for key in ("pre", "router", "w13", "w2"):
                torch.testing.assert_close(got[norm_type][key], dense[key], rtol=1e-10, atol=1e-14,
                                           msg=f"rank {rank} {key} {norm_type}-norm")


def _nan_and_repeat(rank: int, world: int) -> dict:
    model = nn.Sequential(_pre(), ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(),
                                                placement=_placement("replicas", E, world), seed=1))
    model[1].load_full_weights(*_weights64(E))
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for nan_rank in range(world):
            model.zero_grad()
            model(_inputs(world)[rank]).pow(2).sum().backward()
            ml.reduce_expert_grads(model)
            if rank == nan_rank:  # changed in place after the reduction (as AMP's unscale_ does): still reduced
                model[1].experts.w2.grad[0, 0, 0] = float("nan")  # slot 0: a main replica on every rank
            out[nan_rank] = [float(ml.clip_grad_norm_(model, MAX_NORM, p)) for p in (float("inf"), 2.0)]
    out["reduced_then_clipped"] = [str(w.message) for w in caught if "not reduced" in str(w.message)]
    try:  # clipped gradients are still reduced ones
        ml.reduce_expert_grads(model)
        out["again"] = "no error"
    except ValueError as exc:
        out["again"] = str(exc)
    model.zero_grad()
    model(_inputs(world)[rank]).pow(2).sum().backward()
    with warnings.catch_warnings(record=True) as caught:  # clipped before the reduction: said
        warnings.simplefilter("always")
        ml.clip_grad_norm_(model, MAX_NORM)
    out["unreduced"] = [str(w.message) for w in caught]
    return out


def test_clip_grad_norm_nan_on_any_rank_and_no_second_reduction():
    """A NaN in one rank's expert gradient makes every rank's norm NaN, inf-norm included (a MAX
    all-reduce alone may drop it), whichever rank holds it; after clipping, a second
    reduce_expert_grads is still refused (it would divide by the world size again)."""
    for result in run_distributed(_nan_and_repeat, 2, timeout=240):
        for nan_rank in range(2):
            assert all(v != v for v in result[nan_rank]), (nan_rank, result[nan_rank])
        assert "reduced already" in result["again"]
        assert any("were not reduced by moelayers.reduce_expert_grads" in w for w in result["unreduced"]), result
        assert not result["reduced_then_clipped"], result


def _single_groups_in_a_world(rank: int, world: int) -> dict:
    """A layer built with ParallelGroups.single() in a job of 2 ranks, wired for DDP as the README
    says: reduce_expert_grads reduced nothing (the groups said world 1), each rank's experts learned
    from its own tokens and clip_grad_norm_ found another norm on each rank. Now refused."""
    model = nn.Sequential(_pre(), ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1))
    model[1].load_full_weights(*_weights64(E))
    model(_inputs(world)[rank]).pow(2).sum().backward()
    out = {}
    try:
        ml.reduce_expert_grads(model)
        out["reduce"] = "no error"
    except ValueError as exc:
        out["reduce"] = str(exc)
    try:
        ml.clip_grad_norm_(model.parameters(), MAX_NORM)  # torch's signature
        out["clip"] = "no error"
    except TypeError as exc:
        out["clip"] = str(exc)
    return out


def test_single_groups_in_a_multi_rank_job_are_refused_by_reduce_expert_grads():
    for res in run_distributed(_single_groups_in_a_world, 2, timeout=120):
        assert "groups describe a world of 1 rank(s) (ParallelGroups.single()?) in a world of 2" in res["reduce"], res
        assert "ParallelGroups.from_world(ep=1)" in res["reduce"], res
        assert "clip_grad_norm_ takes the model (an nn.Module), not generator" in res["clip"], res


def _scaler_steps(rank: int, world: int, ep: int) -> dict:
    """Three AMP steps (GradScaler, the documented order); at step 1 an inf in rank 1's expert
    gradient alone."""
    model = nn.Sequential(_pre(), ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(ep=ep), seed=1))
    model[1].load_full_weights(*_weights64(E))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    x = _inputs(world)[rank]
    log = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(x).pow(2).mean()).backward()
        for p in (*model[0].parameters(), model[1].router.weight):  # DDP's mean over the world
            dist.all_reduce(p.grad)
            p.grad /= world
        if step == 1 and rank == 1:
            model[1].experts.w13.grad[0, 0, 0] = float("inf")
        ml.reduce_expert_grads(model)
        scaler.unscale_(opt)
        ml.clip_grad_norm_(model, 1.0)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((stepped, scale))
    dense = torch.cat([p.detach().flatten() for p in (*model[0].parameters(), model[1].router.weight)])
    return {"log": log, "dense": dense}


@pytest.mark.parametrize("ep", [2, 1])
def test_grad_scaler_skips_an_overflow_on_every_rank(ep):
    """With experts apart (ep=2) the inf was in rank 1's gradients alone: GradScaler skipped the step
    there and stepped on rank 0, the loss scales parted and every later dense gradient was weighted
    differently on each rank, silently. reduce_expert_grads now spreads it: every rank skips."""
    a, b = run_distributed(_scaler_steps, 2, ep, timeout=120)
    assert a["log"] == b["log"], (a["log"], b["log"])
    assert [stepped for stepped, _ in a["log"]] == [True, False, True], a["log"]
    assert torch.equal(a["dense"], b["dense"])
