"""`TinyDecoder`: a small decoder-only transformer with an MoE slot per block, for recipes and tests.

::

    input_ids -> embedding -> N x [ h += attn(norm(h))   (causal, RoPE, per-request KV cache)
                                    h += moe(norm(h))    (any moelayers layer, token_ids passed) ]
              -> norm -> lm_head -> logits

Attention is data-parallel by default (``attention='dp'``): every rank builds the same attention
weights (seeded generator, independent of the rank) and keeps only the KV caches of its own
requests. The MoE slot is expert-parallel: all ranks call it collectively every step, possibly with
zero tokens. With ``attention='tp'`` the attention heads are split over the TP ranks (every TP rank
runs the same requests with its heads and their KV caches) and each block's MoE slot finishes the
partial attention output itself: ``h = moe.forward_tp(attn_partial, h, norm2, token_ids=...)``
(e.g. ``SemanticMoE(mode='tp')``, which also gets its two predecessors' n-gram
context ranks as ``prev_ranks``).

Continuous batching goes through :meth:`TinyDecoder.step`: a step mixes prefill chunks and single
decode tokens of several requests; attention runs per request on its own cache, the MoE layers
get all tokens of the step in one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NoReturn
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moelayers.dispatch.comm import copy_to_group
from moelayers.layers.base import MoELayerBase

__all__ = ["TinyConfig", "TinyDecoder", "KVCache", "RMSNorm", "CausalSelfAttention", "StepRequest"]


@dataclass
class TinyConfig:
    """Shape of the tiny decoder (the MoE blocks are configured by the factory).

    Args:
        vocab_size: vocabulary ``V``.
        hidden_size: model width ``H``.
        num_layers: transformer blocks ``N`` (one MoE slot each).
        num_heads: attention heads (must divide ``hidden_size``; head size must be even for RoPE).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        init_std: std of the normal init of embedding, projections and LM head.
        dtype: parameter and activation dtype (must match the MoE layers' ``params_dtype``).
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TinyConfig.{name} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head size (hidden_size / num_heads) must be even for RoPE")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"TinyConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")
        for name, low, strict in (("rope_theta", 0.0, True), ("norm_eps", 0.0, False), ("init_std", 0.0, False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < low or (strict and v == low):
                raise ValueError(f"TinyConfig.{name} must be a finite number {'>' if strict else '>='} {low:g}, got {v!r}")


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension (computed in float32 or better)."""

    def __init__(self, size: int, eps: float = 1e-6, *, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., H]``."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


@dataclass
class KVCache:
    """Keys and values of one request at one layer: ``k, v [num_heads, P, head_dim]``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        """``P``: positions cached so far."""
        return int(self.k.shape[1])

    def extended(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """A new cache with ``[nh, n, hd]`` keys/values appended (this one is left as it is, so a
        step that fails part-way leaves every request's caches as they were)."""
        return KVCache(torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1))


def _tp_heads(cfg: TinyConfig, attention: str, groups) -> tuple[int, int] | None:
    """This rank's ``[lo, hi)`` heads under ``attention='tp'`` (``None`` for ``'dp'``)."""
    if attention not in ("dp", "tp"):
        raise ValueError(f"attention must be 'dp' or 'tp', got {attention!r}")
    if attention == "dp":
        return None
    if groups is None:
        raise ValueError("attention='tp' needs groups (a ParallelGroups with the TP group)")
    p, r = groups.tp_size, groups.tp_rank
    if cfg.num_heads % p:
        raise ValueError(f"attention='tp' over {p} ranks needs num_heads ({cfg.num_heads}) divisible by {p}")
    per = cfg.num_heads // p
    return r * per, (r + 1) * per


def _checked_slot(cfg: TinyConfig, index: int, moe: Any, attention: str) -> nn.Module:
    """Block ``index``'s MoE slot from the factory, refused at construction where it cannot serve:
    not a module, a layer config of another dtype or width, or no attention-TP path under ``'tp'``."""
    if not isinstance(moe, nn.Module):
        raise TypeError(f"moe_factory({index}) returned {type(moe).__name__}, not an nn.Module")
    mcfg = getattr(moe, "config", None)
    if mcfg is not None and hasattr(mcfg, "params_dtype") and hasattr(mcfg, "hidden_size"):
        if mcfg.hidden_size != cfg.hidden_size:
            raise ValueError(f"moe_factory({index}): the MoE layer's hidden_size {mcfg.hidden_size} is not the "
                             f"model's {cfg.hidden_size}")
        if mcfg.params_dtype != cfg.dtype:
            raise ValueError(f"moe_factory({index}): the MoE layer computes in {mcfg.params_dtype}, the model in "
                             f"{cfg.dtype} (TinyConfig.dtype must match params_dtype)")
    if attention == "tp" and (not hasattr(moe, "forward_tp") or getattr(moe, "mode", "tp") != "tp"):
        raise ValueError(f"attention='tp' needs MoE slots with forward_tp (e.g. SemanticMoE(mode='tp')); "
                         f"block {index} holds {type(moe).__name__}"
                         + (f"(mode={moe.mode!r})" if hasattr(moe, "mode") else ""))
    if isinstance(moe, MoELayerBase) and moe.layer_number is None:
        moe.layer_number = index  # the ranks tell the blocks' layers apart in every exchange
    return moe


def _step_request(index: int, item: Any) -> "StepRequest":
    """A batch item of :meth:`TinyDecoder.step` as a ``StepRequest`` (a clear error where it is none)."""
    if isinstance(item, StepRequest):
        req = item
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        req = StepRequest(item[0], item[1])
    else:
        shape = f" of shape {list(item.shape)}" if isinstance(item, torch.Tensor) else ""
        raise TypeError(f"batch item {index}: expected a StepRequest or (request_id, token_ids), got "
                        f"{type(item).__name__}{shape}")
    if isinstance(req.request_id, torch.Tensor):  # hashes by identity: its cache could never be found again
        raise TypeError(f"batch item {index}: request_id must be hashable by value (a str or int), got a tensor")
    return req


def _check_vocab(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """``ValueError`` naming the first id outside ``[0, vocab_size)``."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)].reshape(-1)[0]
        raise ValueError(f"{name}: token id {int(bad)} outside [0, vocab_size={vocab_size})")


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form). ``x [..., n, hd]``, ``positions [n]`` -> same shape."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float64) / hd))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [n, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE and torch SDPA (no bias)."""

    def __init__(self, cfg: TinyConfig, *, device=None, heads: tuple[int, int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.heads = heads or (0, cfg.num_heads)  # [lo, hi): this rank's heads (attention-TP), default all
        self.num_heads = self.heads[1] - self.heads[0]
        width = self.num_heads * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * width, bias=False, dtype=cfg.dtype, device=device)
        self.out = nn.Linear(width, cfg.hidden_size, bias=False, dtype=cfg.dtype, device=device)

    @torch.no_grad()
    def load_full(self, qkv: torch.Tensor, out: torch.Tensor) -> None:
        """Copy this rank's heads from the full ``qkv [3H, H]`` and ``out [H, H]`` weights."""
        h, lo, hi = self.cfg.hidden_size, self.heads[0] * self.head_dim, self.heads[1] * self.head_dim
        self.qkv.weight.copy_(torch.cat([qkv[i * h + lo:i * h + hi] for i in range(3)]))
        self.out.weight.copy_(out[:, lo:hi])

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., n, H] -> 3 x [..., nh, n, hd]``."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = x.shape[:-1] + (self.num_heads, self.head_dim)
        return tuple(t.view(shape).transpose(-3, -2) for t in (q, k, v))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Full causal pass without cache. ``x [B, S, H] -> [B, S, H]``."""
        b, s, h = x.shape
        q, k, v = self._heads(x)
        pos = torch.arange(s, device=x.device)
        q, k = _rope(q, pos, self.cfg.rope_theta), _rope(k, pos, self.cfg.rope_theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))  # explicit: b*s may be 0

    def forward_cached(self, x: torch.Tensor, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """One request's new tokens against its cache.

        Args:
            x: ``[n, H]`` new tokens (a prefill chunk or one decode token), positions ``P .. P+n-1``.
            cache: the request's cache at this layer (``None``: start one).

        Returns:
            ``(out [n, H], new_cache)``: the cache extended by ``n`` positions (a new object).
        """
        n = x.shape[0]
        q, k, v = self._heads(x)  # [nh, n, hd]
        if cache is None:
            cache = KVCache(k[:, :0], v[:, :0])
        p = cache.length
        pos = torch.arange(p, p + n, device=x.device)
        q, k = _rope(q, pos, self.cfg.rope_theta), _rope(k, pos, self.cfg.rope_theta)
        cache = cache.extended(k, v)
        k_all, v_all = cache.k, cache.v
        if n == 1:  # a decode token sees everything
            o = F.scaled_dot_product_attention(q, k_all, v_all)
        elif p == 0:
            o = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)
        else:  # a chunk after cached positions: query i sees keys j <= p + i
            mask = torch.arange(p + n, device=x.device)[None, :] <= (p + torch.arange(n, device=x.device))[:, None]
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.out(o.transpose(0, 1).reshape(n, -1)), cache


class Block(nn.Module):
    """``h += attn(norm1(h)); h += moe(norm2(h), token_ids)``."""

    def __init__(self, cfg: TinyConfig, moe: nn.Module, *, device=None, heads: tuple[int, int] | None = None):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=cfg.dtype, device=device)
        self.attn = CausalSelfAttention(cfg, device=device, heads=heads)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=cfg.dtype, device=device)
        self.moe = moe


@dataclass
class StepRequest:
    """One request's part of a step.

    Attributes:
        request_id: key of the request's KV cache (a new id starts a new cache).
        token_ids: ``[n]`` tokens to process: a whole prompt (prefill) or one decode token.
    """

    request_id: Hashable
    token_ids: torch.Tensor


class TinyDecoder(nn.Module):
    """Small decoder with an MoE slot per block.

    Args:
        cfg: model shape.
        moe_factory: ``moe_factory(layer_index) -> nn.Module`` builds block ``i``'s MoE slot,
            called as ``moe(x [T, H], token_ids=[T])``. ``None`` is rejected. A moelayers layer
            built without a ``layer_number`` gets ``i``.
        device: where the non-MoE weights live.
        seed: seeds the non-MoE weights (independent of the rank, so every rank agrees).
        attention: ``'dp'`` (default) or ``'tp'`` (heads split over ``groups``' TP ranks; every MoE
            slot must offer ``forward_tp``).
        groups: the ``ParallelGroups`` of ``attention='tp'`` (its ``tp_size`` must divide ``num_heads``).
    """

    def __init__(self, cfg: TinyConfig, moe_factory: Callable[[int], nn.Module], *, device=None, seed: int = 0,
                 attention: str = "dp", groups=None):
        super().__init__()
        if not callable(moe_factory):
            raise TypeError("moe_factory must be a callable layer_index -> nn.Module")
        self.cfg = cfg
        self.attention, heads = attention, _tp_heads(cfg, attention, groups)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.blocks = nn.ModuleList(Block(cfg, _checked_slot(cfg, i, moe_factory(i), attention), device=device,
                                          heads=heads) for i in range(cfg.num_layers))
        self.tp_group = groups.tp if attention == "tp" else None
        if attention == "tp":  # applied by forward_tp to this rank's chunk: partial gradients
            for b in self.blocks:
                b.norm2.weight.sequence_parallel = True
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=cfg.dtype, device=device)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=cfg.dtype, device=device)
        self.caches: dict[Hashable, list[KVCache | None]] = {}
        self.seed = seed
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``N(0, init_std)`` for embedding, attention and LM head from a generator seeded by
        ``seed`` (drawn on CPU in float64, so every rank and device gets the same values);
        norms to one. MoE slots keep their own initialisation."""
        gen = torch.Generator().manual_seed(self.seed)
        h = self.cfg.hidden_size

        def draw(shape) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.float64).normal_(0.0, self.cfg.init_std, generator=gen)

        for p in (self.embed.weight, self.lm_head.weight):
            p.copy_(draw(p.shape))
        for b in self.blocks:  # full attention weights, sliced to this rank's heads
            b.attn.load_full(draw((3 * h, h)), draw((h, h)))
            b.norm1.weight.fill_(1.0)
            b.norm2.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)

    @property
    def moe_layers(self) -> list[nn.Module]:
        """The MoE slots, block order."""
        return [b.moe for b in self.blocks]

    def _refuse(self, exc: Exception) -> NoReturn:
        """Raise ``exc`` (this rank's input refused) after the first MoE slot has told the other ranks
        in the collective they are about to run (its ``refuse_input``), so that they raise too instead
        of waiting for this rank; a slot without one cannot tell them."""
        refuse = getattr(self.blocks[0].moe, "refuse_input", None) if len(self.blocks) else None
        if refuse is not None:
            refuse(exc)
        raise exc

    # ------------------------------------------------------------------ full-sequence pass
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal pass without caches (all ranks call it together: the MoE is collective).

        Args:
            input_ids: ``[B, S]`` token ids.

        Returns:
            ``[B, S, V]`` logits.

        Raises:
            TypeError, ValueError: ``input_ids`` is not a ``[B, S]`` integer tensor (a ``[S]`` one is
                named as such: add the batch dimension, ``ids[None]``), or holds an id outside
                ``[0, vocab_size)``. The other ranks raise too (see :meth:`step`).
        """
        try:
            if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
                    or input_ids.dtype == torch.bool:
                got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
                raise TypeError(f"input_ids must be an integer tensor, got {got}")
            if input_ids.dim() != 2:
                hint = ": one sequence of S tokens is input_ids[None] ([1, S])" if input_ids.dim() == 1 else ""
                raise ValueError(f"input_ids must be [B, S], got {list(input_ids.shape)}{hint}")
            b, s = input_ids.shape
            input_ids = input_ids.to(torch.int64)  # nn.Embedding takes int32/int64 only
            _check_vocab(input_ids, self.cfg.vocab_size, "input_ids")
        except (TypeError, ValueError) as exc:
            self._refuse(exc)
        h, w = self.embed(input_ids), self.cfg.hidden_size  # explicit widths: b * s may be 0
        flat_ids = input_ids.reshape(-1)
        history: list = []
        for blk in self.blocks:
            if self.attention == "tp":
                x = copy_to_group(blk.norm1(h), self.tp_group)  # this rank's heads: a partial input gradient
                partial = blk.attn(x).reshape(b * s, w)
                h = self._moe_tp(blk, partial, h.reshape(b * s, w), flat_ids, history).view(b, s, w)
                continue
            h = h + blk.attn(blk.norm1(h))
            m = blk.moe(blk.norm2(h).reshape(b * s, w), token_ids=flat_ids)
            h = h + m.view(b, s, w)
        return self.lm_head(self.norm(h))

    @staticmethod
    def _moe_tp(blk: Block, partial: torch.Tensor, residual: torch.Tensor, token_ids: torch.Tensor,
                history: list, forced: dict | None = None) -> torch.Tensor:
        """Attention-TP: the MoE slot finishes the partial attention output (``forward_tp``); slots
        that record ``last_context_ranks`` get their two predecessors' as ``prev_ranks`` (n-gram).
        ``forced``: ``{"topk_ids": ids}`` to force the routing, or empty."""
        kw = dict(forced or {})
        if hasattr(blk.moe, "last_context_ranks"):
            kw["prev_ranks"] = (history[-2] if len(history) > 1 else None, history[-1] if history else None)
        out = blk.moe.forward_tp(partial, residual, blk.norm2, token_ids=token_ids, **kw)
        history.append(getattr(blk.moe, "last_context_ranks", None))
        return out

    # ------------------------------------------------------------------ continuous batching
    @torch.no_grad()
    def step(
        self,
        batch: Sequence[StepRequest | tuple[Hashable, torch.Tensor]],
        *,
        forced_topk: Sequence[torch.Tensor | None] | None = None,
    ) -> dict[Hashable, torch.Tensor]:
        """One serving step over prefill chunks and decode tokens of several requests.

        Every rank must call this in the same step, even with an empty ``batch``: the MoE layers
        are collective. Each request's positions continue from its cache length. Inference only:
        it runs under ``torch.no_grad()`` (the KV caches would otherwise keep every earlier step's
        autograd graph alive, memory growing with the square of the sequence length); train
        through :meth:`forward`.

        Args:
            batch: ``StepRequest`` or ``(request_id, token_ids [n])`` items; ``n >= 1``.
            forced_topk: optional, per block, ``[T, K]`` integer expert ids (``T`` = all tokens of
                the step, in batch order) that block's MoE routes by (its forward's ``topk_ids``;
                trace replay); an entry may be ``None`` (that block routes itself). Ids a layer
                refuses (not integers, not ``[T, K]``, outside ``[0, E)``) raise on every rank
                (in capacity mode with ``check_finite=False``, on every rank that forces its
                routing: a rank without tokens passes empty ``[0, K]`` ids to be one of them).

        Returns:
            ``{request_id: logits [V]}``: next-token logits after each request's last token.

        Raises:
            TypeError, ValueError: an item that is not a ``StepRequest`` or a ``(request_id,
                token_ids)`` pair, a tensor request id, token ids that are not an integer ``[n]``
                tensor with ``n >= 1`` and every id in ``[0, vocab_size)``, or a request twice.
                With a moelayers MoE layer in the first block, the other ranks raise ``ValueError``
                in that layer's exchange (``refuse_input``) instead of waiting for this one.
        """
        try:
            items = [_step_request(i, b) for i, b in enumerate(batch)]
            dev = self.embed.weight.device
            for it in items:
                t = it.token_ids
                if (not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex
                        or t.dtype == torch.bool):
                    raise TypeError(f"request {it.request_id!r}: token_ids must be an integer tensor, got "
                                    f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
                if t.dim() > 1:
                    raise ValueError(f"request {it.request_id!r}: token_ids must be [n], got {list(t.shape)} "
                                     "(one request per batch item)")
            ids = [it.token_ids.reshape(-1).to(device=dev, dtype=torch.int64) for it in items]
            for it, t in zip(items, ids):
                if t.numel() == 0:
                    raise ValueError(f"request {it.request_id!r} has no tokens in this step")
                _check_vocab(t, self.cfg.vocab_size, f"request {it.request_id!r}: token_ids")
            if len({it.request_id for it in items}) != len(items):
                raise ValueError("a request appears twice in one step: give it one chunk per step")
            lens = [t.numel() for t in ids]
            all_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=dev)
            if forced_topk is not None and len(forced_topk) != len(self.blocks):
                raise ValueError(f"forced_topk has {len(forced_topk)} entries for {len(self.blocks)} blocks")
        except (TypeError, ValueError) as exc:
            self._refuse(exc)
        # staged: committed to self.caches only when every block has run (a collective may raise)
        caches = [list(self.caches.get(it.request_id) or [None] * len(self.blocks)) for it in items]
        h = self.embed(all_ids)  # [T, H]
        history: list = []
        for li, blk in enumerate(self.blocks):
            x = copy_to_group(blk.norm1(h), self.tp_group)
            outs = []
            for ri, chunk in enumerate(torch.split(x, lens) if lens else ()):
                o, caches[ri][li] = blk.attn.forward_cached(chunk, caches[ri][li])
                outs.append(o)
            attn = torch.cat(outs) if outs else torch.zeros_like(x)
            # forced ids as the forward's argument: ids the layer refuses on one rank are refused
            # on every rank (its own check), where force_routing raised on that rank alone
            forced = {} if forced_topk is None or forced_topk[li] is None else {"topk_ids": forced_topk[li]}
            if self.attention == "tp":  # attn is this rank's partial sum over its heads
                h = self._moe_tp(blk, attn, h, all_ids, history, forced)
                continue
            h = h + attn
            h = h + blk.moe(blk.norm2(h), token_ids=all_ids, **forced)
        for it, cache in zip(items, caches):
            self.caches[it.request_id] = cache
        last = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0) - 1
        logits = self.lm_head(self.norm(h[last.to(dev)])) if items else h.new_zeros(0, self.cfg.vocab_size)
        return {it.request_id: logits[i] for i, it in enumerate(items)}

    def cache_length(self, request_id: Hashable) -> int:
        """Positions cached for ``request_id`` (0 if unknown)."""
        c = self.caches.get(request_id)
        return 0 if c is None or c[0] is None else c[0].length

    def release(self, request_id: Hashable) -> None:
        """Drop a finished request's KV caches."""
        self.caches.pop(request_id, None)
