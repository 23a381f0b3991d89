"""SemanticMoE attention-TP with a fitted plan on gloo at world sizes 2 and 4: the tiny decoder's
output equals the dense reference, every layer's online token→rank assignment equals the held-out
evaluation's (``assign_tp`` on the true routing of the earlier layers) for each predictor
(``combined``: the history predictor, ``token``, ``alg3``), and the expert history each layer
gathers for the combined predictor is the routing itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moelayers as ml
from moelayers.testing import check_close, run_distributed

H, F, V, L, DEPTH = 32, 16, 64, 4, 3


def _plan(world: int):
    from moelayers.planning.semantic_solvers import plan_semantic
    from moelayers.trace import synthetic_trace

    trace = synthetic_trace(60, L, 4 * world, 2, V, seq_len=(4, 24), seed=2)
    return plan_semantic(trace, world, "tp", progress=False, history=DEPTH)


def run_history_case(rank: int, world: int, predictor: str = "combined") -> tuple[list[str], list[np.ndarray]]:
    """``(errors, [last_ranks of every layer])`` of one rank."""
    from moelayers.models import TinyConfig, TinyDecoder
    from moelayers.planning.semantic_eval import assign_tp, balanced_assign
    from moelayers.trace import RoutingTrace

    plan, groups = _plan(world), ml.ParallelGroups.from_world(tp=world)
    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4 * world, top_k=2, params_dtype=torch.float64,
                       init_std=0.2)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=L, num_heads=4, dtype=torch.float64, init_std=0.2)
    tp = TinyDecoder(cfg, lambda i: ml.SemanticMoE.from_plan(plan, i, moe, groups, mode="tp", seed=10 + i,
                                                             predictor=predictor),
                     attention="tp", groups=groups, seed=2)
    ref = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=10 + i), seed=2)
    for mine, theirs in zip(tp.moe_layers, ref.moe_layers):
        mine.load_full_weights(*theirs.export_full_weights())
    ids = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(1))  # 21 tokens: a partial chunk
    with torch.no_grad():
        errs = [check_close("tiny tp forward", tp(ids), ref(ids))]
    flat, t = ids.reshape(-1).numpy(), ids.numel()
    cap = np.array([[t // world + (q < t % world) for q in range(world)]])
    topk = [m.last_topk_ids.numpy() for m in ref.moe_layers]  # every token's routing (dense reference)
    held = RoutingTrace(np.stack(topk, 1), flat, np.array([0, t]), moe.num_experts, vocab_size=V)
    offline = assign_tp(plan, held, 4 * world * (-(-t // (4 * world))), predictor=predictor)  # one partial batch
    for layer, m in enumerate(tp.moe_layers):
        if predictor == "combined":  # spelled out once: the fitted scores on the earlier layers' routing
            prev = np.stack([topk[layer - d] for d in range(1, min(DEPTH, layer) + 1)], 1) if layer else None
            want = balanced_assign(plan.rank_scores(layer, flat, prev), cap)
            assert np.array_equal(want, offline[:, layer])
        if not np.array_equal(m.last_ranks.numpy(), offline[:, layer]):
            errs.append(f"{predictor} layer {layer}: online ranks {m.last_ranks.tolist()} != offline "
                        f"{offline[:, layer].tolist()}")
        context = m.last_context_ranks
        if predictor == "combined" and layer < L - 1 and (context is None
                                                          or not np.array_equal(context[0].numpy(), topk[layer])):
            errs.append(f"layer {layer}: the gathered expert history is not the routing")
    return [e for e in errs if e], [m.last_ranks.numpy() for m in tp.moe_layers]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("predictor", ("combined", "token", "alg3"))
def test_history_predictor_online_equals_offline(world, predictor):
    results = run_distributed(run_history_case, world, predictor)
    failures = [f"rank {r}: {e}" for r, (errs, _) in enumerate(results) for e in errs]
    assert not failures, "\n".join(failures)
    for r, (_, ranks) in enumerate(results[1:], 1):
        assert all((a == b).all() for a, b in zip(ranks, results[0][1])), f"rank {r} assigned differently"


def _context_and_id_checks(rank: int, world: int) -> dict[str, str]:
    """forward_tp on 2 ranks: an expert history with an id outside [0, E) on rank 1 (used to escape
    the refusal handling as an IndexError and leave rank 0 waiting in the agreement), histories
    that differ between the ranks (used to give wrong outputs silently), uint64 token ids (used to
    crash in index_select), a numpy integer layer index, and a batch of 0 tokens (its output used to
    leave the autograd graph)."""
    plan, groups = _plan(world), ml.ParallelGroups.from_world(tp=world)
    e = 4 * world
    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=e, top_k=2, params_dtype=torch.float64)
    layer = ml.SemanticMoE.from_plan(plan, np.int64(2), moe, groups, mode="tp", seed=3)
    norm = lambda x: x  # noqa: E731
    g = torch.Generator().manual_seed(0)
    partials = [torch.randn(9, H, generator=g, dtype=torch.float64) for _ in range(world)]
    residual = torch.randn(9, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (9,), generator=g)
    hist = torch.randint(0, e, (2, 9, 2), generator=g)
    out = {}
    with torch.no_grad():
        want = layer.forward_tp(partials[rank], residual, norm, token_ids=ids, prev_ranks=(None, hist))
    for kind in ("history id >= E", "negative history id", "other histories", "pair swapped", "alone vs pair"):
        bad = hist.clone()
        ctx = (None, bad)
        if rank == 1:
            if kind == "other histories":
                bad[0, 0, 0] = (bad[0, 0, 0] + 1) % e
            elif kind == "pair swapped":  # (h, None): the same tensor in the other place
                ctx = (bad, None)
            elif kind == "alone vs pair":
                ctx = bad
            else:
                bad[0, 0, 0] = e if kind == "history id >= E" else -1
        try:
            with torch.no_grad():
                layer.forward_tp(partials[rank], residual, norm, token_ids=ids, prev_ranks=ctx)
            out[kind] = "no error"
        except ValueError as exc:
            msg = str(exc)
            if kind in ("other histories", "pair swapped", "alone vs pair"):
                ok = "different prev_ranks" in msg
            else:
                ok = ("outside [0, " in msg) if rank == 1 else ("refused the input of TP rank(s) [1]" in msg)
            out[kind] = "raised" if ok else f"wrong error: {msg}"
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        with torch.no_grad():
            got = layer.forward_tp(partials[rank], residual, norm, token_ids=ids.to(dtype), prev_ranks=(None, hist))
        out["uint64 ids"] = out.get("uint64 ids", "same") if torch.equal(got, want) else f"{dtype} differs"
    with torch.no_grad():  # an unsigned history on one rank (min/max have no uint16 kernel: used to escape the agreement)
        small = hist.to(torch.uint16) if rank == 1 else hist
        got = layer.forward_tp(partials[rank], residual, norm, token_ids=ids, prev_ranks=(None, small))
    out["uint16 history"] = "same" if torch.equal(got, want) else "differs"
    x0 = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    y0 = layer.forward_tp(x0, torch.zeros(0, H, dtype=torch.float64), norm, token_ids=ids[:0],
                          prev_ranks=(None, hist[:, :0]))
    out["0 tokens"] = "in the graph" if y0.requires_grad else "detached"
    y0.sum().backward()
    return out


@pytest.mark.timeout(120)
def test_forward_tp_checks_the_context_and_takes_any_integer_ids():
    want = {"history id >= E": "raised", "negative history id": "raised", "other histories": "raised",
            "pair swapped": "raised", "alone vs pair": "raised", "uint64 ids": "same", "uint16 history": "same",
            "0 tokens": "in the graph"}
    assert run_distributed(_context_and_id_checks, 2, timeout=90) == [want, want]


def test_trace_recorder_refuses_attention_tp_layers():
    """TraceRecorder records forward() calls; attention-TP layers run forward_tp on shuffled chunks."""
    from moelayers.models import TinyConfig, TinyDecoder
    from moelayers.trace import TraceRecorder

    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=4, top_k=2)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4)
    single = ml.ParallelGroups.single()
    model = TinyDecoder(cfg, lambda i: ml.SemanticMoE(moe, single, mode="tp"), attention="tp", groups=single)
    with pytest.raises(ValueError, match="cannot record attention-TP layers.*mode='dp'"):
        with TraceRecorder(model):
            pass


def test_expert_history_must_hold_integer_ids():
    from moelayers.layers.semantic import _history_of

    with pytest.raises(TypeError, match="integer expert ids"):
        _history_of(torch.zeros(1, 3, 2), torch.zeros(3), num_experts=4)


def test_expert_history_as_numpy_is_read_and_ranks_are_refused():
    """A history passed as a numpy array was ignored (the prediction ran without it, as for None);
    ranks (Algorithm 3's context) given to a history-predictor layer were ignored likewise."""
    import numpy as np

    from moelayers.layers.semantic import _history_of

    hist = torch.randint(0, 4, (2, 3, 2), generator=torch.Generator().manual_seed(0))
    for given in (hist.numpy(), (None, hist.numpy()), (None, hist.tolist())):  # (a bare list of 2 is a pair)
        assert torch.equal(_history_of(given, torch.zeros(3), num_experts=4), hist)
    for ranks in (np.zeros((2, 3), np.int64), torch.zeros(2, 3, dtype=torch.int64), (None, torch.zeros(3)),
                  (torch.zeros(3), torch.zeros(3))):
        with pytest.raises(ValueError, match="predicts ranks from the experts chosen at earlier layers"):
            _history_of(ranks, torch.zeros(3), num_experts=4)
    assert _history_of((torch.zeros(3), torch.zeros(3)), torch.zeros(3)) is None  # (gathering the context)
    assert _history_of(None, torch.zeros(3), num_experts=4) is None and _history_of((None, None), None) is None


def test_schedulers_take_numpy_integers_and_refuse_bool_ratios():
    import numpy as np

    from moelayers.schedule import SemanticScheduler, rebatch

    rb = rebatch(torch.tensor([0, 1, 1]), torch.ones(3), np.int64(2))  # was "must be a positive int, got 2"
    assert rb.num_ranks == 2 and isinstance(rb.num_ranks, int)
    from tests.distributed.test_semantic import make_plan

    plan = make_plan(4, 2, mode="dp")
    for bad in (True, "2", 0.5):  # True was taken as 1; "2" failed with Python's bare comparison TypeError
        with pytest.raises(ValueError, match="max_ratio must be a number >= 1"):
            SemanticScheduler(plan, total_tokens=10, max_ratio=bad)
