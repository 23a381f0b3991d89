"""SemanticMoE (dp and tp modes), the shuffled reduce-scatter / all-gather and the tiny decoder's
attention-TP against the dense float64 reference, on gloo at world sizes 2 and 4.

``run_semantic_cases`` runs every case on one rank of any world size (the GPU suite calls it under
NCCL) and returns ``{case: error or None}`` plus what must be identical on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moelayers as ml
from moelayers.models.tiny import RMSNorm
from moelayers.planning.semantic import SemanticPlan, majority_rank
from moelayers.router import scores_to_topk
from moelayers.schedule import shuffled_all_gather, shuffled_reduce_scatter
from moelayers.testing import check_close, error_of, redraw_near_ties, run_distributed

H, F, V, L = 32, 16, 48, 3


# ---------------------------------------------------------------------- plans
def make_plan(num_experts: int, num_ranks: int, seed: int = 0, *, vocab: int = V, layers: int = L,
              mode: str = "tp", unseen: int = 8) -> SemanticPlan:
    """A random valid plan: balanced expert ranks, random token/n-gram tables (the token table shared
    by all layers in dp mode); the last ``unseen`` token ids have confidence 0, and layers 0/1 have
    no n-gram confidence."""
    g = torch.Generator().manual_seed(seed)
    er = torch.stack([(torch.arange(num_experts) % num_ranks)[torch.randperm(num_experts, generator=g)]
                      for _ in range(layers)])
    tr = torch.randint(0, num_ranks, (layers, vocab), generator=g)
    if mode == "dp":
        tr[:] = tr[0].clone()
    tc = torch.rand(layers, vocab, generator=g) * 0.9 + 0.05
    tc[:, vocab - unseen:] = 0.0
    nr = torch.randint(0, num_ranks, (layers, num_ranks, num_ranks), generator=g)
    nc = torch.rand(layers, num_ranks, num_ranks, generator=g)
    nc[:2] = 0.0
    return SemanticPlan(er.numpy(), tr.numpy(), tc.numpy(), nr.numpy(), nc.numpy(), num_ranks, num_experts, vocab,
                        mode)


def weights64(num_experts: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, H, generator=g, dtype=torch.float64) * 0.5,
            torch.randn(num_experts, 2 * F, H, generator=g, dtype=torch.float64) * H ** -0.5,
            torch.randn(num_experts, H, F, generator=g, dtype=torch.float64) * F ** -0.5)


def _norm(dtype, device="cpu"):
    """The pre-MoE RMSNorm (same weights in every dtype and on every device)."""
    w = 1.0 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    n = RMSNorm(H, dtype=dtype, device=device)
    with torch.no_grad():
        n.weight.copy_(w.to(dtype))
    return n


# ---------------------------------------------------------------------- tp cases
TP_CASES = [
    dict(name="tp-f32-prev", dtype=torch.float32, tokens=lambda r: 4 * r, prev=True),
    dict(name="tp-bf16-ragged", dtype=torch.bfloat16, tokens=lambda r: 4 * r + 1, prev=True),
    dict(name="tp-f64-overflow", dtype=torch.float64, tokens=lambda r: 3 * r + 2, overflow=True),
    dict(name="tp-f32-unseen", dtype=torch.float32, tokens=lambda r: 2 * r - 1, unseen=True),
    dict(name="tp-f32-noplan", dtype=torch.float32, tokens=lambda r: r - 1, noplan=True),  # T < R
    dict(name="tp-f32-zero", dtype=torch.float32, tokens=lambda r: 0),
    # fixed capacity (a CUDA graph on GPUs in bf16): a first forward on other tokens captures, the second replays
    dict(name="tp-bf16-capacity", dtype=torch.bfloat16, tokens=lambda r: 4 * r + 1, prev=True, capacity=True),
]


def _tp_inputs(case, world, t, plan):
    g = torch.Generator().manual_seed(17 + t)
    partials = [torch.randn(t, H, generator=g, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(t, H, generator=g, dtype=torch.float64)
    if case.get("unseen"):  # ids the profiling never saw: confidence 0 (ids past the vocabulary are refused)
        ids = torch.randint(V - 8, V, (t,), generator=g)
    else:
        ids = torch.randint(0, V, (t,), generator=g)
    prev = None
    if case.get("prev"):
        prev = torch.randint(-1, world, (2, t), generator=g)
    if case.get("overflow") and plan is not None:  # every token predicted on rank 0, distinct confidences
        plan.token_rank[2] = 0
        plan.token_conf[2] = torch.linspace(0.1, 0.9, V).numpy()
    return partials, residual, ids, prev


def _run_tp_case(rank, world, groups, case, device, outs):
    dtype, e = case["dtype"], 4 * world
    t = case["tokens"](world)
    plan = None if case.get("noplan") else make_plan(e, world, seed=3)
    partials, residual, ids, prev = _tp_inputs(case, world, t, plan)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=dtype)
    kw = dict(device=device, seed=7)
    if case.get("capacity"):  # chunks of ceil(t / world) = 5 rows
        kw.update(capacity=6, cuda_graph=device.type == "cuda" and dtype == torch.bfloat16)
    layer = (ml.SemanticMoE(cfg, groups, mode="tp", **kw) if plan is None
             else ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", **kw))
    w64 = weights64(e)
    layer.load_full_weights(*(w.to(dtype).to(device) for w in w64))
    n64, norm = _norm(torch.float64), _norm(dtype, device)
    with torch.no_grad():
        if case.get("capacity"):
            layer.forward_tp(partials[rank].flip(0).to(dtype).to(device), residual.flip(0).to(dtype).to(device), norm,
                             token_ids=ids.flip(0).to(device), prev_ranks=prev.flip(1).to(device))
        out = layer.forward_tp(partials[rank].to(dtype).to(device), residual.to(dtype).to(device), norm,
                               token_ids=ids.to(device), prev_ranks=None if prev is None else prev.to(device))
        layer.release_graphs()
        h64 = residual + sum(partials)
        ref = h64 + ml.reference.moe_forward(n64(h64), *w64, cfg.replace(params_dtype=torch.float64))
        low = None
        if dtype == torch.bfloat16:
            hl = residual.to(dtype) + sum(p.to(dtype) for p in partials)
            low = hl + ml.reference.moe_forward(_norm(dtype)(hl), *(w.to(dtype) for w in w64), cfg)
    rb = layer.last_rebatch
    outs[case["name"]] = (out.double().cpu(), rb.perm.cpu(), layer.last_ranks.cpu())
    errs = [check_close(f"{case['name']} output", out.cpu(), ref, low)]
    counts = torch.bincount(rb.rank.cpu(), minlength=world)
    if t and not (counts.max() - counts.min() <= 1 and counts.sum() == t):
        errs.append(f"{case['name']}: unequal chunks {counts.tolist()}")
    if case.get("overflow") and t:
        conf = torch.as_tensor(plan.token_conf[2])[ids]
        top = torch.argsort(conf, descending=True, stable=True)[: rb.valid_rows(0)]
        if sorted(top.tolist()) != sorted((rb.rank.cpu() == 0).nonzero().flatten().tolist()):
            errs.append(f"{case['name']}: rank 0 should keep its {rb.valid_rows(0)} most confident tokens")
    return [e for e in errs if e]


def _lar_case(rank, world, groups, device):
    """LAR recorded in tp mode = the LAR of the shuffled chunk assignment; an oracle plan raises it."""
    e, t, dtype = 4 * world, 8 * world, torch.float64
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=dtype)
    w64 = weights64(e, seed=99)
    g = torch.Generator().manual_seed(4)
    partials = [torch.randn(t, H, generator=g, dtype=dtype) for _ in range(world)]
    residual = torch.randn(t, H, generator=g, dtype=dtype)
    ids = torch.randperm(V, generator=g)[:t]
    n64, norm = _norm(dtype), _norm(dtype, device)
    h64 = residual + sum(partials)
    topk, _ = scores_to_topk(n64(h64) @ w64[0].t(), cfg)
    plan = make_plan(e, world, seed=5)
    er = plan.placement(2).expert_rank()
    plan.token_rank[2, ids.numpy()] = er[topk[:, 0]].numpy()  # oracle: each token's top-1 expert's rank
    plan.token_conf[2, ids.numpy()] = 1.0
    lars, errs = [], []
    for p in (None, plan):
        layer = (ml.SemanticMoE(cfg, groups, mode="tp", placement=plan.placement(2), device=device, seed=1)
                 if p is None else ml.SemanticMoE.from_plan(p, 2, cfg, groups, mode="tp", device=device, seed=1))
        layer.load_full_weights(*(w.to(device) for w in w64))
        with torch.no_grad():
            layer.forward_tp(partials[rank].to(device), residual.to(device), norm, token_ids=ids.to(device))
        lar = layer.last_stats.reduce(groups.ep).lar
        expected = float((er[topk] == layer.last_ranks.cpu()[:, None]).double().mean())
        if abs(lar - expected) > 1e-12:
            errs.append(f"tp LAR {lar} != LAR of the chunk assignment {expected}")
        lars.append(lar)
    if world > 1 and not lars[1] > lars[0]:  # one rank: everything is local either way
        errs.append(f"oracle plan LAR {lars[1]:.3f} not above plain chunks {lars[0]:.3f}")
    return errs, lars


def _collectives_case(rank, world, groups, device):
    """shuffled_reduce_scatter / shuffled_all_gather against sum + index (incl. dummies)."""
    g = torch.Generator().manual_seed(8)
    t = 3 * world - 1
    c = -(-t // world)
    parts = [torch.randn(t, 5, generator=g, dtype=torch.float64) for _ in range(world)]
    perm = torch.full((world * c,), -1, dtype=torch.int64)
    perm[torch.randperm(world * c, generator=g)[:t]] = torch.randperm(t, generator=g)
    full = sum(parts)
    chunk = shuffled_reduce_scatter(parts[rank].to(device), perm.to(device), groups.tp)
    mine = perm[rank * c:(rank + 1) * c]
    want = torch.where((mine >= 0)[:, None], full[mine.clamp(min=0)], 0.0)
    errs = []
    if (chunk.cpu() - want).abs().max() > 1e-12:
        errs.append("shuffled_reduce_scatter differs from sum + gather")
    back = shuffled_all_gather(chunk, perm.to(device), groups.tp)
    if back.shape != (t, 5) or (back.cpu() - full).abs().max() > 1e-12:
        errs.append("shuffled_all_gather(shuffled_reduce_scatter(x)) is not the all-reduce")
    return errs


# ---------------------------------------------------------------------- dp cases
def _run_dp_case(rank, world, groups, dtype, device):
    e = 4 * world
    plan = make_plan(e, world, seed=11, mode="dp")
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=dtype)
    layer = ml.SemanticMoE.from_plan(plan, 1, cfg, groups, device=device, seed=3)
    errs = [] if layer.mode == "dp" and layer.placement == plan.placement(1) else ["dp layer: wrong mode/placement"]
    w64 = weights64(e, seed=21)
    layer.load_full_weights(*(w.to(dtype).to(device) for w in w64))
    g = torch.Generator().manual_seed(50 + rank)
    draw = lambda n: torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype).double()  # noqa: E731
    # no router near-ties: a GPU's bf16 logits may break one otherwise than the CPU bf16 reference
    x64 = redraw_near_ties(draw(5 + 2 * rank), w64[0], 2, draw, score_fn=cfg.score_fn)
    ids = torch.randint(0, V + 5, (x64.shape[0],), generator=g)
    with torch.no_grad():
        y = layer(x64.to(dtype).to(device), token_ids=ids.to(device))
    ref = ml.reference.moe_forward(x64, *w64, cfg.replace(params_dtype=torch.float64))
    low = None if dtype != torch.bfloat16 else ml.reference.moe_forward(x64.to(dtype), *(w.to(dtype) for w in w64), cfg)
    errs.append(check_close(f"dp-{dtype} output", y.cpu(), ref, low))
    errs += _vanilla_checkpoint_into_plan(layer, plan, cfg, groups, device, w64, x64, ids, ref, low)
    return [e for e in errs if e]


def _vanilla_checkpoint_into_plan(planned, plan, cfg, groups, device, w64, x64, ids, ref, low) -> list[str]:
    """A VanillaMoE's checkpoint (linear placement) loaded into a plan-built layer: served in the
    checkpoint's placement with a warning naming the way back, then moved to the plan's placement
    (``apply_placement``, a collective) without one; the output equals the reference throughout."""
    dtype, errs = cfg.params_dtype, []
    vanilla = ml.VanillaMoE(cfg, groups, device=device, seed=8)
    vanilla.load_full_weights(*(w.to(dtype).to(device) for w in w64))
    layer = ml.SemanticMoE.from_plan(plan, 1, cfg, groups, device=device, seed=9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer.load_state_dict(vanilla.state_dict())
    warned = sum("apply_placement" in str(w.message) for w in caught)
    # one rank: the same experts; several: told once on every rank (a filter that raises must raise on all)
    if layer.placement != vanilla.placement or warned != (groups.ep_size > 1):
        errs.append(f"a linear checkpoint in a plan-built layer: adopted {layer.placement == vanilla.placement}, "
                    f"warned {warned} at {groups.ep_size} expert-parallel rank(s)")
    for step in ("checkpoint", "moved"):
        if step == "moved":
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # back on the plan: no warning
                layer.apply_placement(plan.placement(1))
            if layer.placement != planned.placement:
                errs.append("apply_placement(plan.placement(1)) did not give the plan's placement")
        with torch.no_grad():
            y = layer(x64.to(dtype).to(device), token_ids=ids.to(device))
        errs.append(check_close(f"dp-{dtype} output, {step}", y.cpu(), ref, low))
    return errs


# ---------------------------------------------------------------------- tiny decoder, attention-TP
def _tiny(groups, attention, layer_fn, dtype=torch.float64, device=None):
    from moelayers.models import TinyConfig, TinyDecoder

    cfg = TinyConfig(vocab_size=V + 16, hidden_size=H, num_layers=L, num_heads=4, dtype=dtype, init_std=0.2)
    return TinyDecoder(cfg, layer_fn, attention=attention, groups=groups, device=device, seed=2)


def _tiny_case(rank, world, groups, device, outs):
    """TinyDecoder with attention-TP + SemanticMoE(tp) vs one process with attention-DP + VanillaMoE."""
    e = 4 * world
    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=torch.float64,
                       init_std=0.2)
    plan = make_plan(e, world, seed=13)
    tp = _tiny(groups, "tp", lambda i: ml.SemanticMoE.from_plan(plan, i, moe, groups, mode="tp", device=device,
                                                                 seed=10 + i), device=device)
    ref = _tiny(None, "dp", lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=10 + i))
    for mine, theirs in zip(tp.moe_layers, ref.moe_layers):  # same logical weights on any device
        mine.load_full_weights(*(w.to(device) for w in theirs.export_full_weights()))
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, V, (7,), generator=g), torch.randint(0, V, (4,), generator=g)
    errs, got = [], []
    with torch.no_grad():
        for batch in ([("a", a[:5]), ("b", b[:3])], [("a", a[5:6]), ("b", b[3:4])], [("a", a[6:7])]):
            lt = tp.step([(k, v.to(device)) for k, v in batch])
            lr = ref.step(batch)
            for k in lr:
                got.append(lt[k].cpu())
                errs.append(check_close(f"tiny tp step {k}", lt[k].cpu(), lr[k]))
        ids = torch.stack([a[:6], torch.cat([b, a[:2]])])
        errs.append(check_close("tiny tp forward", tp(ids.to(device)).cpu(), ref(ids)))
    if tp.blocks[2].moe.last_ranks is None or tp.blocks[2].moe.last_ranks.numel() != 12:
        errs.append("tiny tp: last_ranks not recorded")
    for i in (0, 1):  # the n-gram context of layer 2: majority ranks at layers 0 and 1, as planned
        want = majority_rank(ref.blocks[i].moe.last_topk_ids.numpy(), plan.expert_rank[i], world)
        if not (tp.blocks[i].moe.last_context_ranks.cpu().numpy() == want).all():
            errs.append(f"tiny tp: layer {i} context ranks differ from the plan's majority ranks")
    if tp.blocks[2].moe.last_context_ranks is not None:  # no later n-gram needs it: not gathered
        errs.append("tiny tp: layer 2 gathered context ranks nobody uses")
    outs["tiny"] = (torch.stack(got), torch.zeros(1), torch.zeros(1))
    return [e for e in errs if e]


# ---------------------------------------------------------------------- runner
def run_semantic_cases(rank: int, world: int, device: str = "cpu") -> tuple[dict, dict, list[float]]:
    """Every case on this rank: ``({case: error or None}, {case: tensors identical on all ranks}, lars)``."""
    device = torch.device(device)
    tp_groups = ml.ParallelGroups.from_world(tp=world)
    dp_groups = ml.ParallelGroups.from_world()
    results, outs = {}, {}
    for case in TP_CASES:
        results[case["name"]] = "; ".join(_run_tp_case(rank, world, tp_groups, case, device, outs)) or None
    errs, lars = _lar_case(rank, world, tp_groups, device)
    results["tp-lar"] = "; ".join(errs) or None
    results["collectives"] = "; ".join(_collectives_case(rank, world, tp_groups, device)) or None
    for dtype in (torch.float32, torch.bfloat16):
        results[f"dp-{dtype}"] = "; ".join(_run_dp_case(rank, world, dp_groups, dtype, device)) or None
    results["tiny-tp"] = "; ".join(_tiny_case(rank, world, tp_groups, device, outs)) or None
    dist.barrier()
    # numpy arrays travel back by value (tensors would go through shared memory of exited processes)
    return results, {k: [t.detach().cpu().numpy() for t in v] for k, v in outs.items()}, lars


def check_results(results: list) -> None:
    """Every case passed on every rank, and tp outputs, permutations and ranks agree across ranks."""
    failures = [f"rank {r}: {err}" for r, (res, _, _) in enumerate(results) for err in res.values() if err]
    assert not failures, "\n".join(failures)
    first = results[0][1]
    for r, (_, outs, _) in enumerate(results[1:], 1):
        for name, tensors in first.items():
            for a, b in zip(tensors, outs[name]):
                assert a.shape == b.shape and (a == b).all(), f"{name}: rank {r} differs from rank 0"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 4))
def test_semantic_moe_matches_reference(world):
    results = run_distributed(run_semantic_cases, world)
    check_results(results)
    _, _, lars = results[0]
    print(f"world {world}: tp LAR plain chunks {lars[0]:.3f}, oracle plan {lars[1]:.3f}")


TP_BAD_INPUTS = ("residual shape", "dtype", "forced rows", "no token ids", "not a tensor", "fewer tokens",
                 "other token ids", "swaps that cancel", "id past the vocabulary", "negative id",
                 "lowest int64 id")


def _tp_bad_input_on_one_rank(rank, world):
    """forward_tp with a bad input on rank 1, or with tokens that differ between the ranks: every
    rank raises (none hangs or crashes the collectives, none returns a wrong output silently); the
    next call still works."""
    groups = ml.ParallelGroups.from_world(tp=world)
    plan = make_plan(4 * world, world, seed=3)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=torch.float64)
    layer = ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", seed=7)
    norm = _norm(torch.float64)
    partials, residual, ids, _ = _tp_inputs({}, world, 9, plan)
    outcome = {}
    for kind in TP_BAD_INPUTS:
        x, res, tok, forced = partials[rank], residual, ids, torch.zeros(9, 2, dtype=torch.int64)
        if rank == 1:
            x = x.float() if kind == "dtype" else x
            res = res[:5] if kind == "residual shape" else res
            forced = forced[:4] if kind == "forced rows" else forced
            tok = None if kind == "no token ids" else tok
            x = x.tolist() if kind == "not a tensor" else x
            if kind == "fewer tokens":
                x, res, tok, forced = x[:8], res[:8], tok[:8], forced[:8]
            tok = tok.flip(0) if kind == "other token ids" else tok
        if kind == "swaps that cancel":  # [.., a, b, b, a] against [.., b, a, a, b]: equal position-weighted sums
            a, b = int(ids[0]), (int(ids[0]) + 1) % int(ids.max() + 1)
            tok = ids.clone()
            tok[:4] = torch.tensor([a, b, b, a] if rank == 0 else [b, a, a, b])
        if kind in ("id past the vocabulary", "negative id", "lowest int64 id"):  # on every rank: another vocabulary
            tok = ids.clone()
            tok[5] = {"id past the vocabulary": V, "negative id": -1}.get(kind, -2 ** 63)
        layer.force_routing(forced)
        try:
            with torch.no_grad():
                layer.forward_tp(x, res, norm, token_ids=tok)
            outcome[kind] = "no error"
        except (TypeError, ValueError) as e:
            if kind == "fewer tokens":
                ok = "different numbers of tokens (8..9; this rank " in str(e)
            elif kind in ("other token ids", "swaps that cancel"):
                ok = "different token ids" in str(e)
            elif kind in ("id past the vocabulary", "negative id", "lowest int64 id"):
                bad = "<= -2**61" if kind == "lowest int64 id" else int(tok[5])
                ok = f"token id {bad} is outside the plan's vocabulary [0, vocab_size={V})" in str(e)
            else:
                ok = ("refused the input of TP rank(s) [1]" in str(e)) == (rank == 0)
            outcome[kind] = "raised" if ok else f"raised the wrong error: {e}"
        with torch.no_grad():
            out = layer.forward_tp(partials[rank], residual, norm, token_ids=ids)
        if out.shape != (9, H):
            outcome[kind] = f"the next call gave {list(out.shape)}"
    # verify_tp_inputs=False skips the agreement: the same output on valid inputs
    quiet = ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", seed=7, verify_tp_inputs=False)
    with torch.no_grad():
        same = torch.equal(quiet.forward_tp(partials[rank], residual, norm, token_ids=ids),
                           layer.forward_tp(partials[rank], residual, norm, token_ids=ids))
    outcome["verify off"] = "same output" if same else "verify_tp_inputs=False changed the output"
    return outcome


@pytest.mark.timeout(120)
def test_forward_tp_bad_input_on_one_rank_raises_on_every_rank():
    raised = {**{kind: "raised" for kind in TP_BAD_INPUTS}, "verify off": "same output"}
    assert run_distributed(_tp_bad_input_on_one_rank, 2, timeout=90) == [raised, raised]
    with pytest.raises(TypeError, match="verify_tp_inputs must be a bool"):
        ml.SemanticMoE(ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2),
                       ml.ParallelGroups.single(), verify_tp_inputs="off")
    # one TP rank: the ids are checked too (one host read), unless verify_tp_inputs=False
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2, params_dtype=torch.float64)
    partials, residual, ids, _ = _tp_inputs({}, 1, 9, None)
    for verify in (True, False):
        alone = ml.SemanticMoE.from_plan(make_plan(4, 1), 0, cfg, ml.ParallelGroups.single(), mode="tp",
                                         verify_tp_inputs=verify)
        for bad in (V, -3):
            tok = ids.clone()
            tok[2] = bad
            with torch.no_grad():
                if verify:
                    with pytest.raises(ValueError, match=rf"token id {bad} is outside the plan's vocabulary"):
                        alone.forward_tp(partials[0], residual, _norm(torch.float64), token_ids=tok)
                else:
                    alone.forward_tp(partials[0], residual, _norm(torch.float64), token_ids=tok)


def _tp_residual_out_of_sync(rank, world, device="cpu"):
    """A residual stream one bit apart on rank 1 (or with two rows swapped there): each rank adds its
    chunk's rows of its own copy, so forward_tp returned rows from both copies, silently. With
    ``verify_tp_residual`` every rank raises (in float64 and bfloat16), and equal residuals give
    the output of the layer without the check, bit for bit."""
    groups = ml.ParallelGroups.from_world(tp=world)
    plan = make_plan(4 * world, world, seed=3)
    outcome = {}
    for dtype in (torch.float64, torch.bfloat16):
        cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=dtype)
        checked = ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", seed=7, verify_tp_residual=True,
                                           device=device)
        plain = ml.SemanticMoE.from_plan(plan, 2, cfg, groups, mode="tp", seed=7, device=device)
        partials, residual, ids, _ = _tp_inputs({}, world, 9, plan)
        x, norm, ids = partials[rank].to(device, dtype), _norm(dtype, device), ids.to(device)
        residual = residual.to(device, dtype)
        with torch.no_grad():
            same = torch.equal(checked.forward_tp(x, residual, norm, token_ids=ids),
                               plain.forward_tp(x, residual, norm, token_ids=ids))
        outcome[dtype, "equal"] = "same output" if same else "the check changed the output"
        for kind in ("one bit", "rows swapped"):
            res = residual.clone()
            if rank == 1 and kind == "one bit":
                res.view(torch.int16 if dtype == torch.bfloat16 else torch.int64)[4, 3] += 1  # the next float up
            if rank == 1 and kind == "rows swapped":
                res[[2, 6]] = res[[6, 2]]
            try:
                with torch.no_grad():
                    checked.forward_tp(x, res, norm, token_ids=ids)
                outcome[dtype, kind] = "no error"
            except ValueError as e:
                outcome[dtype, kind] = "raised" if "hold different residuals (verify_tp_residual)" in str(e) else str(e)
    return outcome


@pytest.mark.timeout(120)
def test_forward_tp_verify_tp_residual_catches_residuals_out_of_sync():
    check_residual_checks(run_distributed(_tp_residual_out_of_sync, 2, timeout=90))
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="verify_tp_residual=True needs verify_tp_inputs=True"):
        ml.SemanticMoE(cfg, ml.ParallelGroups.single(), verify_tp_inputs=False, verify_tp_residual=True)
    with pytest.raises(TypeError, match="verify_tp_residual must be a bool"):
        ml.SemanticMoE(cfg, ml.ParallelGroups.single(), verify_tp_residual=1)


def check_residual_checks(out):
    """:func:`_tp_residual_out_of_sync`'s outcome on every rank, as expected (also on GPUs)."""
    for dtype in (torch.float64, torch.bfloat16):
        for r in range(2):
            assert (out[r][dtype, "equal"], out[r][dtype, "one bit"], out[r][dtype, "rows swapped"]) == \
                ("same output", "raised", "raised"), out


def _tp_ranks_whose_backward_would_differ(rank, world, device="cpu"):
    """Autograd into attn_partial or residual on rank 0 only (the inner forward's agreement sees only
    the chunk after the norm, which needs a gradient on both): the backward's all-gather or
    all-reduce waited for rank 1 forever. A layer cast to float32 on rank 1: gloo aborted in the
    reduce-scatter. The router frozen on rank 1: allreduce_partial_grads paired rank 0's router
    gradient with rank 1's norm gradient. Every rank raises now, and the next call is exact."""
    from moelayers.dispatch.comm import allreduce_partial_grads

    groups = ml.ParallelGroups.from_world(tp=world)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=torch.float64)
    gen = torch.Generator().manual_seed(4)
    partials = [torch.randn(9, H, generator=gen, dtype=torch.float64).to(device) for _ in range(world)]
    residual = torch.randn(9, H, generator=gen, dtype=torch.float64).to(device)
    outcome = {}
    for case in ("attn_partial", "residual", "dtype"):
        layer, norm = ml.SemanticMoE(cfg, groups, mode="tp", seed=3, device=device), _norm(torch.float64, device)
        x, res = partials[rank].clone(), residual.clone()
        if case != "dtype":
            (x if case == "attn_partial" else res).requires_grad_(rank == 0)
        elif rank == 1:
            layer, norm, x, res = layer.float(), norm.float(), x.float(), res.float()
        try:
            layer.forward_tp(x, res, norm, token_ids=None).sum().backward()
            outcome[case] = "no error"
        except ValueError as e:
            outcome[case] = str(e)
    layer, norm = ml.SemanticMoE(cfg, groups, mode="tp", seed=3, device=device), _norm(torch.float64, device)
    layer.router.weight.requires_grad_(rank == 0)
    model = torch.nn.ModuleDict({"moe": layer, "norm": norm})
    norm.weight.sequence_parallel = True
    layer.forward_tp(partials[rank], residual, norm, token_ids=None).sum().backward()
    outcome["partial grads"] = error_of(allreduce_partial_grads, model, groups.tp)
    layer.router.weight.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    x = partials[rank].clone().requires_grad_(True)
    y = layer.forward_tp(x, residual, norm, token_ids=None)
    y.sum().backward()
    allreduce_partial_grads(model, groups.tp)
    h = residual + sum(partials)
    ref = h + ml.reference.moe_forward(norm(h), *layer.export_full_weights(), cfg)
    outcome["next"] = "exact" if torch.allclose(y, ref, rtol=1e-10, atol=1e-12) else "wrong output"
    return outcome


def check_tp_backward_refusals(results: list) -> None:
    for out in results:
        for name in ("attn_partial", "residual"):
            assert (f"rank(s) [0] back-propagate into {name} and rank(s) [1] do not" in out[name]
                    or f"rank(s) [1] do not back-propagate into {name} and rank(s) [0] back-propagate into {name}"
                    in out[name]), out
        assert "rank(s) [1] compute in torch.float32 and rank(s) [0] compute in torch.float64" in out["dtype"], out
        assert "hold gradients of different sequence-parallel parameters" in out["partial grads"], out
        assert out["next"] == "exact", out


@pytest.mark.timeout(120)
def test_forward_tp_ranks_whose_backward_would_differ_raise_together():
    check_tp_backward_refusals(run_distributed(_tp_ranks_whose_backward_would_differ, 2, timeout=90))


def _tp_norm_fails_on_one_rank(rank, world):
    """The caller's norm raising, or returning another dtype, on rank 1 only: rank 1 raised, and rank 0
    waited in the layer's exchange forever. Now every rank raises and the next call is exact."""
    groups = ml.ParallelGroups.from_world(tp=world)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=torch.float64)
    norm = _norm(torch.float64)
    gen = torch.Generator().manual_seed(4)
    partials = [torch.randn(9, H, generator=gen, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(9, H, generator=gen, dtype=torch.float64)
    failing = {"raises": lambda h: 1 / 0, "float32": lambda h: norm(h).float()}
    outcome = {}
    # (with capacity and check_finite=False the other rank read no flags: it went on into the all-gather)
    for name, kw in (("eager", {}), ("capacity", dict(capacity=16, check_finite=False))):
        layer = ml.SemanticMoE(cfg, groups, mode="tp", seed=3, **kw)
        for kind, bad in failing.items():
            try:
                with torch.no_grad():
                    layer.forward_tp(partials[rank], residual, bad if rank == 1 else norm, token_ids=None)
                outcome[name, kind] = "no error"
            except (ZeroDivisionError, ValueError) as e:
                outcome[name, kind] = type(e).__name__
        with torch.no_grad():
            y = layer.forward_tp(partials[rank], residual, norm, token_ids=None)
        h = residual + sum(partials)
        ref = h + ml.reference.moe_forward(norm(h), *layer.export_full_weights(), cfg)
        outcome[name, "next"] = "exact" if torch.allclose(y, ref, rtol=1e-10, atol=1e-12) else "wrong output"
    return outcome


@pytest.mark.timeout(120)
def test_forward_tp_norm_failing_on_one_rank_raises_on_every_rank():
    out = run_distributed(_tp_norm_fails_on_one_rank, 2, timeout=60)
    for name in ("eager", "capacity"):
        assert {k: out[1][name, k] for k in ("raises", "float32", "next")} == \
            {"raises": "ZeroDivisionError", "float32": "ValueError", "next": "exact"}, out
        assert {k: out[0][name, k] for k in ("raises", "float32", "next")} == \
            {"raises": "ValueError", "float32": "ValueError", "next": "exact"}, out


def _tp_chunks_over_capacity(rank, world):
    """forward_tp with ``capacity`` and chunks larger than it: with check_finite=False only the rank
    whose chunk overflowed learned it (the others returned from the MoE into the all-gather and
    waited there). Every rank now raises before any collective, and the next call serves."""
    groups = ml.ParallelGroups.from_world(tp=world)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=torch.float64)
    norm = _norm(torch.float64)
    outcome = {}
    for verify in (True, False):
        layer = ml.SemanticMoE(cfg, groups, mode="tp", seed=3, capacity=3, check_finite=False,
                               verify_tp_inputs=verify)
        for t in (3 * world + 1, 3 * world):  # chunks of 4 rows (on some ranks), then exactly 3
            gen = torch.Generator().manual_seed(t)
            partials = [torch.randn(t, H, generator=gen, dtype=torch.float64) for _ in range(world)]
            residual = torch.randn(t, H, generator=gen, dtype=torch.float64)
            try:
                with torch.no_grad():
                    y = layer.forward_tp(partials[rank], residual, norm, token_ids=None)
            except ValueError as e:
                outcome[(verify, t)] = "raised" if "more than the layer's capacity of 3" in str(e) else str(e)
                continue
            h = residual + sum(partials)
            ref = h + ml.reference.moe_forward(norm(h), *layer.export_full_weights(), cfg)
            outcome[(verify, t)] = "exact" if torch.allclose(y, ref, rtol=1e-10, atol=1e-12) else "wrong output"
    return outcome


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_forward_tp_chunks_over_capacity_raise_on_every_rank(world):
    expected = {(v, t): ("raised" if t > 3 * world else "exact") for v in (True, False) for t in (3 * world + 1, 3 * world)}
    assert run_distributed(_tp_chunks_over_capacity, world, timeout=90) == [expected] * world


def _tp_training_grads(rank, world):
    """Attention-TP TinyDecoder with SemanticMoE(mode='tp') against the one-process model: the same
    loss, and every gradient equal to the reference's (this rank's heads of the attention; the
    router and norm2, used on one chunk per rank, after allreduce_partial_grads). The expert
    gradients used to come out world x too large (the output gather's backward summed the ranks'
    identical gradients) and the residual's were missing for other ranks' rows."""
    from moelayers.dispatch.comm import allreduce_partial_grads
    from moelayers.models.tiny import TinyConfig, TinyDecoder

    tc = TinyConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, dtype=torch.float64, init_std=0.2)
    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=2 * world, top_k=2,
                       params_dtype=torch.float64, init_std=0.3)
    groups = ml.ParallelGroups.from_world(tp=world)
    model = TinyDecoder(tc, lambda i: ml.SemanticMoE(cfg, groups, mode="tp", seed=i), attention="tp", groups=groups)
    ref = TinyDecoder(tc, lambda i: ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=i))
    for b, r in zip(model.blocks, ref.blocks):
        r.moe.load_full_weights(*b.moe.export_full_weights())
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, ref):
        loss = torch.nn.functional.cross_entropy(m(ids).reshape(-1, 32), target.reshape(-1))
        loss.backward()
        losses.append(loss.detach())
    allreduce_partial_grads(model, groups.tp)
    errs = [check_close("loss", losses[0], losses[1].double())]
    for name in ("embed.weight", "lm_head.weight", "norm.weight", "blocks.0.norm1.weight", "blocks.1.norm2.weight",
                 "blocks.0.norm2.weight", "blocks.1.moe.router.weight"):
        errs.append(check_close(name, model.get_parameter(name).grad, ref.get_parameter(name).grad))
    h, (lo, hi) = 16, (x * 16 // world for x in (rank, rank + 1))
    for i, (b, r) in enumerate(zip(model.blocks, ref.blocks)):
        g13, g2 = b.moe.expert_grads_full()
        errs.append(check_close(f"block {i} expert w13", g13, r.moe.experts.w13.grad))
        errs.append(check_close(f"block {i} expert w2", g2, r.moe.experts.w2.grad))
        qkv = torch.cat([r.attn.qkv.weight.grad[j * h + lo:j * h + hi] for j in range(3)])
        errs.append(check_close(f"block {i} qkv (this rank's heads)", b.attn.qkv.weight.grad, qkv))
        errs.append(check_close(f"block {i} attention out", b.attn.out.weight.grad, r.attn.out.weight.grad[:, lo:hi]))
    return [e for e in errs if e]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", (2, 4))
def test_attention_tp_training_gradients_match_the_reference(world):
    for rank, errors in enumerate(run_distributed(_tp_training_grads, world, timeout=90)):
        assert errors == [], f"rank {rank}: {errors}"


# ---------------------------------------------------------------------- recipes/serve.py
ROOT = Path(__file__).resolve().parents[2]


def _serve(run_dir: Path, *overrides: str) -> dict:
    cmd = [sys.executable, str(ROOT / "recipes" / "serve.py"), "parallel.world_size=2", "router=replay", "seed=0",
           "progress=false", "plot=false", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"serve failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads((run_dir / "results.json").read_text())


@pytest.mark.timeout(300)
def test_serve_semantic_beats_vanilla_round_robin(tmp_path):
    """Same requests (replayed trace, seed 0): Sem-MoE placement + scheduler vs linear + round robin.
    LAR and bytes are per-activation quantities, independent of batching, so the run is deterministic."""
    sem = _serve(tmp_path / "semantic", "layer=semantic", "scheduler=semantic")
    van = _serve(tmp_path / "vanilla", "layer=vanilla", "scheduler=round_robin")
    assert (sem["layer"], sem["scheduler"], van["scheduler"]) == ("semantic", "semantic", "round_robin")
    assert sem["output_tokens"] == van["output_tokens"] > 0
    assert sem["lar"] > van["lar"] + 0.02, (sem["lar"], van["lar"])
    assert sem["bytes_sent"] < van["bytes_sent"], (sem["bytes_sent"], van["bytes_sent"])
    # no request_offset: the plan's training sequences are served too, and the results say so
    n = sem["num_requests"]
    assert sem["in_sample_requests"] == n // 2 and van["in_sample_requests"] == 0
    assert any(f"{n // 2} of {n} requests replay sequences the semantic plan was trained on" in m for m in sem["notes"])


def _serve_cfg(*overrides: str) -> dict:
    from hydra import compose, initialize_config_dir

    from recipes._common import to_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_dict(compose("config", overrides=list(overrides)))


def test_serve_semantic_plan_sources_and_config_errors(tmp_path):
    from dataclasses import replace

    from recipes import _serve_workload, serve

    cfg = _serve_cfg("layer=semantic", "scheduler=semantic", "router=replay", "workload.num_requests=8")
    built = serve.semantic_plan(cfg, 2)  # no file: planned (dp) on the replay trace's first half
    assert built.mode == "dp" and built.num_ranks == 2 and serve.semantic_plan(cfg, 2) is built
    path = tmp_path / "plan.npz"
    built.save(path)
    for sched in ("semantic", {"name": "semantic", "plan_path": str(path)}):
        layer_path = None if isinstance(sched, dict) else str(path)
        c = dict(cfg, scheduler=sched, layer=dict(cfg["layer"], plan_path=layer_path))
        serve.check_config(c)
        loaded = serve.semantic_plan(c, 2)
        assert (loaded.expert_rank == built.expert_rank).all() and (loaded.token_rank == built.token_rank).all()
        trace = serve.load_replay_trace(c)
        requests = serve.make_requests(c, 512, trace)
        owners = serve.get_scheduler(c["scheduler"])(requests, 2, c)
        assert sorted(owners) == [0] * 4 + [1] * 4  # balanced: every 2 requests take both ranks
        # a plan file: the sequences it records (planned on sequences 0-3 of 8), by content
        assert serve.in_sample_requests(c, requests, trace, True, 2) == 4
        cached = [k for k in _serve_workload._PLANS if k[0] == str(path)]
        for key in cached:  # a file written before plans recorded them: unknown
            _serve_workload._PLANS[key] = replace(_serve_workload._PLANS[key], train_sequences=None)
        assert cached and serve.in_sample_requests(c, requests, trace, True, 2) is None
        for key in cached:
            del _serve_workload._PLANS[key]
    trace = serve.load_replay_trace(cfg)
    requests = serve.make_requests(cfg, 512, trace)
    assert serve.in_sample_requests(cfg, requests, trace, True) == 4  # planned on sequences 0-3 of 8
    late = dict(cfg, trace=dict(cfg["trace"], request_offset=4, num_sequences=12))
    assert serve.in_sample_requests(late, serve.make_requests(late, 512, trace), trace, True) == 0
    with pytest.raises(ValueError, match="plan"):
        serve.check_config(_serve_cfg("scheduler=semantic", "router=learned"))
    with pytest.raises(ValueError, match="mode=dp"):
        serve.check_config(_serve_cfg("layer=semantic", "router=replay", "layer.kwargs.mode=tp"))
    with pytest.raises(FileNotFoundError):
        serve.check_config(dict(cfg, layer=dict(cfg["layer"], plan_path=str(tmp_path / "missing.npz"))))
    with pytest.raises(ValueError, match="name"):
        serve.get_scheduler({"plan_path": str(path)})


def _scheduled_requests_case(rank, world, joint):
    """Attention-DP serving: 12 requests of uneven length scheduled over the ranks by the semantic
    scheduler (one by one, or a batch's mask cycles jointly); each rank runs its own requests
    through SemanticMoE(mode='dp') in one forward (some ranks hold more tokens than others)."""
    from moelayers.schedule import SemanticScheduler

    e = 4 * world
    plan = make_plan(e, world, seed=11, mode="dp")
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=torch.float64)
    layer = ml.SemanticMoE.from_plan(plan, 1, cfg, ml.ParallelGroups.from_world(), seed=3)
    w64 = weights64(e, seed=21)
    layer.load_full_weights(*w64)
    g = torch.Generator().manual_seed(7)  # the same requests on every rank
    reqs = [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(1, 12, (12,), generator=g)]
    xs = [torch.randn(q.numel(), H, generator=g, dtype=torch.float64) for q in reqs]
    sched = SemanticScheduler(plan, layer=1, total_tokens=sum(q.numel() for q in reqs))
    owner = sched.assign_batch(reqs) if joint else [sched.assign(q) for q in reqs]
    mine = [i for i, o in enumerate(owner) if o == rank]
    x = torch.cat([xs[i] for i in mine]) if mine else torch.zeros(0, H, dtype=torch.float64)
    ids = torch.cat([reqs[i] for i in mine]) if mine else torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        y = layer(x, token_ids=ids)
    ref = ml.reference.moe_forward(x, *w64, cfg)
    return owner, check_close(f"rank {rank} requests {mine}", y, ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("joint", (False, True))
@pytest.mark.parametrize("world", (2, 4))
def test_scheduled_requests_match_reference(world, joint):
    results = run_distributed(_scheduled_requests_case, world, joint, timeout=90)
    owners = [owner for owner, _ in results]
    assert all(o == owners[0] for o in owners)  # every rank schedules alike
    assert sorted(set(owners[0])) == list(range(world))
    assert [err for _, err in results if err] == []


def _tp_mode_with_other_ep_ranks(rank, world):
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    eps = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # megatron-style: EP strided over the TP groups
    groups = ml.ParallelGroups.from_groups(ep=eps[rank % 2], tp=tps[rank // 2])
    try:
        ml.SemanticMoE(ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2), groups, mode="tp")
        return "accepted"
    except ValueError as e:
        return str(e)


@pytest.mark.timeout(120)
def test_tp_mode_needs_the_same_ranks_in_tp_and_ep():
    """tp = ep was checked by size and rank: ranks 0 and 3 accepted TP [0, 1] with EP [0, 2] (and then
    waited in the first collective) while ranks 1 and 2 refused with 'got tp=2, ep=2'."""
    for rank, msg in enumerate(run_distributed(_tp_mode_with_other_ep_ranks, 4, timeout=100)):
        assert "the same ranks" in msg and f"tp=2 ranks [{rank // 2 * 2}, {rank // 2 * 2 + 1}]" in msg, (rank, msg)


def test_tp_layer_with_a_dp_plan_warns_and_names_the_predictor_that_runs():
    """A ``mode='dp'`` plan has no per-layer rank predictor: in tp mode Algorithm 3 runs on its tables,
    which ``predictor`` says (it said 'combined'), and the layer warns that the plan was made for dp."""
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2, params_dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"got a plan made for mode='dp'.*make the plan with recipes/plan.py mode=tp"):
        layer = ml.SemanticMoE.from_plan(make_plan(4, 1, mode="dp"), 1, cfg, ml.ParallelGroups.single(), mode="tp")
    assert layer.predictor == "alg3"
    assert ml.SemanticMoE.from_plan(make_plan(4, 1, mode="dp"), 1, cfg, ml.ParallelGroups.single()).mode == "dp"
