"""The dense single-process reference every layer must reproduce.

It shares no code with the layers: routing scores, the top-k, forced-routing weights and the
SwiGLU expert are written out here, so that a bug in the layers' versions cannot agree with itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moelayers.config import MoEConfig
from moelayers.router import autocast_on


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``silu(x W1^T) * (x W3^T) W2^T``.

    Args:
        x: ``[N, H]``; w13: ``[2F, H]`` (gate rows ``W1 = w13[:F]`` first, then up ``W3 = w13[F:]``);
            w2: ``[H, F]``.

    Returns:
        ``[N, H]``.
    """
    f = w2.shape[1]
    w1, w3 = w13[:f], w13[f:]
    return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()


def _routing(logits: torch.Tensor, config: MoEConfig, topk_ids: torch.Tensor | None):
    """``(ids [T, K], weights [T, K])``: scores in float32 (or float64), top-k unless forced, renormalised
    if asked. megatron's ranking: with ``rank_post_softmax_by_logits`` a softmax renormalised over the
    top-k ranks the logits themselves; with ``rank_in_logits_dtype`` the other scores are rounded to the
    logits' dtype before the top-k."""
    work = torch.promote_types(logits.dtype, torch.float32)
    scores = torch.softmax(logits.to(work), dim=-1) if config.score_fn == "softmax" else torch.sigmoid(logits.to(work))
    ranked = scores
    post_softmax = config.score_fn == "softmax" and config.norm_topk_prob
    if post_softmax and config.rank_post_softmax_by_logits:
        ranked = logits
    elif not post_softmax and config.rank_in_logits_dtype:
        ranked = scores.to(logits.dtype)
        scores = ranked.to(work)
    if topk_ids is None:
        _, ids = torch.topk(ranked, config.top_k, dim=-1)
    else:
        ids = topk_ids
    weights = scores.gather(1, ids)
    if config.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights


def _check_inputs(x, router_weight, w13, w2, config: MoEConfig, topk_ids) -> None:
    """The reference's inputs against ``config``, as the layers check theirs."""
    e, h, f = config.num_experts, config.hidden_size, config.ffn_hidden_size
    for name, t in (("x", x), ("router_weight", router_weight), ("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != h:
        raise ValueError(f"x must be [T, {h}], [S, B, {h}] or [B, S, {h}], got {list(x.shape)}")
    for name, t, want in (("router_weight", router_weight, (e, h)), ("w13", w13, (e, 2 * f, h)), ("w2", w2, (e, h, f))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {list(want)} for this config (E={e}, H={h}, F={f}), got {list(t.shape)}")
    if topk_ids is not None and (not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype == torch.bool
                                 or topk_ids.is_floating_point() or topk_ids.is_complex()):
        raise TypeError(f"topk_ids must be an integer tensor, got "
                        f"{topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__}")


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
        x: ``[T, H]``, ``[S, B, H]`` or ``[B, S, H]``.
        router_weight: ``[E, H]``; w13: ``[E, 2F, H]``; w2: ``[E, H, F]`` (logical order).
        config: routing configuration.
        topk_ids: optional forced ``[T, K]`` expert choice (as in trace replay), or laid out like
            ``x`` (``[S, B, K]`` for ``[S, B, H]`` hidden states).

    Returns:
        Same shape as ``x``.

    Raises:
        TypeError: ``x`` or a weight is not a tensor, or ``topk_ids`` is not an integer tensor
            (float ids were truncated to other experts).
        ValueError: ``x`` or a weight is not shaped by ``config`` (``H``, ``F``, ``E``: another
            model's weights computed another MoE), ``topk_ids`` is not laid out like ``x`` with
            ``K = config.top_k`` columns, or holds ids outside ``[0, E)``.
    """
    _check_inputs(x, router_weight, w13, w2, config, topk_ids)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    dtype = config.logits_dtype(x.dtype)
    with torch.autocast(x.device.type, enabled=False) if autocast_on(x) else contextlib.nullcontext():
        logits = x2.to(dtype) @ router_weight.to(dtype).t()  # in the dtype promised, as the router
    forced = None
    if topk_ids is not None:
        k = config.top_k
        if tuple(topk_ids.shape) not in ((x2.shape[0], k), (*shape[:-1], k)):
            raise ValueError(f"topk_ids must be [{x2.shape[0]}, {k}] (or {[*shape[:-1], k]}) for x of shape "
                             f"{list(shape)}, got {list(topk_ids.shape)}")
        forced = topk_ids.reshape(x2.shape[0], k).to(torch.int64)
        if forced.numel() and (forced.min() < 0 or forced.max() >= config.num_experts):
            raise ValueError(f"topk_ids must be in [0, {config.num_experts}), got ids in "
                             f"[{int(forced.min())}, {int(forced.max())}]")
    if x2.shape[0] == 0:  # no token: an empty output on the graph all the same (zero gradients), as the layers'
        tied = (logits.sum() + w13.sum() + w2.sum()).to(x.dtype)
        return (x2 + 0 * tied).view(shape)
    ids, weights = _routing(logits, config, forced)
    weights = weights.to(x.dtype)
    y = torch.zeros_like(x2)
    for e in range(config.num_experts):
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        out = swiglu_expert(x2[tok], w13[e].to(x.dtype), w2[e].to(x.dtype))
        y = y.index_add(0, tok, out * weights[tok, k, None])
    return y.view(shape)
