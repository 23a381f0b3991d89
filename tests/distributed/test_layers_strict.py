"""Strict two-rank checks (gloo): tied replicas get their expert's whole gradient, and placement
moves across ranks are all-or-nothing. One spawn runs every check."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.testing import error_of, run_distributed

H, FF, E = 8, 4, 4
OLD = [[0, 1, 2], [3, 0, -1]]  # expert 0 on both ranks, rank 1's slot 2 empty


def _cfg():
    return ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=2, params_dtype=torch.float64)


def _full_weights():
    g = torch.Generator().manual_seed(11)
    return (torch.randn(E, H, generator=g, dtype=torch.float64), 0.3 * torch.randn(E, 2 * FF, H, generator=g, dtype=torch.float64),
            0.3 * torch.randn(E, H, FF, generator=g, dtype=torch.float64))


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(12, H, generator=g, dtype=torch.float64)
    dy = torch.randn(12, H, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [0, 3], [2, 0], [3, 1]] * 3)  # expert 0 on every rank's tokens
    return x, dy, ids


def _layer(groups, phy2log=OLD):
    layer = ml.VanillaMoE(_cfg(), groups, placement=ml.ExpertPlacement.from_phy2log(torch.tensor(phy2log), E))
    layer.load_full_weights(*_full_weights())
    return layer


def _tie_check(rank, world, groups):
    errors = []
    layer = _layer(groups)
    x, dy, ids = _data(rank)
    layer.force_routing(ids)
    (layer(x) * dy).sum().backward()
    # reference: the experts' gradient over every rank's tokens
    r, w13, w2 = (t.clone().requires_grad_(True) for t in _full_weights())
    total = 0
    for q in range(world):
        xq, dyq, idsq = _data(q)
        total = total + (ml.reference.moe_forward(xq, r, w13, w2, _cfg(), topk_ids=idsq) * dyq).sum()
    total.backward()
    for s, e in enumerate(OLD[rank]):
        g13, g2 = layer.experts.w13.grad[s], layer.experts.w2.grad[s]
        want13 = w13.grad[e] if e >= 0 else torch.zeros_like(g13)
        want2 = w2.grad[e] if e >= 0 else torch.zeros_like(g2)
        if not (torch.allclose(g13, want13, atol=1e-10) and torch.allclose(g2, want2, atol=1e-10)):
            errors.append(f"tie: slot {s} (expert {e}) gradient differs from the expert's whole gradient")
    f13, f2 = layer.expert_grads_full()
    if not (torch.allclose(f13, w13.grad, atol=1e-10) and torch.allclose(f2, w2.grad, atol=1e-10)):
        errors.append("tie: expert_grads_full differs from the reference")
    return errors


def _move_checks(rank, world, groups):
    from moelayers.layers.moves import PlacementMoveError, PlacementRejected, move_expert_weights

    errors = []
    cfg = _cfg()
    layer = _layer(groups)
    x, _, _ = _data(rank)
    with torch.no_grad():
        y0 = layer(x)
    before13, before2 = layer.experts.w13.detach().clone(), layer.experts.w2.detach().clone()
    old = layer.placement.copy()
    new = ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 0, -1], [1, 2, 0]]), E)

    def unchanged(what):
        if layer.placement != old or not torch.equal(layer.experts.w13, before13) \
                or not torch.equal(layer.experts.w2, before2):
            errors.append(f"{what}: the aborted move changed the placement or the weights")

    # the ranks were handed different placements: rejected on both, before any transfer
    mine = new if rank == 0 else ml.ExpertPlacement.from_phy2log(torch.tensor([[3, 1, -1], [0, 2, 1]]), E)
    try:
        move_expert_weights(layer, mine)
        errors.append("different placements: no error")
    except PlacementRejected as e:
        if e.failing_ranks != []:
            errors.append(f"different placements: failing ranks {e.failing_ranks}")
    unchanged("different placements")

    # a failure while staging on rank 1 only: nothing is committed anywhere
    def hook(staging):
        if rank == 1:
            raise RuntimeError("injected")

    try:
        move_expert_weights(layer, new, fault_hook=hook)
        errors.append("staging fault: no error")
    except PlacementRejected:
        errors.append("staging fault: reported as a rejection")
    except PlacementMoveError as e:
        if e.failing_ranks != [1] or e.stage != "staging":
            errors.append(f"staging fault: failing ranks {e.failing_ranks}, stage {e.stage}")
    unchanged("staging fault")

    # the real move: every slot holds its new expert's weights, the emptied slot is zeroed, outputs unchanged
    move_expert_weights(layer, new)
    _, w13, w2 = _full_weights()
    for s, e in enumerate(new.phy2log[rank].tolist()):
        want13 = w13[e] if e >= 0 else torch.zeros_like(w13[0])
        want2 = w2[e] if e >= 0 else torch.zeros_like(w2[0])
        if not (torch.equal(layer.experts.w13[s], want13) and torch.equal(layer.experts.w2[s], want2)):
            errors.append(f"move: slot {s} does not hold expert {e}")
    with torch.no_grad():
        y1 = layer(x)
    if not torch.allclose(y1, y0, atol=1e-12):
        errors.append("move: outputs changed")
    ref = ml.reference.moe_forward(x, *_full_weights(), cfg)
    if not torch.allclose(y1, ref, atol=1e-10):
        errors.append("move: outputs differ from the reference")
    return errors


def _deepcopy_check(rank, world, groups):
    """copy.deepcopy failed on the process groups ('cannot pickle ProcessGroup'): the copy now shares
    them and owns its weights; it serves the reference's outputs, and training it leaves the original."""
    import copy

    layer = _layer(groups)
    twin = copy.deepcopy(layer)
    errors = []
    if twin.groups.ep is not layer.groups.ep or twin.dispatcher.group is not layer.dispatcher.group:
        errors.append("deepcopy: the copy does not share the process groups")
    x, dy, _ = _data(rank)
    with torch.no_grad():
        if not torch.allclose(twin(x), ml.reference.moe_forward(x, *_full_weights(), _cfg()), atol=1e-10):
            errors.append("deepcopy: the copy's outputs differ from the reference")
        twin.experts.w13.add_(1.0)
        if not torch.equal(layer.export_full_weights()[1], _full_weights()[1]):
            errors.append("deepcopy: editing the copy's weights changed the original's")
    return errors


def _all_checks(rank, world):
    groups = ml.ParallelGroups.from_world()
    return {"tie": _tie_check(rank, world, groups), "moves": _move_checks(rank, world, groups),
            "deepcopy": _deepcopy_check(rank, world, groups)}


_results: list = []


def _results_once():
    """Spawn once for every check; a failed run is reported by each check without spawning again."""
    if not _results:
        try:
            _results.append(run_distributed(_all_checks, 2, timeout=110))
        except RuntimeError as e:
            _results.append(e)
    if isinstance(_results[0], Exception):
        raise _results[0]
    return _results[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", ["tie", "moves", "deepcopy"])
def test_two_ranks(check):
    for rank, res in enumerate(_results_once()):
        assert res[check] == [], f"rank {rank}: {res[check]}"


def _mixed_autograd(rank, world):
    """A frozen layer where only rank 0's input requires grad: the combine sent padded rows from one
    rank and raw rows from the other (H * itemsize = 24 bytes, not a multiple of 16), and gloo killed
    the process. Since, a forward that records autograd on some ranks only is refused on every rank
    in the exchange of split sizes, before any payload (rank 1 would never run rank 0's backward)."""
    cfg = ml.MoEConfig(hidden_size=3, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=5).requires_grad_(False)
    x = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_(rank == 0)
    return error_of(layer, x)


@pytest.mark.timeout(90)
def test_ranks_that_differ_in_autograd_raise_together():
    out = run_distributed(_mixed_autograd, 2, timeout=60)
    assert all("rank(s) [0] record autograd in this forward and rank(s) [1] do not" in msg for msg in out), out


def _meta_built_replicas(rank, world, materialise):
    """A replicated placement built under torch.device("meta"): the replica tie (the backward's sum
    over an expert's replicas) was built on the meta device, and the first backward failed."""
    import torch

    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    g = ml.ParallelGroups.from_world()
    placement = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2], [2, 3, 0]]), 4)  # experts 0, 2 twice
    dense = ml.VanillaMoE(cfg, g, placement=placement, seed=1)
    with torch.device("meta"):
        lazy = ml.VanillaMoE(cfg, g, placement=placement, seed=1)
    if materialise == "assign":
        lazy.load_state_dict(dense.state_dict(), assign=True)
    else:
        lazy.to_empty(device="cpu")
        lazy.reset_parameters()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    lazy(x).sum().backward()
    dense(x).sum().backward()
    return [torch.equal(a.grad, b.grad) for a, b in zip(lazy.parameters(), dense.parameters())]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("materialise", ["to_empty", "assign"])
def test_a_meta_built_layer_with_replicas_trains(materialise):
    for rank, same in enumerate(run_distributed(_meta_built_replicas, 2, materialise, timeout=90)):
        assert all(same), (rank, same)


def _finer_autograd_mismatch(rank, world):
    """Every rank records autograd, but the backward's exchanges would differ: the dispatch's rows
    want a gradient on some ranks only (a router frozen on one rank; or a frozen router everywhere
    and a plain empty input where a rank has no tokens), or replicated experts are frozen on one
    rank (its backward skips the replicas' sum). The forwards passed and the backward hung."""
    from tests.distributed.test_training_paths import _placement

    cfg = ml.MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    out = {}
    for disp in ("alltoall", "allgather"):
        def build(place="linear"):
            return ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=5, dispatcher=disp,
                                 placement=_placement(place, 4, world))

        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        layer = build()
        layer.router.requires_grad_(rank == 0)
        out[f"{disp}/router frozen on one rank"] = error_of(layer, x)
        layer = build()
        layer.router.requires_grad_(False)
        empty = torch.empty(0, 4, dtype=torch.float64)
        out[f"{disp}/plain empty input"] = error_of(layer, x.requires_grad_() if rank == 0 else empty)
        y = layer(x if rank == 0 else empty.requires_grad_())  # the advice: the empty input requires one too
        y.square().sum().backward()
        out[f"{disp}/empty input requiring a gradient"] = "trained" if layer.experts.w13.grad is not None else "no grad"
        layer = build("replicas")
        layer.experts.requires_grad_(rank == 0)
        out[f"{disp}/replicas frozen on one rank"] = error_of(layer, x)
    return out


@pytest.mark.timeout(120)
def test_ranks_whose_backward_exchanges_would_differ_raise_together():
    for out in run_distributed(_finer_autograd_mismatch, 2, timeout=100):
        for case, msg in out.items():
            if "requiring a gradient" in case:
                assert msg == "trained", (case, msg)
                continue
            what = "train replicated experts" if "replicas" in case else "dispatch rows that want a gradient"
            assert f"rank(s) [0] {what}" in msg and "rank(s) [1] do not" in msg, (case, msg)


def _backward_order(rank, world):
    """Two micro-batches of equal sizes (forced routing), back-propagated mb0 then mb1 on one rank
    and mb1 then mb0 on the other: the exchanges paired up by order alone and the gradients were
    silently wrong. The next forward now raises on every rank; the one after serves."""
    cfg = ml.MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    out = {}
    for disp in ("alltoall", "allgather"):
        for swap in (False, True):
            layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), seed=5, dispatcher=disp)
            gen = torch.Generator().manual_seed(rank)
            ids = torch.tensor([[0, 3], [1, 2], [2, 1]])
            ys = []
            for _ in range(2):
                layer.force_routing(ids)
                ys.append(layer(torch.randn(3, 4, dtype=torch.float64, generator=gen)))
            for y in (ys[::-1] if swap and rank == 1 else ys):
                y.sum().backward()
            x = torch.randn(3, 4, dtype=torch.float64, generator=gen)
            out[f"{disp}/swap={swap}"] = error_of(layer, x)
            out[f"{disp}/swap={swap}/then"] = error_of(layer, x)
    return out


@pytest.mark.timeout(120)
def test_backwards_in_another_order_on_one_rank_raise_at_the_next_forward():
    for out in run_distributed(_backward_order, 2, timeout=100):
        for case, msg in out.items():
            if "swap=True" in case and not case.endswith("then"):
                assert "back-propagated this layer's forwards in different orders" in msg, (case, msg)
            else:
                assert msg == "no error", (case, msg)


def _out_of_step(rank, world):
    """Rank 0 runs another exchange of the same size on the expert-parallel group (as a rank that
    back-propagates while the others run a forward would) where rank 1 runs the layer's forward:
    rank 1 read those bytes as flags and raised 'the layer refused the input of rank(s) [0]'."""
    import torch.distributed as dist

    cfg = ml.MoEConfig(hidden_size=4, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    out = {}
    for disp in ("alltoall", "allgather"):
        groups = ml.ParallelGroups.from_world()
        layer = ml.VanillaMoE(cfg, groups, seed=5, dispatcher=disp)
        if rank == 0:
            stray = torch.full((world, 4), BAD_INPUT_BITS, dtype=torch.int64)
            dist.all_to_all_single(torch.empty_like(stray), stray, group=groups.ep)
            out[disp] = "sent"
        else:
            out[disp] = error_of(layer, torch.randn(3, 4, dtype=torch.float64))
    return out


BAD_INPUT_BITS = 4 | 32  # bytes that read as "refused the input" and "records autograd"


@pytest.mark.timeout(120)
def test_a_rank_out_of_step_is_named_as_such():
    out = run_distributed(_out_of_step, 2, timeout=100)
    assert out[0] == {"alltoall": "sent", "allgather": "sent"}, out
    for disp, msg in out[1].items():
        assert "got no forward header from expert-parallel rank(s) [0]" in msg and "out of step" in msg, (disp, msg)


def _copies_that_differ(rank, world, device="cpu"):
    """Replicas of experts 0 and 1 on both ranks; a custom init through Module.apply (the same seed on
    every rank) drew each slot on its own, and each rank computed with its own copy."""
    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=6, top_k=2)
    place = ml.ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]]), 6)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(), placement=place, seed=0, device=device)
    out = {"built": error_of(layer.check_weights)}
    torch.manual_seed(1234)
    layer.apply(lambda m: [torch.nn.init.normal_(p, std=0.3) for p in m.parameters(recurse=False)])
    out["applied"] = error_of(layer.check_weights)
    layer.reset_parameters()
    out["reset"] = error_of(layer.check_weights)
    copies = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=1), seed=rank, device=device)  # two copies (edp)
    out["edp"] = error_of(copies.check_weights)
    copies.load_full_weights(*layer.export_full_weights(), verify=False)
    out["edp loaded"] = error_of(copies.check_weights)
    return out


def check_copies(results: list) -> None:
    for rank, out in enumerate(results):
        assert out["built"] == out["reset"] == out["edp loaded"] == "no error", (rank, out)
        assert "copies of the same weights differ (w13 of expert(s) [0, 1], w2 of expert(s) [0, 1];" in out["applied"], out
        assert "router_weight of expert(s) [0, 1, 2, 3, 4, 5]" in out["edp"] and "w13 of expert(s) [0, 1, 2, 3, 4, 5]" \
            in out["edp"], (rank, out)


@pytest.mark.timeout(90)
def test_check_weights_finds_copies_that_differ():
    check_copies(run_distributed(_copies_that_differ, 2, timeout=60))


def _cast_on_rank_0_only(rank, world, op, ep=None):
    """A layer cast to bf16 on rank 0 only, then ``op``: what each rank raised (or "no error")."""
    e, h, f = 4, 16, 8
    layer = ml.VanillaMoE(ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=2),
                          ml.ParallelGroups.from_world(ep=ep))
    if rank == 0:
        layer.to(torch.bfloat16)
    calls = {"export_full_weights": layer.export_full_weights, "expert_grads_full": layer.expert_grads_full,
             "check_weights": layer.check_weights,
             "apply_placement": lambda: layer.apply_placement(ml.ExpertPlacement(torch.tensor([[2, 3], [0, 1]]), e))}
    return error_of(calls[op]) or "no error"


@pytest.mark.parametrize("op", ["export_full_weights", "expert_grads_full", "check_weights", "apply_placement"])
def test_a_layer_cast_on_some_ranks_only_is_told_on_every_rank(op):
    """The gathers and the move exchanged rows of other sizes: gloo aborted the process (SIGABRT), and
    check_weights blamed copies that differ (a low-precision journey); forward and load_full_weights
    already told the dtypes."""
    for said in run_distributed(_cast_on_rank_0_only, 2, op, timeout=120, collective_timeout=60):
        assert ("different dtypes" in said and "cast the layer alike" in said), said


def test_check_weights_tells_a_cast_on_one_rank_to_every_group():
    """Two expert-parallel groups of 2 (world 4): the dtype check raised on rank 0's group before the
    expert-data-parallel all-reduce, and the other group waited in it (a review)."""
    for said in run_distributed(_cast_on_rank_0_only, 4, "check_weights", 2, timeout=150, collective_timeout=60):
        assert ("different dtypes" in said and "cast the layer alike" in said), said
