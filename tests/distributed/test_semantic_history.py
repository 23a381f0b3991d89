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
