"""Moving experts between optimizer steps with ``apply_placement(p, optimizer=opt)``: Adam's moments
move with the weights, in the same transaction (gloo, world 2)."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.layers.moves import PlacementMoveError, PlacementRejected
from moelayers.testing import run_distributed
from tests.distributed.test_checkpoint import E, STEPS, _logical, _Model, _placements, _train


def _build(world: int, place: str, device: str = "cpu"):
    """The checkpoint test's model, its placement with 3 slots per rank (linear: one left empty)."""
    placement = ml.ExpertPlacement.linear(E, world, 3) if place == "linear" else _placements(world)[place]
    model = _Model(ml.ParallelGroups.from_world(), placement, device, torch.float64)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _move_in_training(rank: int, world: int, device: str = "cpu") -> dict:
    """Train, move (with, and without, the optimizer), train on; the uninterrupted run in the first
    placement is the reference. Also a fault while staging and ranks that disagree on the optimizer
    (also on GPUs, tests/gpu)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    out = {}
    model, optim = _build(world, "linear", device)
    _train(model, optim, range(2 * STEPS))
    reference = _logical(model, optim)
    for target in ("replicated", "reversed"):
        for with_optimizer in (True, False):
            model, optim = _build(world, "linear", device)
            _train(model, optim, range(STEPS))
            before = _logical(model, optim)
            optim.zero_grad(set_to_none=True)
            model.moe.apply_placement(_placements(world)[target], optimizer=optim if with_optimizer else None)
            moved = _logical(model, optim)
            if with_optimizer:  # every logical expert's weights and moments, bit for bit, replicas included
                assert all(torch.equal(moved[k], before[k]) for k in before), target
            _train(model, optim, range(STEPS, 2 * STEPS))
            after = _logical(model, optim)
            out[(target, with_optimizer)] = max(float((after[k] - reference[k]).abs().max()) for k in reference)
    # a fault while staging: nothing moves, the optimizer's state neither
    model, optim = _build(world, "linear", device)
    _train(model, optim, range(STEPS))
    optim.zero_grad(set_to_none=True)
    before, placement = _logical(model, optim), model.moe.placement.copy()

    def fault(staging):
        assert len(staging.states) == 4  # exp_avg and exp_avg_sq of w13 and w2
        for t in staging.rows():
            t.fill_(float("nan"))
        if rank == 1:
            raise RuntimeError("injected")

    model.moe._staging_fault_hook = fault
    with pytest.raises(PlacementMoveError):
        model.moe.apply_placement(_placements(world)["reversed"], optimizer=optim)
    model.moe._staging_fault_hook = None
    after = _logical(model, optim)
    out["fault"] = all(torch.equal(after[k], before[k]) for k in before) and model.moe.placement == placement
    # one rank passes the optimizer, the other none: refused on both before any transfer (no hang)
    with pytest.raises(PlacementRejected) as info:
        model.moe.apply_placement(_placements(world)["reversed"], optimizer=optim if rank == 0 else None)
    out["disagree"] = str(info.value)
    # optimizers at different steps (one rank's resumed from an older checkpoint): moments of different
    # ages would be mixed, so refused on both before any transfer
    if rank == 1:
        for p in (model.moe.experts.w13, model.moe.experts.w2):
            optim.state[p]["step"] += 1
    with pytest.raises(PlacementRejected) as info:
        model.moe.apply_placement(_placements(world)["reversed"], optimizer=optim)
    out["steps"] = str(info.value)
    out["steps_kept"] = model.moe.placement == placement
    # an optimizer that does not hold the expert weights would move none of its state: refused, not ignored
    other = torch.optim.AdamW(model.pre.parameters())
    with pytest.raises(PlacementRejected) as info:
        model.moe.apply_placement(_placements(world)["reversed"], optimizer=other)
    out["foreign"] = str(info.value.__cause__)
    return out


def test_apply_placement_moves_the_optimizer_state_with_the_weights():
    """Linear -> replicated and -> reversed (an empty slot) after three AdamW steps: with the optimizer
    every expert keeps its weights and moments bit for bit, and three more steps give the
    uninterrupted run's weights; without it they do not (the moments stay with the slots). A fault
    on one rank while staging leaves weights and moments as they were; ranks that disagree on the
    optimizer, or whose optimizers are at different steps, are refused."""
    check_moves(run_distributed(_move_in_training, 2, timeout=240))


def check_moves(results: list[dict]) -> None:
    for result in results:
        for target in ("replicated", "reversed"):
            assert result[(target, True)] < 1e-12, (target, result[(target, True)])
            assert result[(target, False)] > 1e-6, (target, result[(target, False)])
        assert result["fault"]
        assert "optimizers with different per-slot states" in result["disagree"]
        assert "at different steps" in result["steps"] and result["steps_kept"]
        assert "does not hold this layer's expert weights" in result["foreign"], result["foreign"]


def _non_contiguous_state(rank: int, world: int) -> bool:
    model, optim = _build(world, "linear")
    _train(model, optim, range(STEPS))
    optim.zero_grad(set_to_none=True)
    for p in (model.moe.experts.w13, model.moe.experts.w2):  # the same values, laid out transposed
        state = optim.state[p]
        state["exp_avg"] = state["exp_avg"].transpose(1, 2).contiguous().transpose(1, 2)
        assert not state["exp_avg"].is_contiguous()
    before = _logical(model, optim)
    model.moe.apply_placement(_placements(world)["reversed"], optimizer=optim)
    after = _logical(model, optim)
    return all(torch.equal(after[k], before[k]) for k in before)


def test_optimizer_state_laid_out_otherwise_moves():
    """Rows of a non-contiguous state are sent from copies (gloo and NCCL refuse non-contiguous
    tensors: one rank raised before posting its transfers, and its peer waited for them forever)."""
    assert run_distributed(_non_contiguous_state, 2, timeout=120) == [True, True]
