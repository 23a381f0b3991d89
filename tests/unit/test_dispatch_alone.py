"""One rank: the all-to-all dispatcher skips the payload it would exchange with itself (its launches
were most of a small forward's host time on a GPU, docs/benchmarks.md, session 21). Everything the
exchange through a group of one gave must stay: outputs and gradients bit for bit, statistics, the
flag checks."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.dispatch.alltoall import AllToAllDispatcher

H, F, E, K = 16, 8, 4, 2


def _run(layer, x, ids=None):
    x = x.clone().requires_grad_(True)
    if ids is not None:
        layer.force_routing(ids)
    y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    with torch.no_grad():
        y_eval = layer(x)
    return [y, y_eval, *grads], layer.last_stats


def _cases():
    spare = ml.ExpertPlacement.from_phy2log(torch.tensor([[2, -1, 0, 3, -1, 1]]), E)  # empty slots, another order
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        yield dtype, None, None
    yield torch.float32, spare, None
    yield torch.float32, None, torch.tensor([[0, 0], [3, 1], [2, 2], [1, 3], [0, 1]])


@pytest.mark.parametrize("dtype,placement,ids", list(_cases()))
def test_one_rank_skips_the_exchange_with_the_same_results(monkeypatch, dtype, placement, ids):
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=dtype)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0)).to(dtype)
    calls = []
    alone = AllToAllDispatcher._dispatch_alone
    monkeypatch.setattr(AllToAllDispatcher, "_dispatch_alone", lambda self, *a: (calls.append(1), alone(self, *a))[1])
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=placement, seed=1)
    fast, fast_stats = _run(layer, x, ids)
    assert calls  # (the path under test ran)
    monkeypatch.setattr(AllToAllDispatcher, "_dispatch_alone", AllToAllDispatcher._dispatch_exchange)
    slow, slow_stats = _run(layer, x, ids)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    for name in ("pairs_sent", "rows_sent", "bytes_sent"):
        assert getattr(fast_stats, name) == getattr(slow_stats, name), name


def test_one_rank_tells_what_the_exchange_told():
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    with pytest.raises(ValueError, match="NaN|inf|non-finite"):
        layer(torch.full((3, H), float("nan")))
    assert layer(torch.zeros(0, H)).shape == (0, H)
    layer.force_routing(torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match=r"\[0, 4\)|out of range|outside"):
        layer(torch.zeros(1, H))


def _groups_of_one(rank, world):
    """Each rank its own expert-parallel group of one (a real process group): alone too, the same output."""
    import torch.distributed as dist

    from moelayers.testing import check_close
    from moelayers.reference import moe_forward

    calls = []
    alone = AllToAllDispatcher._dispatch_alone
    AllToAllDispatcher._dispatch_alone = lambda self, *a: (calls.append(1), alone(self, *a))[1]
    groups = [dist.new_group([r]) for r in range(world)]
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=torch.float64,
                       init_std=0.5)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_groups(groups[rank]), seed=1)
    x = torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        error = check_close("group of one", layer(x), moe_forward(x, *layer.export_full_weights(), cfg))
    return layer.groups.ep is not None, bool(calls), error


def test_a_group_of_one_is_alone_too():
    from moelayers.testing import run_distributed

    assert run_distributed(_groups_of_one, 2, timeout=60) == [(True, True, None)] * 2


@pytest.mark.parametrize("n,j,s", [(0, 2, 4), (1, 1, 1), (5, 2, 4), (300, 8, 16), (3000, 8, 128)])
def test_dense_pairs_are_local_pairs_with_every_entry_valid(n, j, s):
    """The one-rank dispatch's pairs (fewer kernels) are those of the general sort, also when made
    under inference mode and then used where autograd records (the cached constants are normal tensors)."""
    from moelayers.dispatch.base import dense_pairs, local_pairs

    slots = torch.randint(0, s, (n, j), generator=torch.Generator().manual_seed(n + j))
    with torch.inference_mode():
        first = dense_pairs(slots.clone(), s)
    want, got = local_pairs(slots, s, n * j), dense_pairs(slots, s)
    for a, b, c in zip((want.pair_row, want.slot_counts, want.index), (got.pair_row, got.slot_counts, got.index),
                       (first.pair_row, first.slot_counts, first.index)):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not got.index.is_inference()
