"""Attention-TP token rebatching (Sem-MoE Algorithm 3) and the shuffled collectives it rides on.

With attention tensor-parallel over ``R`` ranks, every rank holds the attention output of all ``T``
tokens as a partial sum, and the all-reduce that would finish it is replaced by a reduce-scatter:
rank ``r`` gets the finished rows of chunk ``r`` and runs the (expert-parallel) MoE on them. The
reduce-scatter may hand out the rows in any order, so the rebatch picks the order that sends each
token to the rank holding its experts. Two predictors:

* :class:`HistoryPredictor` (plans with ``token_logq``, what ``plan_semantic`` writes for tp): the
  plan's log-linear scores of the token id and the token's experts at the previous ``D`` layers
  (``SemanticPlan.rank_scores``), per-rank prices that balance the demand (:func:`price_balance`),
  then equal chunks, the highest scores of a rank first (:func:`capacity_ranks`). This is the
  held-out evaluation's default (``moelayers.planning.semantic_eval.balanced_assign``) to the bit:
  the same float32 sums in the same order, the same float64 price updates, the same tie-breaks.
  Chunk ``r`` takes ``T // R`` tokens, plus one for the first ``T % R`` ranks.
* :class:`LayerTables` (Algorithm 3 as published): per token, the rank from T (token_rank /
  token_conf at this layer) or from the n-gram A (ngram_rank / ngram_conf given the token's ranks at
  the two previous layers), whichever is more confident; the most confident tokens of a rank stay,
  the least confident overflow to the ranks with room; the ``R*C - T`` dummy rows go to the last
  chunks, as with the history predictor.

::

    perm      [R*C] token per shuffled row (-1 = dummy); chunk r = perm[r*C:(r+1)*C], C = ceil(T / R)
    shuffled_reduce_scatter(partial [T, H], perm, group) -> [C, H]    rows gathered by perm, then reduce-scatter
    shuffled_all_gather(chunk [C, H], perm, group)      -> [T, H]    all-gather, then the inverse permutation

Everything here is a deterministic function of its inputs (integer counts, stable orders, no
atomics), so every TP rank, given the same tokens, computes the same rebatch without talking.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moelayers.dispatch.comm import AllGatherRows, GatherRowsSplitGrad, ReduceScatterRows, ReduceScatterRowsSplitGrad
from moelayers.kernels import bucket_positions, shuffle_rows
from moelayers.planning.semantic import PRICE_DECAY, PRICE_ITERS, PRICE_STEP

#: the previous layers' context of a token's rank: the ranks at layers l-2 and l-1 for Algorithm 3's
#: n-gram (a [2, T] tensor, or a pair of [T] tensors / None; -1 = unknown), or, for a plan that predicts
#: from the expert history, the [D', T, K] experts of the D' layers before (alone, or second in a pair)
PrevRanks = Any


# ---------------------------------------------------------------------- the plan's tables at one layer
@dataclass
class LayerTables:
    """The predictors of one layer, taken from a ``SemanticPlan`` (or any object with its fields).

    Attributes:
        token_rank: ``[V]`` int64 rank predicted for each token id (``-1`` = none).
        token_conf: ``[V]`` float32 confidence of ``token_rank`` (0 for unseen tokens).
        ngram_rank: ``[R, R]`` int64 rank predicted from the ranks at layers ``l-2, l-1``.
        ngram_conf: ``[R, R]`` float32 confidence of ``ngram_rank`` (0 at layers 0 and 1).
    """

    token_rank: torch.Tensor
    token_conf: torch.Tensor
    ngram_rank: torch.Tensor
    ngram_conf: torch.Tensor

    @property
    def num_ranks(self) -> int:
        return int(self.ngram_rank.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.token_rank.shape[0])

    @classmethod
    def from_plan(cls, plan: Any, layer: int) -> "LayerTables":
        """Layer ``layer``'s tables of ``plan`` (fields ``token_rank [L, V]``, ``token_conf [L, V]``,
        ``ngram_rank [L, R, R]``, ``ngram_conf [L, R, R]``; numpy or torch).

        Raises:
            ValueError: ``layer`` out of range, or tables of inconsistent shapes.
        """
        tr, tc = _as_tensor(plan.token_rank, torch.int64), _as_tensor(plan.token_conf, torch.float32)
        nr, nc = _as_tensor(plan.ngram_rank, torch.int64), _as_tensor(plan.ngram_conf, torch.float32)
        if tr.dim() != 2 or tc.shape != tr.shape:
            raise ValueError(f"plan.token_rank/token_conf must both be [L, V], "
                             f"got {list(tr.shape)} and {list(tc.shape)}")
        num_layers, r = tr.shape[0], int(plan.num_ranks)
        if nr.shape != (num_layers, r, r) or nc.shape != nr.shape:
            raise ValueError(f"plan.ngram_rank/ngram_conf must both be [L, R, R] = [{num_layers}, {r}, {r}], "
                             f"got {list(nr.shape)} and {list(nc.shape)}")
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int (the plan's layer index), got {layer!r}")
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer!r} is out of range for a plan of {num_layers} layers")
        layer = int(layer)
        return cls(tr[layer].clone(), tc[layer].clone(), nr[layer].clone(), nc[layer].clone())

    def to(self, device: torch.device | str) -> "LayerTables":
        tables = (self.token_rank, self.token_conf, self.ngram_rank, self.ngram_conf)
        return LayerTables(*(t.to(device) for t in tables))


def _as_tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(a).to(dtype).cpu()


# ---------------------------------------------------------------------- step 1: predict
def _check_token_ids(token_ids: torch.Tensor) -> None:
    """``TypeError`` unless ``token_ids`` is a ``[T]`` integer tensor (float ids would be truncated)."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype.is_floating_point \
            or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        got = f"{token_ids.dtype} {list(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise TypeError(f"token_ids must be a [T] integer tensor, got {got}")


def predict_ranks(token_ids: torch.Tensor, tables: LayerTables,
                  prev_ranks: PrevRanks = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the rank of T or of the n-gram A, whichever is more confident (T on ties).

    Args:
        token_ids: ``[T]`` int token ids; ids outside the plan's vocabulary have no T prediction.
        tables: this layer's predictors (on ``token_ids``' device).
        prev_ranks: the tokens' ranks at layers ``l-2`` and ``l-1``: ``[2, T]``, or a pair of ``[T]``
            tensors or ``None``; ``-1`` (or ``None``) = unknown, and A needs both.

    Returns:
        ``(pred [T] int64, conf [T] float32)``: predicted rank (``-1`` = no prediction) and confidence.
    """
    _check_token_ids(token_ids)
    t, dev, r = token_ids.numel(), token_ids.device, tables.num_ranks
    ids = token_ids.to(torch.int64)
    known = (ids >= 0) & (ids < tables.vocab_size)
    safe = torch.where(known, ids, 0)
    pred = torch.where(known, tables.token_rank[safe], -1)
    conf = torch.where(known & (pred >= 0), tables.token_conf[safe], 0.0)
    p2, p1 = _prev_pair(prev_ranks, t, dev)
    if p2 is not None and p1 is not None:
        seen = (p2 >= 0) & (p2 < r) & (p1 >= 0) & (p1 < r)
        p2s, p1s = torch.where(seen, p2, 0), torch.where(seen, p1, 0)
        pred_a = torch.where(seen, tables.ngram_rank[p2s, p1s], -1)
        conf_a = torch.where(seen & (pred_a >= 0), tables.ngram_conf[p2s, p1s], 0.0)
        use_a = conf_a > conf
        pred, conf = torch.where(use_a, pred_a, pred), torch.where(use_a, conf_a, conf)
    pred = torch.where((pred >= 0) & (pred < r), pred, -1)
    return pred, torch.where(pred >= 0, conf, 0.0).to(torch.float32)


def _prev_pair(prev: PrevRanks, t: int, dev: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if prev is None:
        return None, None
    if isinstance(prev, np.ndarray):  # (as the history predictor takes it)
        prev = torch.as_tensor(prev)
    if isinstance(prev, torch.Tensor):
        if prev.dim() != 2 or prev.shape[0] != 2:
            raise ValueError(f"prev_ranks must be [2, T] (layers l-2, l-1), got {list(prev.shape)}")
        prev = (prev[0], prev[1])
    if not isinstance(prev, Sequence) or len(prev) != 2:
        raise ValueError("prev_ranks must be a [2, T] tensor or a pair (ranks at l-2, ranks at l-1)")
    out = []
    for p in prev:
        if p is not None:
            p = torch.as_tensor(p)
            if p.shape != (t,):
                raise ValueError(f"prev_ranks entries must be [T] = [{t}], got {list(p.shape)}")
            if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:  # (2.7 was rank 2)
                raise TypeError(f"prev_ranks entries must be integer ranks, got {p.dtype}")
            p = p.to(device=dev, dtype=torch.int64)
        out.append(p)
    return out[0], out[1]


# ---------------------------------------------------------------------- the log-linear history predictor
@dataclass
class HistoryPredictor:
    """The tp predictor of one layer of a plan (``SemanticPlan.rank_scores``), in torch.

    Attributes:
        token_scores: ``[V, R]`` (float16 or float32) token part, ``plan.token_logq[layer]``.
        history: ``[D, E, R]`` float32 score each expert at layer ``layer-d`` adds (``plan.history_pmi[layer]``).
        history_weight: ``D`` floats, the weights of the depths.
        layer: the plan's layer (depths ``d > layer`` are never used).
    """

    token_scores: torch.Tensor
    history: torch.Tensor
    history_weight: tuple[float, ...]
    layer: int

    @property
    def num_ranks(self) -> int:
        return int(self.token_scores.shape[1])

    @property
    def depth(self) -> int:
        """Previous layers whose experts the scores use (``<= layer``)."""
        return min(int(self.history.shape[0]), self.layer)

    @classmethod
    def from_plan(cls, plan: Any, layer: int, *, history: bool = True) -> "HistoryPredictor | None":
        """Layer ``layer``'s predictor, or ``None`` when the plan has no ``token_logq`` (Algorithm 3
        tables only). ``history=False``: the token part alone (the evaluation's ``token`` predictor)."""
        logq = getattr(plan, "token_logq", None)
        if logq is None:
            return None
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int (the plan's layer index), got {layer!r}")
        if not 0 <= layer < len(logq):  # -1 would read the last layer's table
            raise ValueError(f"layer {layer!r} is out of range for a plan of {len(logq)} layers")
        logq = torch.as_tensor(logq[layer])
        hist = getattr(plan, "history_pmi", None) if history else None
        if hist is None:
            hist, weight = torch.zeros(0, 1, logq.shape[1]), ()
        else:
            hist = torch.as_tensor(hist[layer]).to(torch.float32)
            w = getattr(plan, "history_weight", None)
            w = torch.ones(hist.shape[0]) if w is None else torch.as_tensor(w).to(torch.float32)
            weight = tuple(float(x) for x in w.tolist())
        return cls(logq.clone(), hist.clone(), weight, int(layer))

    def to(self, device: torch.device | str) -> "HistoryPredictor":
        return HistoryPredictor(self.token_scores.to(device), self.history.to(device), self.history_weight, self.layer)

    def scores(self, token_ids: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, R]`` float32 log-scores (ids outside the vocabulary: history part only).

        Args:
            token_ids: ``[T]`` int token ids.
            history: ``[D', T, K]`` int expert ids at layers ``layer-1, layer-2, ...`` (``None`` = none).

        Raises:
            TypeError: ``token_ids`` is not a ``[T]`` integer tensor.
        """
        _check_token_ids(token_ids)
        v = self.token_scores.shape[0]
        ids = token_ids.to(torch.int64)
        known = (ids >= 0) & (ids < v)
        out = self.token_scores[torch.where(known, ids, 0)].to(torch.float32)
        out = torch.where(known[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        if history is None:
            return out
        if history.dim() != 3 or history.shape[1] != ids.numel():
            raise ValueError(f"history must be [D', T={ids.numel()}, K] expert ids, got {list(history.shape)}")
        for d in range(min(int(history.shape[0]), self.depth)):
            w = self.history_weight[d]
            if w == 0:
                continue
            table, prev = self.history[d], history[d].to(torch.int64)
            term = table[prev[:, 0]].clone()
            for k in range(1, prev.shape[1]):
                term += table[prev[:, k]]
            out += term if w == 1 else term * w
        return out


def price_balance(scores: torch.Tensor, capacity: torch.Tensor, *, iters: int = PRICE_ITERS,
                  step: float = PRICE_STEP, decay: float = PRICE_DECAY) -> torch.Tensor:
    """Scores minus per-rank prices that spread the demand to ``capacity [R]`` (one batch).

    ``moelayers.planning.semantic_eval.price_balance`` for one group, in the same float64
    element-wise operations (bit-identical result), with no host synchronisation.

    Returns:
        ``[T, R]`` float32 adjusted scores.
    """
    s = scores.to(torch.float32).to(torch.float64)
    cap = capacity.to(device=s.device, dtype=torch.float64)
    per = torch.clamp(cap.mean(), min=1.0)
    price = torch.zeros_like(cap)
    for _ in range(iters):
        choice = torch.argmax(s - price, dim=1)
        excess = torch.bincount(choice, minlength=cap.numel()).to(torch.float64) - cap
        price = price + torch.where((excess > 0).any(), step * excess / per, torch.zeros_like(excess))
        step *= decay
    return (s - price).to(torch.float32)


def capacity_ranks(scores: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Equal chunks (``moelayers.planning.semantic_eval.capacity_assign`` for one group, same result).

    In at most ``R`` rounds each unplaced token asks for its best rank with room; a rank keeps its
    highest-scoring candidates (ties: the earlier token; :func:`~moelayers.kernels.bucket_positions`)
    up to its room.

    Args:
        scores: ``[T, R]`` float32.
        capacity: ``[R]`` int64 room per rank (sum ``>= T``).

    Returns:
        ``[T]`` int64 rank per token.
    """
    t, r = scores.shape
    dev = scores.device
    out = torch.full((t,), -1, dtype=torch.int64, device=dev)
    room = capacity.to(device=dev, dtype=torch.int64).clone()
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=dev)
    # finite scores: a rank with room (even one scored -inf) always beats a full one, so every token is placed
    finite = torch.nan_to_num(scores.to(torch.float32), nan=-3e38, neginf=-3e38, posinf=3e38)
    for _ in range(r):
        todo = out < 0
        cand = torch.where(room[None, :] > 0, finite, neg_inf)
        choice = torch.argmax(cand, dim=1)
        best = cand.gather(1, choice[:, None])[:, 0]
        pos = bucket_positions(torch.where(todo, choice, -1), torch.where(todo, best, torch.zeros_like(best)))
        ok = todo & (pos < room[choice])
        out = torch.where(ok, choice, out)
        room = room - torch.zeros_like(room).scatter_add_(0, choice, ok.to(torch.int64))
    return out


def balanced_ranks(scores: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """:func:`capacity_ranks` of :func:`price_balance`: ``[T]`` rank per token."""
    return capacity_ranks(price_balance(scores, capacity), capacity)


def even_capacity(num_tokens: int, num_ranks: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[R]`` int64: ``T // R`` tokens per rank, one more for the first ``T % R`` ranks (as ``step_capacity``)."""
    ranks = torch.arange(num_ranks, device=device)
    return (num_tokens // num_ranks + (ranks < num_tokens % num_ranks)).to(torch.int64)


def rebatch_ranks(rank: torch.Tensor, num_ranks: int, pred: torch.Tensor | None = None,
                  conf: torch.Tensor | None = None) -> Rebatch:
    """The :class:`Rebatch` that sends each token to ``rank [T]``.

    Chunk ``r`` holds its tokens in token order, then (when it takes ``C - 1``) one dummy row.

    Args:
        rank: ``[T]`` int64, exactly ``even_capacity(T, R)[r]`` tokens on rank ``r``, as
            :func:`balanced_ranks` returns. Not checked (that would cost a host sync per
            forward): with other counts, tokens beyond a chunk's ``C`` rows are lost.
        num_ranks: ``R``.
        pred, conf: ``[T]`` each token's predicted rank and its confidence, kept in the result
            (default: ``rank`` and ones).
    """
    t, r, dev = rank.numel(), num_ranks, rank.device
    c = -(-t // r)
    cap = even_capacity(t, r, dev)
    pred = rank if pred is None else pred
    conf = torch.ones(t, device=dev) if conf is None else conf.to(torch.float32)
    if t == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Rebatch(empty, empty, empty, pred, conf, torch.zeros(r, dtype=torch.int64, device=dev), 0, r, 0)
    pos = bucket_positions(rank, torch.zeros(t, device=dev))  # token order within a rank
    inverse = rank * c + pos
    perm = torch.full((r * c,), -1, dtype=torch.int64, device=dev)
    perm[inverse] = torch.arange(t, device=dev)
    return Rebatch(perm, inverse, rank, pred, conf, cap, t, r, c)


def rebatch_history(token_ids: torch.Tensor, predictor: HistoryPredictor, num_ranks: int,
                    history: torch.Tensor | None = None) -> Rebatch:
    """:meth:`HistoryPredictor.scores`, :func:`balanced_ranks` and :func:`rebatch_ranks` for one batch.

    ``pred``/``conf`` of the result: each token's best rank before balancing and its softmax share.
    """
    if predictor.num_ranks != num_ranks:
        raise ValueError(f"the plan's tables are for {predictor.num_ranks} ranks, the group has {num_ranks}")
    ids = token_ids.reshape(-1)
    scores = predictor.scores(ids, history)
    rank = balanced_ranks(scores, even_capacity(ids.numel(), num_ranks, ids.device))
    best, pred = scores.max(1) if ids.numel() else (scores.new_zeros(0), ids.new_zeros(0))
    conf = torch.exp(best - torch.logsumexp(scores, 1)) if ids.numel() else best
    return rebatch_ranks(rank, num_ranks, pred, conf)


# ---------------------------------------------------------------------- step 2: bucket into equal chunks
@dataclass
class Rebatch:
    """A token order for the shuffled reduce-scatter: ``R`` equal chunks of ``C`` rows.

    Attributes:
        perm: ``[R*C]`` int64 token of each shuffled row, ``-1`` for a dummy (padding) row.
        inverse: ``[T]`` int64 shuffled row of each token.
        rank: ``[T]`` int64 rank each token is assigned to (``inverse // C``).
        pred: ``[T]`` int64 predicted rank (``-1`` = none); conf: ``[T]`` float32 its confidence.
        capacity: ``[R]`` int64 real tokens per chunk (``C``, or ``C - 1`` for a chunk with a dummy row).
        num_tokens: ``T``; num_ranks: ``R``; chunk_size: ``C = ceil(T / R)``.
    """

    perm: torch.Tensor
    inverse: torch.Tensor
    rank: torch.Tensor
    pred: torch.Tensor
    conf: torch.Tensor
    capacity: torch.Tensor
    num_tokens: int
    num_ranks: int
    chunk_size: int
    _host_capacity: list[int] | None = None

    @property
    def num_dummies(self) -> int:
        """``R*C - T`` padding rows (``< R``), one at the end of as many chunks."""
        return self.num_ranks * self.chunk_size - self.num_tokens

    def valid_rows(self, r: int) -> int:
        """Real tokens in chunk ``r``: its first ``C`` or ``C - 1`` rows (one small host read)."""
        if self._host_capacity is None:
            self._host_capacity = self.capacity.tolist()
        return self._host_capacity[r]

    def chunk(self, r: int) -> torch.Tensor:
        """``[C]`` tokens of chunk ``r`` (``-1`` = dummy, only in the last row)."""
        return self.perm[r * self.chunk_size:(r + 1) * self.chunk_size]


def rebatch(pred: torch.Tensor, conf: torch.Tensor, num_ranks: int) -> Rebatch:
    """Group tokens by predicted rank into ``R`` equal chunks.

    The ``R*C - T`` dummy rows go to the last chunks (:func:`even_capacity`, as the held-out
    evaluation's ``step_capacity``), one each, as their last row. Chunk ``r`` then takes up to ``cap_r`` (``C`` or ``C - 1``)
    tokens predicted for ``r``, most confident first; the rest (overflow, the least confident, and
    tokens without prediction) fill the remaining room of the chunks in rank order, in token order.

    Args:
        pred: ``[T]`` int predicted rank (``-1`` or out of range = none).
        conf: ``[T]`` float confidence.
        num_ranks: ``R``.

    Returns:
        The :class:`Rebatch`.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, numbers.Integral) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    num_ranks = int(num_ranks)  # (a numpy integer, as the schedulers take)
    if pred.dim() != 1 or conf.shape != pred.shape:
        raise ValueError(f"expected pred [T] and conf [T]; got {list(pred.shape)} and {list(conf.shape)}")
    t, r, dev = pred.numel(), num_ranks, pred.device
    c = -(-t // r)
    pred = pred.to(torch.int64)
    pred = torch.where((pred >= 0) & (pred < r), pred, -1)
    conf = torch.where(pred >= 0, torch.nan_to_num(conf.float(), nan=0.0), 0.0)
    if t == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Rebatch(empty, empty, empty, pred, conf, torch.zeros(r, dtype=torch.int64, device=dev), 0, r, 0)
    has = pred >= 0
    safe = torch.where(has, pred, 0)
    cap = even_capacity(t, r, dev)  # as the held-out evaluation (step_capacity): the first T % R ranks take C
    pos = bucket_positions(pred, conf)
    keep = has & (pos < cap[safe])
    kept = torch.zeros(r, dtype=torch.int64, device=dev).scatter_add_(0, safe, keep.to(torch.int64))
    room = cap - kept
    room_end = torch.cumsum(room, 0)
    k = torch.cumsum((~keep).to(torch.int64), 0) - 1  # index among the leftovers, token order
    free_rank = torch.searchsorted(room_end, k.clamp(min=0), right=True).clamp(max=r - 1)
    free_pos = kept[free_rank] + k - (room_end - room)[free_rank]
    inverse = torch.where(keep, safe * c + pos, free_rank * c + free_pos)
    perm = torch.full((r * c,), -1, dtype=torch.int64, device=dev)
    perm[inverse] = torch.arange(t, device=dev)
    return Rebatch(perm, inverse, inverse // c, pred, conf, cap, t, r, c)


def rebatch_tokens(token_ids: torch.Tensor, tables: LayerTables | None, num_ranks: int,
                   prev_ranks: PrevRanks = None) -> Rebatch:
    """:func:`predict_ranks`, then :func:`rebatch` into equal chunks, with the ranks the held-out
    evaluation gives (``tp_scores`` with ``predictor='alg3'`` into ``capacity_assign``): a token
    whose predicted rank has no room (fewer tokens than ranks) or that has no prediction asks for
    rank 0, below any confidence, as a token asks there for the lowest rank with room in the
    evaluation; the overflow then fills the ranks with room in rank order. Without tables, plain
    equal chunks in token order. The result keeps the predictions (``pred``/``conf``) as made.
    """
    if tables is None:
        t = token_ids.numel()
        return rebatch(torch.full((t,), -1, dtype=torch.int64, device=token_ids.device),
                       torch.zeros(t, device=token_ids.device), num_ranks)
    if tables.num_ranks != num_ranks:
        raise ValueError(f"the plan's tables are for {tables.num_ranks} ranks, the group has {num_ranks}")
    pred, conf = predict_ranks(token_ids.reshape(-1), tables, prev_ranks)
    cap = even_capacity(pred.numel(), num_ranks, pred.device)
    asks = (pred >= 0) & (pred < num_ranks)
    asks &= cap[torch.where(asks, pred, 0)] > 0
    out = rebatch(torch.where(asks, pred, 0), torch.where(asks, conf.to(torch.float32), -1.0), num_ranks)
    return replace(out, pred=pred, conf=conf.to(torch.float32))


def inverse_permutation(perm: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T]`` shuffled row of each token, from ``perm [N]`` (``-1`` = dummy row), ``-1`` for a
    token ``perm`` does not hold. ``perm`` must hold each token once (as :func:`rebatch` makes it);
    not checked, which would cost a host sync per forward."""
    target = torch.where(perm >= 0, perm, num_tokens)
    inv = torch.full((num_tokens + 1,), -1, dtype=torch.int64, device=perm.device)
    inv.scatter_(0, target, torch.arange(perm.numel(), device=perm.device))
    return inv[:num_tokens]


# ---------------------------------------------------------------------- the shuffled collectives
def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def shuffled_reduce_scatter(partial: torch.Tensor, perm: torch.Tensor, group, *,
                            replicated_grad: bool = False) -> torch.Tensor:
    """Finish a TP partial sum, each rank keeping its rebatched chunk.

    Rows are gathered by ``perm`` straight into the reduce-scatter input buffer (Triton kernel on
    CUDA), then ``reduce_scatter_tensor`` sums over the group. Differentiable (the backward is
    :func:`shuffled_all_gather` of the gradient).

    Args:
        partial: ``[T, H]`` this rank's partial sum, same token order on every rank.
        perm: ``[R*C]`` token per shuffled row, ``-1`` = dummy (zeros); identical on every rank;
            each token once (:func:`rebatch`'s; not checked: a host sync per forward).
        group: the TP process group (``None`` = one process).
        replicated_grad: the gradient this gives ``partial`` (the same full gradient on every
            rank) is used alike on every rank, as the replicated output of
            ``shuffled_all_gather(..., replicated_grad=True)`` is (``SemanticMoE.forward_tp``): a
            double backward then keeps this rank's block of that gradient's cotangent instead of
            summing the ranks' identical ones. Only second-order gradients differ.

    Returns:
        ``[C, H]``: rows ``perm[r*C:(r+1)*C]`` of the full sum, on rank ``r``.
    """
    r = _group_size(group)
    if partial.dim() != 2:
        raise ValueError(f"partial must be [T, H], got {list(partial.shape)}")
    if perm.dim() != 1 or perm.numel() % r:
        raise ValueError(f"perm must be [R*C] with R = {r} ranks, got {list(perm.shape)}")
    buf = shuffle_rows(partial, perm)
    if group is None or buf.numel() == 0:  # every rank has the same T: all skip together
        return buf[: perm.numel() // r]
    return (ReduceScatterRowsSplitGrad if replicated_grad else ReduceScatterRows).apply(group, buf)


def shuffled_all_gather(chunk: torch.Tensor, perm: torch.Tensor, group, *,
                        inverse: torch.Tensor | None = None, replicated_grad: bool = False) -> torch.Tensor:
    """Gather every rank's chunk and restore the original token order.

    ``all_gather_into_tensor`` of the ``[C, H]`` chunks, then rows picked by the inverse
    permutation (Triton kernel on CUDA); dummy rows are dropped. Differentiable.

    Args:
        chunk: ``[C, H]`` this rank's rows, in rebatched order.
        perm: ``[R*C]`` the rebatch's permutation (``-1`` = dummy), identical on every rank.
        group: the TP process group (``None`` = one process).
        inverse: optional ``[T]`` inverse of ``perm`` (saves recomputing it and a host sync).
        replicated_grad: the output's gradient is the same full gradient on every rank (the ranks
            go on with replicated computation, megatron's tensor parallelism without sequence
            parallelism): the backward keeps this rank's rows. ``False``: each rank's gradient is
            a partial sum, which the backward reduce-scatters (the adjoint of the gather).

    Returns:
        ``[T, H]`` in the original token order, identical on every rank.
    """
    r = _group_size(group)
    if chunk.dim() != 2 or perm.dim() != 1 or perm.numel() != r * chunk.shape[0]:
        raise ValueError(f"chunk [C, H] and perm [R*C] (R = {r}) do not fit: {list(chunk.shape)}, {list(perm.shape)}")
    if inverse is None:
        inverse = inverse_permutation(perm, int((perm >= 0).sum()))
    if group is None or chunk.numel() == 0:  # no rows anywhere (every rank holds the same tokens): no collective
        gathered = chunk if group is None else chunk.new_zeros(perm.numel(), chunk.shape[1]) + chunk.sum()
        # (+ the empty chunk's sum, 0: the output stays in the autograd graph, as with rows)
    else:
        gathered = (GatherRowsSplitGrad if replicated_grad else AllGatherRows).apply(group, chunk)
    return shuffle_rows(gathered, inverse)
