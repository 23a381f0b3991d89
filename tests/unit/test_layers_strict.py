"""Strict single-process checks of the router, the reference, the config, the experts' replica tie,
the dispatch helpers and the layers' placement moves (each pins behaviour a user relies on)."""

from __future__ import annotations

import itertools

import pytest
import torch

import moelayers as ml
from moelayers import reference
from moelayers.dispatch.flags import NONFINITE_LOGITS
from moelayers.router import forced_topk_weights, scores_to_topk

H, FF = 8, 4


def _cfg(**kw):
    base = dict(hidden_size=H, ffn_hidden_size=FF, num_experts=6, top_k=2)
    base.update(kw)
    return ml.MoEConfig(**base)


# ---------------------------------------------------------------- router
@pytest.mark.parametrize("rank_post", [False, True])
def test_router_weights_are_computed_in_float32_for_bf16_logits(rank_post):
    """scores_to_topk returns float32 weights for bf16 logits (softmax over the selected logits in float32)."""
    cfg = _cfg(num_experts=8, top_k=3, rank_post_softmax_by_logits=rank_post)
    logits = (torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    ids, w = scores_to_topk(logits, cfg)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    want = torch.softmax(logits.float().gather(1, ids), dim=-1)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-7)


def test_router_flags_nonfinite_logits_with_forced_ids_and_bad_ids_without_check_finite():
    """NaN logits are an error with replayed (forced) routing too; forced ids outside [0, E) are an
    error whatever check_finite says."""
    cfg = _cfg(num_experts=4, top_k=2)
    r = ml.TopKRouter(cfg)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(3, H)
    ok_ids = torch.tensor([[0, 1], [2, 3], [3, 0]])
    r(x, ok_ids)  # fine
    bad_x = x.clone()
    bad_x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        r(bad_x, ok_ids)
    r(bad_x, ok_ids, defer_check=True)
    assert int(r.last_flags) & NONFINITE_LOGITS
    quiet = ml.TopKRouter(cfg, check_finite=False)
    quiet.weight.data.copy_(r.weight.data)
    quiet(bad_x, ok_ids)  # NaN logits not checked
    with pytest.raises(ValueError, match="outside"):
        quiet(x, torch.tensor([[0, 1], [2, 4], [3, 0]]))
    with pytest.raises(ValueError, match="outside"):
        quiet(x, torch.tensor([[0, 1], [2, -1], [3, 0]]))
    # a layer with forced routing refuses NaN input too
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    layer.force_routing(ok_ids)
    with pytest.raises(ValueError, match="NaN or inf"):
        layer(bad_x)


ROUTING_FLAGS = list(itertools.product(("softmax", "sigmoid"), (True, False), (True, False), (True, False)))


@pytest.mark.parametrize("score_fn,norm,in_dtype,post_logits", ROUTING_FLAGS)
def test_router_and_reference_agree_on_bf16_logits(score_fn, norm, in_dtype, post_logits):
    """The layers' router and the independent reference pick the same experts with the same float32
    weights for every combination of ranking flags (softmax after the top-k is never rounded)."""
    cfg = _cfg(num_experts=16, top_k=4, score_fn=score_fn, norm_topk_prob=norm, rank_in_logits_dtype=in_dtype,
               rank_post_softmax_by_logits=post_logits)
    logits = (torch.randn(500, 16, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16)
    ids, w = scores_to_topk(logits, cfg)
    rids, rw = reference._routing(logits, cfg, None)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)
    # forced routing (trace replay): the weights of given ids, as the reference computes them
    forced = torch.randint(0, 16, (500, 4), generator=torch.Generator().manual_seed(2))
    fw = forced_topk_weights(logits, forced, cfg)
    _, rfw = reference._routing(logits, cfg, forced)
    assert fw.dtype == torch.float32
    torch.testing.assert_close(fw, rfw, rtol=1e-6, atol=1e-7)


def _layer_and_reference_grads(cfg, placement=None, forced=None, seed=0):
    """Gradients of <y, g> w.r.t. x and every weight: the single-process layer and the reference."""
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=placement, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1, generator=gen)
        layer.experts.w13.normal_(0, 0.3, generator=gen)
        layer.experts.w2.normal_(0, 0.3, generator=gen)
        if placement is not None:  # replicas of an expert hold the same weights
            r, w13, w2 = layer.export_full_weights()
            layer.load_full_weights(r, w13, w2)
    x = torch.randn(24, H, dtype=cfg.params_dtype, generator=gen, requires_grad=True)
    g = torch.randn(24, H, dtype=cfg.params_dtype, generator=gen)
    if forced is not None:
        layer.force_routing(forced)
    y = layer(x)
    (y * g).sum().backward()
    r, w13, w2 = (t.detach().clone().requires_grad_(True) for t in layer.export_full_weights())
    xr = x.detach().clone().requires_grad_(True)
    yr = reference.moe_forward(xr, r, w13, w2, cfg, topk_ids=forced)
    (yr * g).sum().backward()
    return layer, x, y, yr, (xr.grad, r.grad, w13.grad, w2.grad)


@pytest.mark.parametrize("score_fn,norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
def test_router_weight_gradient_matches_the_reference(score_fn, norm):
    """The router weight's gradient flows through the renormalised top-k weights (sum included)."""
    cfg = _cfg(score_fn=score_fn, norm_topk_prob=norm, params_dtype=torch.float64)
    layer, x, y, yr, (gx, gr, g13, g2) = _layer_and_reference_grads(cfg)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(layer.router.weight.grad, gr)
    full13, full2 = layer.expert_grads_full()
    torch.testing.assert_close(full13, g13)
    torch.testing.assert_close(full2, g2)


def test_reference_refuses_negative_forced_ids():
    cfg = _cfg(num_experts=4, top_k=2, params_dtype=torch.float64)
    x = torch.randn(3, H, dtype=torch.float64)
    w = (torch.randn(4, H, dtype=torch.float64), torch.randn(4, 2 * FF, H, dtype=torch.float64),
         torch.randn(4, H, FF, dtype=torch.float64))
    for bad in ([[0, 1], [2, -1], [3, 0]], [[0, 1], [2, 4], [3, 0]]):
        with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
            reference.moe_forward(x, *w, cfg, topk_ids=torch.tensor(bad))


def test_reference_computes_router_logits_in_router_dtype():
    """router_dtype=float32 with bf16 inputs and weights: the reference routes by float32 logits
    (near-ties that bf16 logits break otherwise included)."""
    e = 64
    cfg = _cfg(num_experts=e, top_k=4, params_dtype=torch.bfloat16, router_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2000, H, generator=g).to(torch.bfloat16)
    r = torch.randn(e, H, generator=g).to(torch.bfloat16)
    w13 = (0.3 * torch.randn(e, 2 * FF, H, generator=g)).to(torch.bfloat16)
    w2 = (0.3 * torch.randn(e, H, FF, generator=g)).to(torch.bfloat16)
    ids32 = torch.softmax(x.float() @ r.float().t(), -1).topk(4, -1).indices
    ids16 = torch.softmax((x @ r.t()).float(), -1).topk(4, -1).indices
    assert not torch.equal(ids32.sort(1).values, ids16.sort(1).values)  # the check has teeth
    y = reference.moe_forward(x, r, w13, w2, cfg)
    assert torch.equal(y, reference.moe_forward(x, r, w13, w2, cfg, topk_ids=ids32))
    with torch.no_grad():
        layer_ids, _ = _router_with(cfg, r)(x)
    assert torch.equal(layer_ids, ids32)


def _router_with(cfg, weight):
    router = ml.TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


# ---------------------------------------------------------------- config
def test_config_boundaries_and_logits_dtype():
    for kw in (dict(init_std=0.0), dict(hidden_size=0), dict(top_k=0), dict(top_k=7)):
        with pytest.raises(ValueError):
            _cfg(**kw)
    assert _cfg(top_k=6).top_k == 6
    assert _cfg(router_dtype=torch.float32).logits_dtype(torch.float64) is torch.float64
    assert _cfg(router_dtype=torch.float32).logits_dtype(torch.bfloat16) is torch.float32
    assert _cfg().logits_dtype(torch.bfloat16) is torch.bfloat16


def _tc(**kw):
    from types import SimpleNamespace

    import torch.nn.functional as F

    base = dict(num_moe_experts=4, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                hidden_size=H, ffn_hidden_size=FF, moe_router_topk=2, moe_router_score_function="softmax")
    base.update(kw)
    return SimpleNamespace(**base)


def test_from_megatron_normalisation_and_training_losses():
    from moelayers.config import megatron_training_losses

    assert ml.MoEConfig.from_megatron(_tc(moe_router_score_function="sigmoid", moe_router_topk=1)).norm_topk_prob is False
    assert ml.MoEConfig.from_megatron(_tc(moe_router_score_function="sigmoid")).norm_topk_prob is True
    assert ml.MoEConfig.from_megatron(_tc(moe_router_pre_softmax=True)).norm_topk_prob is False
    assert ml.MoEConfig.from_megatron(_tc()).rank_post_softmax_by_logits is True
    assert ml.MoEConfig.from_megatron(_tc(moe_ffn_hidden_size=6)).ffn_hidden_size == 6
    listed = _tc(moe_router_load_balancing_type=["seq_aux_loss", "aux_loss"], moe_aux_loss_coeff=[0.0, 0.1],
                 moe_z_loss_coeff=0.0)
    got = megatron_training_losses(listed)
    assert len(got) == 1 and "'aux_loss'" in got[0]
    assert megatron_training_losses(_tc(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                                        moe_z_loss_coeff=0.0)) == []
    assert megatron_training_losses(_tc(moe_z_loss_coeff=1e-3)) == ["moe_z_loss_coeff=0.001"]


# ---------------------------------------------------------------- experts: the replica tie
def test_replica_tie_tables():
    """replica_tie: the local slots of replicated experts and their rows among the replicated experts."""
    from moelayers.experts import replica_tie

    p = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 3, -1], [2, 3, 0, 4]]), 5)  # 0 and 3 replicated
    t0 = replica_tie(p, 0, None, "cpu")
    assert t0.slots.tolist() == [0, 2] and t0.rows.tolist() == [0, 1] and t0.num_rows == 2
    t1 = replica_tie(p, 1, None, "cpu")
    assert t1.slots.tolist() == [1, 2] and t1.rows.tolist() == [1, 0] and t1.num_rows == 2
    assert replica_tie(ml.ExpertPlacement.linear(4, 2), 0, None, "cpu") is None


# ---------------------------------------------------------------- dispatch/base: replicas, pairs, flags
def test_local_first_policy_prefers_the_local_replica_else_spreads_by_token_and_rank():
    from moelayers.dispatch.base import LocalFirstPolicy, routes_from_placement

    p = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1], [0, 2], [3, -1]]), 4)  # expert 0 in slots 0 and 2
    ids = torch.tensor([[0, 1], [0, 3], [0, 2], [0, 1]])
    pol = LocalFirstPolicy()
    assert pol(ids, p, 0).tolist() == [[0, 1], [0, 4], [0, 3], [0, 1]]  # rank 0 holds expert 0: slot 0
    assert pol(ids, p, 1).tolist() == [[2, 1], [2, 4], [2, 3], [2, 1]]  # rank 1 holds it in slot 2
    assert pol(ids, p, 2).tolist() == [[0, 1], [2, 4], [0, 3], [2, 1]]  # remote: (t + rank) % 2 -> 0, 1, 0, 1
    p3 = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1], [0, 2], [0, 3]]), 4)  # three replicas, none on rank 3?
    ids3 = torch.tensor([[1, 0]] * 6)
    # rank 1 holds expert 0 (slot 2) and not expert 1 (slot 1 on rank 0 only)
    assert pol(ids3, p3, 1).tolist() == [[1, 2]] * 6
    r = routes_from_placement(ids, torch.ones(4, 2), p, 2, pol)
    assert r.dest_rank.tolist() == [[0, 0], [1, 2], [0, 1], [1, 0]]
    assert r.dest_slot.tolist() == [[0, 1], [0, 0], [0, 1], [0, 1]]
    # one replica per expert: the first replica, whatever the rank
    lin = ml.ExpertPlacement.linear(4, 2)
    assert pol(ids, lin, 1).tolist() == ids.tolist()


def test_local_first_policy_spreads_remote_load_evenly_over_three_replicas():
    from moelayers.dispatch.base import LocalFirstPolicy

    p = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1], [0, 2], [1, 3], [0, 3]]), 4)
    ids = torch.tensor([[0, 3]] * 6)
    got = LocalFirstPolicy()(ids, p, 2)[:, 0].tolist()
    # expert 0's replicas are slots 0, 2, 6; rank 2 has none: token t takes replica (t + 2) % 3
    assert got == [6, 0, 2, 6, 0, 2]


def test_local_pairs_static_and_with_known_count():
    from moelayers.dispatch.base import local_pairs

    slots = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    st = local_pairs(slots, 3, static=True)
    assert st.slot_counts.tolist() == [2, 1, 2]
    assert st.index.tolist() == [[3, -1], [0, 4], [-1, -1], [2, 1]]
    assert st.pair_row.tolist()[:5] == [1, 3, 3, 0, 1] and len(st.pair_row) == 8
    known = local_pairs(slots, 3, num_pairs=5)
    assert known.pair_row.tolist() == [1, 3, 3, 0, 1] and known.index.tolist() == st.index.tolist()
    # slot 0 is a slot like any other (only -1 means none)
    z = local_pairs(torch.tensor([[0], [0], [-1]]), 1)
    assert z.slot_counts.tolist() == [2] and z.pair_row.tolist() == [0, 1] and z.index.tolist() == [[0], [1], [-1]]


def test_raise_if_placements_differ_and_nonfinite_flags():
    from moelayers.dispatch.flags import (BAD_INPUT, FORCED_OUT_OF_RANGE, NONFINITE_LOGITS, raise_if_flagged,
                                         raise_if_placements_differ)

    raise_if_placements_differ([7, 7, 7])
    with pytest.raises(ValueError, match=r"\[\[0\], \[1\]\]"):
        raise_if_placements_differ([7, 8])
    with pytest.raises(ValueError, match=r"\[\[0, 2\], \[1\]\]"):
        raise_if_placements_differ([3, 9, 3])
    raise_if_flagged([0, 0])
    with pytest.raises(ValueError, match=r"NaN or inf \(on expert-parallel rank\(s\) \[1\]\)"):
        raise_if_flagged([0, NONFINITE_LOGITS])
    with pytest.raises(ValueError, match=r"outside \[0, num_experts\) on expert-parallel rank\(s\) \[0\]"):
        raise_if_flagged([FORCED_OUT_OF_RANGE | NONFINITE_LOGITS, NONFINITE_LOGITS])
    with pytest.raises(ValueError, match=r"refused the input of expert-parallel rank\(s\) \[1\]"):
        raise_if_flagged([FORCED_OUT_OF_RANGE, BAD_INPUT])


# ---------------------------------------------------------------- layers/moves (one process)
def _moved_layer():
    cfg = _cfg(num_experts=3, top_k=2, params_dtype=torch.float64)
    old = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, -1]]), 3)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=old, seed=4)
    return cfg, old, layer


def test_single_process_move_commits_each_expert_with_its_weights_and_zeroes_emptied_slots():
    from moelayers.layers.moves import move_expert_weights

    cfg, old, layer = _moved_layer()
    x = torch.randn(10, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y0 = layer(x).detach()  # (a graph kept alive would refuse the move: it saved the weights)
    r, w13, w2 = layer.export_full_weights()
    new = ml.ExpertPlacement.from_phy2log(torch.tensor([[-1, 2, 0, 1]]), 3)  # slot 0 (expert 0) is emptied
    moves = move_expert_weights(layer, new)
    assert moves == old.moves_to(new) and len(moves) == 3
    assert layer.placement == new
    for slot, e in ((1, 2), (2, 0), (3, 1)):
        assert torch.equal(layer.experts.w13[slot], w13[e]) and torch.equal(layer.experts.w2[slot], w2[e])
    assert torch.count_nonzero(layer.experts.w13[0]) == 0 and torch.count_nonzero(layer.experts.w2[0]) == 0
    torch.testing.assert_close(layer(x), y0)


def test_single_process_move_rejects_bad_placements_before_touching_weights():
    from moelayers.layers.moves import PlacementRejected, move_expert_weights

    cfg, old, layer = _moved_layer()
    before = layer.experts.w13.detach().clone()
    bad = [ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2]]), 3),            # other slots per rank
           ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, 3]]), 4),         # other experts
           "not a placement"]
    edited = ml.ExpertPlacement.from_phy2log(torch.tensor([[2, 1, 0, -1]]), 3)
    edited.phy2log[0, 0] = 1  # edited in place: expert 2 lost, 1 twice on one rank
    bad.append(edited)
    for new in bad:
        with pytest.raises(PlacementRejected):
            move_expert_weights(layer, new)
        assert layer.placement == old and torch.equal(layer.experts.w13, before)
    layer(torch.randn(4, H, dtype=torch.float64)).sum().backward()
    with pytest.raises(PlacementRejected) as info:
        move_expert_weights(layer, ml.ExpertPlacement.from_phy2log(torch.tensor([[2, 1, 0, -1]]), 3))
    assert "gradients" in str(info.value.__cause__) and layer.placement == old


# ---------------------------------------------------------------- layers/semantic (one process)
def _plan(num_experts=4, num_ranks=1, mode="tp", layers=4, vocab=16):
    from moelayers.planning.semantic import SemanticPlan

    g = torch.Generator().manual_seed(0)
    er = torch.stack([(torch.arange(num_experts) % num_ranks)[torch.randperm(num_experts, generator=g)]
                      for _ in range(layers)])
    tr = torch.randint(0, num_ranks, (layers, vocab), generator=g)
    tc = torch.rand(layers, vocab, generator=g) * 0.9 + 0.05
    nr = torch.randint(0, num_ranks, (layers, num_ranks, num_ranks), generator=g)
    nc = torch.rand(layers, num_ranks, num_ranks, generator=g)
    nc[:2] = 0.0  # layers 0 and 1 have no n-gram confidence; layer 2's n-gram reads layer 0's ranks
    return SemanticPlan(er.numpy(), tr.numpy(), tc.numpy(), nr.numpy(), nc.numpy(), num_ranks, num_experts, vocab,
                        mode)


def test_semantic_layer_checks_its_plan_mode_and_inputs():
    cfg = _cfg(num_experts=4, top_k=2, params_dtype=torch.float64)
    single = ml.ParallelGroups.single()
    with pytest.raises(ValueError, match=r"<memory>: semantic plan field 'num_experts' is 4, but the model/parallel "
                                         r"setup needs 6; re-plan with recipes/plan.py"):
        ml.SemanticMoE(_cfg(num_experts=6), single, plan=_plan())
    duck = _plan()
    duck.check_compatible = None  # a plan-like object without the check: the layer's own
    with pytest.raises(ValueError, match="the plan is for 4 experts, the layer has 6: re-plan with recipes/plan.py"):
        ml.SemanticMoE(_cfg(num_experts=6), single, plan=duck)
    with pytest.raises(ValueError, match="mode must be one of"):
        ml.SemanticMoE(cfg, single, mode="ep")
    assert ml.SemanticMoE.from_plan(_plan(mode="tp"), 0, cfg, single).mode == "tp"
    odd = _plan(mode="dp")
    odd.mode = "ep"  # a plan-like object of another mode: the layer falls back to 'dp'
    assert ml.SemanticMoE.from_plan(odd, 0, cfg, single).mode == "dp"
    assert ml.SemanticMoE.from_plan(_plan(mode="dp"), 0, cfg, single).mode == "dp"
    dp = ml.SemanticMoE(cfg, single, mode="dp")
    x = torch.randn(5, H, dtype=torch.float64)
    with pytest.raises(ValueError, match="mode='tp'"):
        dp.forward_tp(x, x, lambda h: h, token_ids=None)
    tp = ml.SemanticMoE.from_plan(_plan(), 0, cfg, single, mode="tp", predictor="alg3")
    with pytest.raises(ValueError, match="needs token_ids"):
        tp.forward_tp(x, x, lambda h: h, token_ids=None)
    with pytest.raises(ValueError, match="needs token_ids"):
        tp.forward_tp(x, x, lambda h: h)  # token_ids left out: the same
    planless = ml.SemanticMoE(cfg, single, mode="tp")  # token_ids may be left out (plain chunks)
    assert torch.equal(planless.forward_tp(x, x, torch.tanh), planless.forward_tp(x, x, torch.tanh, token_ids=None))


def test_semantic_forward_tp_one_rank_matches_the_reference_and_keeps_the_context():
    cfg = _cfg(num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.SemanticMoE.from_plan(_plan(), 0, cfg, ml.ParallelGroups.single(), mode="tp", predictor="alg3", seed=3)
    assert layer.gather_context  # layer 2's n-gram has confidence: the next layers need this layer's ranks
    g = torch.Generator().manual_seed(5)
    part, res = torch.randn(7, H, dtype=torch.float64, generator=g), torch.randn(7, H, dtype=torch.float64, generator=g)
    ids = torch.randint(0, 16, (7,), generator=g)
    with torch.no_grad():
        out = layer.forward_tp(part, res, torch.tanh, token_ids=ids)
    h = res + part
    torch.testing.assert_close(out, h + reference.moe_forward(torch.tanh(h), *layer.export_full_weights(), cfg))
    assert layer.last_context_ranks is not None and layer.last_context_ranks.tolist() == [0] * 7
    assert layer.last_ranks.tolist() == [0] * 7
    hist = ml.SemanticMoE.from_plan(_plan(), 1, cfg, ml.ParallelGroups.single(), mode="tp", predictor="alg3")
    assert hist.gather_context  # layer 2 reads layer 0's ranks, layer 3's n-gram layer 1's
    last = ml.SemanticMoE.from_plan(_plan(), 3, cfg, ml.ParallelGroups.single(), mode="tp", predictor="alg3")
    assert not last.gather_context
    with torch.no_grad():
        last.forward_tp(part, res, torch.tanh, token_ids=ids)
    assert last.last_context_ranks is None


def test_backend_device_takes_nccl_inside_a_mixed_backend(monkeypatch):
    """A group made with ``backend="cpu:gloo,cuda:nccl"`` has NCCL for CUDA tensors: the GPU, as a
    plain NCCL group (megatron's adapter picked it; the shared helper compared names whole)."""
    from moelayers.groups import backend_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert backend_device("cpu:gloo,cuda:nccl") == backend_device("nccl") == torch.device("cuda", 2)
    assert backend_device("gloo") == backend_device(None) == torch.device("cpu")


def test_training_helpers_import_from_their_old_place():
    from moelayers.layers import rank_local_names, rank_local_params, reduce_expert_grads

    assert (rank_local_names, rank_local_params, reduce_expert_grads) == (
        ml.rank_local_names, ml.rank_local_params, ml.reduce_expert_grads)


def test_default_device_follows_the_world_for_one_expert_rank(monkeypatch):
    """With one expert-parallel rank there is no EP group; a layer on from_world() of a one-rank NCCL
    world used to land on the CPU (its docstring: CUDA when NCCL is used). The groups now carry the
    world's backend; single() (a reference layer inside a distributed job, say) stays on the CPU."""
    import dataclasses

    from moelayers.layers.base import _default_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _default_device(ml.ParallelGroups.single()) == torch.device("cpu")
    one_nccl_rank = dataclasses.replace(ml.ParallelGroups.single(), backend="nccl")  # what from_world() builds
    assert _default_device(one_nccl_rank) == torch.device("cuda", 3)
    assert _default_device(dataclasses.replace(one_nccl_rank, backend="gloo")) == torch.device("cpu")
    with pytest.raises(ValueError, match="backend must be a backend name or None"):
        dataclasses.replace(one_nccl_rank, backend=1)


def _groups_backend_and_layer_device(rank, world):
    groups = ml.ParallelGroups.from_world()
    return groups.backend, str(ml.VanillaMoE(_cfg(), groups).router.weight.device)


@pytest.mark.timeout(120)
def test_from_world_records_the_backend():
    from moelayers.testing import run_distributed

    assert run_distributed(_groups_backend_and_layer_device, 1, timeout=100) == [("gloo", "cpu")]


def test_a_policy_that_is_falsy_is_still_the_layer_policy():
    """`replica_policy or LocalFirstPolicy()` replaced a policy object that evaluates as false (an
    empty container, `__len__` 0) by the default one, silently."""

    class Picks(list):  # empty: falsy
        def __call__(self, topk_ids, placement, rank):
            self.append(1)
            return placement.first_replica(topk_ids.device)[topk_ids]

    policy = Picks()
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), replica_policy=policy)
    assert layer.replica_policy is policy
    with torch.no_grad():
        layer(torch.randn(3, 16))
    assert policy == [1]


def test_a_policy_editing_the_expert_ids_in_place_is_refused():
    """A custom policy that rewrote ``topk_ids`` in place sent the tokens to the experts it wrote, and
    its picks were checked against the rewritten ids: a silently wrong output. It gets a copy now,
    so its picks are checked against the router's ids."""

    def to_expert_0(topk_ids, placement, rank):
        topk_ids[:, 0] = 0  # every token's first choice "becomes" expert 0, and its slot is picked
        return placement.first_replica(topk_ids.device)[topk_ids]

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), replica_policy=to_expert_0, seed=2)
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.raises(ValueError, match="replica policy"):
        layer(x)


@pytest.mark.parametrize("cls", ["VanillaMoE", "SemanticMoE", "VariabilityAwareMoE"])
def test_a_layer_built_under_inference_mode_serves_and_trains_outside_it(cls):
    """Built under torch.inference_mode(), the layer's tensors were inference tensors: the first
    forward of a VariabilityAwareMoE outside it failed recording its loads ("Inplace update to
    inference tensor outside InferenceMode"), and loading weights or moving experts failed on
    every layer."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.5)
    kwargs = dict(window=2) if cls == "VariabilityAwareMoE" else {}
    with torch.inference_mode():
        layer = getattr(ml, cls)(cfg, ml.ParallelGroups.single(), seed=3, **kwargs)
    router_w, w13, w2 = layer.export_full_weights()
    layer.load_full_weights(router_w, w13.flip(0).contiguous(), w2.flip(0).contiguous())
    layer.apply_placement(ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4))
    x = torch.randn(5, 16)
    with torch.no_grad():
        y = layer(x)
    layer(x).sum().backward()
    torch.testing.assert_close(y, ml.reference.moe_forward(x, router_w, w13.flip(0), w2.flip(0), cfg))
    assert layer.experts.w13.grad is not None


@pytest.mark.parametrize("router_dtype", [None, torch.float32])
def test_the_router_picks_the_same_experts_under_autocast(router_dtype):
    """Under torch.autocast(bf16) the logits were computed in bf16 whatever router_dtype said (fp32
    input and weights): 10 of 4,096 tokens went to other experts than without autocast."""
    cfg = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=16, top_k=4, router_dtype=router_dtype)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=0)
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, weights = layer.router(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids_ac, weights_ac = layer.router(x)
            layer(x[:64])
            ref = ml.reference.moe_forward(x[:64], *layer.export_full_weights(), cfg, topk_ids=None)
    assert torch.equal(ids_ac, ids) and torch.equal(weights_ac, weights)
    assert torch.equal(layer.last_topk_ids, ids[:64])
    assert ref.dtype == torch.float32


def test_under_autocast_the_layer_takes_the_autocast_dtype():
    """An nn.Linear under torch.autocast(bf16) hands the next module bf16: the fp32 layer refused it
    (and forward_tp named attn_partial "x"); it now takes it as the fp32 values it holds."""
    from moelayers.models.tiny import RMSNorm

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    tp = ml.SemanticMoE(cfg, ml.ParallelGroups.single(), mode="tp", seed=1)
    norm = RMSNorm(16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), layer(x.float()))
        residual = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
        y = tp.forward_tp(x, residual, norm, token_ids=None)
        assert torch.equal(y, tp.forward_tp(x.float(), residual, norm, token_ids=None))
        with pytest.raises(TypeError, match=r"attn_partial has dtype torch.float16, the layer computes in "
                                            r"torch.float32 \(and takes torch.bfloat16 under the torch.autocast"):
            tp.forward_tp(x.half(), residual, norm, token_ids=None)
    with pytest.raises(TypeError, match=r"x has dtype torch.bfloat16, the layer computes in torch.float32: "
                                        r"cast x \(x.to\(torch.float32\)\) or the layer \(layer.to\(torch.bfloat16\)\)$"):
        layer(x)  # no autocast: refused as before
    with pytest.raises(TypeError, match=r"x has dtype torch.int64, the layer computes in torch.float32: cast x "
                                        r"\(x.to\(torch.float32\)\); x is the hidden states \(token ids go as "
                                        r"token_ids=\)$"):
        layer(x.long())  # not layer.to(torch.int64), which torch refuses


def test_a_submodule_cast_alone_is_named():
    """layer.experts.to(bf16) left config.params_dtype at fp32: bf16 input was refused as not fp32.
    (fp32 input, the config's dtype, is not checked against the weights on the latency path: it fails
    inside a matmul, "expected m1 and m2 to have the same dtype".)"""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    layer.experts.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"weights are \['torch.bfloat16', 'torch.float32'\] but its config says "
                                        r"torch.float32: cast the whole layer"):
        layer(torch.randn(3, 16, dtype=torch.bfloat16))
    layer.to(torch.bfloat16)
    assert layer(torch.randn(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_policy_module_with_state_loads_like_any_submodule():
    """A replica policy that is an nn.Module with a buffer: a checkpoint of a layer with the default
    policy was refused whole, even with strict=False, "missing key(s) ['replica_policy.count']; nothing
    of this MoE layer was loaded (its weights are laid out in the checkpoint's placement ...)"."""

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))

        def forward(self, topk_ids, placement, rank):
            return placement.first_replica(topk_ids.device)[topk_ids]

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    plain = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), replica_policy=Counting(), seed=2)
    result = layer.load_state_dict(plain.state_dict(), strict=False)
    assert result.missing_keys == ["replica_policy.count"]
    assert torch.equal(layer.experts.w13, plain.experts.w13)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "replica_policy.count"'):
        layer.load_state_dict(plain.state_dict())


def test_a_forward_keeps_no_reference_to_its_input():
    """The exchange's digest was cached by the input tensor (a review found it): the last 256 inputs
    of every layer, and their autograd graphs, stayed alive."""
    import gc
    import weakref

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    refs = []
    for _ in range(5):
        x = torch.randn(8, 16, requires_grad=True)
        layer(x).sum()
        refs.append(weakref.ref(x))
        del x
    gc.collect()
    assert all(r() is None for r in refs)
    assert layer.graphs_in_flight() == 0  # the dropped graphs are freed


def test_a_layer_warning_names_the_callers_line():
    """Warnings raised inside the forward named a line of torch's (the forward runs under
    torch.compiler.disable and other wrappers): they now name the first line outside moelayers and torch."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), window=2, auto_replan=True)
    kept = []  # graphs kept alive: a due re-plan waits, and warns after 4 windows
    with pytest.warns(RuntimeWarning, match="a due re-plan has waited 8 forwards for autograd graphs") as caught:
        for _ in range(12):
            kept.append(layer(torch.randn(3, 16)))
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is missing")
def test_grouped_mm_experts_follow_autocast_as_the_loop_does():
    """torch.autocast does not cover torch._grouped_mm: an fp32 layer under bf16 autocast computed its
    experts in bf16 with backend='loop' (and 'auto', and the reference) but in fp32 with 'grouped_mm'."""
    cfg = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, init_std=0.5)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    out = {}
    for backend in ("loop", "grouped_mm"):
        layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1, expert_backend=backend)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[backend] = layer(x)
    with torch.no_grad():
        fp32 = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg, topk_ids=layer.last_topk_ids)
    assert out["loop"].dtype == out["grouped_mm"].dtype == torch.float32
    apart = float((out["grouped_mm"] - out["loop"]).abs().max())
    assert apart < 0.1 * float((out["loop"] - fp32).abs().max()), apart


def test_force_routing_none_drops_pending_ids():
    """Ids forced on a layer that a failed step never reached stayed pending, and the next step's
    forward took them silently; force_routing(None) drops them."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        routed = layer(x)
        layer.force_routing(torch.tensor([[2, 3]] * 5))
        layer.force_routing(None)
        assert torch.equal(layer(x), routed)
