"""moelayers.integrations.hf at world 2 (gloo): swapped HF-like models (the fake modules of
tests/unit/test_hf.py, both layouts) compute what their blocks computed, each rank on its own input,
and ``hf_weights`` gathers every expert on every rank."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.integrations.hf import hf_weights, swap_moe_blocks
from moelayers.testing import run_distributed
from tests.unit.test_hf import Model, _Masked, _x


def _swap_and_compare(rank: int, world: int, device: str = "cpu") -> list:
    out = []
    for model_type, old in (("qwen3_moe", False), ("mixtral", True)):
        model = Model(model_type, norm=False, old=old).eval().to(device)  # the same weights on every rank
        blocks = [model.layers[0].mlp, model.layers[2].mlp]
        x = _x(1 + rank, 3 + 2 * rank, seed=10 + rank).to(device)  # each rank its own batch
        with torch.no_grad():
            expected = model(x)
        names = swap_moe_blocks(model, ml.ParallelGroups.from_world())
        with torch.no_grad():
            diff = (model(x) - expected).abs().max().item()
        same = []
        for name, block in zip(names, blocks):
            back = hf_weights(model.get_submodule(name))  # a collective: every rank, every expert
            own = {k: v.to(back[k].device) for k, v in block.state_dict().items() if k in back}
            same.append(sorted(back) == sorted(block.state_dict()) and all(torch.equal(back[k], v) for k, v in own.items()))
        layer = model.get_submodule(names[0])
        layer = getattr(layer, "layer", layer)
        out.append((names, diff, same, layer.groups.ep_size, len(layer.placement.experts_on(rank))))
    return out


@pytest.mark.timeout(180)
def test_swap_at_world_2():
    check_swap_results(run_distributed(_swap_and_compare, 2, timeout=150))


def check_swap_results(per_rank: list) -> None:
    for results in per_rank:
        for names, diff, same, ep_size, local in results:
            assert names == ["layers.0.mlp", "layers.2.mlp"]
            assert diff < 1e-12, diff
            assert same == [True, True]
            assert (ep_size, local) == (2, 3)  # 6 experts over 2 ranks


def _skip_padding(rank: int, world: int, device: str = "cpu") -> list:
    """Each rank its own left-padded batch; rank 1's is all padding at first (no rows to exchange)."""
    out = []
    for old in (False, True):
        torch.manual_seed(0)  # the same weights on every rank
        plain, model = _Masked(old).eval().to(device), _Masked(old).eval().to(device)
        model.load_state_dict(plain.state_dict())
        names = swap_moe_blocks(model, ml.ParallelGroups.from_world(), token_ids=True, skip_padding=True)
        layer = model.get_submodule(names[0])
        layer = getattr(layer, "layer", layer)
        ids = torch.randint(1, 30, (2 + rank, 4), generator=torch.Generator().manual_seed(rank)).to(device)
        for mask in (torch.zeros_like(ids) if rank else (ids > 10).long(), (ids > 10 + 5 * rank).long()):
            with torch.no_grad():
                expected, got = plain(ids, attention_mask=mask), model(ids, attention_mask=mask)
            keep = mask.bool()
            out.append(((got[keep] - expected[keep]).abs().max().item() if keep.any() else 0.0,
                        layer.last_topk_ids.shape[0] == int(keep.sum())))
    return out


@pytest.mark.timeout(180)
def test_skip_padding_at_world_2():
    for results in run_distributed(_skip_padding, 2, timeout=150):
        assert all(diff < 1e-12 and rows for diff, rows in results), results


def _refused_with_checkpointing(rank: int, world: int) -> list:
    """Training with gradient checkpointing: rank 0's batch has padding, rank 1's none; both must refuse
    (a rank that refused alone left the other waiting in the expert exchange, a review). Then only rank
    0 checkpointing (a misconfiguration): rank 1 learns it in the exchange instead of waiting, and the
    next forwards, checkpointing off, run in step (a journey: they paired with the wrong calls)."""
    torch.manual_seed(0)
    model = _Masked().train()
    swap_moe_blocks(model, ml.ParallelGroups.from_world(), skip_padding=True)
    ids = torch.tensor([[0, 2, 3], [4, 5, 6]])
    mask = (ids != 0).long() if rank == 0 else torch.ones_like(ids)
    out = []
    for checkpointing in (True, rank == 0, False):
        model.model.layers[0].gradient_checkpointing = checkpointing  # as HF's gradient_checkpointing_enable() does
        try:
            model(ids, attention_mask=mask).sum().backward()
            out.append("ran")
        except ValueError as exc:
            out.append(str(exc))
    return out


@pytest.mark.timeout(180)
def test_skip_padding_refused_with_checkpointing_on_every_rank():
    for rank, (both, one, none) in enumerate(run_distributed(_refused_with_checkpointing, 2, timeout=120,
                                                             collective_timeout=60)):
        assert "gradient checkpointing" in both, both
        assert ("gradient checkpointing" if rank == 0 else "refused the input of expert-parallel rank(s) [0]") in one
        assert none == "ran"
