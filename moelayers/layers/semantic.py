"""`SemanticMoE` (Sem-MoE / Semantic Parallelism): experts placed with the tokens that use them.

An offline plan (``moelayers.planning.semantic.SemanticPlan``) co-clusters tokens and experts: per
layer it gives each expert a rank (``plan.placement(layer)``) and each token a predicted rank with a
confidence (``token_rank/token_conf``, and an n-gram table over the token's ranks at the two
previous layers). Online, tokens are sent to where their experts are:

- ``mode='dp'`` (attention data-parallel): a placement-driven layer (``forward(x, token_ids=...)``)
  whose placement comes from the plan; requests are routed to ranks by
  :class:`moelayers.schedule.SemanticScheduler` outside the layer.
- ``mode='tp'`` (attention tensor-parallel, ``tp = ep``): :meth:`SemanticMoE.forward_tp` replaces
  attention's all-reduce by a reduce-scatter whose rows are rebatched so that each rank gets the
  tokens predicted for it, runs the MoE on its chunk (expert-parallel over the same group) and
  all-gathers the result back into the original order. The prediction is the plan's: with
  ``token_logq`` (what ``plan_semantic`` writes for tp) the log-linear predictor of the token id
  and the token's experts at the previous layers, balanced into equal chunks exactly as the
  held-out evaluation does (``moelayers.schedule.token_shuffle.HistoryPredictor``); otherwise
  Sem-MoE Algorithm 3 (token table vs n-gram of the previous ranks)::

      attn_partial [T, H] --shuffled reduce-scatter--> [C, H] (+ residual rows of the chunk) = h
      h + moe(norm(h))    --shuffled all-gather-->     [T, H], original order, every TP rank

Routing, dispatch and expert math are the base's; the shuffle is lossless, so outputs equal the
dense reference ``h + moe_forward(norm(h))``, ``h = residual + sum_tp attn_partial``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from moelayers._autograd import in_backward
from moelayers._compile import eager_under_compile
from moelayers._warnings import warn_caller
from moelayers.config import PARAMS_DTYPES, MoEConfig
from moelayers.dispatch.comm import all_gather_flat, copy_to_group, fingerprint
from moelayers.groups import ParallelGroups
from moelayers.kernels import shuffle_rows
from moelayers.layers.base import MoELayerBase, _check_forced_type
from moelayers.layers.turns import one_at_a_time
from moelayers.placement import ExpertPlacement, on_host
from moelayers.planning.semantic import PREDICTORS
from moelayers.schedule.token_shuffle import (
    HistoryPredictor,
    LayerTables,
    PrevRanks,
    Rebatch,
    rebatch_history,
    rebatch_tokens,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)

MODES = ("dp", "tp")


class SemanticMoE(MoELayerBase):
    """Expert-parallel MoE layer with a semantic (token/expert co-clustered) placement.

    Args:
        config, groups: as every layer. ``mode='tp'`` needs the expert-parallel group to be the
            tensor-parallel group (``ParallelGroups.from_world(ep=n, tp=n)``: the same ``n`` ranks;
            ``n = world`` for one group).
        placement: default ``plan.placement(layer_idx)`` with a plan, else linear.
        mode: ``'dp'`` (attention data-parallel) or ``'tp'`` (attention tensor-parallel).
        plan: a ``SemanticPlan`` (duck-typed: ``expert_rank``, ``token_rank``, ``token_conf``,
            ``ngram_rank``, ``ngram_conf``, ``num_ranks``, ``num_experts``, ``placement(layer)``).
            Without one, ``forward_tp`` cuts plain chunks in token order.
        layer_idx: which layer of the plan this layer is.
        predictor: ``mode='tp'``: how tokens are assigned to ranks, as ``recipes/plan.py
            planner.predictor`` evaluates it: ``'combined'`` (default: the log-linear predictor of the
            token id and the experts of the previous layers), ``'token'`` (the token id alone) or
            ``'alg3'`` (Sem-MoE Algorithm 3 as published: token table vs n-gram of the previous ranks).
            A plan without ``token_logq`` (Algorithm 3 tables only, e.g. a ``mode='dp'`` plan) runs
            ``'alg3'`` whatever is asked; the ``predictor`` attribute then says ``'alg3'``.
        verify_tp_inputs: ``forward_tp`` with several TP ranks first checks in one small all-reduce
            (and a host read) that the ranks hold the same tokens and none refused its input. With
            a plan it also checks that the token ids are in the plan's vocabulary, on one TP rank
            too (there with a host read of its own).
            ``False`` saves that per call; every rank must then pass identical, valid inputs (a
            refused input on one rank leaves the others waiting in the reduce-scatter; ids outside
            the vocabulary get no prediction from the token table).
        verify_tp_residual: ``forward_tp`` also checks, in the same all-reduce, that ``residual``
            holds the same bits on every TP rank (a fingerprint of its ``[T, H]`` values: a few
            elementwise passes over it on every call). Off by default: a residual stream that
            differs between the TP ranks (a rank that dropped out of sync) otherwise gives some
            output rows from one rank's residual and some from another's, silently. Needs
            ``verify_tp_inputs``.
        **kwargs: the rest of :class:`MoELayerBase`'s arguments (dispatcher, device, seed, ...).

    Attributes:
        semantic_plan: the plan (``None`` without one; ``plan`` is the base's step-2 method).
        last_ranks: ``[T]`` int64 rank each token was assigned to in the last ``forward_tp``
            (original token order, same on every TP rank).
        last_context_ranks: the context the next layers' predictors need, from the last
            ``forward_tp`` (same on every TP rank; ``None`` when no later layer uses it). With the
            history predictor: ``[D', T, K]`` int64 expert ids of the tokens at this layer and the
            ``D' - 1`` before it (the history the next layer reads; pass it as ``prev_ranks[1]``).
            With Algorithm 3: ``[T]`` int64 rank holding most of each token's experts at this layer
            (ties: the lower rank, ``moelayers.planning.semantic.majority_rank``), gathered when the
            plan's n-gram has confidence at layer ``layer_idx + 1`` or ``+ 2``; pass
            ``(ranks at l-2, ranks at l-1)`` as ``prev_ranks``.
        last_rebatch: the last :class:`moelayers.schedule.Rebatch`.

    Raises:
        ValueError: an unknown mode, a plan for another number of experts or ranks, ``layer_idx``
            outside the plan, or ``mode='tp'`` with an expert-parallel group other than the TP group.

    Example (layers 2 and 3 of a decoder; ``prev`` is what the earlier layers left for the next)::

        layers = [SemanticMoE.from_plan(plan, i, cfg, ParallelGroups.from_world(tp=world), mode="tp")
                  for i in range(plan.num_layers)]
        prev = (layers[1].last_context_ranks, layers[2].last_context_ranks)
        h = layers[3].forward_tp(attn_partial, h, norm, token_ids=ids, prev_ranks=prev)
    """

    # normal tensors even when built under torch.inference_mode() (see MoELayerBase.__init__)
    @torch.inference_mode(False)
    def __init__(
        self,
        config: MoEConfig,
        groups: ParallelGroups,
        *,
        placement: ExpertPlacement | None = None,
        mode: str = "dp",
        plan: Any = None,
        layer_idx: int = 0,
        predictor: str = "combined",
        verify_tp_inputs: bool = True,
        verify_tp_residual: bool = False,
        **kwargs: Any,
    ):
        for name, value in (("verify_tp_inputs", verify_tp_inputs), ("verify_tp_residual", verify_tp_residual)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if verify_tp_residual and not verify_tp_inputs:
            raise ValueError("verify_tp_residual=True needs verify_tp_inputs=True (the residual's check rides on "
                             "the inputs' all-reduce)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {predictor!r}")
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a ParallelGroups, got {type(groups).__name__}")
        if mode == "tp" and not _tp_groups_fit(groups):
            raise ValueError(f"mode='tp' runs the MoE expert-parallel over the TP group (tp = ep, the same ranks), got "
                             f"tp={groups.tp_size} ranks {_group_ranks(groups.tp)}, ep={groups.ep_size} ranks "
                             f"{_group_ranks(groups.ep)}: use ParallelGroups.from_world(ep=n, tp=n) (n = world for one group)")
        tables, predictor_obj, gather_context = None, None, False
        if plan is not None:
            _check_plan(plan, config, groups)
            tables, predictor_obj, gather_context = _plan_tables(plan, layer_idx, mode, predictor)  # checks layer_idx
            placement = placement or plan.placement(layer_idx)
            if mode == "tp" and predictor_obj is None:
                predictor = "alg3"  # what runs (the plan has no rank predictor's tables)
            k = getattr(plan, "top_k", None)
            if (mode == "tp" and predictor == "combined" and getattr(plan, "history_pmi", None) is not None
                    and k not in (None, config.top_k)):
                warn_caller(f"{getattr(plan, 'source', 'the plan')}: the semantic plan was made from routing with "
                            f"top_k={int(k)} and this layer routes top_k={config.top_k}. Its placement serves, but "
                            f"its tp rank predictor weighs each expert an earlier layer chose as fitted for "
                            f"{int(k)} of them a token: re-plan from a trace of this routing for the best locality")
            if mode == "tp" and getattr(plan, "mode", mode) == "dp":
                warn_caller("SemanticMoE(mode='tp') got a plan made for mode='dp': its placements were solved for "
                            "requests that keep one rank through every layer, and it has no per-layer rank "
                            "predictor (Algorithm 3 runs on its tables). For attention-TP, make the plan with "
                            "recipes/plan.py mode=tp")
        super().__init__(config, groups, placement=placement, **kwargs)
        self.gather_context = gather_context
        self.mode, self.semantic_plan, self.layer_idx, self.predictor = mode, plan, layer_idx, predictor
        self.verify_tp_inputs, self.verify_tp_residual = verify_tp_inputs, verify_tp_residual
        if mode == "tp":  # routes only this TP rank's chunk: a partial gradient (see forward_tp)
            self.router.weight.sequence_parallel = True
        self._tables, self._predictor = tables, predictor_obj
        # what decides forward_tp's shuffle besides the tokens and their context: compared across TP ranks
        self._predictor_digest = _predictor_digest(predictor_obj if predictor_obj is not None else tables, predictor)
        self._tables_on: dict[torch.device, LayerTables | HistoryPredictor] = {}
        self.last_ranks: torch.Tensor | None = None
        self.last_context_ranks: torch.Tensor | None = None
        self.last_rebatch: Rebatch | None = None
        self._expert_rank_on: torch.Tensor | None = None  # [E] placement.expert_rank() on the device
        self._warn_if_off_plan()

    @classmethod
    def from_plan(cls, plan: Any, layer_idx: int, config: MoEConfig, groups: ParallelGroups, *,
                  mode: str | None = None, **kwargs: Any) -> "SemanticMoE":
        """Layer ``layer_idx`` of ``plan``: its placement and token tables.

        Args:
            plan: a ``SemanticPlan``; ``plan.check_compatible(num_experts, ep_size)`` is called.
            layer_idx: the plan's layer.
            config, groups: as every layer.
            mode: ``'dp'`` | ``'tp'``; default ``plan.mode`` when that is one of them, else ``'dp'``.
            **kwargs: passed to the constructor (dispatcher, device, seed, ``layer_number``, ...).
        """
        if mode is None:
            mode = getattr(plan, "mode", "dp")
            mode = mode if mode in MODES else "dp"
            if mode == "tp" and isinstance(groups, ParallelGroups) and not _tp_groups_fit(groups):
                raise ValueError(f"the plan was made for mode='tp' (plan.mode; SemanticMoE.from_plan takes it when no "
                                 f"mode is given), which runs the MoE over the TP group, but the groups have "
                                 f"tp={groups.tp_size}, ep={groups.ep_size}: pass mode='dp' to serve this plan's "
                                 f"placement with attention-DP, or build the groups with "
                                 f"ParallelGroups.from_world(ep=n, tp=n)")
        return cls(config, groups, mode=mode, plan=plan, layer_idx=layer_idx, **kwargs)

    # ------------------------------------------------------------------ attention-TP
    def tables(self, device: torch.device) -> LayerTables | HistoryPredictor | None:
        """This layer's predictor on ``device`` (cached), or ``None`` without a plan."""
        table = self._predictor if self._predictor is not None else self._tables
        if table is None:
            return None
        device = torch.device(device)
        if device not in self._tables_on:
            self._tables_on[device] = table.to(device)
        return self._tables_on[device]

    def _flags_read_always(self) -> bool:
        """In ``tp`` mode :meth:`forward_tp` runs an all-gather after the MoE: a forward one rank
        refuses (its ``norm`` failed) raises on every rank, also with ``capacity`` and
        ``check_finite=False``, instead of leaving the others in the all-gather."""
        return self.mode == "tp"

    def rebatch(self, token_ids: torch.Tensor | None, prev_ranks: PrevRanks = None, *,
                num_tokens: int | None = None) -> Rebatch:
        """The token order of :meth:`forward_tp` (deterministic: the same on every TP rank).

        Args:
            token_ids: ``[T]`` token ids (``None`` only without a plan, with ``num_tokens``).
            prev_ranks: the previous layers' context (see :meth:`forward_tp`).
            num_tokens: ``T`` when ``token_ids`` is ``None`` (plain equal chunks in token order).

        Raises:
            ValueError: ``token_ids`` is ``None`` while the plan predicts ranks from them, or the
                context is refused (see :meth:`forward_tp`).
        """
        if token_ids is None:
            if self._tables is not None or self._predictor is not None:
                raise ValueError("forward_tp needs token_ids: the plan predicts ranks from them")
            token_ids = torch.zeros(num_tokens or 0, dtype=torch.int64, device=self.router.weight.device)
        ids = token_ids.reshape(-1)
        if self._predictor is not None:
            history = _history_of(prev_ranks, ids, num_experts=self.config.num_experts)
            return rebatch_history(ids, self.tables(ids.device), self.groups.tp_size, history)
        return rebatch_tokens(ids, self.tables(ids.device), self.groups.tp_size, prev_ranks)

    @eager_under_compile  # eager under torch.compile, as MoELayerBase.forward
    @one_at_a_time  # threads take turns (moelayers/layers/turns.py)
    def forward_tp(self, attn_partial: torch.Tensor, residual: torch.Tensor,
                   norm: Callable[[torch.Tensor], torch.Tensor], *, token_ids: torch.Tensor | None = None,
                   prev_ranks: PrevRanks = None, topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``h + moe(norm(h))`` with ``h = residual + sum_tp attn_partial``, through the shuffled
        reduce-scatter / all-gather (every TP rank calls it with the same tokens).

        Args:
            attn_partial: ``[T, H]`` (or ``[S, B, H]``) attention output before its TP all-reduce.
            residual: same shape: the residual stream (identical on every TP rank).
            norm: the pre-MoE norm, applied to this rank's chunk of ``h``.
            token_ids: ``[T]`` (or ``[S, B]``) token ids, flattened like ``attn_partial``; ``None``
                only for a layer without a plan (plain equal chunks in token order).
            prev_ranks: the context from the earlier layers, i.e. their :attr:`last_context_ranks`
                as a pair ``(layer l-2's, layer l-1's)``. History predictor: the second is
                ``[D', T, K]`` expert ids at layers ``l-1, l-2, ...`` (a ``[D', T, K]`` tensor alone
                is accepted too; ``None`` = no history). Algorithm 3: the tokens' ranks at layers
                ``l-2`` and ``l-1`` (``[2, T]`` or a pair, ``None``/``-1`` = unknown).
            topk_ids: optional forced routing of all ``T`` tokens (``[T, K]`` or ``[S, B, K]``), as
                :meth:`force_routing` but an argument, which activation checkpointing hands to the
                recomputation (a recomputed ``forward_tp`` cannot find ids forced the other way).

        Returns:
            ``[T, H]`` (shape of ``attn_partial``), original token order, on every TP rank.

        Gradients follow megatron's tensor parallelism without sequence parallelism: the output
        is replicated and its gradient is the same full gradient on every TP rank; ``attn_partial``
        and ``residual`` then get full gradients (the residual's summed over the TP ranks, each of
        which used its chunk's rows). The router weight and ``norm``'s parameters see only this
        rank's chunk: their gradients are partial sums to be all-reduced over the TP group, as for
        megatron's sequence-parallel norms (the router weight carries ``sequence_parallel = True``).

        Raises:
            ValueError: the layer was built with ``mode='dp'``; ``token_ids`` is ``None`` while the
                plan predicts ranks from them (as the next case).
            TypeError, ValueError: this rank's input, residual, token ids or forced routing are
                refused (also ``topk_ids`` given while ``force_routing`` ids are pending). With
                several TP ranks they first agree in one small all-reduce (before any other
                collective): when any rank refused its input, or the ranks hold different numbers of
                tokens, token ids, contexts, plans (the shuffle of the tokens) or forced routing,
                every TP rank raises (the refused rank its own error,
                the others a ``ValueError`` naming it) instead of crashing or waiting. Token ids
                outside the plan's vocabulary raise ``ValueError`` on every TP rank (both with
                ``verify_tp_inputs``).
            Exception: ``norm`` raising (or returning another shape or dtype) on one rank: that rank
                raises its error, the others ``ValueError``, after the layer's exchange.
        """
        pending = None
        if not in_backward():  # (a recomputation leaves ids forced for the next call where they are)
            pending, self._forced_ids = self._forced_ids, None  # used by this call only, even one that raises
        forced = pending if topk_ids is None else topk_ids
        if self.mode != "tp":
            raise ValueError("forward_tp needs a layer built with mode='tp' (this one is mode='dp')")
        refused = None
        try:
            if topk_ids is not None:
                _check_forced_type(topk_ids)
                if pending is not None:
                    raise ValueError("topk_ids given to a forward_tp for which force_routing ids are pending: pass one")
            x2, residual, token_ids, forced = self._tp_inputs(attn_partial, residual, token_ids, forced)
            if (self.groups.tp_size == 1 and self.verify_tp_inputs and self._tables is not None
                    and token_ids is not None and token_ids.numel()):
                self._check_vocabulary(*torch.stack([token_ids.min(), token_ids.max()]).tolist())
            rb = self.rebatch(token_ids, prev_ranks, num_tokens=x2.shape[0])
            if (self.capacity is not None and self.beyond_capacity == "raise"
                    and rb.chunk_size > self.capacity):  # known alike on every TP rank
                raise ValueError(f"forward_tp: {x2.shape[0]} tokens over {rb.num_ranks} TP rank(s) make chunks of "
                                 f"{rb.chunk_size} rows, more than the layer's capacity of {self.capacity}: split "
                                 "the batch, build the layer with a larger capacity, or with "
                                 "beyond_capacity='exact'")
        except Exception as exc:  # whatever this rank's input raised: the other TP ranks must learn it
            if self.groups.tp_size == 1 or not self.verify_tp_inputs:
                raise
            refused = exc
        if self.groups.tp_size > 1 and self.verify_tp_inputs:
            settings = None if refused else _tp_settings(x2.dtype, attn_partial, residual)
            checked = None if refused or not self.verify_tp_residual else residual
            self._agree_tp(refused, None if refused else x2.shape[0], None if refused else token_ids,
                           None if refused else prev_ranks, None if refused else forced, settings, checked)
        r, group = self.groups.tp_rank, self.groups.tp
        mine = rb.chunk(r)
        n = rb.valid_rows(r)
        reduced = shuffled_reduce_scatter(x2, rb.perm, group, replicated_grad=True)  # [C, H]
        res = copy_to_group(residual.reshape(x2.shape), group)  # each rank uses its rows: grads summed
        h = shuffle_rows(res, mine) + reduced                                    # dummy rows: zeros
        rows = mine[:n]
        hv = h[:n]
        z = self._normed(norm, hv)  # before the chunk's routing is forced: a norm that raises leaves nothing forced
        chunk_ids = None if forced is None else forced.index_select(0, rows.to(forced.device))  # this chunk's rows
        if topk_ids is None and chunk_ids is not None:  # (force_routing's: the layer keeps it for recomputation)
            self._forced_ids, chunk_ids = chunk_ids, None
        # a recomputation (activation checkpointing) finds this forward's routing by forward_tp's own input,
        # which it is given again, not by the chunk z, which it makes anew: the one that requires grad (a
        # reentrant checkpoint's first pass keeps the routing of an input that does; with attn_partial made
        # under no_grad and a residual that requires grad, keyed by attn_partial its recomputation was refused)
        self._replay_key = residual if residual.requires_grad and not attn_partial.requires_grad else attn_partial
        try:
            y = self.forward(z, token_ids=None if token_ids is None else token_ids.index_select(0, rows),
                             topk_ids=chunk_ids)
        finally:  # (a forward pre-hook raising would leave it for the next forward)
            self._replay_key = None
        out_chunk = torch.cat([hv + y, h[n:]])
        out = shuffled_all_gather(out_chunk, rb.perm, group, inverse=rb.inverse, replicated_grad=True)
        if not in_backward():  # activation checkpointing recomputing: the record stays the caller's forward's
            self._record_tp(rb, n, prev_ranks, token_ids)
        return out.view(attn_partial.shape)

    def _tp_inputs(self, attn_partial: torch.Tensor, residual: Any, token_ids: torch.Tensor | None,
                   forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                         torch.Tensor | None]:
        """:meth:`forward_tp`'s inputs checked on this rank: ``(x2 [T, H], residual [T, H] or as
        given, token_ids [T] int, forced [T, K] or None)``; ``TypeError``/``ValueError`` if refused."""
        x2, token_ids = self._check_input(attn_partial, token_ids, "attn_partial")
        if token_ids is not None and token_ids.dtype in _WIDE_UNSIGNED:  # index_select has no kernel for them
            token_ids = token_ids.to(torch.int64)  # (ids above 2**63 wrap negative: outside the vocabulary either way)
        if not isinstance(residual, torch.Tensor) or residual.shape != attn_partial.shape:
            raise ValueError(f"residual must have the shape of attn_partial {list(attn_partial.shape)}, "
                             f"got {list(getattr(residual, 'shape', []))}")
        residual = self._from_autocast(residual, "residual")
        if residual.dtype != x2.dtype or residual.device != x2.device:
            raise TypeError(f"residual is {residual.dtype} on {residual.device}, "
                            f"attn_partial {x2.dtype} on {x2.device}")
        if (forced is not None and forced.dim() == 3 and attn_partial.dim() == 3
                and forced.shape[:2] == attn_partial.shape[:2]):
            forced = forced.reshape(-1, forced.shape[-1])  # [S, B, K] for [S, B, H], as forward() takes it
        if forced is not None and tuple(forced.shape) != (x2.shape[0], self.config.top_k):
            raise ValueError(f"forced routing has shape {list(forced.shape)}, expected "
                             f"[{x2.shape[0]}, {self.config.top_k}] (or [S, B, K] laid out like attn_partial)")
        return x2, residual, token_ids, forced

    def _normed(self, norm: Callable[[torch.Tensor], torch.Tensor], hv: torch.Tensor) -> torch.Tensor:
        """``norm(hv)``, checked to keep ``hv``'s shape and dtype; a norm that fails on this rank
        raises on every expert-parallel rank (after the layer's exchange, where the others wait)."""
        try:
            z = norm(hv)
            if not isinstance(z, torch.Tensor) or z.shape != hv.shape or z.dtype != hv.dtype:
                got = f"{list(z.shape)} {z.dtype}" if isinstance(z, torch.Tensor) else type(z).__name__
                raise ValueError(f"norm must return a tensor shaped and typed like its input ({list(hv.shape)} "
                                 f"{hv.dtype}, this rank's rows after the reduce-scatter), got {got}")
        except Exception as exc:  # noqa: BLE001 - the caller's norm, whatever it raised
            if self.groups.ep_size == 1:
                raise
            self._refuse_in_step(exc)  # raises, after telling the other ranks
        return z

    def _record_tp(self, rb: Rebatch, n: int, prev_ranks: PrevRanks, token_ids: torch.Tensor | None) -> None:
        """Keep what the next layer's :meth:`forward_tp` takes from this one (:attr:`last_context_ranks`)."""
        self.last_ranks, self.last_rebatch = rb.rank, rb
        self.last_context_ranks = None
        if self.gather_context and self._predictor is not None:
            self.last_context_ranks = self._context_history(rb, n, _history_of(prev_ranks, token_ids))
        elif self.gather_context:
            self.last_context_ranks = self._context_ranks(rb, n)

    @one_at_a_time
    def refuse_input(self, exc: Exception) -> NoReturn:
        """As :meth:`MoELayerBase.refuse_input`; in ``tp`` mode, where the ranks are about to call
        :meth:`forward_tp`, through its first collective (the agreement on the inputs, which
        ``verify_tp_inputs=False`` skips: then this rank raises alone). Pending forced routing is
        dropped, as the other ranks' call drops it."""
        if self.mode != "tp":
            super().refuse_input(exc)
        if not in_backward():
            self._forced_ids = None
        if self.groups.tp_size > 1 and self.verify_tp_inputs:
            self._agree_tp(exc, None, None)  # raises
        raise exc

    def _agree_tp(self, refused: Exception | None, num_tokens: int | None, token_ids: torch.Tensor | None,
                  prev_ranks: PrevRanks = None, forced: torch.Tensor | None = None,
                  settings: int | None = None, residual: torch.Tensor | None = None) -> None:
        """One ``MAX`` all-reduce over the TP group of each rank's token count, order-sensitive
        fingerprints of its token ids and of its context (``prev_ranks``), the digest of its
        predictor (its plan's tables: with the tokens and context, what decides the shuffle), a
        fingerprint of its forced routing, one of ``residual``'s bits (``verify_tp_residual``; the
        field stays 0 without it), a refusal flag per rank and each rank's ``settings``
        (:func:`_tp_settings`: its dtype and which inputs it back-propagates into); raises on every
        rank when any rank refused its input (``refused``, raised as it is on that rank) or the ranks
        disagree (the shuffled collectives need the same tokens, in the same order, everywhere:
        different counts or dtypes crash them, different ids, contexts, plans or forced routing give
        wrong outputs silently, and a backward into an input on some ranks only waits in its
        collective for the others)."""
        r, fields = self.groups.tp_size, 14
        host = torch.full((fields + 2 * r,), -(1 << 62), dtype=torch.int64)  # MAX identity of the fields
        host[fields:] = 0
        host[fields + self.groups.tp_rank] = int(refused is not None)
        host[fields + r + self.groups.tp_rank] = 0 if settings is None else settings
        if refused is None:  # each value v as (v, -v): the MAX of both is equal only where all are
            host[0], host[1] = num_tokens, -num_tokens
            host[6], host[7] = self._predictor_digest, -self._predictor_digest
            if forced is None:
                host[8] = host[9] = 0
            if residual is None:
                host[10] = host[11] = 0
        vec = host.to(self.router.weight.device)  # one copy: the fingerprints below are device values
        if refused is None:
            prints = [(2, [] if token_ids is None else [token_ids]), (4, _context_tensors(prev_ranks))]
            prints += [] if forced is None else [(8, [forced])]
            prints += [] if residual is None else [(10, [_row_prints(residual)])]
            for i, tensors in prints:
                f = _fingerprint_of(tensors, vec.device)
                vec[i], vec[i + 1] = f >> 1, -(f >> 1)  # halved: the negation never overflows
            if token_ids is not None and token_ids.numel():  # the largest and the smallest id (fields 12, 13)
                ids = token_ids.to(vec.device, torch.int64).clamp(-(1 << 61), 1 << 61)  # (above the MAX identity)
                vec[12], vec[13] = ids.max(), -ids.min()
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.groups.tp)
        v = vec.tolist()
        bad = [i for i, flag in enumerate(v[fields:fields + r]) if flag]
        if refused is not None:
            raise refused
        if bad:
            raise ValueError(f"forward_tp refused the input of TP rank(s) {bad} (see their error); this rank "
                             f"{self.groups.tp_rank} raises too")
        if v[0] != -v[1]:
            raise ValueError(f"forward_tp: the TP ranks hold different numbers of tokens ({-v[1]}..{v[0]}; this rank "
                             f"{num_tokens}): every TP rank must call it with the same tokens")
        _check_tp_settings(v[fields + r:])
        for i, what in enumerate(_TP_DISAGREEMENTS):  # fingerprint i in fields 2 + 2i (max) and 3 + 2i (-min)
            if v[2 + 2 * i] != -v[3 + 2 * i]:
                raise ValueError(f"forward_tp: the TP ranks {what}")
        if v[12] > -(1 << 62):  # (some rank had token ids)
            self._check_vocabulary(-v[13], v[12])

    def _check_vocabulary(self, lo: int, hi: int) -> None:
        """``ValueError`` when token ids from ``lo`` to ``hi`` leave the plan's vocabulary (the
        plan was made for another one: its token table would predict nothing for them)."""
        if self._tables is None:
            return
        v = self._tables.vocab_size
        if lo < 0 or hi >= v:
            bad = (lo if lo > -(1 << 61) else "<= -2**61") if lo < 0 else (hi if hi < 1 << 61 else ">= 2**61")
            raise ValueError(f"forward_tp: token id {bad} is outside the plan's vocabulary [0, vocab_size={v}) "
                             f"({self._label()}, plan layer {self.layer_idx}): token ids must be >= 0 and < "
                             f"vocab_size; use a plan made for this vocabulary (a plan takes its vocab_size from "
                             f"the trace: a trace file without one has that of its largest id + 1)")

    def _gather_rows(self, rows: torch.Tensor, rb: Rebatch) -> torch.Tensor:
        """``[T, ...]`` in the original token order from every rank's ``[C, ...]`` chunk rows."""
        if self.groups.tp is None:
            gathered = rows
        else:
            gathered = rows.new_empty((self.groups.tp_size * rows.shape[0], *rows.shape[1:]))
            if gathered.numel():
                all_gather_flat(gathered, rows.contiguous(), group=self.groups.tp)
        return gathered[rb.inverse]

    def _context_history(self, rb: Rebatch, n: int, history: torch.Tensor | None) -> torch.Tensor | None:
        """``[D', T, K]`` experts of every token at this layer and the ``D' - 1`` before it."""
        topk = self.last_topk_ids  # [n, K] this chunk's routing
        if topk is None:
            return None
        mine = torch.full((rb.chunk_size, topk.shape[1]), -1, dtype=torch.int64, device=topk.device)
        mine[:n] = topk
        now = self._gather_rows(mine, rb)[None]
        depth = int(self._predictor.history.shape[0])
        if history is None or depth < 2:
            return now
        return torch.cat([now, history[: depth - 1].to(now.device, torch.int64)])

    def _context_ranks(self, rb: Rebatch, n: int) -> torch.Tensor | None:
        """``[T]`` majority rank of each token's experts here, gathered from the chunks' routing."""
        topk = self.last_topk_ids  # [n, K] this chunk's routing
        if topk is None:
            return None
        r, dev = self.groups.tp_size, topk.device
        if self._expert_rank_on is None or self._expert_rank_on.device != dev:
            self._expert_rank_on = self.placement.expert_rank().to(dev)
        counts = torch.zeros(rb.chunk_size, r, dtype=torch.int64, device=dev)
        counts[:n].scatter_add_(1, self._expert_rank_on[topk], torch.ones_like(topk))
        mine = torch.where(torch.arange(rb.chunk_size, device=dev) < n, counts.argmax(1), -1)  # ties: lower rank
        return self._gather_rows(mine, rb)

    def _adopt_placement(self, placement) -> None:
        super()._adopt_placement(placement)
        self._expert_rank_on = None  # derived from the old placement
        self._warn_if_off_plan()

    def _warn_if_off_plan(self) -> None:
        """Warn when the layer serves other experts on some rank than its plan places there (a
        checkpoint saved in another placement, e.g. a ``VanillaMoE``'s linear one, adopted by
        ``load_state_dict``; a move; ``placement=``): outputs are unchanged, but the plan's token
        tables send tokens to the ranks of the plan's experts, so most activations turn remote."""
        if self.semantic_plan is None:
            return
        planned = self.semantic_plan.placement(self.layer_idx)
        # (on every rank, although the placement is the group's: a filter that makes it an error raises on all)
        if _experts_per_rank(planned) != _experts_per_rank(self.placement):
            warn_caller(f"SemanticMoE layer {self.layer_idx} serves another expert placement than its plan's (a "
                          "checkpoint saved in another placement, a move, or placement=): outputs are unchanged, but "
                          "the plan sends tokens to the ranks of its own placement, so the local activation rate "
                          "drops. To serve the plan's placement, move the weights there on every rank: "
                          "layer.apply_placement(layer.semantic_plan.placement(layer.layer_idx))")

    def extra_repr(self) -> str:
        return f"mode={self.mode}, layer_idx={self.layer_idx}, " + super().extra_repr()


_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def _experts_per_rank(placement: ExpertPlacement) -> list[frozenset[int]]:
    """The experts each rank holds, whatever the slot order."""
    return [frozenset(row[row >= 0].tolist()) for row in placement.phy2log]


def _context_tensors(prev: PrevRanks) -> list[torch.Tensor | None]:
    """A ``prev_ranks`` context as a list that tells its forms apart: ``[]`` for ``None``, ``[t]`` for
    a tensor alone, ``[a, b]`` for a pair (each a tensor or ``None``; arrays and lists as tensors)."""
    if prev is None:
        return []
    if isinstance(prev, (tuple, list)) and len(prev) == 2 and not isinstance(prev[0], (int, float)):
        return [None if p is None else torch.as_tensor(p) for p in prev]
    return [torch.as_tensor(prev)]


def _tp_settings(dtype: torch.dtype, attn_partial: torch.Tensor, residual: torch.Tensor) -> int:
    """What every TP rank's ``forward_tp`` must share beside its tokens, as one positive integer:
    the dtype it computes in (bits 0-3; the reduce-scatter's sizes follow it) and whether autograd
    records a backward into ``attn_partial`` (bit 4) and ``residual`` (bit 5), each of which runs a
    collective (the reduce-scatter's all-gather, the residual's all-reduce) on the ranks that do."""
    grad = torch.is_grad_enabled()
    return (1 + PARAMS_DTYPES.index(dtype)) | (int(grad and attn_partial.requires_grad) << 4) \
        | (int(grad and residual.requires_grad) << 5)


def _check_tp_settings(codes: list[int]) -> None:
    """Raise ``ValueError`` (on every TP rank: ``codes`` are every rank's :func:`_tp_settings`) where
    the ranks differ, naming them."""
    def split(bits: int, what: Callable[[int], str], fix: str) -> None:
        values = {c & bits for c in codes}
        if len(values) > 1:
            groups = {val: [i for i, c in enumerate(codes) if c & bits == val] for val in sorted(values)}
            said = " and ".join(f"rank(s) {ranks} {what(val)}" for val, ranks in groups.items())
            raise ValueError(f"forward_tp: the TP ranks differ: {said}; {fix}")

    split(0xF, lambda val: f"compute in {PARAMS_DTYPES[val - 1]}",
          "cast the layer alike on every TP rank (the reduce-scatter would pair rows of other sizes)")
    for bit, name in ((4, "attn_partial"), (5, "residual")):
        split(1 << bit, lambda val, name=name: f"{'' if val else 'do not '}back-propagate into {name}",
              "every TP rank must record autograd into the same inputs (requires_grad and grad mode alike): "
              "the backward's collective would wait for the ranks that skip it")


#: what differs between the TP ranks when each fingerprint of ``_agree_tp`` does, in its order
_TP_DISAGREEMENTS = (
    "hold different token ids: every TP rank must call it with the same tokens (the same token_ids, in the "
    "same order)",
    "hold different prev_ranks (the earlier layers' context): every TP rank must pass the same (their "
    "last_context_ranks)",
    "shuffle the same tokens differently: their layers were built from different plans or predictors (every TP "
    "rank must use the same SemanticPlan, layer_idx and predictor), or the ranks called their layers in different "
    "orders",
    "force different routing (topk_ids or force_routing): every TP rank must force the same ids for all T "
    "tokens, or none",
    "hold different residuals (verify_tp_residual): the residual stream must be identical, bit for bit, on every "
    "TP rank (each rank adds its rows of its own copy; -0.0 and 0.0 differ), and every TP rank's layer must be built "
    "with the same verify_tp_residual",
)


def _row_prints(t: torch.Tensor) -> torch.Tensor:
    """``[T, ...]`` float -> ``[T]`` int64: each row's fingerprint of its raw bits (a float's
    value cast to an integer would lose its fraction), in chunks of bounded memory."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return fingerprint(t.detach().contiguous().view(ints[t.element_size()]))


def _predictor_digest(predictor: LayerTables | HistoryPredictor | None, name: Any) -> int:
    """A 61-bit digest of a layer's predictor (its tensors' dtypes, shapes and values, its other
    fields) and of the ``predictor`` setting ``name``, made on the host once per layer."""
    h = hashlib.blake2b(f"{type(predictor).__name__}:{name!r}".encode(), digest_size=8)
    for field, value in sorted(vars(predictor).items()) if predictor is not None else ():
        h.update(field.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little") >> 3


def _fingerprint_of(tensors: list[torch.Tensor | None], dev: torch.device) -> torch.Tensor:
    """One order-sensitive int64 fingerprint of how many entries ``tensors`` has and of each entry's
    presence, shape and values (0-d, on ``dev``)."""
    out = fingerprint(torch.tensor([[len(tensors)]], dtype=torch.int64, device=dev))[0]
    for i, t in enumerate(tensors):
        head = [i, -1] if t is None else [i, t.dim(), *t.shape]
        out = out * 3 + fingerprint(torch.tensor([head], dtype=torch.int64, device=dev))[0]
        if t is not None and t.numel():
            out = out * 3 + fingerprint(t.reshape(1, -1).to(dev, torch.int64))[0]
    return out


def _group_ranks(group) -> list[int] | None:
    """The global ranks of ``group`` (``None`` for a group of one)."""
    return None if group is None else dist.get_process_group_ranks(group)


def _tp_groups_fit(groups: ParallelGroups) -> bool:
    """Whether ``mode='tp'`` can run on ``groups``: the MoE's EP group is the attention's TP group."""
    return (groups.tp_size == groups.ep_size and groups.tp_rank == groups.ep_rank
            and _same_group(groups.tp, groups.ep))


def _same_group(a, b) -> bool:
    """Whether two process groups (``None``: this rank alone) hold the same ranks."""
    if a is None or b is None:
        return a is None and b is None
    return a is b or _group_ranks(a) == _group_ranks(b)


def _history_of(prev: PrevRanks, token_ids: torch.Tensor | None, *, num_experts: int | None = None
                ) -> torch.Tensor | None:
    """The ``[D', T, K]`` expert history in ``prev`` (a pair whose second entry is it, or itself; a
    numpy array or nested list as a tensor), else ``None``. With ``num_experts`` (a layer whose plan
    predicts from the history) anything else but ``None`` is refused, since it would be ignored (an
    Algorithm 3 context of ranks, say), and the ids are checked to lie in ``[0, num_experts)`` (one
    host sync)."""
    if isinstance(prev, (tuple, list)) and len(prev) == 2:
        prev = prev[1]
        if prev is not None and not isinstance(prev, torch.Tensor):
            prev = torch.as_tensor(prev)  # (a numpy array too: the prediction needs the history)
        if isinstance(prev, torch.Tensor) and prev.dim() not in (1, 3):  # e.g. last_topk_ids [T, K]: not ignored
            raise ValueError(f"the second entry of prev_ranks must be the ranks at layer l-1 [T] or the expert "
                             f"history [D', T, K], got shape {list(prev.shape)} (one layer's [T, K] ids: add [None])")
    elif prev is not None and not isinstance(prev, torch.Tensor):
        prev = torch.as_tensor(prev)
    if num_experts is not None and prev is not None and prev.dim() != 3:
        raise ValueError(f"this layer's plan predicts ranks from the experts chosen at earlier layers: prev_ranks must "
                         f"be that history [D', T, K] (their last_context_ranks), alone or as the second entry of a "
                         f"pair, or None; got ranks of shape {list(prev.shape)} (Algorithm 3's context), which it "
                         f"cannot use")
    if not isinstance(prev, torch.Tensor) or prev.dim() != 3:
        return None
    t = -1 if token_ids is None else token_ids.numel()
    if prev.shape[1] != t:
        raise ValueError(f"the expert history must be [D', T={t}, K], got {list(prev.shape)}")
    if num_experts is not None and prev.numel():
        if prev.dtype.is_floating_point or prev.dtype.is_complex or prev.dtype == torch.bool:
            raise TypeError(f"the expert history must hold integer expert ids, got dtype {prev.dtype}")
        ids = prev.to(torch.int64)  # min/max have no kernel for uint16/32/64 (ids >= 2**63 turn negative: refused)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"the expert history holds expert id {lo if lo < 0 else hi}, outside [0, {num_experts}) "
                             "(the experts of the earlier layers: their last_context_ranks)")
    return prev


@on_host  # host tables whatever the default device (a model built under torch.device("meta"))
def _plan_tables(plan: Any, layer_idx: int, mode: str, predictor: str):
    """``(tables, history predictor or None, gather_context)`` of layer ``layer_idx`` of ``plan``:
    :meth:`SemanticMoE.tables` copies them to the device the routing runs on."""
    tables = LayerTables.from_plan(plan, layer_idx)  # also checks layer_idx and the table shapes
    history_predictor = None
    if mode == "tp" and predictor != "alg3":
        history_predictor = HistoryPredictor.from_plan(plan, layer_idx, history=predictor == "combined")
    if history_predictor is None:  # Algorithm 3: the next layers' n-grams read this layer's ranks
        later = torch.as_tensor(plan.ngram_conf)[layer_idx + 1:layer_idx + 3]
    else:  # the next layers' predictors read this layer's experts (unless none uses history)
        hist = getattr(plan, "history_pmi", None) if predictor == "combined" else None
        later = torch.zeros(0) if hist is None else torch.as_tensor(hist)[layer_idx + 1:layer_idx + 1 + hist.shape[1]]
    return tables, history_predictor, mode == "tp" and bool((later != 0).any())


def _check_plan(plan: Any, config: MoEConfig, groups: ParallelGroups) -> None:
    """Clear errors for a plan made for another model or world."""
    e, r = getattr(plan, "num_experts", None), getattr(plan, "num_ranks", None)
    if e is None or r is None:
        raise TypeError(f"plan must be a SemanticPlan (num_experts, num_ranks, tables), got {type(plan).__name__}")
    check = getattr(plan, "check_compatible", None)
    if check is not None:  # (a SemanticPlan's names its file and field, and the fix)
        check(config.num_experts, groups.ep_size)
    if int(e) != config.num_experts:
        raise ValueError(f"the plan is for {int(e)} experts, the layer has {config.num_experts}: re-plan with "
                         f"recipes/plan.py for this model")
    if int(r) != groups.ep_size:
        raise ValueError(f"the plan is for {int(r)} ranks, the expert-parallel group has {groups.ep_size}: re-plan "
                         f"with recipes/plan.py parallel.ep={groups.ep_size}")
