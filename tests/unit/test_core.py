"""Unit tests of the core pieces on one process."""

import os
from types import SimpleNamespace

import pytest
import torch

import moelayers as ml
from moelayers.dispatch.base import local_pairs
from moelayers.dispatch.comm import RowLayout
from moelayers.testing import check_close


# ---------------------------------------------------------------- placement
def test_linear_and_tables():
    p = ml.ExpertPlacement.linear(8, 4)
    assert p.phy2log.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.log2phy[:, 0].tolist() == list(range(8))
    assert p.logcnt.tolist() == [1] * 8
    assert p.expert_rank().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_replicas_log2phy_matches_eplb_format():
    p = ml.ExpertPlacement.from_phy2log([[0, 1, 3], [2, 3, 0]], 4)
    assert p.logcnt.tolist() == [2, 1, 1, 2]
    assert p.log2phy.tolist() == [[0, 5], [1, -1], [3, -1], [2, 4]]
    for e in range(4):
        for phys in p.log2phy[e, : p.logcnt[e]].tolist():
            assert p.phy2log.flatten()[phys] == e


def test_from_expert_rank_and_spare_slots():
    p = ml.ExpertPlacement.from_expert_rank([1, 0, 1, 0, 1], slots_per_rank=3)
    assert p.phy2log.tolist() == [[1, 3, -1], [0, 2, 4]]


def test_moves_to():
    a = ml.ExpertPlacement.linear(4, 2)
    b = ml.ExpertPlacement.from_phy2log([[0, 2], [1, 3]], 4)
    moves = a.moves_to(b)
    assert [(m.dst_rank, m.dst_slot, m.expert, m.src_rank, m.src_slot) for m in moves] == [
        (0, 1, 2, 1, 0), (1, 0, 1, 0, 1)]
    assert a.moves_to(a) == []
    with pytest.raises(ValueError, match="differ in shape"):
        a.moves_to(ml.ExpertPlacement.linear(4, 1))


def test_save_load_roundtrip_atomic(tmp_path):
    p = ml.ExpertPlacement.from_phy2log([[0, 1, 3], [2, 3, -1]], 4)
    path = tmp_path / "p.npz"
    p.save(path)
    assert ml.ExpertPlacement.load(path) == p
    assert sorted(os.listdir(tmp_path)) == ["p.npz"]
    bad = tmp_path / "bad.npz"
    import numpy as np
    np.savez(bad, x=np.zeros(2))
    with pytest.raises(ValueError, match="missing key"):
        ml.ExpertPlacement.load(bad)


# ---------------------------------------------------------------- router
@pytest.mark.parametrize("score_fn,norm", [("softmax", True), ("softmax", False), ("sigmoid", True), ("sigmoid", False)])
def test_router_scoring(score_fn, norm):
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=6, top_k=3, score_fn=score_fn, norm_topk_prob=norm)
    r = ml.TopKRouter(cfg)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(20, 8)
    ids, w = r(x)
    logits = x @ r.weight.t()
    scores = logits.softmax(-1) if score_fn == "softmax" else logits.sigmoid()
    top, top_ids = scores.topk(3, -1)
    if norm:
        top = top / top.sum(-1, keepdim=True)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(w, top)


# ---------------------------------------------------------------- experts
def test_grouped_experts_loop_matches_reference():
    ex = ml.GroupedExperts(3, 8, 4, dtype=torch.float64)
    torch.nn.init.normal_(ex.w13)
    torch.nn.init.normal_(ex.w2)
    x = torch.randn(7, 8, dtype=torch.float64)
    counts = torch.tensor([2, 0, 5])
    y = ex(x, counts)
    ref = torch.cat([ml.reference.swiglu_expert(x[:2], ex.w13[0], ex.w2[0]),
                     ml.reference.swiglu_expert(x[2:], ex.w13[2], ex.w2[2])])
    torch.testing.assert_close(y, ref)
    assert ex.w13.allreduce is False and ex.w2.allreduce is False


def test_load_full_zeroes_empty_slots_and_exports():
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=2, top_k=1)
    p = ml.ExpertPlacement.linear(2, 1, slots_per_rank=3)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=p)
    w13, w2 = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    layer.load_full_weights(torch.randn(2, 8), w13, w2)
    assert torch.equal(layer.experts.w13[2], torch.zeros(8, 8))
    _, e13, e2 = layer.export_full_weights()
    assert torch.equal(e13, w13) and torch.equal(e2, w2)


def test_default_init_is_seeded_per_expert():
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=1)
    a = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3)
    b = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3,
                      placement=ml.ExpertPlacement.from_phy2log([[3, 2, 1, 0]], 4))
    for e in range(cfg.num_experts):  # slot 3 - e of b holds expert e: the same draws as a's slot e
        assert torch.equal(a.experts.w13[e], b.experts.w13[3 - e])
        assert torch.equal(a.experts.w2[e], b.experts.w2[3 - e])
    assert torch.equal(a.router.weight, b.router.weight)
    # expert e's draws: w13 then w2 from one generator seeded seed * 1_000_003 + e, N(0, init_std)
    gen = torch.Generator().manual_seed(3 * 1_000_003 + 2)
    w13 = torch.empty_like(a.experts.w13[2]).normal_(0.0, cfg.init_std, generator=gen)
    w2 = torch.empty_like(a.experts.w2[2]).normal_(0.0, cfg.init_std, generator=gen)
    assert torch.equal(a.experts.w13[2], w13) and torch.equal(a.experts.w2[2], w2)


# ---------------------------------------------------------------- dispatch pieces
def test_row_layout_roundtrip():
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    w = torch.randn(5, 3)
    s = torch.randint(-1, 9, (5, 3), dtype=torch.int32)
    layout = RowLayout(((7, x.dtype), (3, w.dtype), (3, torch.int32)))
    assert layout.row_bytes % 16 == 0
    buf = layout.pack([x, w, s])
    xv, wv, sv = layout.views(buf)
    assert torch.equal(xv, x) and torch.equal(wv, w) and torch.equal(sv, s)


def test_local_pairs_sorted_by_slot():
    slots = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    lp = local_pairs(slots, 3)
    assert lp.slot_counts.tolist() == [2, 1, 2]
    assert lp.pair_row.tolist() == [1, 3, 3, 0, 1]
    assert lp.index.tolist() == [[3, -1], [0, 4], [-1, -1], [2, 1]]


def test_forced_routing_takes_any_integer_ids():
    """Replayed ids stored as int16 or uint8 (a trace may) route like int64 ones (uint8 must not act as a mask)."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64,
                       init_std=0.5)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    x = torch.randn(5, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    outs = []
    for dtype in (torch.int64, torch.int16, torch.uint8):
        layer.force_routing(ids.to(dtype))
        outs.append(layer(x))
        assert torch.equal(layer.last_topk_ids, ids)
    ref = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg, topk_ids=ids)
    for y in outs:
        assert check_close("forced ids", y, ref) is None


def test_fp32_router_with_bf16_weights_matches_the_reference():
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2, params_dtype=torch.bfloat16,
                       router_dtype=torch.float32)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    x64 = torch.randn(40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = layer(x64.to(torch.bfloat16))
    w = layer.export_full_weights()
    ref = ml.reference.moe_forward(x64, *(t.double() for t in w), cfg.replace(params_dtype=torch.float64),
                                   topk_ids=layer.last_topk_ids)
    low = ml.reference.moe_forward(x64.to(torch.bfloat16), *w, cfg)
    assert check_close("fp32 router", y, ref, low) is None
    with pytest.raises(TypeError, match="router_dtype"):
        cfg.replace(router_dtype=torch.int32)


# ---------------------------------------------------------------- stats and the checker itself
def test_last_stats_single_process():
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    layer(torch.randn(6, 8))
    st = layer.last_stats
    assert st.lar == 1.0 and st.rank_loads == [12] and st.bytes_sent == [0] and st.imbalance == 1.0
    assert st.with_experts(4).expert_loads.sum() == 12
    assert ml.metrics.merge_stats([st, st]).rank_loads == [24]


def test_allgather_stats_stay_on_the_device_until_read():
    """The all-gather dispatcher read its activation counts on the host in every forward (a second
    device sync after its header's); they are read when asked now, with the same values."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), dispatcher="allgather")
    layer(torch.randn(6, 8))
    st = layer.last_stats
    assert isinstance(st._pairs_sent, torch.Tensor)  # not read yet
    assert st.lar == 1.0 and st.rank_loads == [12] and st.bytes_sent == [0] and st.rows_sent == [6]
    assert st.with_experts(4).expert_loads.sum() == 12


def test_metrics_functions():
    assert ml.metrics.imbalance([1, 1, 4]) == pytest.approx(2.0)
    assert ml.metrics.local_activation_rate(torch.tensor([0, 1]), torch.tensor([[0, 1], [1, 1]])) == 0.75
    assert ml.metrics.rank_loads(torch.tensor([[0, 1], [1, 1]]), 3).tolist() == [1, 3, 0]


def test_checker_catches_a_wrong_output():
    """Negative control: a perturbed expert must fail the equivalence rule."""
    g = torch.Generator().manual_seed(11)  # its own generator: no dependence on the tests run before
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    layer.load_full_weights(torch.randn(4, 8, generator=g), torch.randn(4, 8, 8, generator=g) / 3,
                            torch.randn(4, 8, 4, generator=g) / 2)  # O(1) outputs
    x = torch.randn(16, 8, generator=g)
    r, w13, w2 = layer.export_full_weights()
    ref = ml.reference.moe_forward(x.double(), r.double(), w13.double(), w2.double(), cfg.replace(params_dtype=torch.float64))
    assert check_close("ok", layer(x), ref) is None
    busiest = int(torch.bincount(layer.last_topk_ids.reshape(-1), minlength=4).argmax())
    with torch.no_grad():
        layer.experts.w2[busiest] *= 1.001
    assert check_close("bad", layer(x), ref) is not None


def test_placement_from_expert_rank_refuses_float_ranks():
    with pytest.raises(TypeError, match="integer ranks"):
        ml.ExpertPlacement.from_expert_rank(torch.tensor([0.7, 1.2]), num_ranks=2)
    with pytest.raises(ValueError, match=r"expert_rank must be \[E\] \(one layer\), got shape \[2, 4\]"):
        ml.ExpertPlacement.from_expert_rank(torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0]]))  # it made 8 experts
    for kw in (dict(num_ranks=2.0), dict(slots_per_rank=3.0), dict(num_ranks=0)):
        with pytest.raises(ValueError, match="must be a positive int"):
            ml.ExpertPlacement.from_expert_rank(torch.tensor([0, 0, 1, 1]), **kw)
    assert ml.ExpertPlacement.from_expert_rank(torch.tensor([0, 0, 0, 0]), num_ranks=2).phy2log.tolist() == [
        [0, 1, 2, 3], [-1, -1, -1, -1]]


def test_state_dict_carries_the_placement():
    """Expert weights are stored per slot: a checkpoint of a moved layer loads into a freshly built
    one with the placement it was saved in (it used to load into the wrong experts' slots).

    The placements are not their own inverses (a cyclic shift, and one with spare slots), so a
    checkpoint that stored expert -> slot instead of slot -> expert would load other experts."""
    from moelayers.placement import ExpertPlacement

    g = torch.Generator().manual_seed(4)
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    weights = (torch.randn(4, 16, generator=g, dtype=torch.float64),
               torch.randn(4, 16, 16, generator=g, dtype=torch.float64) / 4,
               torch.randn(4, 16, 8, generator=g, dtype=torch.float64) / 3)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    for slots, table in ((4, [[1, 2, 3, 0]]), (6, [[2, -1, 3, 0, -1, 1]])):
        linear = ExpertPlacement.linear(4, 1, slots_per_rank=slots)
        layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), placement=linear)
        layer.load_full_weights(*weights)
        with torch.no_grad():
            want = layer(x)
            moved = ExpertPlacement.from_phy2log(torch.tensor(table), 4)
            layer.apply_placement(moved)
            state = layer.state_dict()
            assert layer._saved_placement(state["_extra_state"]).phy2log.tolist() == table  # slot -> expert, as placed
            fresh = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), placement=linear)
            fresh.load_state_dict(state)
            assert fresh.placement == moved and fresh.placement.phy2log.tolist() == table
            torch.testing.assert_close(fresh(x), want, rtol=1e-12, atol=1e-12)
            for slot, expert in enumerate(table[0]):  # each slot holds its expert's weights
                if expert >= 0:
                    torch.testing.assert_close(fresh.experts.w2[slot], layer.experts.w2[slot], rtol=0, atol=0)
                    torch.testing.assert_close(fresh.experts.w2[slot], weights[2][expert], rtol=0, atol=0)
    fresh = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single())
    with torch.no_grad():
        wide = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=ExpertPlacement.linear(4, 1, slots_per_rank=5))
        with pytest.raises(ValueError, match="slots per rank"):
            fresh.load_state_dict(wide.state_dict(), strict=False)
        state = layer.state_dict()
        state["_extra_state"] = {"weights": 1}
        with pytest.raises(ValueError, match="must be its placement"):
            fresh.load_state_dict(state)
        newer = layer.state_dict()["_extra_state"].clone()  # the record of a newer moelayers: told as such
        newer[0] += 1
        with pytest.raises(ValueError, match=rf"placement record of this MoE layer is of format {int(newer[0])}, "
                                             rf"written by a newer moelayers; this one \(.*\) reads formats up to"):
            fresh.load_state_dict(dict(layer.state_dict(), _extra_state=newer))


def test_stats_merge_and_reduce_keep_their_counts():
    """merge_stats refuses records over different numbers of ranks (it summed the first record's
    length and dropped the rest); reduce() of an already-reduced record keeps its rank count."""
    from moelayers.metrics import MoEStats, merge_stats

    two, four = MoEStats.from_counts(0, [5, 3], [4, 2], 10), MoEStats.from_counts(0, [1, 1, 1, 9], [1, 1, 1, 9], 10)
    for records in ([two, four], [four, two]):
        with pytest.raises(ValueError, match=r"different numbers of ranks \[2, 4\]"):
            merge_stats(records)
    assert merge_stats([two, two]).pairs_sent == [10, 6]
    reduced = MoEStats(0, [18, 6], [12, 6], [480, 160], 2, 14)
    assert reduced.reduce(None).num_ranks_reduced == 2
    with pytest.raises(ValueError, match="holds no expert loads"):
        reduced.expert_loads
    # a layer's records keep their expert loads through reduce and merge, read before or not
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    with torch.no_grad():
        layer(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)))
    want = torch.bincount(layer.last_topk_ids.flatten(), minlength=4)
    st = layer.last_stats
    assert torch.equal(st.reduce(None).expert_loads, want)
    assert torch.equal(merge_stats([st, st]).expert_loads, 2 * want)


def test_last_stats_expert_loads_on_first_read():
    """A layer's last_stats gives its expert loads directly (DESIGN: computed lazily); it used to
    raise unless with_experts(E) was called first."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    for capacity in (None, 16):
        layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), capacity=capacity)
        with torch.no_grad():
            layer(torch.randn(6, 8, generator=torch.Generator().manual_seed(2)))
        want = torch.bincount(layer.last_topk_ids.flatten(), minlength=4)
        assert torch.equal(layer.last_stats.expert_loads, want) and int(want.sum()) == 12


def test_routing_tables_edited_in_place_are_refused():
    """validate() checked only that log2phy's entries point at slots of their expert: a replica
    dropped from log2phy (logcnt still counting it, so tokens routed to slot -1) or listed twice
    passed."""
    from moelayers.placement import ExpertPlacement

    for edit in ("drop", "twice", "count"):
        p = ExpertPlacement([[0, 1], [0, 2]], 3)
        if edit == "count":
            p.logcnt[1] = 0
        else:
            p.log2phy[0, 1] = -1 if edit == "drop" else p.log2phy[0, 0]
        with pytest.raises(ValueError, match="placement tables disagree"):
            p.validate()
    ExpertPlacement([[0, 1], [0, 2]], 3).validate()


def test_a_placement_edited_in_place_is_refused_and_layers_keep_their_own():
    """phy2log edited in place left log2phy (routing) on the old table: apply_placement moved the
    weights by one table and routed by the other, outputs off by 88 silently."""
    from moelayers.layers.moves import PlacementRejected
    from moelayers.placement import ExpertPlacement

    p = ExpertPlacement.linear(4, 1)
    p.phy2log[0, [0, 1]] = p.phy2log[0, [1, 0]]
    with pytest.raises(ValueError, match="phy2log, log2phy or logcnt was changed in place"):
        p.validate()
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), seed=1)
    with pytest.raises(PlacementRejected) as e:
        layer.apply_placement(p)
    assert "phy2log, log2phy or logcnt was changed in place" in str(e.value.__cause__), e.value
    with pytest.raises(ValueError, match="phy2log, log2phy or logcnt was changed in place"):
        ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=p)
    mine = ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4)
    layer.apply_placement(mine)
    mine.phy2log[0, 0] = 1  # the caller's object; the layer serves its own copy
    assert layer.placement is not mine and layer.placement.phy2log[0].tolist() == [3, 2, 1, 0]
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
    ref = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_fingerprint_is_exact_and_order_sensitive():
    """The cross-rank checks' fingerprint: equal rows agree (whatever the chunking), swaps that a
    position-weighted sum cannot see are seen, and so is any single changed value."""
    from moelayers.dispatch.comm import fingerprint

    rows = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 1, 1]])
    fp = fingerprint(rows)
    assert fp[0] == fp[2] and len({int(fp[0]), int(fp[1]), int(fp[3])}) == 3
    assert int((rows[0] * torch.arange(1, 5)).sum()) == int((rows[1] * torch.arange(1, 5)).sum())  # the old check
    big = torch.randint(-2 ** 15, 2 ** 15, (6, 1000), generator=torch.Generator().manual_seed(0), dtype=torch.int16)
    assert torch.equal(fingerprint(big), fingerprint(big, chunk=1500))  # two rows per chunk
    assert fingerprint(big).dtype == torch.int64 and fingerprint(big).shape == (6,)
    for empty in (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.int64)):  # failed to reshape
        assert fingerprint(empty).shape == (0,)
    # the steps now work in place on a copy (a quarter of the temporary memory): the same values, the
    # caller's int64 tensor untouched
    values = torch.arange(12).view(3, 4)
    assert fingerprint(values).tolist() == [3823339940495049444, 4956464686871387711, -6339404665316332204]
    assert torch.equal(values, torch.arange(12).view(3, 4))


# ---------------------------------------------------------------- strict placement and stats checks
def test_placement_constructors_refuse_bad_tables():
    with pytest.raises(ValueError, match="non-empty"):
        ml.ExpertPlacement(torch.zeros((2, 0), dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got 0"):
        ml.ExpertPlacement([[-1]], 0)
    with pytest.raises(ValueError, match=r"outside \[-1, 4\): \[-2\]"):
        ml.ExpertPlacement.from_phy2log([[0, 1, -2], [2, 3, -1]], 4)
    with pytest.raises(ValueError, match=r"slots_per_rank \(3\) < experts per rank \(4\)"):
        ml.ExpertPlacement.linear(8, 2, slots_per_rank=3)
    with pytest.raises(ValueError, match=r"ranks outside \[0, 2\)"):
        ml.ExpertPlacement.from_expert_rank([0, -1, 1], num_ranks=2)
    with pytest.raises(ValueError, match=r"slots_per_rank \(2\) is less than the 3 experts on one rank"):
        ml.ExpertPlacement.from_expert_rank([0, 0, 0, 1], slots_per_rank=2)


def test_expert_rank_is_the_rank_of_the_first_replica():
    p = ml.ExpertPlacement.from_phy2log([[0, 1, 3], [2, 3, 0]], 4)  # log2phy [[0, 5], [1, -1], [3, -1], [2, 4]]
    assert p.expert_rank().tolist() == [0, 0, 1, 0]
    rank, slot = p.first_replica_location("cpu")  # the lookup tables of placement-driven routing
    assert rank.tolist() == [0, 0, 1, 0] and slot.tolist() == [0, 1, 0, 2]


def test_digest_tells_tables_of_other_shapes_apart():
    one, two = ml.ExpertPlacement.linear(4, 1), ml.ExpertPlacement.linear(4, 2)  # same ids in slot order
    assert one.digest() != two.digest()
    assert two.digest() == ml.ExpertPlacement.from_phy2log([[0, 1], [2, 3]], 4).digest()


def test_moves_take_a_local_source_else_round_robin():
    a = ml.ExpertPlacement.from_phy2log([[0, 1], [2, 0]], 3)
    b = ml.ExpertPlacement.from_phy2log([[0, 1], [0, 2]], 3)
    # expert 0 for rank 1 comes from rank 1's own slot 1, not from rank 0
    assert [(m.dst_rank, m.dst_slot, m.expert, m.src_rank, m.src_slot) for m in a.moves_to(b)] == [
        (1, 0, 0, 1, 1), (1, 1, 2, 1, 0)]
    a = ml.ExpertPlacement.from_phy2log([[0, 1], [0, 1], [2, 3], [2, 3]], 4)
    b = ml.ExpertPlacement.from_phy2log([[0, 1], [0, 1], [0, 3], [0, 2]], 4)
    # expert 0 is wanted twice away from its replicas: once from each; expert 2 from rank 3 itself
    assert [(m.dst_rank, m.dst_slot, m.expert, m.src_rank, m.src_slot) for m in a.moves_to(b)] == [
        (2, 0, 0, 0, 0), (3, 0, 0, 1, 0), (3, 1, 2, 3, 0)]


def test_stats_of_a_rank_other_than_0_and_of_nothing():
    from moelayers.metrics import MoEStats, imbalance, local_activation_rate

    st = MoEStats.from_counts(1, [3, 5, 2], [2, 4, 1], 16)
    assert st.bytes_sent == [32, 0, 16] and st.pairs_sent == [3, 5, 2] and st.rows_sent == [2, 4, 1]
    assert st.lar == 0.5
    assert MoEStats.from_counts(1, [0, 0], [0, 0], 16).lar == 0.0
    assert local_activation_rate(torch.zeros(0, dtype=torch.int64), torch.zeros((0, 2), dtype=torch.int64)) == 0.0
    assert imbalance([0, 0, 0]) == 1.0 and imbalance([]) == 1.0


def test_stats_reduce_and_merge_keep_each_count_in_its_place():
    from moelayers.metrics import MoEStats, merge_stats

    a, b = MoEStats.from_counts(1, [3, 5, 2], [2, 4, 1], 16), MoEStats.from_counts(1, [2, 1, 1], [1, 1, 1], 16)
    r = a.reduce(None)
    assert (r.pairs_sent, r.rows_sent, r.bytes_sent, r.lar) == ([3, 5, 2], [2, 4, 1], [32, 0, 16], 0.5)
    m = merge_stats([a, b])  # two steps of one rank: still one rank's records
    assert (m.pairs_sent, m.rows_sent, m.num_ranks_reduced) == ([5, 6, 3], [3, 5, 2], 1)
    assert m.lar == pytest.approx(6 / 14)
    two = MoEStats(0, [18, 6], [12, 6], [480, 160], 2, 14)
    assert merge_stats([two, two]).num_ranks_reduced == 2
    ids = torch.tensor([[0, 2], [2, 1]])
    with_loads = MoEStats.from_counts(0, [4], [2], 8, topk_ids=ids).with_experts(3)
    assert merge_stats([with_loads, with_loads]).expert_loads.tolist() == [2, 2, 4]
    with pytest.raises(ValueError, match="holds no expert loads"):
        merge_stats([with_loads, MoEStats.from_counts(0, [4], [2], 8)]).expert_loads
    with pytest.raises(ValueError, match=r"different numbers of experts \[3, 4\]"):
        merge_stats([with_loads, MoEStats.from_counts(0, [4], [2], 8, topk_ids=ids).with_experts(4)])


def test_moves_wait_for_megatron_main_grad():
    """megatron's DDP accumulates into param.main_grad and clears .grad: a move between accumulated
    micro-batches (explicit or automatic) moved the weights away from the gradients in main_grad."""
    from moelayers.layers.moves import PlacementRejected

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    target = ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4)
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), window=1, auto_replan=True,
                                   planner=lambda loads, curves, **kw: target.expert_rank().numpy())
    w13, w2 = layer.experts.w13, layer.experts.w2
    for w in (w13, w2):
        w.main_grad = torch.zeros_like(w)
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # micro-batches, accumulated as megatron's DDP hook does
        layer(x).sum().backward()
        for w in (w13, w2):
            w.main_grad += w.grad
            w.grad = None
    assert layer.num_replans == 0  # the re-plan due after the first micro-batch waits
    with pytest.raises(PlacementRejected) as info:
        layer.apply_placement(target)
    assert "hold gradients" in str(info.value.__cause__) and "zero_grad_buffer" in str(info.value.__cause__)
    for w in (w13, w2):
        w.main_grad.zero_()  # megatron's zero_grad_buffer() after the optimizer step
    with torch.no_grad():
        layer(x)
    assert layer.num_replans == 1  # (one rank: the planned expert -> rank map is the current one)
    layer.apply_placement(target)  # and an explicit move goes ahead
    assert layer.placement == target


def test_expert_grads_full_reads_megatron_main_grad():
    """Under megatron's DDP the gradients are in main_grad (.grad None): expert_grads_full returned zeros."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    assert all(float(g.abs().max()) == 0.0 for g in layer.expert_grads_full())  # no backward yet
    layer(torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).sum().backward()
    expected = [g.clone() for g in layer.expert_grads_full()]
    assert all(float(g.abs().max()) > 0.0 for g in expected)
    for w in (layer.experts.w13, layer.experts.w2):  # what megatron's DDP hook does
        w.main_grad, w.grad = w.grad.clone(), None
    got = layer.expert_grads_full()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("cls", ["VanillaMoE", "VariabilityAwareMoE"])
@pytest.mark.parametrize("cast", [torch.float64, torch.float16, torch.bfloat16])
def test_a_layer_cast_after_construction_computes_in_its_new_dtype(cls, cast):
    """.half() / .to(dtype) left the layer checking inputs against its construction dtype, and a
    float32 input crashed in the router; load_full_weights refused the layer's own export."""
    from moelayers.reference import moe_forward

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.3)
    layer = getattr(ml, cls)(cfg, ml.ParallelGroups.single(), seed=1).to(cast)
    assert layer.config.params_dtype == cast and layer.router.config is layer.config
    assert cfg.params_dtype == torch.float32  # the caller's config is not touched
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    from moelayers.testing import redraw_near_ties

    x = redraw_near_ties(x, layer.router.weight.double(), 2, lambda n: torch.randn(n, 16, dtype=torch.float64))
    with torch.no_grad():
        y = layer(x.to(cast))
    weights = layer.export_full_weights()
    ref = moe_forward(x, *(w.double() for w in weights), cfg.replace(params_dtype=torch.float64))
    low = None if cast == torch.float64 else moe_forward(x.to(cast), *weights, cfg.replace(params_dtype=cast))
    assert check_close(f"{cls} cast to {cast}", y, ref, low) is None
    layer.load_full_weights(*weights)
    with pytest.raises(TypeError, match=f"x has dtype torch.float32, the layer computes in {cast}"):
        layer(x.float())
    with pytest.raises(TypeError, match="not torch.float8_e4m3fn: the layer was left as it was"):
        layer.to(torch.float8_e4m3fn)  # refused after the weights were cast, the config left behind
    assert layer.router.weight.dtype == layer.experts.w13.dtype == layer.config.params_dtype == cast


def test_module_type_keeps_the_integer_buffers():
    """Module.type(float64) cast every buffer: VariabilityAwareMoE's int64 load window became float64
    and the forward failed while recording loads, losing its output."""
    from moelayers.reference import moe_forward

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.3)
    for cls in (ml.VanillaMoE, ml.VariabilityAwareMoE):
        layer = cls(cfg, ml.ParallelGroups.single(), seed=1).type(torch.float64)
        assert layer.config.params_dtype == torch.float64
        assert all(not b.is_floating_point() for n, b in layer.named_buffers() if n in ("_loads", "_placement_rec"))
        x = torch.randn(7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            y = layer(x)
        ref = moe_forward(x, *layer.export_full_weights(), layer.config, topk_ids=layer.last_topk_ids)
        assert check_close(cls.__name__, y, ref) is None
    layer = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), seed=1)
    with torch.no_grad():
        layer(torch.randn(700, 16))  # counts above 256, which bf16 rounds
    loads = layer._loads.clone()
    assert loads.max() > 256
    assert torch.equal(layer.type(torch.bfloat16)._loads, loads)  # not a round trip through bf16


def test_weights_computed_by_a_parametrization():
    """parametrize / weight_norm / prune make a weight a computed tensor: load_full_weights,
    apply_placement, reset_parameters and expert_grads_full wrote into (or read) that temporary, so
    a move changed the placement but not the weights (wrong outputs) and the gradients read zeros.
    They are refused now; the forward and a cast work with such weights."""
    from torch.nn.utils import parametrizations, parametrize, prune

    from moelayers.layers.moves import PlacementRejected
    from moelayers.reference import moe_forward

    class Same(torch.nn.Module):
        def forward(self, w):
            return w * 1.0

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=6, top_k=2, params_dtype=torch.float64,
                       init_std=0.5)
    x = torch.randn(10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    weights = layer.export_full_weights()
    parametrizations.weight_norm(layer.router, "weight")
    with pytest.raises(TypeError, match=r"load_full_weights works on the layer's own weights in place, but "
                                        r"router.weight is computed .*parametrize.remove_parametrizations"):
        layer.load_full_weights(*weights)
    with pytest.raises(TypeError, match="reset_parameters .* router.weight is computed"):
        layer.reset_parameters()
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    parametrize.register_parametrization(layer.experts, "w13", Same())
    reverse = ml.ExpertPlacement.from_phy2log(torch.tensor([[5, 4, 3, 2, 1, 0]]), 6)
    with pytest.raises(PlacementRejected) as info:
        layer.apply_placement(reverse)
    assert "experts.w13 is computed" in str(info.value.__cause__)
    assert layer.placement == ml.ExpertPlacement.linear(6, 1)
    layer(x).sum().backward()
    with pytest.raises(TypeError, match="expert_grads_full .* experts.w13 is computed"):
        layer.expert_grads_full()
    with torch.no_grad():  # the forward computes with the parametrized weights as they are
        assert check_close("parametrized", layer(x), moe_forward(x, *weights, cfg, topk_ids=layer.last_topk_ids)) is None
    parametrize.remove_parametrizations(layer.experts, "w13")
    layer.zero_grad(set_to_none=True)
    layer.apply_placement(reverse)  # and once removed, a move goes ahead
    # prune keeps a stale router.weight until the next forward: a cast read its dtype and refused the
    # cast layer's input, telling the caller to cast the whole layer (which they had)
    layer = ml.VanillaMoE(cfg.replace(params_dtype=torch.float32), ml.ParallelGroups.single(), seed=1)
    prune.l1_unstructured(layer.router, "weight", amount=0.0)
    layer.double()
    assert layer.config.params_dtype == torch.float64
    with torch.no_grad():
        y = layer(x)
    assert check_close("pruned, cast", y, moe_forward(x, *layer.export_full_weights(), layer.config,
                                                      topk_ids=layer.last_topk_ids)) is None


def test_a_cast_the_grouped_mm_backend_cannot_run_is_refused():
    """backend='grouped_mm' refuses float64 at construction; .double() used to pass and the next
    forward failed inside torch._grouped_mm."""
    from moelayers.experts import GroupedExperts

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), expert_backend="grouped_mm")
    with pytest.raises(TypeError, match=r"backend='grouped_mm' needs .*float64.*the layer was left as it was"):
        layer.double()
    assert layer.router.weight.dtype == layer.experts.w13.dtype == layer.config.params_dtype == torch.float32
    experts = GroupedExperts(4, 16, 8, backend="grouped_mm")
    with pytest.raises(ValueError, match="backend='grouped_mm' needs"):
        experts.double()
    assert experts.w13.dtype == torch.float32
    assert ml.VanillaMoE(cfg, ml.ParallelGroups.single()).double().config.params_dtype == torch.float64  # auto: fine


def test_deepcopy_and_config_copies():
    """The layer keeps its own config (an edit of the caller's broke it silently); a deep copy owns
    its weights (at world >= 2 it failed on the process groups: tests/distributed/test_layers_strict.py)."""
    import copy

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=2)
    cfg.top_k = 100
    x = torch.randn(5, 16)
    with torch.no_grad():
        y = layer(x)
        twin = copy.deepcopy(layer)
        assert torch.equal(twin(x), y) and twin.experts.w13.data_ptr() != layer.experts.w13.data_ptr()
    with pytest.raises(ValueError, match="DeepEP's dispatcher is not part of this version"):
        ml.VanillaMoE(ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2),
                      ml.ParallelGroups.single(), dispatcher="deepep")
    with pytest.raises(TypeError, match="router_dtype must be None or one of"):
        ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, router_dtype=torch.float8_e4m3fn)
    import numpy as np

    sized = ml.MoEConfig(hidden_size=np.int64(16), ffn_hidden_size=8, num_experts=np.int32(4), top_k=2)  # from a file
    assert type(sized.hidden_size) is int and sized.num_experts == 4
    with pytest.raises(TypeError, match="verify must be a bool, got 'no'"):
        layer.load_full_weights(*layer.export_full_weights(), verify="no")
    with pytest.raises(TypeError, match="not a dict"):
        ml.MoEConfig.from_megatron({"num_moe_experts": 8})


@pytest.mark.parametrize("cls", [ml.VanillaMoE, ml.VariabilityAwareMoE])
def test_a_copy_made_under_inference_mode_takes_weights_later(cls):
    """A rollout copy made inside ``torch.inference_mode()`` held inference tensors: loading the
    trainer's weights into it later raised torch's "Inplace update to inference tensor" (and a
    VariabilityAwareMoE's no_grad forward did too, through its load window)."""
    import copy

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    policy = cls(cfg, ml.ParallelGroups.single(), seed=2)
    with torch.inference_mode():
        rollout = copy.deepcopy(policy)
    assert not any(t.is_inference() for t in (*rollout.parameters(), *rollout.buffers()))
    trained = cls(cfg, ml.ParallelGroups.single(), seed=3)
    rollout.load_full_weights(*trained.export_full_weights())
    rollout.apply_placement(ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4))
    x = torch.randn(5, 16)
    with torch.no_grad():
        assert torch.equal(rollout(x), trained(x))
    rollout.load_state_dict(policy.state_dict())
    with torch.no_grad():
        assert torch.equal(rollout(x), policy(x))


def test_a_strict_load_missing_keys_loads_nothing_of_the_layer():
    """set_extra_state adopted the checkpoint's placement before the missing weight was noticed: a
    caller catching the error kept a layer serving expert 2's w2 as expert 0's."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)
    src = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3,
                        placement=ml.ExpertPlacement.from_phy2log(torch.tensor([[2, 3, 0, 1, 6, 7, 4, 5]]), 8))
    dst = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=4)
    before = [t.clone() for t in dst.export_full_weights()]
    state = {k: v for k, v in src.state_dict().items() if k != "experts.w2"}
    with pytest.raises(RuntimeError, match=r"missing key\(s\) \['experts.w2'\]; nothing of this MoE layer was loaded"):
        dst.load_state_dict(state)
    assert dst.placement == ml.ExpertPlacement.linear(8, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, dst.export_full_weights()))
    dst.load_state_dict(src.state_dict())
    assert dst.placement == src.placement
    # strict=False with none of the layer's keys (a partial checkpoint of the rest of the model): the
    # layer is left as it is and its keys are listed as missing. torch hands every module strict=True,
    # so this raised whatever the caller asked.
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(16, 16), "moe": dst})
    before = [t.clone() for t in dst.export_full_weights()]
    res = model.load_state_dict({"proj.weight": torch.zeros(16, 16), "proj.bias": torch.zeros(16)}, strict=False)
    assert res.missing_keys == ["moe._extra_state", "moe.router.weight", "moe.experts.w13", "moe.experts.w2"]
    assert all(torch.equal(a, b) for a, b in zip(before, dst.export_full_weights())) and dst.placement == src.placement
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"moe._extra_state\""):
        model.load_state_dict({"proj.weight": torch.zeros(16, 16), "proj.bias": torch.zeros(16)})
    # the router alone missing (logical order, whatever the placement): the rest loads, the router is
    # listed as missing, as any module's weight (it was refused with a reason about the placement)
    dst = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=4)
    router = dst.router.weight.detach().clone()
    res = dst.load_state_dict({k: v for k, v in src.state_dict().items() if k != "router.weight"}, strict=False)
    assert res.missing_keys == ["router.weight"] and dst.placement == src.placement
    assert torch.equal(dst.router.weight, router)
    assert all(torch.equal(a, b) for a, b in zip(src.export_full_weights()[1:], dst.export_full_weights()[1:]))


def test_layer_state_stays_whole():
    """Found by a review of layer state; each case failed before its fix:
    a size mismatch adopted the checkpoint's placement before torch raised about the sizes; a state
    dict taken before a move paired the moved weights (views) with the old placement; a deep copy lost
    the parameters' flags (allreduce=False: megatron's DDP would all-reduce the experts) and watched
    the original's autograd graphs; a device move kept a captured graph of the old weights; a rank
    loading another rank's file was not told."""
    import copy

    from moelayers.placement import ExpertPlacement

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    g = ml.ParallelGroups.single()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    src = ml.VariabilityAwareMoE(cfg, g, seed=1, placement=ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4))
    dst = ml.VanillaMoE(cfg.replace(ffn_hidden_size=12), g, seed=2)
    with pytest.raises(RuntimeError, match=r"size mismatch for experts.w13: \[4, 16, 16\] in the checkpoint, "
                                           r"\[4, 24, 16\] here.*nothing of this MoE layer was loaded"):
        dst.load_state_dict(src.state_dict())
    assert dst.placement == ExpertPlacement.linear(4, 1)

    snapshot = src.state_dict()
    with torch.no_grad():
        src.apply_placement(ExpertPlacement.from_phy2log(torch.tensor([[1, 2, 3, 0]]), 4))
        fresh = ml.VanillaMoE(cfg, g, seed=5)
        fresh.load_state_dict(snapshot)
        assert fresh.placement == src.placement
        torch.testing.assert_close(fresh(x), src(x), rtol=0, atol=0)

    twin = copy.deepcopy(src)
    assert twin.experts.w13.allreduce is False and twin.experts.w2.allreduce is False
    src.experts.w13.main_grad = torch.zeros(1)  # a DDP wrapper's buffer: the copy's wrapper makes its own
    assert not hasattr(copy.deepcopy(src).experts.w13, "main_grad")
    y = src(x)  # autograd records: the original watches this graph, the copy must not
    assert src.graphs_in_flight() == 1 and copy.deepcopy(src).graphs_in_flight() == 0
    del y

    class _Graph:
        released = False

        def release(self):
            self.released = True

    src._graphed = {4: (graph := _Graph())}
    src._apply(lambda t: t.clone())  # new storage on the same device, as .cpu() / .cuda() round trips give
    assert graph.released and src._graphed == {}
    src._graphed = {4: (graph := _Graph()), 8: (other_graph := _Graph())}
    src.load_state_dict(src.state_dict())  # copied in place: the graph still reads the right weights
    assert not graph.released
    src.load_state_dict(copy.deepcopy(src.state_dict()), assign=True)  # new tensors: the graphs go
    assert graph.released and other_graph.released and src._graphed == {}

    other = {k: v.clone() for k, v in src.state_dict().items()}
    other["_extra_state"][2] = 1  # ep_rank
    with pytest.raises(ValueError, match="expert slots of expert-parallel rank 1, this layer is rank 0"):
        fresh.load_state_dict(other)
    # format 1 (a dict), from checkpoints of before the record was a tensor; older ones lack ep_rank
    old = {"phy2log": src.placement.phy2log.clone(), "num_experts": 4, "ep_rank": 0}
    fresh.load_state_dict(dict(other, _extra_state=old))
    with pytest.raises(ValueError, match="expert slots of expert-parallel rank 1, this layer is rank 0"):
        fresh.load_state_dict(dict(other, _extra_state=dict(old, ep_rank=1)))
    del old["ep_rank"]
    fresh.load_state_dict(dict(other, _extra_state=old))


@pytest.mark.parametrize("cls", ["VanillaMoE", "VariabilityAwareMoE"])
def test_deferred_init_on_the_meta_device(cls):
    """A model built under ``with torch.device("meta")`` (deferred init), then materialised by
    ``load_state_dict(assign=True)`` or by ``to_empty`` + ``reset_parameters``. The placement's tables
    were built on the meta device (no data: the constructor raised), and ``assign=True`` with a
    checkpoint of another dtype left ``config.params_dtype`` behind and the experts' ``allreduce``
    flag lost."""
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.5)
    g = ml.ParallelGroups.single()
    src = getattr(ml, cls)(cfg, g, seed=1)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        lazy = getattr(ml, cls)(cfg, g, seed=1)
    assert lazy.router.weight.device.type == "meta" and lazy.placement.phy2log.device.type == "cpu"
    lazy.load_state_dict(src.state_dict(), assign=True)
    assert lazy.experts.w13.device.type == "cpu" and lazy.experts.w13.allreduce is False
    with torch.no_grad():
        assert torch.equal(lazy(x), src(x))
    with torch.device("meta"):
        lazy = getattr(ml, cls)(cfg, g, seed=1)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    with torch.no_grad():
        assert torch.equal(lazy(x), src(x))
    if cls == "VariabilityAwareMoE":  # its load window (a buffer no checkpoint holds) left on the meta device
        with torch.device("meta"):
            lazy = ml.VariabilityAwareMoE(cfg, g, seed=1, window=2, auto_replan=True)
        lazy.load_state_dict(src.state_dict(), assign=True)
        with torch.no_grad():
            for _ in range(3):  # the window fills and the re-plan reads it
                lazy(x)
        assert lazy.num_replans == 1 and not lazy._loads.is_meta
    # a dtype the layer cannot take, refused before anything is loaded (it was half loaded)
    mixed = {k: (v.double() if k == "router.weight" else v) for k, v in src.state_dict().items()}
    other = getattr(ml, cls)(cfg, g, seed=2)
    with pytest.raises(TypeError, match="would give the parameters dtypes.*nothing of this MoE layer was loaded"):
        other.load_state_dict(mixed, assign=True)
    assert other.router.weight.dtype == other.config.params_dtype == torch.float32
    wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in src.state_dict().items()}
    other = getattr(ml, cls)(cfg, g, seed=2)
    other.load_state_dict(wide, assign=True)
    assert other.config.params_dtype == torch.float64 and other.experts.w2.allreduce is False
    with torch.no_grad():
        torch.testing.assert_close(other(x.double()), src(x).double(), rtol=1e-5, atol=1e-6)


def test_forced_routing_laid_out_like_the_input():
    """[S, B, K] forced ids for [S, B, H] input (as moe_forward takes them) were refused; the router
    on its own truncated float ids (1.9 became expert 1)."""
    from moelayers.reference import moe_forward

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64,
                       init_std=0.5)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=6)
    x = torch.randn(3, 2, 16, dtype=torch.float64)
    ids = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 1], [2, 0]]])
    with torch.no_grad():
        layer.force_routing(ids)
        y = layer(x)
    assert check_close("[S, B, K] forced", y, moe_forward(x, *layer.export_full_weights(), cfg, topk_ids=ids)) is None
    with pytest.raises(TypeError, match="forced_ids must be integer expert ids, got torch.float32"):
        layer.router(x[0], torch.full((2, 2), 1.9))


def test_exchange_waits_for_posted_transfers_even_when_a_local_copy_fails(monkeypatch):
    """A failing same-rank copy must not leave this rank's isend/irecv un-awaited (its peers would
    wait for it forever): every request is waited on, then the copy's error propagates to the vote."""
    from moelayers.layers import moves

    waited = []

    class Req:
        def __init__(self, i):
            self.i = i

        def wait(self):
            waited.append(self.i)

    monkeypatch.setattr(moves.dist, "batch_isend_irecv", lambda ops: [Req(i) for i in range(len(ops))])
    staging = moves.Staging(0, [0], torch.empty(1, 4, 3), torch.empty(1, 3, 2))
    w13, w2 = torch.randn(2, 5, 3), torch.randn(2, 3, 2)  # w13 rows of another shape: the copy fails
    plan = SimpleNamespace(local=[(0, 1)])
    with pytest.raises(RuntimeError):
        moves._exchange(plan, staging, ["op0", "op1"], [w13, w2])
    assert waited == [0, 1]


def test_router_and_experts_built_on_their_own_are_initialised():
    """Both are public: on their own they held torch.empty's garbage (the router's first call raised
    'router logits contain NaN or inf'). They start at N(0, init_std) from their own seeded
    generator, leaving torch's global generator alone; inside a layer, the layer draws."""
    cfg = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2, init_std=0.05)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    r, ex = ml.TopKRouter(cfg), ml.GroupedExperts(4, 64, 32, init_std=0.05)
    assert torch.equal(torch.random.get_rng_state(), before)
    for w in (r.weight, ex.w13, ex.w2):
        assert torch.isfinite(w).all() and abs(w.std().item() - 0.05) < 0.01
    assert torch.equal(r.weight, ml.TopKRouter(cfg).weight) and not torch.equal(r.weight, ml.TopKRouter(cfg, seed=1).weight)
    ids, _ = r(torch.randn(6, 64))
    assert ids.shape == (6, 2)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3)
    same = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3)
    assert torch.equal(layer.router.weight, same.router.weight) and not torch.equal(layer.router.weight, r.weight)
    # deferred init the way FSDP-style tools do it, reset_parameters() on every module that has one:
    # the layer's seeded draw decides, no submodule redraws its own
    with torch.device("meta"):
        lazy = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=3)
    lazy.to_empty(device="cpu")
    for m in lazy.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(lazy.state_dict().values(), layer.state_dict().values())
               if isinstance(a, torch.Tensor))


def test_replan_before_any_forward_says_the_window_is_empty():
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2)
    v = ml.VariabilityAwareMoE(cfg, ml.ParallelGroups.single(), variability="high")
    with pytest.raises(ValueError, match="no expert loads recorded yet"):
        v.replan()


def test_reduce_expert_grads_in_a_plain_training_loop_never_refuses():
    """zero_grad() (set_to_none), backward, reduce_expert_grads, step, 50 times: each step's gradients
    are new tensors, which Python may give the id of the last step's freed ones; that must not read as
    "reduced already". A second call without a backward still is refused."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, params_dtype=torch.float32)
    model = torch.nn.Sequential(ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        optim.zero_grad()
        model(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
        ml.reduce_expert_grads(model)
        optim.step()
    with pytest.raises(ValueError, match="reduced already"):
        ml.reduce_expert_grads(model)


def test_clip_grad_norm_on_one_rank_is_torchs():
    """Without process groups the norm and the clipped gradients are torch's (2- and inf-norm); a
    non-finite norm raises with error_if_nonfinite, as torch's; the norm has the gradients' dtype."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, params_dtype=torch.float64)
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for norm_type in (2.0, float("inf")):
        grads = []
        for clip in (ml.clip_grad_norm_, lambda m, *a: torch.nn.utils.clip_grad_norm_(m.parameters(), *a)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8, dtype=torch.float64),
                                        ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1))
            model(x).pow(2).sum().backward()
            norm = clip(model, 1e-3, norm_type)
            grads.append((norm, [p.grad for p in model.parameters()]))
        (mine, ours), (theirs, torchs) = grads
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=0)
        for a, b in zip(ours, torchs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)
    model[1].experts.w13.grad[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        ml.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="norm_type must be > 0"):
            ml.clip_grad_norm_(model, 1.0, bad)
    before = [p.grad.clone() for p in model.parameters()]
    for bad in (-1.0, float("nan")):  # -1 flipped the sign of every gradient, NaN filled them with NaN
        with pytest.raises(ValueError, match="max_norm must be >= 0"):
            ml.clip_grad_norm_(model, bad)
    assert all(torch.equal(p.grad.nan_to_num(), b.nan_to_num()) for p, b in zip(model.parameters(), before))
    # only the experts have gradients: the norm keeps their dtype (float64 holds 1e90, float32 does not)
    model.zero_grad()
    for p in model[1].experts.parameters():
        p.grad = torch.full_like(p, 1e45)
    norm = ml.clip_grad_norm_(model, 1.0)
    assert norm.dtype == torch.float64 and torch.isfinite(norm)
    assert torch.isclose(norm, torch.nn.utils.get_total_norm([p.grad * 0 + 1e45 for p in model[1].experts.parameters()]))


def test_checkpoint_entries_load_weights_from_a_per_expert_source():
    """moelayers.checkpoint's per-expert entries, replaced by another source's tensors and loaded,
    put each expert into its slot in a permuted placement (what a rollout's weight sync needs)."""
    from moelayers import checkpoint as mlc

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, params_dtype=torch.float32)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), placement=ml.ExpertPlacement(torch.tensor([[2, 0, 3, 1]]), 4))
    model = torch.nn.Sequential(layer)
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 12, 8, generator=g), torch.randn(4, 8, 6, generator=g)
    sd = mlc.model_state_dict(model)
    assert sorted(k for k in sd if "experts" in k) == [f"0.experts.{w}.{e}" for w in ("w13", "w2") for e in range(4)]
    for e in range(4):
        sd[f"0.experts.w13.{e}"], sd[f"0.experts.w2.{e}"] = w13[e], w2[e]
    assert mlc.load_model_state_dict(model, sd) == ([], [])
    _, got13, got2 = layer.export_full_weights()
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    assert torch.equal(layer.experts.w13[0], w13[2])  # slot 0 holds expert 2


def test_forward_returns_no_view_of_a_2d_input():
    """In training the output is a tensor of its own, not a view (FSDP warns of modules that return
    views: an in-place op on one, e.g. ``y += h``, drops its backward hook); [T, H] output never is."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, params_dtype=torch.float32)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    assert layer(torch.randn(5, 8))._base is None
    y = layer(torch.randn(2, 3, 8))  # [S, B, H] in training: a tensor of its own too
    assert y.shape == (2, 3, 8) and y._base is None
    with torch.no_grad():  # serving: the view of the [T, H] result, no copy
        assert layer(torch.randn(2, 3, 8))._base is not None


def test_long_lists_of_experts_in_messages_say_how_many():
    """load_full_weights named experts [0..7] when all 16 differed, with no sign of the rest."""
    from moelayers.layers.weights import _some

    assert _some([3], "expert") == "expert(s) [3]"
    assert _some(list(range(16)), "expert") == "16 experts: [0, 1, 2, 3, 4, 5, 6, 7, ...]"


def test_the_package_is_marked_typed_and_the_marker_is_packaged():
    """No py.typed: a typed user's mypy saw every moelayers import as Any (a typing journey)."""
    import importlib.resources
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 on; the package supports 3.10)

    assert importlib.resources.files("moelayers").joinpath("py.typed").is_file()
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["moelayers"]


def test_solve_dp_refuses_no_restarts():
    """restarts=0 returned (None, None, inf) against its annotation (a typing journey)."""
    import numpy as np

    from moelayers.planning.semantic_solvers import solve_dp

    with pytest.raises(ValueError, match="restarts must be an int >= 1, got 0"):
        solve_dp(np.ones((4, 2, 4)), np.ones((2, 4)), 2, np.random.default_rng(0), restarts=0)


def test_reference_of_no_tokens_is_on_the_graph_like_the_layers_output():
    """A rank without tokens summed its reference loss into a global one: the reference's empty
    output was outside autograd ('element 0 of tensors does not require grad'), the layer's was not."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    router, w13, w2 = (w.clone().requires_grad_(True) for w in layer.export_full_weights())
    x = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    y = ml.reference.moe_forward(x, router, w13, w2, cfg)
    assert y.shape == (0, 8) and y.grad_fn is not None
    y.sum().backward()
    assert x.grad.shape == (0, 8)
    assert all(w.grad is not None and not w.grad.any() for w in (router, w13, w2))
    y3 = ml.reference.moe_forward(torch.zeros(0, 2, 8, dtype=torch.float64), router, w13, w2, cfg)
    assert y3.shape == (0, 2, 8)
    layer(x).sum().backward()  # the layer's too


def test_a_refused_checkpoint_placement_names_the_layer():
    """'placement is for 7 experts, config has 13' named neither the layer (one of dozens) nor the
    checkpoint (a journey moving checkpoints between models)."""
    from torch import nn

    small = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=7, top_k=2)
    big = small.replace(num_experts=13)

    def model(cfg, number):
        return nn.ModuleDict({"blocks": nn.ModuleList([nn.ModuleDict({"moe": ml.VanillaMoE(
            cfg, ml.ParallelGroups.single(), layer_number=number)})])})

    saved = model(small, 3).state_dict()
    with pytest.raises(ValueError, match=r"^blocks\.0\.moe \(VanillaMoE \(layer 3\)\): the checkpoint's placement is "
                                         r"for 7 experts, config has 13$"):
        model(big, 3).load_state_dict(saved)  # (the weights' sizes differ too: the placement's reason first)
    same_size = ml.VanillaMoE(small, ml.ParallelGroups.single(), placement=ml.ExpertPlacement.linear(7, 1, 8))
    with pytest.raises(ValueError, match=r"^blocks\.0\.moe \(VanillaMoE \(layer 3\)\): the checkpoint's placement has "
                                         r"8 slots per rank, this layer 7"):
        model(small, 3).load_state_dict({f"blocks.0.moe.{k}": v for k, v in same_size.state_dict().items()})
    eight = ml.VanillaMoE(small, ml.ParallelGroups.single(), placement=ml.ExpertPlacement.linear(7, 1, 8))
    with pytest.raises(ValueError, match=r"^blocks\.0\.moe \(VanillaMoE \(layer 3\)\): the checkpoint's placement is "
                                         r"for 7 experts, config has 8$"):  # the same shapes: set_extra_state refuses
        model(small.replace(num_experts=8), 3).load_state_dict({f"blocks.0.moe.{k}": v for k, v in eight.state_dict().items()})
    with pytest.raises(ValueError, match=r"^VanillaMoE: the checkpoint's placement is for 7 experts"):
        ml.VanillaMoE(big, ml.ParallelGroups.single()).load_state_dict(
            {k[len("blocks.0.moe."):]: v for k, v in saved.items()})


def test_moving_trained_weights_without_the_optimizer_warns_once():
    """A journey: load_placement_state_dict / apply_placement without optimizer= after training moved
    the weights and left Adam's moments on the slots (1.7e-2 off after one step), silently; the
    automatic re-plans of VariabilityAwareMoE already warned."""
    import copy
    import warnings

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    there, back = ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0]]), 4), ml.ExpertPlacement.linear(4, 1)

    def moves(layer, *placements, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for p in placements:
                layer.apply_placement(p, **kw)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    fresh = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), layer_number=2)
    with torch.no_grad():
        fresh(torch.randn(3, 8, dtype=torch.float64))
    assert moves(fresh, there, back) == []  # never trained
    trained = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), layer_number=2)
    opt = torch.optim.Adam(trained.parameters())
    trained(torch.randn(3, 8, dtype=torch.float64)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    reference = copy.deepcopy(trained)
    assert moves(trained, there, optimizer=opt) == []  # the moments moved with the weights
    assert moves(trained, trained.placement) == []  # nothing moved
    warned = moves(trained, back, there)
    assert len(warned) == 1 and warned[0].startswith("VanillaMoE (layer 2): expert weights that trained moved to "
                                                     "another placement without the optimizer's per-slot state")
    assert "pass optimizer= to apply_placement" in warned[0]
    assert moves(reference, there) == []  # a copy has not trained
    frozen = copy.deepcopy(trained).requires_grad_(False)
    frozen._trained = True
    assert moves(frozen, back) == []  # no optimizer holds frozen weights


def test_a_resumed_optimizer_makes_a_move_without_it_warn():
    """The documented resume (weights and optimizer loaded, then load_placement_state_dict) without
    optimizer= left the moments behind without a word: the layer had run no forward in this process."""
    import warnings

    from torch import nn

    from moelayers import checkpoint as mlc

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)

    def build():
        model = nn.ModuleDict({"moe": ml.VanillaMoE(cfg, ml.ParallelGroups.single())})
        return model, torch.optim.Adam(model.parameters())

    model, opt = build()
    model["moe"](torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights, moments = mlc.model_state_dict(model), mlc.optimizer_state_dict(model, opt)
    placements = {"moe.placement": torch.tensor([[3, 2, 1, 0]])}
    for give_optimizer in (False, True):
        resumed, ropt = build()
        mlc.load_model_state_dict(resumed, weights)
        mlc.load_optimizer_state_dict(resumed, ropt, moments)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mlc.load_placement_state_dict(resumed, placements, optimizer=ropt if give_optimizer else None)
        said = [str(w.message) for w in caught if "without the optimizer's per-slot state" in str(w.message)]
        assert resumed["moe"].placement.phy2log.tolist() == [[3, 2, 1, 0]]
        assert len(said) == (0 if give_optimizer else 1), said


def test_check_close_takes_the_worst_of_several_low_precision_references():
    """ref_low as a list (references that differ only in the order of a bf16 sum): the bound is 3 x
    the largest of their errors; an empty list or one of another dtype is refused."""
    from moelayers.testing import sums_in_every_order, tolerance

    g = torch.Generator().manual_seed(0)
    terms64 = [torch.randn(64, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    ref64 = sum(terms64)
    lows = sums_in_every_order([t.bfloat16() for t in terms64])
    bf = [t.bfloat16() for t in terms64]
    assert len(lows) == 24 and torch.equal(lows[0], ((bf[0] + bf[1]) + bf[2]) + bf[3])
    errs = [float((lo.double() - ref64).abs().max()) for lo in lows]
    assert tolerance(ref64, lows, torch.bfloat16) == 3 * max(errs) + 1e-3 * float(ref64.abs().max())
    assert all(check_close("order", lo, ref64, lows) is None for lo in lows)
    with pytest.raises(ValueError, match="empty"):
        check_close("none", lows[0], ref64, [])
    with pytest.raises(ValueError, match="must be the reference computed in"):
        check_close("mixed", lows[0], ref64, [lows[1], lows[2].float()])
