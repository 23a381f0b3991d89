"""Call orders of training (gloo): a move between a forward and its backward, micro-batches without
tokens under activation checkpointing, automatic re-plans under a reentrant checkpoint. Gradients
are compared with the dense float64 reference over every rank's tokens."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import moelayers as ml
from moelayers.layers.moves import PlacementRejected
from moelayers.reference import moe_forward
from moelayers.testing import check_close, redraw_near_ties, run_distributed

H, F, K = 16, 8, 2
TIMEOUT = 120


def _weights(e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(e, H, generator=g, dtype=torch.float64) * 0.5,
            torch.randn(e, 2 * F, H, generator=g, dtype=torch.float64) * H ** -0.5,
            torch.randn(e, H, F, generator=g, dtype=torch.float64) * F ** -0.5]


def _tokens(world: int, router: torch.Tensor, seed: int, counts: list[int]) -> list[torch.Tensor]:
    """Every rank's float64 tokens (no router near-ties)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * seed + r)

        def draw(m: int, g=g) -> torch.Tensor:
            return torch.randn(m, H, generator=g, dtype=torch.float64)

        out.append(redraw_near_ties(draw(counts[r]), router, K, draw))
    return out


def _reference_grads(cfg, weights, batches) -> list[torch.Tensor]:
    """Router, w13 and w2 gradients of ``sum over batches and ranks of (y * gy)``, dense float64."""
    params = [w.clone().requires_grad_(True) for w in weights]
    total = 0
    for xs, forced, gys in batches:
        for x, ids, gy in zip(xs, forced, gys):
            if x.shape[0]:
                total = total + (moe_forward(x, *params, cfg, topk_ids=ids) * gy).sum()
    total.backward()
    return [p.grad for p in params]


def _layer_grads(layer) -> list[torch.Tensor]:
    router = layer.router.weight.grad.detach().clone()
    if layer.groups.ep is not None:
        torch.distributed.all_reduce(router, group=layer.groups.ep)
    return [router, *layer.expert_grads_full()]


def _grad_errors(layer, cfg, weights, batches) -> list[str]:
    errors = [check_close(f"d{name}", got, want) for name, got, want
              in zip(("router", "w13", "w2"), _layer_grads(layer), _reference_grads(cfg, weights, batches))]
    return [e for e in errors if e is not None]


# ------------------------------------------------------------------------------ a move mid-step
def _move_midway(rank: int, world: int, kind: str) -> list[str]:
    e = 4 * world
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=K, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world()
    layer = ml.SemanticMoE(cfg, groups, mode="dp") if kind == "semantic" else ml.VanillaMoE(cfg, groups)
    weights = _weights(e)
    layer.load_full_weights(*weights)
    table = layer.placement.phy2log.clone()
    table[0, 0], table[1, 0] = table[1, 0].item(), table[0, 0].item()  # only ranks 0 and 1 change
    new = ml.ExpertPlacement.from_phy2log(table, e)
    xs = _tokens(world, weights[0], 7, [3 + 2 * r for r in range(world)])
    gys = [torch.randn(x.shape, generator=torch.Generator().manual_seed(40 + r), dtype=torch.float64)
           for r, x in enumerate(xs)]
    y = layer(xs[rank])
    outcome = []
    try:
        layer.apply_placement(new)
        outcome.append("moved")
    except PlacementRejected as exc:
        outcome.append(f"PlacementRejected: {exc.__cause__ if exc.__cause__ is not None else exc}")
    (y * gys[rank]).sum().backward()  # raised (autograd) on the ranks that moved; the others waited in it
    outcome += _grad_errors(layer, cfg, weights, [(xs, [None] * world, gys)])
    layer.zero_grad(set_to_none=True)
    layer.apply_placement(new)  # after the backward: accepted
    outcome.append("moved after the backward" if layer.placement == new else "not moved")
    return outcome


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["vanilla", "semantic"])
def test_move_between_a_forward_and_its_backward_is_refused_on_every_rank(kind, world):
    """The move was accepted (nothing to refuse but gradients, not yet there): the backward then
    raised autograd's error on the ranks whose slots changed, and the others waited in its exchange
    until those processes exited. Only VariabilityAwareMoE watched its graphs."""
    for rank, outcome in enumerate(run_distributed(_move_midway, world, kind, timeout=TIMEOUT)):
        assert outcome[0].startswith("PlacementRejected") and "await their backward" in outcome[0], (rank, outcome)
        assert outcome[1:] == ["moved after the backward"], (rank, outcome)


# ------------------------------------------------------------------------------ empty micro-batches
def _empty_micro_batches(rank: int, world: int, reentrant: bool, forced_first: bool) -> list[str]:
    e = 4 * world
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=K, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world())
    weights = _weights(e)
    layer.load_full_weights(*weights)
    batches, live = [], []
    for mb in range(2):  # rank 1 has no tokens in either; one micro-batch forced, the other routed
        xs = _tokens(world, weights[0], 30 + mb, [5 if r != 1 else 0 for r in range(world)])
        forced = [None] * world
        if mb == (0 if forced_first else 1):
            gen = torch.Generator().manual_seed(70 + mb)
            forced = [torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(x.shape[0])])
                      if x.shape[0] else torch.zeros(0, K, dtype=torch.int64) for x in xs]
        gys = [torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + 10 * mb + r), dtype=torch.float64)
               for r, x in enumerate(xs)]
        batches.append((xs, forced, gys))
        x = xs[rank].clone().requires_grad_(True)
        if forced[rank] is not None:
            layer.force_routing(forced[rank])
        live.append(checkpoint(layer, x, use_reentrant=reentrant))
    for mb in (1, 0):  # F0 F1 B1 B0
        (live[mb] * batches[mb][2][rank]).sum().backward()
    return _grad_errors(layer, cfg, weights, batches)


@pytest.mark.parametrize("forced_first", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_micro_batches_without_tokens_recompute_their_own_routing(reentrant, forced_first):
    """Every empty input has data_ptr() 0: the recomputations of two micro-batches without tokens on
    a rank, one forced and one routed by the router, found each other's entry (a refusal on every
    rank, or a CheckpointError on that rank alone while the others waited)."""
    for rank, errors in enumerate(run_distributed(_empty_micro_batches, 2, reentrant, forced_first, timeout=TIMEOUT)):
        assert errors == [], (rank, errors)


# ------------------------------------------------------------------------------ re-plans, reentrant checkpoint
def _replan_under_reentrant_checkpoint(rank: int, world: int) -> tuple[int, list[str]]:
    e = 4 * world
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=K, params_dtype=torch.float64)
    ranks = [torch.arange(e) % world, torch.arange(e) * world // e]  # interleaved, then blocks

    def planner(loads, curves, **kwargs):
        planner.calls += 1
        return ranks[planner.calls % 2].numpy()

    planner.calls = 0
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.from_world(), window=2, auto_replan=True, replan_every=2,
                                   planner=planner)
    layer.load_full_weights(*_weights(e))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            x = torch.randn(6, H, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
            (checkpoint(layer, x.requires_grad_(), use_reentrant=True) ** 2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return layer.num_moves, [str(w.message) for w in caught]


def test_automatic_replan_under_a_reentrant_checkpoint_warns_about_the_optimizer():
    """A reentrant checkpoint's first pass runs under no_grad: the layer never learned it was
    trained, and its automatic moves left Adam's moments with the slots without the warning."""
    for moves, messages in run_distributed(_replan_under_reentrant_checkpoint, 2, timeout=TIMEOUT):
        assert moves > 0
        assert any("without the optimizer's per-slot state" in m for m in messages), messages
