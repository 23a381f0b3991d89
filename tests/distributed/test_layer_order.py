"""Ranks that call their layers in different orders (gloo, 2 ranks). Two layers alike in every
setting exchange the same payload layout, so rank 0's layer A met rank 1's layer B and their rows
were mixed silently. With a ``layer_number`` (the megatron adapter's, the tiny decoder's block index,
or given) the numbers join the digest the ranks compare in every exchange, and every rank raises."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed

TIMEOUT = 90
CFG = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
ORDER = "every rank must call its layers in the same order"


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return f"{'ValueError' if isinstance(exc, ValueError) else type(exc).__name__}: {str(exc).lower()}"
    return "ok"


def _swapped_layers(rank, world, kwargs, numbers):
    groups = ml.ParallelGroups.from_world()
    a, b = (ml.VanillaMoE(CFG, groups, seed=1, layer_number=n, **kwargs) for n in numbers)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    first, second = (a, b) if rank == 0 else (b, a)
    with torch.no_grad():
        swapped = _outcome(lambda: (first(x), second(x)))
        in_order = _outcome(lambda: (a(x), b(x)))  # the layers serve again, called alike
    return swapped, in_order


@pytest.mark.parametrize("kwargs", [{}, {"dispatcher": "allgather"}, {"capacity": 8}, {"dedup": False}],
                         ids=["alltoall", "allgather", "capacity", "nodedup"])
def test_layers_called_in_different_orders_raise_on_every_rank(kwargs):
    for swapped, in_order in run_distributed(_swapped_layers, 2, kwargs, (1, 2), timeout=TIMEOUT):
        assert swapped.startswith("ValueError") and ORDER in swapped, swapped
        assert in_order == "ok", in_order


def _numbered_later(rank, world):
    groups = ml.ParallelGroups.from_world()
    layer = ml.VanillaMoE(CFG, groups, capacity=8)
    x = torch.randn(5, 8)
    with torch.no_grad():
        layer(x)
        layer.layer_number = 3 if rank == 0 else 4  # numbered differently on each rank
        differs = _outcome(lambda: layer(x))
        layer.layer_number = 3
        agrees = _outcome(lambda: layer(x))
    return differs, agrees, layer.layer_number


def test_a_layer_number_set_after_building_is_compared():
    """megatron numbers its layers after building them (set_layer_number): the digest follows, and
    capacity mode (which compares digests only when they change) compares again."""
    for differs, agrees, number in run_distributed(_numbered_later, 2, timeout=TIMEOUT):
        assert differs.startswith("ValueError") and ORDER in differs, differs
        assert agrees == "ok" and number == 3


def test_layer_number_is_checked_and_numbered_by_the_tiny_decoder():
    with pytest.raises(ValueError, match="layer_number must be None or an int >= 0"):
        ml.VanillaMoE(CFG, ml.ParallelGroups.single(), layer_number=-1)
    with pytest.raises(ValueError, match="layer_number must be None or an int >= 0"):
        ml.VanillaMoE(CFG, ml.ParallelGroups.single(), layer_number=True)
    from moelayers.models.tiny import TinyConfig, TinyDecoder

    tcfg = TinyConfig(vocab_size=16, hidden_size=8, num_heads=2, num_layers=3)
    numbers = {0: None, 1: 7, 2: None}
    model = TinyDecoder(tcfg, lambda i: ml.VanillaMoE(CFG, ml.ParallelGroups.single(), layer_number=numbers[i]))
    assert [b.moe.layer_number for b in model.blocks] == [0, 7, 2]  # a given number is kept


def test_same_settings_and_the_same_number_keep_the_digest():
    """The digest is what the ranks compare: a number changes it, the same number does not."""
    g = ml.ParallelGroups.single()
    plain, one, one_again, two = (ml.VanillaMoE(CFG, g, layer_number=n)._digest() for n in (None, 1, 1, 2))
    assert one == one_again and len({plain, one, two}) == 3


def test_blocks_sharing_a_plan_layer_get_their_own_numbers():
    """A review found SemanticMoE.from_plan numbering its layer by the plan's layer_idx, which
    TinyDecoder then kept: serve's blocks i and i + L (one plan layer each) had the same number."""
    from moelayers.models.tiny import TinyConfig, TinyDecoder
    from tests.distributed.test_semantic import make_plan

    plan = make_plan(4, 1, seed=3, layers=2, mode="dp", vocab=48)
    tcfg = TinyConfig(vocab_size=48, hidden_size=8, num_heads=2, num_layers=4)
    model = TinyDecoder(tcfg, lambda i: ml.SemanticMoE.from_plan(plan, i % 2, CFG, ml.ParallelGroups.single()))
    assert [b.moe.layer_number for b in model.blocks] == [0, 1, 2, 3]


def test_a_layer_pickled_without_a_layer_number_still_works():
    """A layer pickled before layer_number existed has no _layer_number: it reads as None."""
    layer = ml.VanillaMoE(CFG, ml.ParallelGroups.single())
    del layer.__dict__["_layer_number"]
    assert layer.layer_number is None
    layer.layer_number = 2
    assert layer(torch.randn(3, 8)).shape == (3, 8)


def _train_after_a_swap(rank, world):
    groups = ml.ParallelGroups.from_world()
    layers = [ml.VanillaMoE(CFG, groups, seed=1, layer_number=n) for n in range(3)]

    def run(order, seed):
        h = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed * 10 + rank))
        for i in order:
            h = h + layers[i](h)
        h.sum().backward()

    run([0, 1, 2], 0)  # a backward ran: each layer has an order of backwards to report
    swapped = _outcome(lambda: run([0, 2, 1] if rank == 0 else [0, 1, 2], 1))
    after = [_outcome(lambda s=s: run([0, 1, 2], s)) for s in (2, 3)]
    return swapped, after


def test_training_goes_on_after_layers_called_out_of_order():
    """A fresh-eyes journey found the failed forward spending its backwards' order digest on the
    layers it reached (rank 0's layer 2, rank 1's layer 1), so the next two steps raised a false
    "back-propagated in different orders ... resume from a checkpoint". The order is put back."""
    for swapped, after in run_distributed(_train_after_a_swap, 2, timeout=TIMEOUT):
        assert swapped.startswith("ValueError") and ORDER in swapped, swapped
        assert after == ["ok", "ok"], after


def _deepcopy_with_edp(rank, world):
    import copy

    layer = ml.VanillaMoE(CFG, ml.ParallelGroups.from_world(ep=2), seed=1, layer_number=0)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        return torch.equal(layer(x), twin(x)), twin.groups is layer.groups, twin.layer_number


def test_deepcopy_with_expert_data_parallel_groups():
    """copy.deepcopy failed ("cannot pickle ProcessGroup") where ep < world: the edp group was copied."""
    for same, shared, number in run_distributed(_deepcopy_with_edp, 4, timeout=TIMEOUT):
        assert same and shared and number == 0


def _policy_and_reference(rank, world):
    import copy

    groups = ml.ParallelGroups.from_world()
    policy = ml.VanillaMoE(CFG, groups, seed=1, layer_number=0)
    reference = copy.deepcopy(policy).requires_grad_(False)
    reference.layer_number = 1000  # (the README's advice for a copy held beside its model)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    policy(x).sum().backward()  # the policy trained: it has an order of backwards to report

    def both(order):
        with torch.no_grad():
            for layer in order:
                layer(x)

    swapped = _outcome(lambda: both((policy, reference) if rank == 0 else (reference, policy)))
    after = [_outcome(lambda: both((policy, reference))), _outcome(lambda: policy(x).sum().backward())]

    def refused():  # out of order again, and rank 0 refuses its input (a model's check of its token ids)
        with torch.no_grad():
            if rank == 0:
                policy.refuse_input(ValueError("rank 0's token ids are bad"))
            reference(x)

    refusal = _outcome(refused)
    after += [_outcome(lambda: both((policy, reference))), _outcome(lambda: policy(x).sum().backward())]
    def swapped_with_nan():  # out of order, with NaN logits on rank 1: every rank raises that (not a false
        h = x.clone()        # backward-order error, and none at the next forwards)
        if rank == 1:
            h[1, 2] = float("nan")
        with torch.no_grad():
            for layer in (policy, reference) if rank == 0 else (reference, policy):
                layer(h)

    with_nan = _outcome(swapped_with_nan)
    after += [_outcome(lambda: both((policy, reference))), _outcome(lambda: policy(x).sum().backward())]
    return swapped, refusal, with_nan, after


def _vote_and_refusal(rank, world):
    """Capacity mode with a size vote (two capacities): the vote compares the settings before any
    flag; a rank refusing its input there left the others alone in the collective that names them."""
    import copy

    groups = ml.ParallelGroups.from_world()
    policy = ml.VanillaMoE(CFG, groups, seed=1, layer_number=0, capacity=(4, 8))
    reference = copy.deepcopy(policy)
    reference.layer_number = 1000
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        policy(x), reference(x)

        def refused():
            if rank == 0:
                policy.refuse_input(ValueError("rank 0's token ids are bad"))
            else:
                reference(x)

        refusal = _outcome(refused)
        after = _outcome(lambda: (policy(x), reference(x)))
    return refusal, after


def test_a_model_and_its_renumbered_copy_called_out_of_order_name_the_layer_numbers():
    """A journey's RL process (a trained policy and its deep-copied reference) called them in
    different orders on the ranks. The copy renumbered, the exchange paired layers 0 and 1000 and
    said the ranks "back-propagated in different orders ... resume from a checkpoint", on the
    reference too, which never trained: now the layer numbers are named, and training goes on."""
    outcomes = run_distributed(_policy_and_reference, 2, timeout=TIMEOUT)
    for swapped, _, with_nan, after in outcomes:
        assert swapped.startswith("ValueError") and "layer_number is 0 on rank(s)" in swapped, swapped
        assert "back-propagated" not in swapped, swapped
        assert "router logits contain nan or inf (on expert-parallel rank(s) [1])" in with_nan, with_nan
        assert after == ["ok"] * 6, after
    # a rank's own error first (it does not join the collective that names the settings: no hang), and
    # the order of backwards it took put back (refuse_input then raised a false backward-order error)
    assert outcomes[0][1] == "ValueError: rank 0's token ids are bad", outcomes
    assert "refused the input of expert-parallel rank(s) [0]" in outcomes[1][1], outcomes
    (own, after0), (other, after1) = run_distributed(_vote_and_refusal, 2, timeout=TIMEOUT)
    assert own == "ValueError: rank 0's token ids are bad" and "serve different" in other, (own, other)
    assert after0 == after1 == "ok"
