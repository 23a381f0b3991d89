"""``check_finite='deferred'``: capacity mode reads a forward's exchanged flags when the next forward
starts (no host sync per forward), and that forward raises the error on every rank, before any
collective; ``moelayers.check_pending`` reads what the last forwards left."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed

CFG = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)


def _x(rows: int, seed: int, nan: bool = False) -> torch.Tensor:
    x = torch.randn(rows, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    if nan:
        x[rows // 2, 3] = float("nan")
    return x


@pytest.mark.parametrize("capacity", [16, (4, 16), None])  # None: one rank's exact forward defers too
def test_deferred_check_raises_at_the_next_forward(capacity):
    groups = ml.ParallelGroups.single()
    layer = ml.VanillaMoE(CFG, groups, capacity=capacity, check_finite="deferred")
    checked = ml.VanillaMoE(CFG, groups, capacity=capacity)  # the same weights (seed 0), checked at once
    w = layer.export_full_weights()
    with torch.inference_mode():
        for step in range(3):  # good batches: the same outputs as the checked layer, bit for bit
            x = _x(3 + 4 * step, step)
            y = layer(x)
            assert torch.equal(y, checked(x))
            torch.testing.assert_close(y, ml.reference.moe_forward(x, *w, CFG), rtol=1e-12, atol=1e-12)
        assert torch.isnan(layer(_x(5, 7, nan=True))).any()  # returned: its flags are read later
        with pytest.raises(ValueError, match=r"its last forward, whose output was returned already .*NaN or inf"):
            layer(_x(5, 8))
        assert torch.equal(layer(_x(5, 8)), checked(_x(5, 8)))  # read once: the layer goes on
        layer(_x(2, 9, nan=True))
        model = torch.nn.Sequential(layer, ml.VanillaMoE(CFG, groups, capacity=capacity, check_finite="deferred"))
        model[1](_x(3, 10))  # (a layer's first forward reads the flags: it compares the ranks' placements)
        model[1](_x(3, 10, nan=True))
        with pytest.raises(ValueError, match=r"NaN or inf"):  # both layers' flags read, the first one's error
            ml.check_pending(model)
        ml.check_pending(model)  # nothing left to raise, here or at the next forwards
        layer(_x(5, 8)), model[1](_x(5, 8))
        layer(_x(2, 9, nan=True))
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            twin.check_pending()  # a copy starts with nothing pending
            assert torch.equal(twin(_x(5, 8)), checked(_x(5, 8)))
        with pytest.raises(ValueError, match=r"NaN or inf"):
            layer.check_pending()


def test_deferred_check_without_capacity_raises_at_once_where_it_must():
    """Without capacity, 'deferred' defers only an inference forward of the router's own routing
    on one rank. A forward recording autograd (training) and a forced one check at once."""
    layer = ml.VanillaMoE(CFG, ml.ParallelGroups.single(), check_finite="deferred")
    assert layer.router.check_finite is True
    with pytest.raises(ValueError, match=r"^router logits contain NaN or inf"):
        layer(_x(4, 0, nan=True))  # autograd records it: at once
    layer.check_pending()
    with torch.no_grad():
        layer.force_routing(torch.tensor([[0, 4]] * 4))
        with pytest.raises(ValueError, match=r"^forced routing .* outside \[0, num_experts\)"):
            layer(_x(4, 1))
        layer.check_pending()
        layer(_x(4, 2, nan=True))
        with pytest.raises(ValueError, match=r"its last forward, whose output was returned already .*NaN or inf"):
            layer.check_pending()


def test_deferred_check_alone_across_training_and_checkpoints():
    """Found by a review of the one-rank deferral: (1) a rollout, a training step, a rollout: the
    flag word of the second rollout (the backward's order bits) was copied into the first's bool
    buffer and read as NaN; (2) a reentrant checkpoint's first pass (under no_grad) deferred, so
    its NaN output went on silently and the next good step raised; (3) beyond the largest
    capacity (exact) it defers too."""
    from torch.utils.checkpoint import checkpoint

    layer = ml.VanillaMoE(CFG, ml.ParallelGroups.single(), check_finite="deferred")
    with torch.inference_mode():
        layer(_x(4, 0))
    layer(_x(4, 1).requires_grad_()).sum().backward()
    with torch.inference_mode():
        layer(_x(4, 2))
        layer(_x(4, 3))  # reads the last one's word: the backward's order bits, no error
    layer.check_pending()
    x = _x(4, 4, nan=True).requires_grad_()
    with pytest.raises(ValueError, match=r"^router logits contain NaN or inf"):
        checkpoint(layer, x, use_reentrant=True)  # the first pass: at once, as in training
    checkpoint(layer, _x(4, 5).requires_grad_(), use_reentrant=True).sum().backward()  # the next step is fine
    layer.check_pending()
    beyond = ml.VanillaMoE(CFG, ml.ParallelGroups.single(), check_finite="deferred", capacity=4,
                           beyond_capacity="exact")
    with torch.inference_mode():
        beyond(_x(3, 6))
        assert torch.isnan(beyond(_x(8, 7, nan=True))).any()  # exact, beyond 4 rows: returned
        with pytest.raises(ValueError, match=r"its last forward, whose output was returned already .*NaN or inf"):
            beyond(_x(3, 8))


@pytest.mark.parametrize("value", ["off", "Deferred", 1, None])
def test_check_finite_takes_a_bool_or_deferred(value):
    with pytest.raises(TypeError, match=r"check_finite must be True, False or 'deferred', got"):
        ml.VanillaMoE(CFG, ml.ParallelGroups.single(), check_finite=value)


def test_recipes_read_check_finite_deferred():
    from recipes._common import LAYER_FLAGS, normalize_flags

    d = {"layer": {"kwargs": {"check_finite": " Deferred", "dedup": "off"}}}
    normalize_flags(d, LAYER_FLAGS)
    assert d["layer"]["kwargs"] == {"check_finite": "deferred", "dedup": False}
    with pytest.raises(ValueError, match=r"layer\.kwargs\.dedup must be true or false"):
        normalize_flags({"layer": {"kwargs": {"dedup": "deferred"}}}, LAYER_FLAGS)


def _outcome(e: ValueError) -> str:
    msg = str(e)
    if "must be [T, 16]" in msg:  # (with the pending report of the forward before as its context)
        return "hidden size" + (" after late" if "its last forward" in str(e.__context__) else "")
    if "refused the input of expert-parallel rank(s) [0]" in msg:
        return "refused 0"
    if "check_finite" in msg and "serve different" in msg:
        return "differ"
    if "NaN or inf" in msg and "rank(s) [1]" in msg:
        return "late" if "its last forward" in msg else "now"
    return msg


def _deferred_on_two_ranks(rank, world, capacity):
    """Rank 1's router logits are NaN at some forwards, rank 0 refuses its input or forces its
    routing at others, through a model of two layers: every rank raises in the same forward and
    layer (none goes on into the next layer's exchange alone), deferred or at once; then the ranks
    go on. Ranks built with other NaN checks raise together at their first forward."""
    layers = [ml.VanillaMoE(CFG, ml.ParallelGroups.from_world(), capacity=capacity, check_finite="deferred",
                            seed=i) for i in range(2)]
    weights = [layer.export_full_weights() for layer in layers]
    out = []

    def step(x, *, refuse=False, force=False, read=False):
        try:
            with torch.inference_mode():
                if read:
                    ml.check_pending(torch.nn.ModuleList(layers))
                    out.append("ok")
                    return
                h = x
                for i, (layer, w) in enumerate(zip(layers, weights)):
                    if refuse and i == 0:  # as a model refusing its token ids before its first block
                        layer.refuse_input(ValueError("x must be [T, 16] here"))
                    if force and i == 0:
                        layer.force_routing(torch.zeros(h.shape[0], 2, dtype=torch.int64) + torch.tensor([0, 1]))
                    y = layer(h)
                    if not torch.isnan(h).any() and not force:
                        torch.testing.assert_close(y, ml.reference.moe_forward(h, *w, CFG), rtol=1e-12, atol=1e-12)
                    h = y
            out.append("ok")
        except ValueError as e:
            out.append(_outcome(e))

    rows = (3, 9)[rank]
    step(_x(rows, rank))
    step(_x(rows, 10 + rank, nan=rank == 1))
    step(_x(rows, 20 + rank))  # layer 0 raises step 2's
    step(None, read=True)  # layer 1 still holds step 2's: check_pending reads it
    step(_x(rows, 30 + rank, nan=rank == 1))
    step(None, read=True)
    step(_x(rows, 40 + rank), refuse=rank == 0)  # nothing pending: the vote tells rank 1
    step(_x(rows, 50 + rank, nan=rank == 1), force=rank == 0)  # rank 0 reads at once: so does rank 1
    step(_x(rows, 60 + rank, nan=rank == 1))
    step(_x(rows, 70 + rank), refuse=rank == 0)  # rank 1's NaN pending: read first, on both
    step(None, read=True)  # layer 1's of step 9
    step(_x(rows, 80 + rank))
    mixed = ml.VanillaMoE(CFG, ml.ParallelGroups.from_world(), capacity=capacity,
                          check_finite=True if rank == 0 else "deferred")
    try:
        with torch.inference_mode():
            mixed(_x(rows, 90))
        out.append("no error")
    except ValueError as e:
        out.append(_outcome(e))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("capacity", [16, (4, 16)])
def test_deferred_check_on_two_ranks_raises_on_every_rank_in_the_same_forward(capacity):
    got = run_distributed(_deferred_on_two_ranks, 2, capacity, timeout=100)
    if capacity == 16:  # one capacity on two ranks: no size vote to learn another rank's refusal: immediate
        expected = [["ok", "now", "ok", "ok", "now", "ok", own, "now", "now", own, "ok", "ok", "differ"]
                    for own in ("hidden size", "refused 0")]
    else:
        expected = [["ok", "ok", "late", "late", "ok", "late", own, "now", "ok", late, "late", "ok", "differ"]
                    for own, late in (("hidden size", "hidden size after late"), ("refused 0", "late"))]
    assert got == expected, got
