"""`TopKRouter`: logits -> top-k logical experts and their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelayers._dtypes import to_dtype
from moelayers.config import MoEConfig
from moelayers.dispatch.flags import FORCED_OUT_OF_RANGE, raise_if_flagged


def scores_to_topk(logits: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Score router logits and select the top-k experts.

    Scoring runs in float32 (float64 for float64 logits) so that near-ties are broken the same way
    whatever the batch, unless ``config.rank_in_logits_dtype`` / ``rank_post_softmax_by_logits`` ask
    for megatron's ranking (see :class:`~moelayers.config.MoEConfig`); weights are returned in
    float32/float64 and cast by the caller.

    Args:
        logits: ``[T, E]`` router logits.
        config: gives ``top_k``, ``score_fn``, ``norm_topk_prob`` and the ranking flags.

    Returns:
        ``(topk_ids [T, K] int64, topk_weights [T, K] float)``.
    """
    work = torch.promote_types(logits.dtype, torch.float32)
    if config.rank_post_softmax_by_logits and _post_softmax(config):
        top, ids = torch.topk(logits, config.top_k, dim=-1)  # megatron: top-k of the logits, softmax over them
        return ids, torch.softmax(top.to(work), dim=-1)
    weights, ids = torch.topk(_scores(logits, config), config.top_k, dim=-1)
    return ids, _normalised(to_dtype(weights, work), config)


def forced_topk_weights(logits: torch.Tensor, topk_ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """Weights for externally chosen experts (trace replay): the scores of ``topk_ids`` under
    this router, normalised as the config says. ``[T, E], [T, K] -> [T, K]``."""
    work = torch.promote_types(logits.dtype, torch.float32)
    weights = torch.gather(_scores(logits, config), 1, topk_ids.long())  # any integer ids (a trace may store int16)
    return _normalised(weights.to(work), config)


def _any_nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """0-dim bool: whether ``logits`` holds a NaN or an inf, in three kernels (``isfinite().all()``
    takes six on CUDA, and the router is on the host-bound path): ``x * 0`` is 0 for every finite
    ``x`` and NaN for NaN and ±inf, so the sum is NaN exactly when some entry is not finite."""
    if logits.requires_grad:  # (nothing to record; without autograd, detach would be one more call)
        logits = logits.detach()
    return torch.isnan(logits.mul(0).sum())


def _post_softmax(config: MoEConfig) -> bool:
    """Softmax renormalised over the top-k: megatron's softmax after the top-k (``pre_softmax=False``)."""
    return config.score_fn == "softmax" and config.norm_topk_prob


def _scores(logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """``[T, E]`` softmax or sigmoid scores in float32/float64; with ``config.rank_in_logits_dtype``
    rounded to the logits' dtype (megatron-core 0.16's ``.type_as(logits)``), except for softmax after
    the top-k, whose weights megatron computes in float32 from the selected logits."""
    scores = to_dtype(logits, torch.promote_types(logits.dtype, torch.float32))
    scores = torch.softmax(scores, dim=-1) if config.score_fn == "softmax" else torch.sigmoid(scores)
    return scores.to(logits.dtype) if config.rank_in_logits_dtype and not _post_softmax(config) else scores


def _normalised(weights: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if config.norm_topk_prob:
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights


def autocast_on(x: torch.Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``x``'s device. The router then computes without it: autocast
    would round the logits to its own dtype (bf16) whatever ``MoEConfig.router_dtype`` says, and
    near-ties would pick other experts than the logits of the promised dtype."""
    kind = x.device.type
    available = _AUTOCAST_AVAILABLE.get(kind)
    if available is None:
        available = _AUTOCAST_AVAILABLE[kind] = torch.amp.is_autocast_available(kind)
    return available and torch.is_autocast_enabled(kind)


_AUTOCAST_AVAILABLE: dict[str, bool] = {}  # device type -> whether autocast exists for it (a fixed fact)


class TopKRouter(nn.Module):
    """Linear gate ``[E, H]`` (no bias) followed by :func:`scores_to_topk`.

    Built on its own, the gate starts at ``N(0, config.init_std)`` from a generator seeded with
    ``seed`` (torch's global generator is left alone); the layers draw their own weights.

    Args:
        config: the MoE block.
        check_finite: raise ``ValueError`` on NaN/inf logits. Standalone this costs a device sync;
            inside a layer (``defer_check=True``) the flag is left in ``last_flags`` and the
            dispatcher reads it with its split sizes, at no extra sync. Forced expert ids outside
            ``[0, E)`` are flagged the same way whatever ``check_finite`` says (they are clamped
            into range so that the exchange completes, then every rank raises).
        device: where the gate lives (``None``: torch's default device; ``'meta'``: no storage).
        seed: seed of the gate's generator (see above).
        init: draw the gate now; ``False`` leaves it uninitialised (the layers draw it).
    """

    def __init__(self, config: MoEConfig, *, device: torch.device | str | None = None, check_finite: bool = True,
                 seed: int = 0, init: bool = True):
        super().__init__()
        self.config = config
        self.check_finite = check_finite
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        if init:
            self._init_weight(seed)

    @torch.no_grad()
    def _init_weight(self, seed: int) -> None:
        """``weight ~ N(0, config.init_std)`` from a generator seeded with ``seed`` (not on meta).
        Not ``reset_parameters``: deferred-init tools call that on every submodule, and inside a
        layer the layer's own ``reset_parameters`` decides the router's weights."""
        if self.weight.device.type != "meta":
            gen = torch.Generator(device=self.weight.device).manual_seed(seed)
            self.weight.normal_(0.0, self.config.init_std, generator=gen)

    def forward(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None, *, defer_check: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: ``[T, H]`` hidden states.
            forced_ids: optional ``[T, K]`` expert ids to use instead of the top-k (replay).
            defer_check: store the flag (``moelayers.dispatch.flags.NONFINITE_LOGITS`` |
                ``FORCED_OUT_OF_RANGE``, a 0-dim bool or int32 device tensor, or ``None`` when
                nothing was checked) in ``last_flags`` instead of raising now.

        Returns:
            ``(topk_ids [T, K] int64, topk_weights [T, K] in x.dtype)``.

        Raises:
            TypeError: ``forced_ids`` is not an integer tensor (a float id would be truncated).
            ValueError: ``forced_ids`` is not ``[T, K]``; without ``defer_check``, NaN/inf logits
                (``check_finite``) or forced ids outside ``[0, E)``.
        """
        if forced_ids is not None and (forced_ids.is_floating_point() or forced_ids.is_complex()
                                       or forced_ids.dtype == torch.bool):
            raise TypeError(f"forced_ids must be integer expert ids, got {forced_ids.dtype}")
        if forced_ids is not None and tuple(forced_ids.shape) != (x.shape[0], self.config.top_k):
            raise ValueError(f"forced_ids must be [T, K] = [{x.shape[0]}, {self.config.top_k}], "
                             f"got {list(forced_ids.shape)}")
        if autocast_on(x):  # the logits in the dtype promised (router_dtype, else x's), not autocast's
            with torch.autocast(x.device.type, enabled=False):
                return self.forward(x, forced_ids, defer_check=defer_check)
        if self.config.router_dtype is None:  # the default: no extra calls on the latency path
            logits = F.linear(x, self.weight)  # (x @ weight.t(): the same matmul, one call fewer)
        else:
            dtype = self.config.logits_dtype(x.dtype)
            logits = x.to(dtype) @ self.weight.to(dtype).t()
        flag = _any_nonfinite(logits) if self.check_finite else None  # a bool: NONFINITE_LOGITS when set
        if forced_ids is None:
            ids, weights = scores_to_topk(logits, self.config)
        else:
            ids = forced_ids.to(torch.int64)  # a trace may store int16 / uint8 ids (uint8 would index as a mask)
            bad = ((ids < 0) | (ids >= self.config.num_experts)).any().to(torch.int32) * FORCED_OUT_OF_RANGE
            flag = bad if flag is None else bad | flag.to(torch.int32)
            ids = ids.clamp(0, self.config.num_experts - 1)
            weights = forced_topk_weights(logits, ids, self.config)
        # a plain value (no parameter, buffer or submodule): set without nn.Module.__setattr__'s checks for them
        object.__setattr__(self, "last_flags", flag if defer_check else None)
        if not defer_check and flag is not None:
            raise_if_flagged([int(flag)])
        return ids, to_dtype(weights, x.dtype)
