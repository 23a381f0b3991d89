"""Bad input gets a clear ValueError/TypeError naming the problem, and nothing half-applied."""

import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import moelayers as ml
from moelayers.testing import check_close, run_distributed

CFG = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)


def layer(**kw):
    return ml.VanillaMoE(CFG, ml.ParallelGroups.single(), **kw)


def test_top_k_larger_than_num_experts():
    with pytest.raises(ValueError, match="top_k"):
        ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=5)


@pytest.mark.parametrize("field,value,exc", [
    ("hidden_size", 0, ValueError), ("num_experts", 2.5, TypeError), ("score_fn", "relu", ValueError),
    ("activation", "gelu", ValueError), ("params_dtype", torch.int32, TypeError), ("init_std", -1.0, ValueError),
])
def test_config_fields(field, value, exc):
    kwargs = dict(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    kwargs[field] = value
    with pytest.raises(exc, match=field):
        ml.MoEConfig(**kwargs)


def test_experts_not_divisible_over_ranks():
    with pytest.raises(ValueError, match="divisible"):
        ml.ExpertPlacement.linear(10, 4)


def test_placement_missing_expert():
    with pytest.raises(ValueError, match=r"missing expert\(s\) \[3\]"):
        ml.ExpertPlacement.from_phy2log([[0, 1], [2, -1]], 4)


def test_placement_id_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        ml.ExpertPlacement.from_phy2log([[0, 1], [2, 4]], 4)


def test_placement_duplicate_replica_on_one_rank():
    with pytest.raises(ValueError, match="duplicate replicas of expert\\(s\\) \\[1\\] on rank 0"):
        ml.ExpertPlacement.from_phy2log([[0, 1, 1], [2, 3, -1]], 4)


def test_placement_not_integer():
    with pytest.raises(TypeError, match="integer"):
        ml.ExpertPlacement.from_phy2log(torch.zeros(2, 2), 4)


def test_placement_of_a_meta_table():
    """torch's "Cannot copy out of meta tensor" was all a user got."""
    with pytest.raises(ValueError, match="phy2log is a meta tensor"):
        ml.ExpertPlacement(torch.zeros(2, 2, dtype=torch.int64, device="meta"), 4)


def test_placement_for_other_experts_or_ranks():
    with pytest.raises(ValueError, match="8 experts"):
        layer(placement=ml.ExpertPlacement.linear(8, 1))
    with pytest.raises(ValueError, match="spans 2 ranks"):
        layer(placement=ml.ExpertPlacement.linear(4, 2))


def test_token_ids_wrong_length_and_dtype():
    m = layer()
    x = torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"token_ids must be \[5\] or shaped like x without its last dimension \[5\], got \[4\]"):
        m(x, token_ids=torch.arange(4))
    with pytest.raises(TypeError, match="token_ids must be an integer"):
        m(x, token_ids=torch.zeros(5))


def test_input_shape_dtype():
    m = layer()
    with pytest.raises(ValueError, match=r"x must be \[T, 16\]"):
        m(torch.randn(5, 15))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(5, 16, dtype=torch.float64))


def test_wrong_dtype_or_device_of_weights_is_not_half_applied():
    m = layer()
    before = [p.detach().clone() for p in m.parameters()]
    e, h, f = 4, 16, 8
    good = (torch.randn(e, h), torch.randn(e, 2 * f, h), torch.randn(e, h, f))
    with pytest.raises(TypeError, match="w2 has dtype torch.float64"):
        m.load_full_weights(good[0], good[1], good[2].double())
    with pytest.raises(ValueError, match=r"w13 must have shape \[4, 16, 16\]"):
        m.load_full_weights(good[0], good[1][:, :-1], good[2])
    with pytest.raises(TypeError, match="w2 is on meta"):
        m.load_full_weights(good[0], good[1], good[2].to("meta"))
    with pytest.raises(TypeError, match="router_weight must be a torch.Tensor"):
        m.load_full_weights(good[0].numpy(), good[1], good[2])
    for b, p in zip(before, m.parameters()):
        assert torch.equal(b, p), "a failed load changed weights"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_router_logits(bad):
    m = layer()
    x = torch.randn(5, 16)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        m(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_check_of_the_router(dtype):
    """The router's check flags exactly the logits with a NaN or an inf (either sign, or both, whose
    sum would be NaN anyway), and not large finite logits whose sum overflows."""
    from moelayers.router import _any_nonfinite

    big = torch.finfo(dtype).max
    finite = torch.tensor([[big, big, -big], [1.0, -0.0, 3.0]], dtype=dtype)
    assert not _any_nonfinite(finite) and not _any_nonfinite(finite[:0])
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        logits = finite.clone()
        logits[1, : len(bad)] = torch.tensor(bad, dtype=dtype)
        assert _any_nonfinite(logits), bad
    assert _any_nonfinite(torch.tensor([float("inf")], dtype=dtype, requires_grad=dtype != torch.bfloat16))


def test_forced_routing_shape():
    m = layer()
    m.force_routing(torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="forced routing"):
        m(torch.randn(5, 16))


@pytest.mark.parametrize("ids", [torch.zeros(5, 2, dtype=torch.bool), torch.zeros(5, 2), [[0, 1]] * 5])
def test_forced_routing_must_be_integer_ids(ids):
    with pytest.raises(TypeError, match="integer tensor of expert ids"):
        layer().force_routing(ids)


@pytest.mark.parametrize("bad", [4, -1])
def test_forced_routing_out_of_range(bad):
    m = layer()
    ids = torch.zeros(5, 2, dtype=torch.int16)
    ids[3, 1] = bad
    m.force_routing(ids)
    with pytest.raises(ValueError, match=r"expert ids outside \[0, num_experts\)"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match="outside"):
        m.router(torch.randn(5, 16), ids)  # standalone: at once


def test_forced_routing_is_not_left_for_a_later_forward():
    """A forward that raises still consumes the forced routing: the next one routes by itself."""
    m = layer()
    x = torch.randn(5, 16)
    with torch.no_grad():
        m(x)
        own = m.last_topk_ids.clone()
        m.force_routing(torch.full((5, 2), 3, dtype=torch.int64))
        with pytest.raises(TypeError, match="dtype"):
            m(x.double())
        m(x)
    assert torch.equal(m.last_topk_ids, own)


@pytest.mark.parametrize("kw, err, match", [
    (dict(init_std=float("inf")), ValueError, "init_std"),
    (dict(init_std=True), ValueError, "init_std"),
    (dict(norm_topk_prob="no"), TypeError, "norm_topk_prob"),
    (dict(norm_topk_prob=None), TypeError, "norm_topk_prob"),
])
def test_config_values(kw, err, match):
    with pytest.raises(err, match=match):
        ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, **kw)


@pytest.mark.parametrize("capacity", [2.5, True, "4", 0, [], [4, 0], (2, "4"), [True]])
def test_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ValueError, match="capacity must be None, an int >= 1 .* or a non-empty list or tuple of them"):
        layer(capacity=capacity)


def test_groups_need_distributed():
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        ml.ParallelGroups.from_world(ep=2)


def test_bad_dispatcher_and_types():
    with pytest.raises(ValueError, match="dispatcher"):
        layer(dispatcher="ring")
    with pytest.raises(TypeError, match="groups must be a ParallelGroups"):
        ml.VanillaMoE(CFG, None)
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        ml.VanillaMoE({"hidden_size": 16}, ml.ParallelGroups.single())


def _groups_mismatch(rank, world):
    errors = []
    for kwargs in (dict(ep=3), dict(tp=3), dict(ep=0)):
        try:
            ml.ParallelGroups.from_world(**kwargs)
            errors.append(f"{kwargs}: no error")
        except ValueError as e:
            if "does not divide the world size 4" not in str(e):
                errors.append(f"{kwargs}: unclear message {e}")
    try:  # a float size was said not to divide the world
        ml.ParallelGroups.from_world(ep=2.0)
        errors.append("ep=2.0: no error")
    except TypeError as e:
        if "ep must be an int, got 2.0" not in str(e):
            errors.append(f"ep=2.0: unclear message {e}")
    import numpy as np

    numpy_groups = ml.ParallelGroups.from_world(ep=np.int64(2), tp=np.int32(2))  # was refused: "does not divide"
    if (numpy_groups.ep_size, numpy_groups.tp_size) != (2, 2) or type(numpy_groups.ep_size) is not int:
        errors.append(f"numpy sizes gave ep_size={numpy_groups.ep_size!r}, tp_size={numpy_groups.tp_size!r}")
    groups = ml.ParallelGroups.from_world(ep=2)
    try:
        ml.VanillaMoE(ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=3, top_k=1), groups)
        errors.append("3 experts over 2 ranks: no error")
    except ValueError as e:
        if "divisible" not in str(e):
            errors.append(f"unclear: {e}")
    # the expert-data-parallel group: one rank of each expert-parallel group
    if dist.get_process_group_ranks(groups.edp) != [rank % 2, rank % 2 + 2]:
        errors.append(f"edp holds {dist.get_process_group_ranks(groups.edp)}")
    try:
        ml.ParallelGroups.from_groups(groups.ep, edp=dist.group.WORLD)
        errors.append("an edp group of 4 ranks with ep=2 in a world of 4: no error")
    except ValueError as e:
        if "expected world_size // ep_size = 2" not in str(e):
            errors.append(f"unclear: {e}")
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=1)
    for what, layer_groups, match in (
            ("without edp", ml.ParallelGroups.from_groups(groups.ep), "no expert-data-parallel group"),
            # the right size, the wrong ranks: the expert-parallel group itself (summed different experts' gradients)
            ("edp = ep", ml.ParallelGroups.from_groups(groups.ep, edp=groups.ep), "must hold the ranks at the same place"),
            ("tp", ml.ParallelGroups.from_world(tp=2), "tensor-parallel ranks")):
        try:
            ml.reduce_expert_grads(ml.VanillaMoE(cfg, layer_groups))
            errors.append(f"reduce_expert_grads {what}: no error")
        except ValueError as e:
            if match not in str(e):
                errors.append(f"unclear: {e}")
    return errors


@pytest.mark.timeout(120)
def test_groups_that_do_not_match_the_world():
    for errors in run_distributed(_groups_mismatch, 4):
        assert errors == []


def _indivisible_auto_replan(rank, world):
    """3 experts over 2 ranks (a placement with an empty slot) with auto_replan: GEM places equal
    experts per rank, so every due re-plan failed and warned, forever; now refused when built."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=3, top_k=1)
    place = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1], [2, -1]]), 3)
    groups = ml.ParallelGroups.from_world()
    try:
        ml.VariabilityAwareMoE(cfg, groups, placement=place, window=2, auto_replan=True)
        return "no error"
    except ValueError as e:
        assert "divisible" in str(e), str(e)
    ml.VariabilityAwareMoE(cfg, groups, placement=place, window=2)  # serving without re-plans is fine
    return "raised"


@pytest.mark.timeout(120)
def test_auto_replan_needs_experts_divisible_by_the_ranks():
    assert run_distributed(_indivisible_auto_replan, 2) == ["raised", "raised"]


@pytest.mark.parametrize("name", ["auto_replan", "record_loads"])
def test_variability_flags_must_be_bools(name):
    """A config's 'off' string is truthy: record_loads='off' recorded and re-planned (serve.py's
    layer.kwargs.record_loads=off ran with it on)."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    with pytest.raises(TypeError, match=f"{name} must be a bool, got 'off'"):
        ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), window=2, **{name: "off"})
    from recipes._common import LAYER_FLAGS, normalize_flags

    d = {"layer": {"kwargs": {name: "off"}}}
    normalize_flags(d, LAYER_FLAGS)  # what serve.py and bench.py do with the config
    assert d["layer"]["kwargs"][name] is False


def _settings_differ(rank, world, what):
    """Ranks built with another dedup or top_k read each other's payload rows with their own
    layout: an out-of-range index decoded from the payload's bytes, or a gloo reset. The digest the
    ranks exchange now covers those settings."""
    k = 3 if what == "top_k" and rank == 1 else 2
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=k)
    kw = dict(dedup=rank == 0) if what.endswith("dedup") else {}
    if what.startswith("allgather"):
        kw["dispatcher"] = "allgather"  # which ignores dedup: its ranks serve together
    if what == "dispatcher":  # an all-gather against an all-to-all hung (different first collectives)
        kw["dispatcher"] = "allgather" if rank else "alltoall"
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=0, **kw)
    try:
        with torch.no_grad():
            layer(torch.randn(5 + rank, 16))
    except ValueError as e:
        assert "different placements or layer settings (their ranks within the expert-parallel group, grouped by them: [[0], [1]])" in str(e), str(e)
        return "raised"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["dedup", "top_k", "allgather-dedup", "dispatcher"])
def test_ranks_with_other_payload_settings_raise(what):
    want = "no error" if what == "allgather-dedup" else "raised"
    assert run_distributed(_settings_differ, 2, what) == [want, want]


#: what every rank's error says when rank 1 alone cast its layer to bf16 (named by the ranks' gathered settings)
NAMED_CAST = ("dtype of x is torch.float32 on rank(s) [0], torch.bfloat16 on rank(s) [1]; dtype of the routing weights "
              "is torch.float32 on rank(s) [0], torch.bfloat16 on rank(s) [1]. Every rank must compute in the same dtype")


def _cast_on_one_rank(rank, world, dispatcher, device="cpu"):
    """A layer cast on one rank only (``layer.to(torch.bfloat16)``) lays its payload rows out in
    another dtype: the other rank read them as garbage indices and gloo aborted the process. The
    exchanged digest now covers the payload's dtypes: ValueError on every rank; and
    ``load_full_weights`` names the dtypes instead of saying the weights differ."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=0, dispatcher=dispatcher, device=device)
    if rank == 1:
        layer = layer.to(torch.bfloat16)
    dtype = layer.config.params_dtype
    out = {}
    try:
        with torch.no_grad():
            layer(torch.randn(6, 16, generator=torch.Generator().manual_seed(rank)).to(device, dtype))
        out["forward"] = "no error"
    except ValueError as e:
        out["forward"] = str(e)
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(8, 16, generator=g), torch.randn(8, 16, 16, generator=g), torch.randn(8, 16, 8, generator=g))
    try:
        layer.load_full_weights(*(w.to(device, dtype) for w in weights))
        out["load"] = "no error"
    except ValueError as e:
        out["load"] = str(e)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])  # (capacity mode cannot tell: README)
def test_layer_cast_on_one_rank_raises_on_every_rank(dispatcher):
    for out in run_distributed(_cast_on_one_rank, 2, dispatcher, timeout=60):
        assert NAMED_CAST in out["forward"], out["forward"]
        assert "hold the layer in different dtypes" in out["load"], out["load"]


def _kwargs(dispatcher: str) -> dict:
    """The layer's arguments for ``dispatcher``: ``"capacity"`` a fixed capacity of 6 tokens,
    ``"capacities"`` sizes to choose from (6 the largest)."""
    return {"capacity": dict(capacity=6), "capacities": dict(capacity=(2, 4, 6))}.get(dispatcher,
                                                                                     dict(dispatcher=dispatcher))


def _nan_on_one_rank(rank, world, dispatcher):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    kwargs = _kwargs(dispatcher)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), **kwargs)
    x = torch.randn(5, 8)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        with torch.no_grad():
            m(x)
    except ValueError as e:
        assert "NaN or inf" in str(e) and (dispatcher.startswith("capacit") or "rank(s) [1]" in str(e)), str(e)
        with torch.no_grad():
            m(torch.randn(3, 8))  # still usable afterwards: nothing was left half-done
        return "raised"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "capacity", "capacities"])
def test_nan_on_one_rank_raises_on_every_rank(dispatcher):
    assert run_distributed(_nan_on_one_rank, 2, dispatcher) == ["raised", "raised"]


class _PickSlot:
    """A replica policy that returns ``phys`` for every (token, k) on rank ``on_rank`` (``"next"``:
    the first replica of the next expert), and the right replicas elsewhere."""

    def __init__(self, phys, on_rank):
        self.phys, self.on_rank = phys, on_rank

    def __call__(self, topk_ids, placement, rank):
        if rank != self.on_rank:
            return placement.first_replica(topk_ids.device)[topk_ids]
        if self.phys == "next":
            return placement.first_replica(topk_ids.device)[(topk_ids + 1) % placement.num_experts]
        if self.phys in ("float", "short"):  # not [T, K] integer slots: the others used to hang in the exchange
            right = placement.first_replica(topk_ids.device)[topk_ids]
            return right.float() if self.phys == "float" else right[:, :1]
        return torch.full_like(topk_ids, self.phys)


def _bad_replica_picks(rank, world, dispatcher):
    """A custom policy's picks that do not hold the routed expert (another expert's slot, an empty
    spare slot, a slot past the placement) were used as they were: wrong outputs, no error."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    spr = 4 // world + 1  # one empty spare slot per rank
    place = ml.ExpertPlacement.linear(4, world, slots_per_rank=spr)
    kwargs = dict(_kwargs(dispatcher), check_finite=False) if dispatcher.startswith("capacit") else _kwargs(dispatcher)
    out = []
    for phys in ("next", spr - 1, world * spr + 3, -2, "float", "short"):
        m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single(),
                          placement=place, replica_policy=_PickSlot(phys, world - 1), **kwargs)
        try:
            with torch.no_grad():
                m(torch.randn(5, 8))
            out.append(f"{phys}: no error")
        except ValueError as e:  # (the rank with float or short picks says what came back)
            own = rank == world - 1 and str(e).startswith("replica policy _PickSlot must return")
            out.append("raised" if own or (f"rank(s) [{world - 1}]" in str(e) and "replica policy" in str(e)) else str(e))
    good = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single(),
                         placement=place, replica_policy=_PickSlot(None, -1), **kwargs)
    with torch.no_grad():
        good(torch.randn(5, 8))  # a custom policy that picks right replicas serves
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "capacity", "capacities"])
def test_bad_replica_picks_raise_on_every_rank(dispatcher):
    assert _bad_replica_picks(0, 1, dispatcher) == ["raised"] * 6
    assert run_distributed(_bad_replica_picks, 2, dispatcher) == [["raised"] * 6] * 2


def test_replica_policy_must_be_callable_and_return_slots():
    with pytest.raises(TypeError, match="replica_policy must be callable"):
        layer(replica_policy="local")
    m = layer(replica_policy=lambda ids, placement, rank: ids.float())
    with pytest.raises(ValueError, match="replica policy function must return integer physical slots"):
        m(torch.randn(3, 16))
    m = layer(replica_policy=lambda ids, placement, rank: ids[:, :1])
    with pytest.raises(ValueError, match=r"replica policy function must return \[T, K\]"):
        m(torch.randn(3, 16))
    m = layer(replica_policy=lambda ids, placement, rank: ids.numpy())  # it said "integer slots, got int64"
    with pytest.raises(ValueError, match="must return a torch tensor of integer physical slots, got ndarray"):
        m(torch.randn(3, 16))
    m = layer(replica_policy=lambda ids, placement, rank: {}[0])  # the policy's own error is the cause
    with pytest.raises(ValueError, match="replica policy function must return picks, but raised KeyError") as info:
        m(torch.randn(3, 16))
    assert isinstance(info.value.__cause__, KeyError)


def test_a_placement_with_other_slots_per_rank_says_how_to_make_room():
    """More slots: build the layer with them (a hint that works for any E and R, where linear() needs
    E divisible by R); fewer: pad the new placement with empty slots (the hint pointed the other way)."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    with pytest.raises(ValueError, match=r"has 5 slots per rank, the layer's has 4 \(a layer keeps the slots it was "
                                         r"built with: for replicas, build it with spare slots, e\.g\. placement="
                                         r"ExpertPlacement\.from_expert_rank\(expert_rank, num_ranks=1, "
                                         r"slots_per_rank=5\)\)"):
        m.apply_placement(ml.ExpertPlacement.linear(4, 1, slots_per_rank=5))
    roomy = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=ml.ExpertPlacement.linear(4, 1, slots_per_rank=6))
    with pytest.raises(ValueError, match=r"has 4 slots per rank, the layer's has 6 \(.*give the new placement 6 slots "
                                         r"per rank, the extra ones empty \(-1\), e\.g\. ExpertPlacement\."
                                         r"from_expert_rank\(expert_rank, num_ranks=1, slots_per_rank=6\)\)"):
        roomy.apply_placement(ml.ExpertPlacement.linear(4, 1))
    roomy.apply_placement(ml.ExpertPlacement.from_expert_rank(torch.zeros(4, dtype=torch.long), num_ranks=1,
                                                              slots_per_rank=6))  # as the hint says


def test_the_default_placement_says_how_to_spread_experts_unevenly():
    """E not divisible by the ranks: 'linear placement needs ... divisible' did not say it was the
    default placement, nor that uneven placements (ranks without experts too) are served."""
    from moelayers.testing import run_distributed

    run_distributed(_uneven_default, 3)


def _uneven_default(rank, world):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=7, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world()
    with pytest.raises(ValueError, match=r"the default \(linear\) placement needs num_experts \(7\) divisible by the "
                                         r"3 expert-parallel ranks; .*from_expert_rank\(torch\.arange\(7\) % 3, "
                                         r"num_ranks=3\)"):
        ml.VanillaMoE(cfg, groups)
    m = ml.VanillaMoE(cfg, groups, placement=ml.ExpertPlacement.from_expert_rank(torch.arange(7) % 3, num_ranks=3))
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    w = m.export_full_weights()
    torch.testing.assert_close(m(x), ml.reference.moe_forward(x, *w, cfg), rtol=1e-12, atol=1e-12)


def _overflow_on_one_rank(rank, world, check_finite, served_before=True, capacity=4):
    """Rank 1 has more tokens than the capacity: it takes part in the exchange (no rank hangs).
    ``served_before``: after a first forward, which compares the ranks' placements (a flag read)."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), capacity=capacity, check_finite=check_finite)
    if served_before:
        with torch.no_grad():
            m(torch.randn(3, 8))
    try:
        with torch.no_grad():
            m(torch.randn(7 if rank == 1 else 3, 8))
    except ValueError as e:
        assert "capacity of 4" in str(e) and "rank(s) [1]" in str(e), str(e)
        assert (rank == 1) == ("7 tokens on this rank" in str(e)), str(e)
        with torch.no_grad():
            m(torch.randn(3, 8))  # still usable afterwards (every rank takes part again)
        return "raised"
    with torch.no_grad():
        m(torch.randn(3, 8))
    return "no error"


def _forced_out_of_range_on_one_rank(rank, world, dispatcher, check_finite):
    """Every rank replays a trace; rank 1's holds an expert id >= E: every rank raises, none hangs."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    kwargs = _kwargs(dispatcher)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), check_finite=check_finite, **kwargs)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    if rank == 1:
        ids[1, 0] = 4
    m.force_routing(ids)
    try:
        with torch.no_grad():
            m(torch.randn(3, 8))
    except ValueError as e:
        assert "outside [0, num_experts)" in str(e) and "rank(s) [1]" in str(e), str(e)
        with torch.no_grad():
            m(torch.randn(3, 8))  # still usable afterwards
        return "raised"
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "capacity", "capacities"])
@pytest.mark.parametrize("check_finite", [True, False])
def test_forced_ids_out_of_range_on_one_rank_raise_on_every_rank(dispatcher, check_finite):
    assert run_distributed(_forced_out_of_range_on_one_rank, 2, dispatcher, check_finite) == ["raised", "raised"]


BAD_INPUTS = {  # what rank 1 passes instead of x [3, 8] (with token ids [3] and forced routing [3, 2])
    "hidden size": dict(x=lambda: torch.randn(3, 9)),
    "dtype": dict(x=lambda: torch.randn(3, 8, dtype=torch.float64)),
    "token_ids": dict(token_ids=lambda: torch.arange(4)),
    "forced shape": dict(forced=lambda: torch.tensor([[0, 1], [2, 3]])),
}


def _bad_input_on_one_rank(rank, world, dispatcher, check_finite):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    kwargs = _kwargs(dispatcher)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), check_finite=check_finite, **kwargs)
    return {kind: _refused_forward(m, rank, kind) for kind in BAD_INPUTS}


def _refused_forward(m, rank, kind):
    """Rank 1's input is refused: it takes part in the exchange with no tokens and raises its own
    error; the others learn it with their split sizes and raise too (none waits forever)."""
    make = dict(x=lambda: torch.randn(3, 8), token_ids=lambda: torch.arange(3),
                forced=lambda: torch.tensor([[0, 1], [2, 3], [1, 2]]))
    if rank == 1:
        make.update(BAD_INPUTS[kind])
    m.force_routing(make["forced"]())
    try:
        with torch.no_grad():
            m(make["x"](), token_ids=make["token_ids"]())
    except (TypeError, ValueError) as e:
        if rank == 0:
            assert "refused the input of expert-parallel rank(s) [1]" in str(e), str(e)
        else:
            assert "expert-parallel" not in str(e), str(e)  # its own reason
        outcome = "raised"
    else:
        outcome = "no error"
    with torch.no_grad():
        y = m(torch.randn(3, 8))  # still usable, in step with the other rank
    assert m.last_topk_ids.shape == (3, 2) and y.shape == (3, 8)
    return outcome


@pytest.mark.timeout(200)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "capacity", "capacities"])
def test_bad_input_on_one_rank_raises_on_every_rank(dispatcher):
    raised = {kind: "raised" for kind in BAD_INPUTS}
    assert run_distributed(_bad_input_on_one_rank, 2, dispatcher, True, timeout=90) == [raised, raised]
    if dispatcher.startswith("capacit"):  # no NaN check, but every rank forces its routing: each reads the flags
        assert run_distributed(_bad_input_on_one_rank, 2, dispatcher, False, timeout=90) == [raised, raised]


@pytest.mark.timeout(120)
def test_capacity_overflow_on_one_rank_raises_without_a_hang():
    assert run_distributed(_overflow_on_one_rank, 2, True) == ["raised", "raised"]
    # without the NaN check there is no sync to learn it: the overflowing rank alone raises, except in
    # the first forward after the layer was built (which reads the flags to compare the placements)
    assert run_distributed(_overflow_on_one_rank, 2, False) == ["no error", "raised"]
    assert run_distributed(_overflow_on_one_rank, 2, False, False) == ["raised", "raised"]
    # several capacities: the ranks agree on one from their row counts, so every rank knows an overflow
    assert run_distributed(_overflow_on_one_rank, 2, False, True, (2, 4)) == ["raised", "raised"]


def _other_capacities_on_one_rank(rank, world, caps, rows):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), capacity=caps[rank], check_finite=False)
    try:
        with torch.no_grad():
            m(torch.randn(rows, 8))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("caps,rows", [(((2, 8), (4, 8)), 1), (((2, 8), (2, 16)), 5), (((2, 8), (2, 16)), 1)])
def test_ranks_with_other_capacity_lists_raise_together(caps, rows):
    """Ranks built with other sizes picked different ones and exchanged buffers of different sizes
    (gloo aborted the process; a hang elsewhere): the ranks' settings travel with the size vote."""
    for got in run_distributed(_other_capacities_on_one_rank, 2, caps, rows, timeout=90):
        assert "serve different placements or layer settings" in got and "capacity" in got, got


def _beyond_capacity_on_one_rank(rank, world, capacity):
    """Rank 1 has more tokens than the largest capacity, and later refuses its input while rank 0
    has too many: every rank runs exact, then padded again; the refusal reaches every rank."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), capacity=capacity, beyond_capacity="exact",
                      check_finite=False)
    w = m.export_full_weights()
    out = []
    for rows in ((3, 20), (3, 1), (0, 9)):
        x = torch.randn(rows[rank], 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            y = m(x)
        torch.testing.assert_close(y, ml.reference.moe_forward(x, *w, cfg), rtol=1e-12, atol=1e-12)
        out.append(m.last_capacity)
    try:
        with torch.no_grad():
            m(torch.randn(20, 8, dtype=torch.float64) if rank == 0 else torch.randn(2, 9, dtype=torch.float64))
        out.append("no error")
    except ValueError as e:
        out.append("refused" if rank == 1 or "refused the input of expert-parallel rank(s) [1]" in str(e) else str(e))
    with torch.no_grad():
        m(torch.randn(2, 8, dtype=torch.float64))  # in step again
    out.append(m.last_capacity)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("capacity", [8, (4, 8)])
def test_beyond_capacity_exact_on_one_rank(capacity):
    small = 4 if isinstance(capacity, tuple) else 8
    assert run_distributed(_beyond_capacity_on_one_rank, 2, capacity, timeout=90) == [[None, small, None, "refused",
                                                                                       small]] * 2


def test_capacity_takes_arrays_of_sizes():
    import numpy as np

    for sizes in (np.array([16, 4]), torch.tensor([16, 4]), np.int64(16), torch.tensor(16)):
        m = layer(capacity=sizes)
        assert m.capacities == ((4, 16) if np.ndim(sizes) else (16,)) and type(m.capacity) is int
    with pytest.raises(ValueError, match=r"capacity\[0\] = 4.0"):
        layer(capacity=torch.tensor([4.0, 16.0]))


def test_beyond_capacity_errors():
    with pytest.raises(ValueError, match="beyond_capacity must be 'raise' or 'exact'"):
        layer(capacity=4, beyond_capacity="eager")
    with pytest.raises(ValueError, match="beyond_capacity='exact' needs a capacity"):
        layer(beyond_capacity="exact")
    with pytest.raises(ValueError, match=r"capacity\[1\] = -1"):
        layer(capacity=[16, -1])
    m = layer(capacity=(2, 4))
    with pytest.raises(AttributeError):
        m.capacity = 8  # set at construction: the dispatchers and graphs are made for it
    with pytest.raises(ValueError, match=r"capacity of 4 \(its largest of \[2, 4\]\) .* padding included"), \
            torch.no_grad():
        m(torch.randn(5, 16))
    assert m.last_capacity is None  # (a refused forward leaves the last good one's records)


def test_capacity_errors():
    with pytest.raises(ValueError, match="capacity needs dispatcher='alltoall'"):
        layer(capacity=4, dispatcher="allgather")
    with pytest.raises(ValueError, match="cuda_graph=True needs a fixed capacity"):
        layer(cuda_graph=True)
    m = layer(capacity=4)
    with pytest.raises(ValueError, match=r"capacity of 4 per rank on expert-parallel rank\(s\) \[0\] \(5 tokens"), \
            torch.no_grad():
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match="inference-only"):
        m(torch.randn(3, 16, requires_grad=True))
    # a frozen router with trainable experts is training too (it was run, and with cuda_graph=True
    # captured: every replay then reused the captured autograd graph)
    m.router.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="inference-only"):
        m(torch.randn(3, 16))
    with torch.no_grad():
        assert m(torch.randn(3, 16)).shape == (3, 16)


def test_token_ids_must_be_laid_out_like_x():
    m = layer()
    x = torch.randn(3, 2, 16)  # [S, B, H]
    with torch.no_grad():
        m(x, token_ids=torch.arange(6).view(3, 2))
        m(x, token_ids=torch.arange(6))  # flattened like x
        with pytest.raises(ValueError, match=r"\[B, S\] ids for \[S, B, H\]"):
            m(x, token_ids=torch.arange(6).view(2, 3))


def _dies_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.timeout(60)
def test_run_distributed_fails_fast_when_a_rank_dies():
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died without reporting \(exit codes \{1: 3\}\)"):
        run_distributed(_dies_on_rank_1, 2, timeout=50)
    assert time.monotonic() - start < 30


def _aborts_on_rank_1(rank, world):
    if rank == 1:
        os.abort()  # as NCCL's watchdog ends a rank that waited past the timeout
    return rank


@pytest.mark.timeout(60)
def test_run_distributed_names_the_signal_that_ended_a_rank():
    """It said "exit codes {1: -6}": which a user must look up (NCCL's watchdog aborts timed-out ranks)."""
    with pytest.raises(RuntimeError, match=r"died without reporting \(exit codes \{1: -6 \(SIGABRT - an abort: e\.g\. NCCL's watchdog"):
        run_distributed(_aborts_on_rank_1, 2, timeout=50)


@pytest.mark.timeout(90)
def test_run_distributed_retries_a_rendezvous_port_taken_meanwhile(monkeypatch):
    """free_port() releases the port it found; another process can take it before rank 0's store
    binds it (EADDRINUSE failed a GPU test). The run starts again on another port."""
    import socket

    from moelayers import testing

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    ports = [held.getsockname()[1]]
    real = testing.free_port
    monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert testing.run_distributed(_rank_of, 2, timeout=60) == [0, 1]
        assert not ports  # the taken port was tried first
        monkeypatch.setattr(testing, "free_port", lambda: held.getsockname()[1])  # taken every time
        with pytest.raises(RuntimeError, match="rendezvous port was taken 3 times"):
            testing.run_distributed(_rank_of, 2, timeout=60)
    finally:
        held.close()


def _rank_of(rank, world):
    return rank


def _returns_a_lock(rank, world):
    import threading

    return threading.Lock() if rank == 1 else rank


@pytest.mark.timeout(60)
def test_run_distributed_names_a_result_that_cannot_be_sent_back():
    """It said 'rank(s) [...] died without reporting (exit codes 0)': the result was pickled in the
    queue's feeder thread, after the worker's error handling."""
    with pytest.raises(RuntimeError, match=r"(?s)--- rank 1 ---.*cannot pickle '_thread.lock' object"):
        run_distributed(_returns_a_lock, 2, timeout=50)
    assert run_distributed(_returns_a_lock, 1, timeout=50) == [0]


def _env_and_parent(rank, world, name):
    return os.environ.get(name), os.getppid()


@pytest.mark.timeout(120)
def test_run_distributed_ranks_see_the_environment_of_the_call(monkeypatch):
    """gloo ranks fork from a fork server that imported torch once; it inherits the environment it
    started with, so a changed variable must restart it (a rank would otherwise import triton
    with a stale TRITON_INTERPRET), while an unchanged one reuses it."""
    from moelayers import testing

    if testing._start_context("gloo").get_start_method() != "forkserver":
        pytest.skip("no fork server on this platform")
    monkeypatch.setenv("MOELAYERS_TEST_VAR", "one")
    first = run_distributed(_env_and_parent, 2, "MOELAYERS_TEST_VAR", timeout=100)
    again = run_distributed(_env_and_parent, 2, "MOELAYERS_TEST_VAR", timeout=100)
    monkeypatch.setenv("MOELAYERS_TEST_VAR", "two")
    changed = run_distributed(_env_and_parent, 2, "MOELAYERS_TEST_VAR", timeout=100)
    assert [v for v, _ in first + again] == ["one"] * 4 and [v for v, _ in changed] == ["two"] * 2
    servers = {name: {p for _, p in res} for name, res in (("first", first), ("again", again), ("changed", changed))}
    assert all(len(p) == 1 for p in servers.values()), servers  # every rank of a call forked by one server
    assert servers["first"] == servers["again"] != servers["changed"], servers
    assert servers["first"] != {os.getpid()}  # forked by the server, not by this process


def test_run_distributed_spawns_nccl_ranks_and_on_request(monkeypatch):
    from moelayers import testing

    assert testing._start_context("nccl").get_start_method() == "spawn"  # CUDA initialised in the rank alone
    monkeypatch.setenv("MOELAYERS_SPAWN_RANKS", "1")
    assert testing._start_context("gloo").get_start_method() == "spawn"


def test_router_and_reference_check_forced_ids():
    """Standalone, the router and the dense reference refuse forced ids of the wrong shape (a
    [T * K] or [K, T] tensor used to broadcast or reshape into a wrong routing) or range."""
    from moelayers.reference import moe_forward
    from moelayers.router import TopKRouter

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    router = TopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(3, 8)
    good = torch.tensor([[0, 1], [2, 3], [1, 2]])
    for bad in (good.t(), good.reshape(-1), good[:, :1], good[:2]):
        with pytest.raises(ValueError, match=r"forced_ids must be \[T, K\] = \[3, 2\]"):
            router(x, bad)
        with pytest.raises(ValueError, match=r"topk_ids must be \[3, 2\]"):
            moe_forward(x, router.weight, torch.randn(4, 8, 8), torch.randn(4, 8, 4), cfg, topk_ids=bad)
    with pytest.raises(ValueError, match=r"topk_ids must be in \[0, 4\)"):
        moe_forward(x, router.weight, torch.randn(4, 8, 8), torch.randn(4, 8, 4), cfg, topk_ids=good + 2)
    ids, _ = router(x, good)
    assert torch.equal(ids, good)
    y_sb = moe_forward(x.view(3, 1, 8), router.weight, torch.randn(4, 8, 8), torch.randn(4, 8, 4), cfg,
                       topk_ids=good.view(3, 1, 2))
    assert y_sb.shape == (3, 1, 8)


@pytest.mark.parametrize("name", ["dedup", "cuda_graph"])  # (check_finite: test_deferred_check.py)
def test_switches_must_be_bools(name):
    """A config's string 'off' is truthy: refused rather than read as on."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    with pytest.raises(TypeError, match=f"{name} must be a bool, got 'off'"):
        ml.VanillaMoE(cfg, ml.ParallelGroups.single(), **{name: "off"})


@pytest.mark.parametrize("capacity", [None, 16])
def test_a_refused_forward_keeps_the_last_records(capacity):
    """NaN logits: the forward raises and last_topk_ids / last_stats still describe the last good
    forward (capacity mode used to overwrite them before raising)."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    m = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), capacity=capacity)
    with torch.no_grad():
        m(torch.randn(5, 16))
        ids, pairs = m.last_topk_ids.clone(), list(m.last_stats.pairs_sent)
        bad = torch.randn(9, 16)
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN or inf"):
            m(bad)
    assert torch.equal(m.last_topk_ids, ids) and list(m.last_stats.pairs_sent) == pairs


def test_explicit_grouped_mm_refuses_what_it_cannot_run():
    """expert_backend='grouped_mm' on float64 (or misaligned rows) fails at construction, not deep in
    the first forward."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='grouped_mm' needs"):
        ml.VanillaMoE(cfg, ml.ParallelGroups.single(), expert_backend="grouped_mm")
    with pytest.raises(ValueError, match="16-byte aligned"):
        ml.VanillaMoE(cfg.replace(params_dtype=torch.float32, ffn_hidden_size=6), ml.ParallelGroups.single(),
                      expert_backend="grouped_mm")


@pytest.mark.parametrize("ids", [torch.ones(3, 2, dtype=torch.bool), torch.full((3, 2), 1.9),
                                 torch.ones(3, 2, dtype=torch.complex64)])
def test_router_refuses_forced_ids_that_are_not_integers(ids):
    """Standalone, the router refuses bool / float / complex forced ids (a bool True became expert 1,
    a float 1.9 was truncated to 1) before their shape is looked at."""
    from moelayers.router import TopKRouter

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    router = TopKRouter(cfg)
    with pytest.raises(TypeError, match=rf"forced_ids must be integer expert ids, got {ids.dtype}"):
        router(torch.randn(3, 8), ids)


def test_config_flags_take_numpy_bools():
    """A flag read from an npz or a numpy array is a numpy bool: taken (stored as a bool), where it
    was refused; a string still is."""
    import numpy as np

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, norm_topk_prob=np.bool_(False),
                       rank_in_logits_dtype=np.bool_(True))
    assert cfg.norm_topk_prob is False and cfg.rank_in_logits_dtype is True
    assert cfg == ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, norm_topk_prob=False,
                               rank_in_logits_dtype=True)
    with pytest.raises(TypeError, match="norm_topk_prob must be a bool, got 'no'"):
        ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, norm_topk_prob="no")


class _PlanMoE(ml.VanillaMoE):
    """A strategy whose plan() bends, on ``on_rank``, one of the placement's routes to ``bad`` =
    (field, value): in Routes of its own (``fresh``), or in the Routes ``super().plan()`` returned
    (which say they are in range)."""

    def __init__(self, *args, bad=None, on_rank=-1, fresh=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.bad, self.on_rank, self.fresh = bad, on_rank, fresh

    def plan(self, topk_ids, topk_weights, token_ids):
        r = super().plan(topk_ids, topk_weights, token_ids)
        rank, slot = r.dest_rank.clone(), r.dest_slot.clone()
        if self.bad is not None and self.groups.ep_rank == self.on_rank:
            field, value = self.bad
            (rank if field == "rank" else slot)[0, 0] = value
        if not self.fresh:
            r.dest_rank, r.dest_slot = rank, slot
            return r
        return ml.Routes(r.topk_ids, r.weights, rank, slot, nonfinite=r.nonfinite)


def _bad_routes_of_a_plan(rank, world, dispatcher, fresh=True):
    """A plan() override's route to a rank past the group (or -1) was dropped by the de-duplicated
    all-to-all and the all-gather (an activation lost, no error), failed with an index error on
    one rank of the other all-to-all, and a slot past the rank's slots was delivered nowhere."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, init_std=0.5)
    groups = ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single()
    kwargs = {"capacity": dict(capacity=6, check_finite=False), "nodedup": dict(dedup=False)}.get(
        dispatcher, dict(dispatcher=dispatcher))
    out = []
    for bad in (("rank", world), ("rank", -1), ("rank", -2), ("slot", 4 // world), ("slot", -1)):
        m = _PlanMoE(cfg, groups, bad=bad, on_rank=world - 1, seed=1, fresh=fresh, **kwargs)
        try:
            with torch.no_grad():
                m(torch.randn(5, 8))
            out.append(f"{bad}: no error")
        except ValueError as e:
            out.append("raised" if f"routes of expert-parallel rank(s) [{world - 1}]" in str(e) else str(e))
    good = _PlanMoE(cfg, groups, seed=1, fresh=fresh, **kwargs)  # all routes in range: the reference's output
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y = good(x)
    router, w13, w2 = good.export_full_weights()
    out.append(check_close("custom plan", y, ml.reference.moe_forward(x, router, w13, w2, cfg)))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fresh", [True, False], ids=["own-routes", "edited-routes"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "nodedup", "allgather", "capacity"])
def test_routes_out_of_range_raise_on_every_rank(dispatcher, fresh):
    want = ["raised"] * 5 + [None]  # (-1, capacity mode's padding, too: a plan() override drops no token)
    assert _bad_routes_of_a_plan(0, 1, dispatcher, fresh) == want
    assert run_distributed(_bad_routes_of_a_plan, 2, dispatcher, fresh) == [want] * 2


class _BrokenPlanMoE(ml.VanillaMoE):
    """A strategy whose plan() breaks its contract in one way (``how``) on rank ``on_rank``."""

    def __init__(self, *args, how="", on_rank=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.how, self.on_rank = how, on_rank

    def plan(self, topk_ids, topk_weights, token_ids):
        r = super().plan(topk_ids, topk_weights, token_ids)
        if self.groups.ep_rank != self.on_rank:
            return r
        if self.how == "raises":
            raise RuntimeError("my plan failed")
        if self.how == "other_expert":  # in range, but the slot holds another expert
            r.dest_slot = (r.dest_slot + 1) % self.placement.slots_per_rank
        elif self.how == "tuple":
            return r.dest_rank, r.dest_slot
        elif self.how == "flat_rank":
            r.dest_rank = r.dest_rank[:, 0]
        elif self.how == "fewer_rows":
            return ml.Routes(r.topk_ids[:-1], r.weights[:-1], r.dest_rank[:-1], r.dest_slot[:-1])
        elif self.how == "float_slot":
            r.dest_slot = r.dest_slot.float()
        elif self.how == "sparse_weights":
            r.weights = r.weights.to_sparse()
        elif self.how == "int_flags":
            r.nonfinite = 0
        return r


PLAN_BREAKS = {"raises": "raised RuntimeError: my plan failed", "other_expert": None,
               "tuple": "must return Routes, got tuple", "flat_rank": r"Routes.dest_rank as a strided \[T, K\]",
               "fewer_rows": r"Routes.dest_rank as a strided \[T, K\]", "float_slot": "Routes.dest_slot as an integer tensor",
               "sparse_weights": r"Routes.weights as a strided \[T, K\]", "int_flags": "must leave Routes.nonfinite None"}


def _broken_plans(rank, world, dispatcher):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, init_std=0.5)
    groups = ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single()
    kwargs = _kwargs(dispatcher)
    out = {}
    for how in PLAN_BREAKS:
        layer = _BrokenPlanMoE(cfg, groups, how=how, on_rank=world - 1, seed=1, **kwargs)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error")  # (a warning raised on one rank alone would hang the others)
            try:
                layer(torch.randn(5, 8))
                out[how] = "no error"
            except ValueError as e:
                out[how] = (str(e), type(e.__cause__).__name__ if e.__cause__ is not None else None)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "capacity", "capacities"])
def test_a_plan_override_that_breaks_its_contract_raises_on_every_rank(dispatcher):
    """An override that raised on one rank left the others waiting in the exchange (a hang until
    the timeout), one with [T] or fewer routes did too, and one routing a token to an in-range slot
    holding another expert computed that expert silently."""
    import re

    for world in (1, 2):
        results = _broken_plans(0, 1, dispatcher) if world == 1 else run_distributed(_broken_plans, 2, dispatcher)
        for rank, got in enumerate([results] if world == 1 else results):
            for how, told in PLAN_BREAKS.items():
                message, cause = got[how] if got[how] != "no error" else (got[how], None)
                if told is None or rank != world - 1:  # the flags' message (the rank whose plan broke: its own)
                    assert message.startswith(f"the routes of expert-parallel rank(s) [{world - 1}]"), (world, rank, how)
                else:
                    assert re.match(rf"_BrokenPlanMoE\.plan\(\) .*{told}", message), (world, how, message)
                    assert cause == ("RuntimeError" if how == "raises" else None), (how, cause)


def test_the_reference_refuses_what_the_layers_refuse():
    """The oracle truncated float forced ids to other experts, computed a 3-expert or an F=6 MoE
    from weights that do not fit the config, and failed on a numpy x with an AttributeError."""
    import numpy as np

    from moelayers.reference import moe_forward

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    g = torch.Generator().manual_seed(0)
    x, rw, w13, w2 = (torch.randn(*s, generator=g) for s in ((3, 8), (4, 8), (4, 8, 8), (4, 8, 4)))
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor, got torch.float32"):
        moe_forward(x, rw, w13, w2, cfg, topk_ids=torch.tensor([[0.9, 1.9]] * 3))
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor, got torch.bool"):
        moe_forward(x, rw, w13, w2, cfg, topk_ids=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"router_weight must be \[4, 8\] for this config"):
        moe_forward(x, rw[:3], w13[:3], w2[:3], cfg)
    with pytest.raises(ValueError, match=r"w13 must be \[4, 8, 8\] for this config \(E=4, H=8, F=4\), got \[4, 12, 8\]"):
        moe_forward(x, rw, torch.randn(4, 12, 8), torch.randn(4, 8, 6), cfg)
    with pytest.raises(ValueError, match=r"x must be \[T, 8\], \[S, B, 8\] or \[B, S, 8\], got \[3, 7\]"):
        moe_forward(x[:, :7], rw, w13, w2, cfg)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        moe_forward(np.zeros((3, 8), dtype=np.float32), rw, w13, w2, cfg)
    assert moe_forward(x, rw, w13, w2, cfg, topk_ids=torch.tensor([[0, 1]] * 3, dtype=torch.int32)).shape == (3, 8)


# ---------------------------------------------------------------------- planners' inputs found by fuzzing
def _fuzzed_inputs():
    from moelayers.planning.eplb import plan_eplb, replicate_experts
    from moelayers.planning.gem import LatencyCurves, plan_gem
    from moelayers.planning.semantic import build_token_table
    from moelayers.planning.steps import LoadWindow

    high = LatencyCurves.preset("high", 2)
    return {
        # uint64 2**64 - 1 became -1: an empty slot, silently
        "placement_uint64_id": (lambda: ml.ExpertPlacement(np.array([[0, 2**64 - 1]], np.uint64), 1),
                                "expert ids outside"),
        # stored wrapped to negative counts
        "window_uint64_count": (lambda: LoadWindow(1, 3).push(np.array([2**64 - 1, 0, 0], np.uint64)), "fit int64"),
        "window_huge_float_count": (lambda: LoadWindow(1, 3).push(np.array([1e30, 0, 0])), "fit int64"),
        # every score inf: the search returned None (plain) or broke its equal-experts invariant (high)
        "gem_overflowing_loads": (lambda: plan_gem(np.full((1, 4), 1e308), LatencyCurves.preset("none", 2),
                                                   method="plain"), "fewer than 2\\*\\*53 rows"),
        "gem_rows_past_2_53": (lambda: plan_gem(np.array([[2**62, 1, 2**61, 3], [5, 2**62, 1, 1]]), high),
                               "fewer than 2\\*\\*53 rows"),
        "gem_fractional_scenarios": (lambda: plan_gem(np.ones((3, 4)), high, scenarios=4.7), "scenarios must be"),
        "eplb_string_loads": (lambda: plan_eplb(np.array(["1", "2"]), 2), "numbers of rows"),
        "eplb_complex_loads": (lambda: plan_eplb(np.array([1 + 5j, 2]), 2), "numbers of rows"),
        "eplb_bool_loads": (lambda: plan_eplb(np.array([True, False]), 2), "numbers of rows"),
        "replicate_nan_weight": (lambda: replicate_experts(np.array([np.nan, 1.0]), 3), "finite numbers"),
        "replicate_no_experts": (lambda: replicate_experts(np.array([]), 0), "finite numbers"),
        # broadcast one routing row over two tokens; truncated expert 0.7 to 0
        "token_table_rows": (lambda: build_token_table(np.array([0, 1]), np.array([[0]]), 2, 2), "integer \\[T, K\\]"),
        "token_table_float_ids": (lambda: build_token_table(np.array([0]), np.array([[0.7]]), 2, 2),
                                  "integer \\[T, K\\]"),
    }


@pytest.mark.parametrize("case", sorted(_fuzzed_inputs()))
def test_planners_refuse_what_fuzzing_found(case):
    call, match = _fuzzed_inputs()[case]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("curves", ["high", "curves.npz", [1.0, 1.1]])
def test_variability_layer_refuses_curves_that_are_not_latency_curves(curves):
    """A preset name or a path as ``curves`` was accepted; every re-plan then failed, as a warning
    with auto_replan (the layer served on in the old placement)."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    with pytest.raises(TypeError, match="curves must be a moelayers.planning.gem.LatencyCurves"):
        ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), curves=curves, auto_replan=True)
    planner = lambda loads, c, **kw: torch.arange(4)  # noqa: E731  (a planner of its own reads its own curves)
    ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), curves=curves, planner=planner)


def test_small_public_helpers_refuse_what_they_took_silently():
    """Found by an error-message audit: each of these returned a wrong result or failed deep inside."""
    import numpy as np

    from moelayers.planning.gem import LatencyCurves, plan_gem
    from moelayers.schedule.token_shuffle import inverse_permutation
    from moelayers.trace import synthetic_trace, train_sequences
    from moelayers.trace_synthetic import trace_statistics

    with pytest.raises(ValueError, match="train_fraction in \\[0, 1\\]"):
        train_sequences(1.5, 10)  # was 15 of 10 sequences
    with pytest.raises(ValueError, match="scale must be \\[R\\]"):
        LatencyCurves.tiled([[1.0, 1.0], [1.0, 1.0]])  # was 4 ranks
    with pytest.raises(TypeError, match="tile must be an int"):
        LatencyCurves.tiled([1.0, 1.0], tile=1.5)
    trace = synthetic_trace(12, 4, 8, 2, 64, seq_len=(4, 16), seed=0)
    with pytest.raises(ValueError, match="layer_pairs must be"):
        trace_statistics(trace, layer_pairs=[(0, -1)])  # -1 was the last layer
    assert trace_statistics(trace, layer_pairs=[(0, 3)])["layer_pairs"] == [(0, 3)]
    # a token perm does not hold: -1, not uninitialised memory
    assert inverse_permutation(torch.tensor([0, 0, 2, -1]), 3).tolist() == [1, -1, 2]
    loads = np.ones((4, 8))
    for seed in (-1, "x", 1.5):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            plan_gem(loads, LatencyCurves.preset("high", 2), seed=seed)


def test_layer_constructor_and_force_routing_say_what_is_wrong():
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    single = ml.ParallelGroups.single()
    for seed in ("abc", None, 1.5, -1):  # "can only concatenate str", "unsupported operand", ...
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            ml.VanillaMoE(cfg, single, seed=seed)
    with pytest.raises(TypeError, match="placement must be an ExpertPlacement"):  # "Boolean value of Tensor"
        ml.VanillaMoE(cfg, single, placement=torch.tensor([[0, 1, 2, 3]]))
    layer = ml.VanillaMoE(cfg, single, seed=np.int64(3))
    for ids in (torch.tensor([0, 1, 2]), torch.zeros(3, 3, dtype=torch.int64)):  # raised at the next forward
        with pytest.raises(ValueError, match=r"force_routing takes \[T, 2\]"):
            layer.force_routing(ids)
    ml.VariabilityAwareMoE(cfg, single, min_gain=np.float32(0.1))  # a numpy float is a number in [0, 1)


def test_plan_semantic_refuses_a_bad_seed():
    from moelayers.planning.semantic_solvers import plan_semantic
    from moelayers.trace import synthetic_trace

    trace = synthetic_trace(12, 2, 8, 2, 64, seq_len=(4, 16), seed=0)
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        plan_semantic(trace, 2, "dp", seed=-1, progress=False)


def test_an_unknown_variability_name_names_its_key():
    """A user's variability option with its own name was told 'variability must be one of ...'."""
    from moelayers.emulation import VariabilitySettings

    with pytest.raises(ValueError, match=r"variability\.name must be one of the presets .* got 'mine'; for measured "
                                         r"curves give variability\.curves\.path=FILE"):
        VariabilitySettings.from_config({"variability": {"name": "mine"}})
    with pytest.raises(ValueError, match=r"^variability must be one of the presets"):
        VariabilitySettings.from_config({"variability": "mine"})


def test_a_plan_override_may_return_float32_weights_of_a_bf16_layer():
    """Renormalising the weights in float32 is fine: they are cast to the router weights' dtype."""

    class Float32Weights(ml.VanillaMoE):
        def plan(self, topk_ids, topk_weights, token_ids):
            r = super().plan(topk_ids, topk_weights, token_ids)
            r.weights = r.weights.float()
            return r

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.bfloat16)
    plain, bent = ml.VanillaMoE(cfg, ml.ParallelGroups.single()), Float32Weights(cfg, ml.ParallelGroups.single())
    bent.load_state_dict(plain.state_dict())
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(bent(x), plain(x))
