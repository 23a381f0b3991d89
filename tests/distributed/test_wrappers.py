"""Our layers inside the wrappers users put around training models: activation checkpointing,
torch's DistributedDataParallel, pickling (``torch.save`` of a whole model). Each test failed before
the fix its docstring names."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import moelayers as ml
from moelayers.testing import run_distributed

H = 16


def _cfg(**kw) -> ml.MoEConfig:
    return ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=8, top_k=2, params_dtype=torch.float64, **kw)


def _variability_steps(rank: int, world: int, wrap: str, device: str = "cpu") -> list:
    """Three training steps of a re-planning VariabilityAwareMoE, checkpointed or not: its step count,
    pending re-plan and moves after each (the GPU suite runs it under NCCL)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    layer = ml.VariabilityAwareMoE(_cfg(), ml.ParallelGroups.from_world(), window=2, auto_replan=True,
                                   variability="high", seed=1, device=dev)
    g, out = torch.Generator().manual_seed(rank), []
    for _ in range(3):
        layer.zero_grad(set_to_none=True)
        x = torch.randn(6 + 5 * rank, H, generator=g, dtype=torch.float64).to(dev).requires_grad_()
        y = layer(x) if wrap == "none" else checkpoint(layer, x, use_reentrant=wrap == "reentrant")
        y.pow(2).sum().backward()
        out.append((layer.steps, layer._replan_pending, layer.num_replans, layer.num_moves))
    return out


def _variability_modes(rank: int, world: int) -> dict:
    return {wrap: _variability_steps(rank, world, wrap) for wrap in ("none", "reentrant", "non_reentrant")}


@pytest.mark.timeout(180)
def test_checkpointing_a_variability_layer_records_each_step_once():
    """Recomputed in the backward, the forward recorded the step's loads again (steps 2, 4, 6; an early
    re-plan that moved weights) or, non-reentrant, ran the deferred re-plan -- a collective weight move --
    inside the backward, which then failed torch's recomputation check."""
    ranks = run_distributed(_variability_modes, 2, timeout=150)
    plain = [r["none"] for r in ranks]
    assert [s[0] for s in plain[0]] == [1, 2, 3]
    assert [r["non_reentrant"] for r in ranks] == plain
    # reentrant: the first pass runs under no_grad, as a serving forward: the due re-plan runs at once
    wrapped = [r["reentrant"] for r in ranks]
    assert [[s[0] for s in steps] for steps in wrapped] == [[1, 2, 3]] * 2
    assert [steps[-1] for steps in wrapped] == [steps[-1] for steps in plain]


def _same_grads_checkpointed(layer, fn, x, *args, reentrant: bool, routed=lambda: True) -> bool:
    """``fn(x, *args)`` plain, then under ``checkpoint``, each followed by a backward: the same input,
    router and expert gradients, and ``routed()`` true after both."""
    grads = []
    for wrap in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = checkpoint(fn, xi, *args, use_reentrant=reentrant) if wrap else fn(xi, *args)
        y.pow(2).sum().backward()
        if not routed():
            return False
        grads.append([xi.grad, layer.router.weight.grad, *layer.expert_grads_full()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def _forced_under_checkpoint(rank: int, world: int, reentrant: bool) -> list:
    """Forced routing (replayed from a rollout) in a checkpointed layer: the recomputation finds the
    forced ids by the layer's input; a layer whose input is made inside the checkpointed region
    cannot be matched, and is refused."""
    groups = ml.ParallelGroups.from_world() if world > 1 else ml.ParallelGroups.single()
    layer = ml.VanillaMoE(_cfg(), groups, seed=1)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5], [3, 4], [4, 3]]).roll(rank, 0)
    x = torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    grads = []
    for wrap in (False, True):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        layer.force_routing(ids)
        y = checkpoint(layer, xi, use_reentrant=reentrant) if wrap else layer(xi)
        y.pow(2).sum().backward()
        grads.append([xi.grad, layer.router.weight.grad, *layer.expert_grads_full()])
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    del xi, y  # their entries go with them
    layer.zero_grad(set_to_none=True)
    layer.force_routing(ids)
    y = checkpoint(lambda t: layer(t * 2.0), x.clone().requires_grad_(), use_reentrant=reentrant)
    try:
        y.sum().backward()
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    del y
    # the ids as an argument: a block that makes the layer's input inside the checkpointed region (as a
    # transformer block does: norm, then the MoE) recomputes with them, where force_routing is refused
    block = lambda t, i: layer(torch.tanh(t) * 2.0, topk_ids=i)  # noqa: E731
    block_same = _same_grads_checkpointed(layer, block, x, ids, reentrant=reentrant,
                                          routed=lambda: torch.equal(layer.last_topk_ids, ids))
    return [same and block_same, refused, len(layer._forced_for_recompute)]


def _forced_both_modes(rank: int, world: int) -> list:
    return [_forced_under_checkpoint(rank, world, reentrant) for reentrant in (True, False)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_forced_routing_under_checkpointing(world):
    """The recomputation did not know the forced ids: it routed by the router, and the gradients went to
    other experts silently (reentrant) or the backward failed torch's recomputation check. Now it
    recomputes the forced routing (gradients identical to the unwrapped layer's), refuses on every
    rank where the input cannot be matched, and keeps nothing once the inputs are freed."""
    for same, refused, kept in sum(run_distributed(_forced_both_modes, world, timeout=150), []):
        assert same
        assert "from an input the layer was not given" in refused, refused
        assert kept == 0


def test_routing_kept_for_recomputation():
    from moelayers.layers.replay import ForcedForRecompute

    kept, x, ids = ForcedForRecompute(), torch.randn(4, H), torch.zeros(4, 2, dtype=torch.int64)
    kept.keep(x, None)
    assert len(kept) == 1 and not kept.active  # kept provisionally: before the layer's first forced forward
    assert kept.find(x) == (True, None)
    kept.keep(x, ids)  # the same input forced: replaces the provisional entry (not ambiguous)
    assert torch.equal(kept.find(x)[1], ids) and kept.active
    x = torch.randn(4, H)
    kept.keep(x, ids)
    ids[0, 0] = 3  # a buffer of ids refilled for the next forward: the entry holds its own copy
    found, forced = kept.find(x.detach())
    assert found and forced.sum() == 0
    assert kept.find(x[:2]) == (False, None) and kept.find(x.clone()) == (False, None)
    kept.keep(x, ids.clone().zero_())  # the same routing again: still known
    assert kept.find(x)[0]
    kept.keep(x, None)  # routed otherwise while the first is alive: which one is recomputed?
    with pytest.raises(ValueError, match="routed in different ways"):
        kept.find(x)
    del x
    assert len(kept) == 0 and kept.active


@pytest.mark.parametrize("reentrant", [True, False])
def test_an_unforced_forward_before_the_first_forced_one_recomputes(reentrant):
    """Micro-batches' forwards before their backwards (pipeline schedules, or summed losses): an unforced
    forward kept nothing before the layer's first forced one, so its recomputation was refused."""
    ids = torch.tensor([[0, 7], [1, 6], [2, 5], [3, 4], [4, 3]])
    xs = [torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    grads = []
    for wrap in (True, False):
        layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1)  # one that has never forced its routing
        ins = [x.clone().requires_grad_() for x in xs]
        run = (lambda t: checkpoint(layer, t, use_reentrant=reentrant)) if wrap else layer
        y0 = run(ins[0])
        layer.force_routing(ids)
        y1 = run(ins[1])
        (y0.pow(2).sum() + y1.pow(2).sum()).backward()
        grads.append([ins[0].grad, ins[1].grad, layer.router.weight.grad, *layer.expert_grads_full()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_router_forward_then_a_forced_one_on_the_same_input():
    """A reference forward by the router, then the same input trained with forced routing (its own
    routing replayed) under checkpointing: the kept unforced entry made the input ambiguous. Also: a
    forced rollout under inference_mode made the layer refuse every later recomputation it could not
    match, for good."""
    layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1)
    x = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    layer(x)
    ids = layer.last_topk_ids.clone()
    layer.force_routing(ids)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    fresh = ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1)
    with torch.inference_mode():
        fresh.force_routing(ids)
        fresh(x.detach())
    assert not fresh._forced_for_recompute.active
    checkpoint(lambda t: fresh(torch.tanh(t)), x, use_reentrant=False).sum().backward()  # input made inside


def test_topk_ids_argument():
    """Forced routing as an argument of the forward: used by that forward only, not with ids pending from
    force_routing, an integer tensor."""
    layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1)
    x = torch.randn(5, H, dtype=torch.float64)
    ids = torch.tensor([[0, 7], [1, 6], [2, 5], [3, 4], [4, 3]])
    y = layer(x, topk_ids=ids)
    assert torch.equal(layer.last_topk_ids, ids)
    ref = ml.reference.moe_forward(x, *layer.export_full_weights(), _cfg(), topk_ids=ids)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)
    layer(x)
    assert not torch.equal(layer.last_topk_ids, ids)  # the next forward routes by itself
    layer.force_routing(ids)
    with pytest.raises(ValueError, match="force_routing ids are pending"):
        layer(x, topk_ids=ids)
    with pytest.raises(TypeError, match="integer tensor"):
        layer(x, topk_ids=ids.double())
    layer(x)
    assert not torch.equal(layer.last_topk_ids, ids)  # both dropped by the refused forward


def test_a_refused_forced_forward_leaves_nothing_to_recompute():
    """A forward refused for its forced ids (wrong rows) kept their routing for its input: retried on that
    input under checkpointing, the backward raised "routed in different ways"."""
    layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.single(), seed=1)
    x = torch.randn(5, H, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(5, 2, dtype=torch.int64)
    ids[:, 1] = 3
    layer.force_routing(ids[:4])
    with pytest.raises(ValueError, match="forced routing has shape"):
        layer(x)
    assert len(layer._forced_for_recompute) == 0 and not layer._forced_for_recompute.active
    for forced in (ids, None):  # retried on that input, forced or not (a new input for the other)
        x = x if forced is not None else x.detach().clone().requires_grad_()
        grads = []
        for wrap in (False, True):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            if forced is not None:
                layer.force_routing(forced)
            y = checkpoint(layer, x, use_reentrant=False) if wrap else layer(x)
            y.pow(2).sum().backward()
            grads.append([x.grad, layer.router.weight.grad, *layer.expert_grads_full()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


def _forced_and_unforced_micro_batches(rank: int, world: int) -> dict:
    """What the review of the first version found: (1) a forced micro-batch whose input is made
    inside the checkpointed region, then an unforced one, then one backward: the first was
    recomputed by the router (the refusal looked at the last forward only); (2) an input routed
    forced in a rollout and then trained on unforced: its recomputation replayed the rollout's ids
    (now a rollout, under inference_mode or no_grad, keeps nothing, and the training forward is
    recomputed by the router; two training forwards routing one input differently are refused); (3) ids forced for the next micro-batch before the backward of the previous one
    were taken by its recomputation; (4) forced ids that are rows of one tensor filled per
    micro-batch were refused as modified in place."""
    layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(), seed=1)
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)])
    xs = [torch.randn(5, H, dtype=torch.float64, generator=g) for _ in range(2)]
    out = {}
    for reentrant in (True, False):
        def ckpt(fn, t):
            return checkpoint(fn, t, use_reentrant=reentrant)

        layer.force_routing(ids)  # (1)
        y1 = ckpt(lambda t: layer(t * 2.0), xs[0].clone().requires_grad_())
        y2 = ckpt(layer, xs[1].clone().requires_grad_())
        try:
            (y1.sum() + y2.sum()).backward()
            out[(1, reentrant)] = "no error"
        except ValueError as exc:
            out[(1, reentrant)] = "refused" if "from an input the layer was not given" in str(exc) else str(exc)
        def same_grads_after_rollout(rollout_mode) -> bool:
            """(2): the unwrapped layer's gradients, then the checkpointed one's, after a forced rollout."""
            grads = []
            for wrap in (False, True):
                layer.zero_grad(set_to_none=True)
                x = xs[0].clone()
                with rollout_mode():
                    layer.force_routing(ids)
                    layer(x)
                y = ckpt(layer, x.requires_grad_()) if wrap else layer(x.requires_grad_())
                y.pow(2).sum().backward()
                grads.append([x.grad, layer.router.weight.grad, *layer.expert_grads_full()])
            return all(torch.equal(a, b) for a, b in zip(*grads))

        out[(2, reentrant)] = same_grads_after_rollout(torch.inference_mode) and same_grads_after_rollout(torch.no_grad)
        x = xs[0].clone().requires_grad_()  # (5) one input, two checkpointed training forwards, other routing
        layer.force_routing(ids)
        y = ckpt(layer, x) + ckpt(layer, x)
        try:
            y.sum().backward()
            out[(5, reentrant)] = "no error"
        except ValueError as exc:
            out[(5, reentrant)] = "refused" if "routed in different ways" in str(exc) else str(exc)
        x = xs[0].clone().requires_grad_()  # (3)
        layer.force_routing(ids)
        y = ckpt(layer, x)
        layer.force_routing(ids.flip(0))  # for the next forward
        y.sum().backward()
        layer(xs[1])
        out[(3, reentrant)] = torch.equal(layer.last_topk_ids, ids.flip(0))
        all_ids = torch.zeros(2, 5, 2, dtype=torch.int64)  # (4)
        ys = []
        for i in range(2):
            all_ids[i] = ids.roll(i, 0)
            layer.force_routing(all_ids[i])
            ys.append(ckpt(layer, xs[i].clone().requires_grad_()))
        try:
            sum(y.sum() for y in ys).backward()
            out[(4, reentrant)] = "ok"
        except ValueError as exc:
            out[(4, reentrant)] = str(exc)
    return out


@pytest.mark.timeout(180)
def test_forced_and_unforced_micro_batches_under_checkpointing():
    for out in run_distributed(_forced_and_unforced_micro_batches, 2, timeout=150):
        for reentrant in (True, False):
            assert out[(1, reentrant)] == "refused", out
            assert out[(2, reentrant)] is True, out
            assert out[(3, reentrant)] is True, out
            assert out[(4, reentrant)] == "ok", out
            assert out[(5, reentrant)] == "refused", out


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_forward_tp_keeps_the_record_of_the_callers_forward(reentrant):
    """Recomputing micro-batch 1's forward_tp after micro-batch 2's forward built its context from the
    layer's last routing, micro-batch 2's: the backward failed (other token counts) or replaced the
    record (last_rebatch, last_context_ranks) with the recomputation's."""
    from moelayers.models.tiny import RMSNorm

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = ml.SemanticMoE(cfg, ml.ParallelGroups.single(), mode="tp", seed=1)
    layer.gather_context = True  # (set by a plan whose later layers read this layer's ranks)
    norm = RMSNorm(H)
    outs = [checkpoint(lambda a, r: layer.forward_tp(a, r, norm, token_ids=None), torch.randn(t, H, requires_grad=True),
                       torch.randn(t, H), use_reentrant=reentrant) for t in (6, 10)]
    record = layer.last_rebatch, layer.last_context_ranks
    outs[0].sum().backward()
    assert layer.last_rebatch is record[0] and layer.last_context_ranks is record[1]


def _tp_layer_and_inputs():
    """A one-process SemanticMoE in tp mode (float64), its norm, 6 tokens' attention partial and
    residual, and forced ids for them."""
    from moelayers.models.tiny import RMSNorm

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, params_dtype=torch.float64)
    layer = ml.SemanticMoE(cfg, ml.ParallelGroups.single(), mode="tp", seed=1)
    g = torch.Generator().manual_seed(3)
    a, r = torch.randn(6, H, dtype=torch.float64, generator=g), torch.randn(6, H, dtype=torch.float64, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    return layer, RMSNorm(H).double(), a, r, ids


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_forward_tp_with_topk_ids(reentrant):
    """forward_tp's forced routing as an argument: a checkpointed forward_tp recomputes with it."""
    layer, norm, a, r, ids = _tp_layer_and_inputs()
    fn = lambda t, i: layer.forward_tp(t, r, norm, token_ids=None, topk_ids=i)  # noqa: E731
    perm = lambda: layer.last_rebatch.perm[layer.last_rebatch.perm >= 0]  # noqa: E731  (tokens in chunk order)
    assert _same_grads_checkpointed(layer, fn, a, ids, reentrant=reentrant,
                                    routed=lambda: torch.equal(layer.last_topk_ids, ids[perm()]))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_forward_tp_with_force_routing(reentrant):
    """A checkpointed forward_tp forced by force_routing recomputes with its routing, found by
    forward_tp's input (by the chunk, which it makes anew, it was refused); and after a forced
    forward under no_grad (an evaluation, a replay) an unforced checkpointed forward_tp recomputes by
    the router (every one was refused from then on)."""
    layer, norm, a, r, ids = _tp_layer_and_inputs()

    def step(wrap: bool, forced: bool):
        layer.zero_grad(set_to_none=True)
        xi = a.clone().requires_grad_()
        if forced:
            layer.force_routing(ids)
        fn = lambda t: layer.forward_tp(t, r, norm, token_ids=None)  # noqa: E731
        y = checkpoint(fn, xi, use_reentrant=reentrant) if wrap else fn(xi)
        y.pow(2).sum().backward()
        return [xi.grad, layer.router.weight.grad, *layer.expert_grads_full()]

    for forced in (True, False):
        plain, wrapped = step(False, forced), step(True, forced)
        assert all(torch.equal(p, w) for p, w in zip(plain, wrapped)), forced
        with torch.no_grad():  # an evaluation with forced routing between training steps
            layer.force_routing(ids)
            layer.forward_tp(a, r, norm, token_ids=None)


def _tp_forced_residual_only(rank, world):
    """At tp = ep = world: forward_tp forced by force_routing, attn_partial without grad and the
    residual with it, under each checkpoint kind: the gradients, or the error's text."""
    from moelayers.models.tiny import RMSNorm

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=4, num_experts=4, top_k=2, params_dtype=torch.float64)
    groups = ml.ParallelGroups.from_world(ep=world, tp=world)
    out = {}
    for wrap in (None, True, False):  # unwrapped, reentrant, non-reentrant
        layer = ml.SemanticMoE(cfg, groups, mode="tp", seed=1)
        norm = RMSNorm(H, dtype=torch.float64)
        g = torch.Generator().manual_seed(0)
        a = torch.randn(6, H, generator=g, dtype=torch.float64)
        r = torch.randn(6, H, generator=g, dtype=torch.float64).requires_grad_()
        layer.force_routing(torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)]))
        fn = lambda x, res: layer.forward_tp(x, res, norm, token_ids=None)  # noqa: E731
        try:
            y = fn(a, r) if wrap is None else checkpoint(fn, a, r, use_reentrant=wrap)
            y.pow(2).sum().backward()
            out[wrap] = [r.grad, layer.router.weight.grad, *layer.expert_grads_full()]
        except ValueError as exc:
            out[wrap] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_checkpointed_forward_tp_forced_with_only_the_residual_requiring_grad():
    """forward_tp forced by force_routing, its attention partial made without grad and the residual
    requiring it: a reentrant checkpoint's recomputation was refused on every rank as if the input
    had been made inside the checkpointed region (the routing was kept by attn_partial, which does
    not require grad; a fuzzing helper found it). It recomputes with the forced routing."""
    for out in run_distributed(_tp_forced_residual_only, 2, timeout=100):
        for wrap in (True, False):
            assert not isinstance(out[wrap], str), (wrap, out[wrap])
            assert all(torch.equal(p, w) for p, w in zip(out[None], out[wrap])), wrap


def test_a_layer_pickles_after_a_training_forward():
    """A VariabilityAwareMoE that had run a forward under autograd held weak references (its graphs in
    flight): torch.save(model) failed with "cannot pickle 'weakref.ReferenceType' object"."""
    layer = ml.VariabilityAwareMoE(_cfg(), ml.ParallelGroups.single(), window=2, seed=1)
    x = torch.randn(5, H, dtype=torch.float64)
    layer(x.requires_grad_()).sum().backward()
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(copy(x), layer(x))


def _pickle_over_groups(rank: int, world: int) -> str:
    layer = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(), seed=1)
    try:
        pickle.dumps(layer)
    except TypeError as exc:
        return str(exc)
    return "pickled"


@pytest.mark.timeout(120)
def test_pickling_a_layer_over_process_groups_says_what_to_do():
    """It failed deep inside pickle: "cannot pickle 'ProcessGroup' object"."""
    for msg in run_distributed(_pickle_over_groups, 2, timeout=100):
        assert "cannot be pickled" in msg and "state_dict()" in msg, msg


def _ddp(rank: int, world: int, ep: int | None = None, device: str = "cpu") -> list[str]:
    """Also run on GPUs (tests/gpu/test_equivalence_gpu.py), with ``device='cuda'`` over NCCL."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moelayers.testing import check_close

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)  # the same weights on every rank, as a model built alike
    w64 = (torch.randn(8, H, dtype=torch.float64) * 0.5, torch.randn(8, 16, H, dtype=torch.float64) * H ** -0.5,
           torch.randn(8, H, 8, dtype=torch.float64) * 8 ** -0.5)
    groups = ml.ParallelGroups.from_world(ep=ep)
    model = torch.nn.Sequential(ml.VanillaMoE(_cfg(), groups, seed=1, device=dev))
    model[0].load_full_weights(*(w.to(dev) for w in w64))
    torch.distributed.barrier()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ml.rank_local_names(model))
    ddp = DDP(model)
    xs = [torch.randn(4 + r, H, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ddp(xs[rank].to(dev)).pow(2).sum().backward()
    ml.reduce_expert_grads(model)
    try:  # twice: the sum and the division again
        ml.reduce_expert_grads(model)
        twice = "a second call: no error"
    except ValueError as exc:
        twice = None if "reduced already" in str(exc) else str(exc)
    # a rank-local buffer: each rank's load window keeps its own counts (DDP broadcast rank 0's before every forward)
    loads = torch.nn.Sequential(ml.VariabilityAwareMoE(_cfg(), groups, window=4, seed=1, device=dev))
    DDP._set_params_and_buffers_to_ignore_for_model(loads, ml.rank_local_names(loads))
    ddp_loads = DDP(loads)
    for _ in range(2):
        with torch.no_grad():
            ddp_loads(xs[rank].to(dev))
    mine = torch.bincount(loads[0].last_topk_ids.flatten().cpu(), minlength=8)
    g13, g2 = (g.cpu() for g in model[0].expert_grads_full())
    errs = [twice, check_close("experts after DDP", model[0].export_full_weights()[1].cpu(), w64[1], None)]
    params = [w.clone().requires_grad_() for w in w64]
    loss = sum(ml.reference.moe_forward(x, *params, _cfg()).pow(2).sum() for x in xs) / world  # DDP: the mean
    loss.backward()
    errs.append(check_close("router grad", model[0].router.weight.grad.cpu(), params[0].grad, None))
    errs.append(check_close("w13 grad", g13, params[1].grad, None))
    errs.append(check_close("w2 grad", g2, params[2].grad, None))
    if not torch.equal(loads[0].window_loads()[1], mine):
        errs.append(f"the load window holds {loads[0].window_loads()[1].tolist()}, this rank routed {mine.tolist()}")
    if groups.edp is not None:  # groups that serve different placements: refused on every rank
        model.zero_grad(set_to_none=True)
        if rank >= groups.ep_size:  # the second group alone (a collective over its ranks)
            model[0].apply_placement(ml.ExpertPlacement.from_phy2log(model[0].placement.phy2log.flip(0), 8))
        try:
            ml.reduce_expert_grads(model)
            errs.append("different placements: no error")
        except ValueError as exc:
            if "serve different placements" not in str(exc):
                errs.append(str(exc))
        # frozen on every rank (a rollout copy beside the trained model): no gradients to sum, not refused
        frozen = torch.nn.ModuleDict({"policy": torch.nn.Sequential(ml.VanillaMoE(_cfg(), groups, device=dev)),
                                      "rollout": model.requires_grad_(False)})
        frozen["policy"](xs[rank].to(dev)).pow(2).sum().backward()
        try:
            ml.reduce_expert_grads(frozen)
        except ValueError as exc:
            errs.append(f"a frozen layer in other placements: {exc}")
    return [e for e in errs if e]


@pytest.mark.timeout(180)
def test_ddp_over_the_expert_parallel_ranks_with_the_experts_left_alone():
    """Plain DDP copied rank 0's experts over rank 1's and averaged different experts' gradients,
    silently: ``rank_local_names`` names what DDP must ignore, and ``reduce_expert_grads`` makes the
    expert gradients those of the mean loss over the world (checked against the reference's)."""
    assert run_distributed(_ddp, 2, timeout=150) == [[], []]
    # two expert-parallel groups of 2 in a world of 4: the README's division alone left each group with its
    # own tokens' gradient (the copies of an expert drifted apart); reduce_expert_grads sums over the groups
    assert run_distributed(_ddp, 4, 2, timeout=150) == [[]] * 4
    model = torch.nn.Sequential(torch.nn.Linear(H, H), ml.VanillaMoE(_cfg(), ml.ParallelGroups.single()))
    assert ml.rank_local_names(model) == ["1.experts.w13", "1.experts.w2"]
    model = torch.nn.ModuleDict({"moe": ml.VariabilityAwareMoE(_cfg(), ml.ParallelGroups.single())})
    assert ml.rank_local_names(model) == ["moe.experts.w13", "moe.experts.w2", "moe._loads"]
