"""The dense single-process reference every layer must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moelayers.config import MoEConfig
from moelayers.router import forced_topk_weights, scores_to_topk


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``silu(x W1^T) * (x W3^T) W2^T``.

    Args:
        x: ``[N, H]``; w13: ``[2F, H]`` (gate rows first, then up); w2: ``[H, F]``.

    Returns:
        ``[N, H]``.
    """
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t()


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: MoEConfig,
    *,
    topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense MoE forward: ``y = sum_k w_k * expert_{id_k}(x)``, computed in ``x.dtype``.

    Args:
        x: ``[T, H]`` or ``[S, B, H]``.
        router_weight: ``[E, H]``; w13: ``[E, 2F, H]``; w2: ``[E, H, F]`` (logical order).
        config: routing configuration.
        topk_ids: optional forced ``[T, K]`` expert choice (as in trace replay).

    Returns:
        Same shape as ``x``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    logits = x2 @ router_weight.to(x.dtype).t()
    if topk_ids is None:
        ids, weights = scores_to_topk(logits, config)
    else:
        ids = topk_ids.reshape(x2.shape[0], -1).to(torch.int64)
        weights = forced_topk_weights(logits, ids, config)
    weights = weights.to(x.dtype)
    y = torch.zeros_like(x2)
    for e in range(config.num_experts):
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out = swiglu_expert(x2[tok], w13[e].to(x.dtype), w2[e].to(x.dtype))
        y = y.index_add(0, tok, out * weights[tok, k, None])
    return y.view(shape)
