"""Semantic planning (Sem-MoE, Speculative MoE): profiling tables and the :class:`SemanticPlan`.

Profiling tables, built from a routing trace (:class:`~moelayers.trace.RoutingTrace`), per layer:

* the token→expert count table ``T [V, E]`` (:class:`TokenExpertTable`, sparse CSR over token ids),
  the token frequencies ``[V]`` and the confidence table ``C_p = Pr(expert | token)`` (an activation
  of token ``v`` goes to expert ``e``; rows sum to 1);
* per rank (under a placement) the token→rank table ``Pr(rank | token)`` (:func:`token_rank_probs`),
  smoothed towards the layer's rank distribution;
* the inter-layer device n-gram ``A, A_p`` (:func:`ngram_tables`): the token's ranks at layers
  ``l-2, l-1`` → its most likely rank at ``l`` and that rank's confidence (Algorithm 3);
* the tp predictor of :meth:`SemanticPlan.rank_scores`: a log-linear model of the token id and the
  token's *experts* at the previous ``D`` layers (:mod:`moelayers.planning.semantic_predict`).

A token's *rank at a layer* (for the n-gram) is the rank holding most of its ``K`` experts there
under the plan's placement, ties to the lower rank (:func:`majority_rank`): the routing of earlier
layers is known when a token is shuffled, so the online shuffler can compute it.

Tokens unseen in profiling are normal: with ``embeddings [V, D]`` they take the row of their
cosine-nearest seen token (:func:`nearest_seen_tokens`), otherwise the layer's overall
distribution. Only ids ``< 0`` or ``>= vocab_size`` are errors (``ValueError`` naming the field).

The solvers and :func:`plan_semantic` live in :mod:`moelayers.planning.semantic_solvers`, the
held-out evaluation in :mod:`moelayers.planning.semantic_eval`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moelayers.placement import ExpertPlacement
from moelayers.files import atomic_write, check_format_version, read_npz

__all__ = [
    "TokenExpertTable", "build_token_table", "check_token_ids", "nearest_seen_tokens", "token_rank_probs",
    "majority_rank", "rank_counts", "ngram_tables", "SemanticPlan",
]  # plan_semantic is importable from here too (lazily, see __getattr__)

#: 2 added train_sequences (format 1's reader refuses such a plan as having an unknown field; readers
#: since then check the version first: files.check_format_version); 3 added top_k
FORMAT_VERSION = 3

#: how tokens are given ranks in tp mode, offline (planning/semantic_eval.py) and online (SemanticMoE)
PREDICTORS = ("combined", "alg3", "token")
#: the schedule of price_balance (scores in nats), offline and online (schedule/token_shuffle.py)
PRICE_ITERS, PRICE_STEP, PRICE_DECAY = 30, 1.0, 0.85


def check_token_ids(token_ids: np.ndarray, vocab_size: int, name: str = "token_ids") -> np.ndarray:
    """``token_ids`` as int64, or ``ValueError`` naming ``name`` if any id is outside ``[0, vocab_size)``."""
    ids = np.asarray(token_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"'{name}' must hold integer token ids, got dtype {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"'{name}' has token id {bad} outside [0, vocab_size={vocab_size})")
    return ids


@dataclass
class TokenExpertTable:
    """Token→expert counts of one layer, sparse (CSR over token ids).

    Attributes:
        indptr: ``[V+1]`` int64; token ``v``'s entries are ``indptr[v]:indptr[v+1]``.
        experts: ``[nnz]`` int64 expert ids, ascending within a token.
        counts: ``[nnz]`` int64 activations of (token, expert).
        token_freq: ``[V]`` int64 occurrences of each token id in the profiled trace.
        expert_load: ``[E]`` int64 activations of each expert.
        top_k: ``K``.
    """

    indptr: np.ndarray
    experts: np.ndarray
    counts: np.ndarray
    token_freq: np.ndarray
    expert_load: np.ndarray
    top_k: int

    @property
    def vocab_size(self) -> int:
        """Token ids the table covers, ``V``."""
        return int(self.indptr.size - 1)

    @property
    def num_experts(self) -> int:
        """Experts of the layer, ``E``."""
        return int(self.expert_load.size)

    @property
    def rows(self) -> np.ndarray:
        """``[nnz]`` token id of each entry."""
        return np.repeat(np.arange(self.vocab_size, dtype=np.int64), np.diff(self.indptr))

    @property
    def seen(self) -> np.ndarray:
        """``[V]`` bool: token ids that occur in the profiled trace."""
        return self.token_freq > 0

    def dense(self) -> np.ndarray:
        """``T [V, E]`` int64 (small tables and tests only)."""
        out = np.zeros((self.vocab_size, self.num_experts), dtype=np.int64)
        out[self.rows, self.experts] = self.counts
        return out

    def layer_distribution(self) -> np.ndarray:
        """``[E]`` float64: the layer's overall expert distribution (loads / total)."""
        total = self.expert_load.sum()
        return self.expert_load / total if total else np.full(self.num_experts, 1.0 / self.num_experts)

    def confidence(self, token_ids: np.ndarray, *, source: np.ndarray | None = None) -> np.ndarray:
        """``C_p = Pr(expert | token)`` rows: ``[n, E]`` float64, each row sums to 1.

        Args:
            token_ids: ``[n]`` ids in ``[0, V)``.
            source: optional ``[V]`` row to read for each token id (see :func:`nearest_seen_tokens`);
                default: the token itself. Tokens without a seen source get the layer distribution.
        """
        ids = check_token_ids(token_ids, self.vocab_size)
        src = ids if source is None else np.asarray(source, dtype=np.int64)[ids]
        uniq, inv = np.unique(src, return_inverse=True)
        out = np.tile(self.layer_distribution(), (uniq.size, 1))
        ok = (uniq >= 0) & (self.token_freq[np.maximum(uniq, 0)] > 0)
        starts = self.indptr[uniq[ok]]
        lens = self.indptr[uniq[ok] + 1] - starts
        sel = np.repeat(np.arange(lens.size), lens)
        pos = np.arange(sel.size) + np.repeat(starts - (np.cumsum(lens) - lens), lens)  # CSR entries of each row
        rows = np.zeros((int(ok.sum()), self.num_experts))
        rows[sel, self.experts[pos]] = self.counts[pos]
        out[ok] = rows / (self.token_freq[uniq[ok]][:, None] * self.top_k)
        return out[inv.reshape(-1)]


def build_token_table(token_ids: np.ndarray, topk_ids: np.ndarray, num_experts: int, vocab_size: int) -> TokenExpertTable:
    """The token→expert table of one layer.

    Args:
        token_ids: ``[T]`` token ids in ``[0, vocab_size)``.
        topk_ids: ``[T, K]`` expert ids of this layer.

    Returns:
        :class:`TokenExpertTable` with ``V = vocab_size``.
    """
    ids = check_token_ids(token_ids, vocab_size)
    top = np.asarray(topk_ids)
    if top.ndim != 2 or top.shape[0] != ids.shape[0] or top.dtype.kind not in "iu":
        raise ValueError(f"topk_ids must be integer [T, K] expert ids for the T = {ids.shape[0]} token ids, got "
                         f"{top.dtype} {list(top.shape)}")
    top = top.astype(np.int64, copy=False)
    num_e, k = int(num_experts), top.shape[1]
    if top.size and (top.min() < 0 or top.max() >= num_e):
        bad = int(top.min()) if top.min() < 0 else int(top.max())
        raise ValueError(f"topk_ids holds expert id {bad}, outside [0, num_experts={num_e})")
    keys = (ids[:, None] * num_e + top).ravel()
    if vocab_size * num_e <= min(1 << 25, 16 * keys.size):  # a dense bincount beats sorting when the keys fill the table
        dense = np.bincount(keys, minlength=vocab_size * num_e)
        nz = np.flatnonzero(dense)
        uniq, cnt = nz, dense[nz]
    else:
        uniq, cnt = np.unique(keys, return_counts=True)
    rows = uniq // num_e
    indptr = np.zeros(vocab_size + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=vocab_size), out=indptr[1:])
    return TokenExpertTable(indptr, (uniq % num_e).astype(np.int64), cnt.astype(np.int64),
                            np.bincount(ids, minlength=vocab_size).astype(np.int64),
                            np.bincount(top.ravel(), minlength=num_e).astype(np.int64), k)


def nearest_seen_tokens(embeddings: np.ndarray, seen: np.ndarray, *, chunk: int = 4096,
                        max_dim: int | None = 256, seed: int = 0, candidates: int = 32) -> np.ndarray:
    """For every token id, the cosine-nearest *seen* token id (seen ids map to themselves).

    Args:
        embeddings: ``[V, D]`` float (e.g. the model's input embedding table).
        seen: ``[V]`` bool, the token ids with profiling data.
        chunk: unseen tokens compared per matmul.
        max_dim: when ``D > max_dim`` the (unit) embeddings are first projected to ``max_dim``
            dimensions by a fixed seeded Gaussian matrix to find the ``candidates`` nearest seen
            tokens fast, which are then ranked by the exact cosine in ``D`` dimensions (the true
            nearest neighbour unless the projection pushed it out of the candidates);
            ``None`` = exact search in ``D`` dimensions.
        candidates: approximate neighbours re-ranked exactly (with ``max_dim``).

    Returns:
        ``[V]`` int64 source id per token; ``-1`` everywhere if nothing is seen.
    """
    emb = np.asarray(embeddings, dtype=np.float32)
    seen = np.asarray(seen, dtype=bool)
    if emb.ndim != 2 or emb.shape[0] != seen.size:
        raise ValueError(f"'embeddings' must be [V={seen.size}, D], got shape {list(emb.shape)}")
    if not np.isfinite(emb).all():
        raise ValueError("'embeddings' has non-finite values")
    src = np.where(seen, np.arange(seen.size), -1).astype(np.int64)
    seen_ids, unseen_ids = np.flatnonzero(seen), np.flatnonzero(~seen)
    if seen_ids.size == 0 or unseen_ids.size == 0:
        return src
    unit = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    approx = max_dim is not None and unit.shape[1] > max_dim
    search = unit
    if approx:
        proj = np.random.default_rng(seed).standard_normal((unit.shape[1], max_dim)).astype(np.float32)
        search = unit @ proj
        search /= np.maximum(np.linalg.norm(search, axis=1, keepdims=True), 1e-12)
    base = search[seen_ids]
    k = min(candidates, seen_ids.size)
    for i in range(0, unseen_ids.size, chunk):
        part = unseen_ids[i:i + chunk]
        sim = search[part] @ base.T  # [n, seen]
        if not approx:
            src[part] = seen_ids[np.argmax(sim, axis=1)]
            continue
        cand = np.argpartition(-sim, k - 1, axis=1)[:, :k]  # [n, k] approximate nearest
        cand.sort(axis=1)  # ties in the exact cosine: the lowest seen id, as argmax would pick
        for j in range(0, part.size, 256):  # exact cosines of the candidates ([256, k, D] at a time)
            rows, c = part[j:j + 256], cand[j:j + 256]
            exact = np.einsum("nd,nkd->nk", unit[rows], unit[seen_ids[c]])
            src[rows] = seen_ids[c[np.arange(rows.size), np.argmax(exact, axis=1)]]
    return src


def token_rank_probs(table: TokenExpertTable, expert_rank: np.ndarray, num_ranks: int, *,
                     smoothing: float = 2.0, source: np.ndarray | None = None) -> np.ndarray:
    """``Pr(rank | token)``: where a token's activations land under a placement, ``[V, R]`` float64.

    ``q[v, r] = (sum_{e on r} T[v, e] + a K p_r) / (K freq[v] + a K)`` with ``p_r`` the layer's
    share of activations on rank ``r`` and ``a = smoothing`` pseudo-occurrences (rare tokens lean
    on the layer distribution). Tokens never seen get ``p`` (or their ``source`` token's row).
    """
    er = np.asarray(expert_rank, dtype=np.int64)
    dist = np.bincount(er, weights=table.layer_distribution(), minlength=num_ranks)
    q = np.bincount(table.rows * num_ranks + er[table.experts], weights=table.counts,
                    minlength=table.vocab_size * num_ranks).reshape(table.vocab_size, num_ranks)
    k, a = table.top_k, float(smoothing)
    q = (q + a * k * dist) / (table.token_freq[:, None] * k + a * k)
    if source is not None:
        src = np.asarray(source, dtype=np.int64)
        unseen = ~table.seen & (src >= 0)
        q[unseen] = q[src[unseen]]
    return q


def rank_counts(topk_ids: np.ndarray, expert_rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[T, R]`` int64: how many of each token's ``K`` experts live on each rank."""
    ranks = np.asarray(expert_rank, dtype=np.int64)[np.asarray(topk_ids).astype(np.int64, copy=False)]
    n = ranks.shape[0]
    return np.bincount((np.arange(n)[:, None] * num_ranks + ranks).ravel(),
                       minlength=n * num_ranks).reshape(n, num_ranks)


def majority_rank(topk_ids: np.ndarray, expert_rank: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[T]`` int64: the rank holding most of each token's experts (ties: the lower rank)."""
    return np.argmax(rank_counts(topk_ids, expert_rank, num_ranks), axis=1)


def ngram_tables(topk_ids: np.ndarray, expert_rank: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Inter-layer device n-gram ``A`` (``ngram_rank``) and its confidence ``A_p`` (``ngram_conf``).

    For layer ``l >= 2`` and context ``(r2, r1)`` = the token's majority ranks at layers ``l-2, l-1``,
    ``A[l, r2, r1]`` is the rank holding most activations at ``l`` of the tokens in that context and
    ``A_p`` the share of those activations it holds (``Pr(local | context)`` when placed there).
    Layers 0 and 1, and contexts never seen, have confidence 0 (and rank: the layer's busiest rank).

    Args:
        topk_ids: ``[T, L, K]`` routing.
        expert_rank: ``[L, E]`` placements.

    Returns:
        ``ngram_rank [L, R, R]`` int64, ``ngram_conf [L, R, R]`` float32.
    """
    num_l, r = expert_rank.shape[0], num_ranks
    topk_ids = np.asarray(topk_ids).astype(np.int64)
    rank_ = np.zeros((num_l, r, r), dtype=np.int64)
    conf = np.zeros((num_l, r, r), dtype=np.float32)
    maj = [majority_rank(topk_ids[:, j], expert_rank[j], r) for j in range(num_l)]
    for layer in range(num_l):
        cnt = rank_counts(topk_ids[:, layer], expert_rank[layer], r)
        rank_[layer] = int(np.argmax(cnt.sum(0)))
        if layer < 2:
            continue
        ctx = maj[layer - 2] * r + maj[layer - 1]
        table = np.zeros((r * r, r))
        for j in range(r):
            table[:, j] = np.bincount(ctx, weights=cnt[:, j], minlength=r * r)
        tot = table.sum(1)
        ok = tot > 0
        rank_[layer].reshape(-1)[ok] = np.argmax(table[ok], axis=1)
        conf[layer].reshape(-1)[ok] = table[ok].max(1) / tot[ok]
    return rank_, conf


# ------------------------------------------------------------------------------------ the plan
_REQUIRED = ("expert_rank", "token_rank", "token_conf", "ngram_rank", "ngram_conf", "num_ranks", "num_experts",
             "vocab_size", "mode")
_OPTIONAL = ("token_logq", "history_pmi", "history_weight", "solver", "theta", "seed", "objective", "format_version",
             "train_sequences", "top_k")


@dataclass(eq=False)
class SemanticPlan:
    """A semantic (co-clustered) plan for ``L`` layers, ``E`` experts, ``R`` ranks, vocabulary ``V``.

    Attributes:
        expert_rank: ``[L, E]`` int64 rank of each expert (``E / R`` per rank).
        token_rank: ``[L, V]`` int64 rank (cluster) of each token id; identical over layers in dp mode.
        token_conf: ``[L, V]`` float32 in ``[0, 1]``. tp: ``Pr(an activation of the token is local |
            token placed on token_rank)``. dp: confidence above chance of the token's request
            cluster, ``(Pr(token_rank | token) - 1/R) / (1 - 1/R)`` (0 = no information).
        ngram_rank: ``[L, R, R]`` int64: majority ranks at layers ``l-2, l-1`` → predicted rank at ``l``.
        ngram_conf: ``[L, R, R]`` float32 (0 for layers 0/1 and unseen contexts).
        num_ranks, num_experts, vocab_size: ``R``, ``E``, ``V``.
        mode: ``'tp'`` (tokens shuffled per layer) or ``'dp'`` (a request keeps one rank).
        token_logq: optional ``[L, V, R]`` float16 token part of the tp predictor's log-scores
            (:meth:`rank_scores`; fitted: ``a log Pr(rank | token) + c``, see ``semantic_predict``).
        history_pmi: optional ``[L, D, E, R]`` float32 history part: the score each expert chosen at
            layer ``l-d`` adds to each rank at ``l`` (the name is historical: pointwise mutual
            information once, fitted log-linear weights now).
        history_weight: optional ``[D]`` float32 weights of the history terms in :meth:`rank_scores`.
        solver, theta, seed, objective: solver metadata (``objective [L]`` final value per layer).
        train_sequences: optional ``[S_train]`` uint64 content digests of the sequences the plan
            was trained on (:meth:`RoutingTrace.sequence_digests`; ``plan_semantic`` records them):
            :meth:`trained_on` tells which sequences of a trace are in-sample for the plan.
        top_k: optional: the ``K`` (experts per token) of the routing the plan was made from.
            ``plan_semantic`` records the trace's; files written before format 3 give ``None``.
            ``SemanticMoE.from_plan`` warns when the layer routes another number of experts per
            token. The placement still serves, but the tp predictor's history terms add ``K``
            experts per earlier layer.
        source: where the plan was loaded from (for error messages).
    """

    expert_rank: np.ndarray
    token_rank: np.ndarray
    token_conf: np.ndarray
    ngram_rank: np.ndarray
    ngram_conf: np.ndarray
    num_ranks: int
    num_experts: int
    vocab_size: int
    mode: str = "tp"
    token_logq: np.ndarray | None = None
    history_pmi: np.ndarray | None = None
    history_weight: np.ndarray | None = None
    solver: str = ""
    theta: float = float("nan")
    seed: int = 0
    objective: np.ndarray | None = None
    train_sequences: np.ndarray | None = None
    top_k: int | None = None
    format_version: int = FORMAT_VERSION
    source: str = field(default="<memory>", repr=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_layers(self) -> int:
        """Layers the plan covers, ``L``."""
        return int(self.expert_rank.shape[0])

    def _fail(self, name: str, problem: str) -> ValueError:
        return ValueError(f"{self.source}: semantic plan field '{name}' {problem}")

    def validate(self) -> None:
        """Check shapes, dtypes and ranges; ``ValueError`` naming the source and the field."""
        for name in ("num_ranks", "num_experts", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise self._fail(name, f"must be a positive int, got {value!r}")
            setattr(self, name, int(value))
        r, e, v = self.num_ranks, self.num_experts, self.vocab_size
        if self.mode not in ("tp", "dp"):
            raise self._fail("mode", f"must be 'tp' or 'dp', got {self.mode!r}")
        if e % r:
            raise self._fail("num_experts", f"({e}) must be divisible by num_ranks ({r})")
        er = np.asarray(self.expert_rank)
        if er.ndim != 2 or er.shape[1] != e or er.shape[0] < 1:
            raise self._fail("expert_rank", f"must be [L, E={e}], got shape {list(er.shape)}")
        num_l = er.shape[0]
        shapes = {"token_rank": (num_l, v), "token_conf": (num_l, v), "ngram_rank": (num_l, r, r),
                  "ngram_conf": (num_l, r, r)}
        for name, shape in shapes.items():
            arr = np.asarray(getattr(self, name))
            if arr.shape != shape:
                raise self._fail(name, f"must have shape {list(shape)}, got {list(arr.shape)}")
        for name, hi in (("expert_rank", r), ("token_rank", r), ("ngram_rank", r)):
            arr = np.asarray(getattr(self, name))
            if arr.dtype.kind not in "iu":
                raise self._fail(name, f"must be integer, got dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= hi):
                raise self._fail(name, f"has ranks outside [0, num_ranks={r})")
            setattr(self, name, arr.astype(np.int64, copy=False))
        counts = np.stack([np.bincount(row, minlength=r) for row in self.expert_rank])
        if (counts != e // r).any():
            bad = int(np.flatnonzero((counts != e // r).any(1))[0])
            raise self._fail("expert_rank", f"must put E/R = {e // r} experts on every rank; layer {bad} has {counts[bad].tolist()}")
        for name in ("token_conf", "ngram_conf"):
            arr = np.asarray(getattr(self, name), dtype=np.float32)
            if not np.isfinite(arr).all() or arr.min(initial=0) < 0 or arr.max(initial=0) > 1 + 1e-5:
                raise self._fail(name, "must be finite and in [0, 1]")
            setattr(self, name, arr)
        if self.mode == "dp" and (self.token_rank != self.token_rank[:1]).any():
            raise self._fail("token_rank", "must be identical across layers in dp mode (a request keeps one rank)")
        opt = {"token_logq": (num_l, v, r), "history_pmi": None, "history_weight": None}
        for name, shape in opt.items():
            arr = getattr(self, name)
            if arr is None:
                continue
            arr = np.asarray(arr)
            if shape is not None and arr.shape != shape:
                raise self._fail(name, f"must have shape {list(shape)}, got {list(arr.shape)}")
            if name == "token_logq":  # stored as float16: a finite value beyond its range would become inf
                with np.errstate(over="ignore"):
                    arr = arr.astype(np.float16)
            if not np.isfinite(arr).all():
                raise self._fail(name, "has non-finite values" + (" (as float16)" if name == "token_logq" else ""))
        if self.history_pmi is not None:
            h = np.asarray(self.history_pmi, dtype=np.float32)
            if h.ndim != 4 or h.shape[0] != num_l or h.shape[2:] != (e, r):
                raise self._fail("history_pmi", f"must be [L={num_l}, D, E={e}, R={r}], got {list(h.shape)}")
            w = np.ones(h.shape[1], np.float32) if self.history_weight is None else np.asarray(self.history_weight, np.float32)
            if w.shape != (h.shape[1],):
                raise self._fail("history_weight", f"must be [D={h.shape[1]}], got {list(w.shape)}")
            self.history_pmi, self.history_weight = h, w
        if self.token_logq is not None:
            self.token_logq = np.asarray(self.token_logq, dtype=np.float16)
        if self.objective is not None:
            obj = np.asarray(self.objective)
            if obj.shape != (num_l,) or obj.dtype.kind not in "iuf":
                raise self._fail("objective", f"must be [L={num_l}] numbers, got shape {list(obj.shape)} dtype {obj.dtype}")
            self.objective = obj.astype(np.float64)
        if self.train_sequences is not None:
            seqs = np.asarray(self.train_sequences)
            if seqs.ndim != 1 or seqs.dtype != np.uint64:
                raise self._fail("train_sequences", f"must be [S] uint64 digests, got shape {list(seqs.shape)} "
                                 f"dtype {seqs.dtype}")
            self.train_sequences = seqs
        if self.top_k is not None:
            k = self.top_k
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= e:
                raise self._fail("top_k", f"must be an int in [1, num_experts={e}] or None, got {k!r}")
            self.top_k = int(k)
            self.format_version = max(int(self.format_version), 3)  # (saved with it, a format-2 reader would not read it)

    def __eq__(self, other: object) -> bool:
        """The same plan: every field equal (arrays in shape, dtype and values; a NaN ``theta`` equals
        a NaN), whatever ``source`` and ``format_version`` say. So a plan equals itself saved and
        loaded back."""
        if not isinstance(other, SemanticPlan):
            return NotImplemented
        for f in fields(self):
            if f.name in ("source", "format_version"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a is None or b is None:
                if a is not b:
                    return False
            elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                a, b = np.asarray(a), np.asarray(b)
                if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                    return False
            elif a != b and not (isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating))
                                 and math.isnan(a) and math.isnan(b)):
                return False
        return True

    __hash__ = None  # (mutable, compared by value)

    def trained_on(self, trace) -> np.ndarray | None:
        """``[S]`` bool: which sequences of ``trace`` (a ``RoutingTrace``) the plan was trained on
        (by content: the same token ids and routing as a training sequence; never an empty one);
        ``None`` when the plan does not record its training sequences (a file written before it
        did, or built by hand)."""
        if self.train_sequences is None:
            return None
        lengths = np.diff(np.asarray(trace.seq_offsets))
        return np.isin(trace.sequence_digests(), self.train_sequences) & (lengths > 0)  # (an empty one repeats none)

    # ------------------------------------------------------------------ use
    def placement(self, layer: int) -> ExpertPlacement:
        """The :class:`~moelayers.placement.ExpertPlacement` of ``layer``."""
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for a plan of {self.num_layers} layers")
        return ExpertPlacement.from_expert_rank(self.expert_rank[layer], num_ranks=self.num_ranks)

    def check_compatible(self, num_experts: int, num_ranks: int, num_layers: int | None = None) -> None:
        """Raise ``ValueError`` (naming the file and field) unless made for these sizes."""
        for name, mine, want in (("num_experts", self.num_experts, num_experts), ("num_ranks", self.num_ranks, num_ranks),
                                 ("expert_rank (layers)", self.num_layers, num_layers)):
            if want is not None and mine != want:
                raise ValueError(f"{self.source}: semantic plan field '{name}' is {mine}, but the model/parallel "
                                 f"setup needs {want}; re-plan with recipes/plan.py for this setup")

    def rank_scores(self, layer: int, token_ids: np.ndarray, prev_topk: np.ndarray | None = None) -> np.ndarray:
        """Log-scores ``[n, R]`` float32 of where tokens' activations at ``layer`` land (tp predictor).

        ``token_logq[layer][v] + sum_d w_d sum_k history_pmi[layer, d-1, e_{l-d, k}]``; uses only the
        token ids and the experts of *earlier* layers. Accumulated in float32 in a fixed order (token
        row, then depth by depth, expert by expert): the online shuffler
        (``moelayers.schedule.token_shuffle.HistoryPredictor``) adds the same numbers in the same order.

        Args:
            layer: ``l`` (negative counts from the end, as in :meth:`placement`).
            token_ids: ``[n]``.
            prev_topk: ``[n, D', K]`` experts at layers ``l-1, l-2, ...`` (``D' <= D``; ``None`` = none).

        Raises:
            IndexError: ``layer`` out of range.
            ValueError: a token id outside the vocabulary, or ``prev_topk`` not ``[n, D', K]`` expert ids.
        """
        if (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))
                or not -self.num_layers <= layer < self.num_layers):
            raise IndexError(f"layer {layer!r} out of range for a plan of {self.num_layers} layers")
        layer = int(layer) % self.num_layers  # -1 is the last layer, as in placement()
        ids = check_token_ids(token_ids, self.vocab_size)
        if prev_topk is not None:
            prev = np.asarray(prev_topk)
            if prev.ndim != 3 or prev.shape[0] != ids.size or prev.dtype.kind not in "iu":
                raise ValueError(f"prev_topk must be [n={ids.size}, D', K] integer expert ids, got shape "
                                 f"{list(prev.shape)} dtype {prev.dtype}")
            if prev.size and (prev.min() < 0 or prev.max() >= self.num_experts):  # -1 would wrap to the last expert
                bad = int(prev.min()) if prev.min() < 0 else int(prev.max())
                raise ValueError(f"prev_topk has expert id {bad} outside [0, num_experts={self.num_experts})")
        if self.token_logq is not None:
            out = self.token_logq[layer].take(ids, axis=0).astype(np.float32)  # take: a faster row gather
        else:  # only (token_rank, token_conf): the conf on token_rank, the rest spread evenly
            conf = np.clip(self.token_conf[layer][ids], 1e-4, 1 - 1e-4)
            out = np.tile(np.log((1 - conf) / max(self.num_ranks - 1, 1))[:, None], (1, self.num_ranks))
            out[np.arange(ids.size), self.token_rank[layer][ids]] = np.log(conf)
            out = out.astype(np.float32)
        if prev_topk is not None and self.history_pmi is not None:
            prev = np.asarray(prev_topk)
            if prev.dtype.kind != "i":  # signed ints index as they are
                prev = prev.astype(np.int64)
            for d in range(min(prev.shape[1], self.history_pmi.shape[1], layer)):
                w = np.float32(self.history_weight[d])
                if w == 0:
                    continue
                table = self.history_pmi[layer, d]
                term = table.take(prev[:, d, 0], axis=0)
                for k in range(1, prev.shape[2]):
                    term += table.take(prev[:, d, k], axis=0)
                out += term if w == 1 else w * term
        return out

    # ------------------------------------------------------------------ files
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The plan's fields as numpy arrays (what :meth:`save` writes; ``source`` and absent
        fields left out)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "source" or value is None:
                continue
            out[f.name] = np.asarray(value)
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan (npz) atomically: temp file in the same folder, then ``os.replace``."""
        self.validate()
        arrays = self.to_arrays()
        atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path: str | os.PathLike) -> SemanticPlan:
        """Read and validate a plan written by :meth:`save`."""
        path = Path(path)
        arrays = read_npz(path, "semantic plan file")
        # first: a newer plan may lack or add fields, and another kind of file has another version
        version = check_format_version(arrays, path, "semantic plan", FORMAT_VERSION, ("semantic_plan",))
        missing = [k for k in _REQUIRED if k not in arrays]
        if missing:
            raise ValueError(f"{path}: semantic plan is missing field(s) {missing}")
        unknown = sorted(set(arrays) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise ValueError(f"{path}: semantic plan has unknown field(s) {unknown}")
        kw = {}
        for k, a in arrays.items():
            if k in ("num_ranks", "num_experts", "vocab_size", "seed", "format_version", "top_k"):
                if a.ndim != 0 or a.dtype.kind not in "iu":
                    raise ValueError(f"{path}: semantic plan field '{k}' must be an integer scalar")
                kw[k] = int(a)
            elif k in ("mode", "solver"):
                if a.ndim != 0 or a.dtype.kind != "U":
                    raise ValueError(f"{path}: semantic plan field '{k}' must be a string")
                kw[k] = str(a)
            elif k == "theta":
                if a.ndim != 0 or a.dtype.kind not in "iuf":
                    raise ValueError(f"{path}: semantic plan field 'theta' must be a number")
                kw[k] = float(a)
            else:
                kw[k] = a
        kw["format_version"] = version  # (1 for a file without the entry: saved again, it stays readable as such)
        return cls(**kw, source=str(path))


if TYPE_CHECKING:  # what the lazy name below is (type checkers see it, and no other name, here)
    from moelayers.planning.semantic_solvers import plan_semantic  # noqa: F401
else:
    def __getattr__(name: str) -> Any:
        """``plan_semantic`` lives in :mod:`moelayers.planning.semantic_solvers` (which imports this module)."""
        if name == "plan_semantic":
            from moelayers.planning import semantic_solvers

            return semantic_solvers.plan_semantic
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
