"""The attention-TP rank predictor of a semantic plan: a log-linear model fitted on the training trace.

At layer ``l`` a token (id ``v``, experts ``e[l-d, k]`` at the ``D`` previous layers) scores rank ``r``::

    s[r] = a[b(v)] * log q_l(r | v) + c_l[r] + sum_{d=1..D} sum_k W_l[d-1, e[l-d, k], r]

``q_l`` is the token→rank table (:func:`~moelayers.planning.semantic.token_rank_probs`), ``b(v)`` the
frequency bucket of the profile behind ``v``'s row (:func:`frequency_bucket`): rare tokens' rows are
trusted less, by as much as the data says. The weights come from a multinomial logistic regression
with soft labels (the share of the token's ``K`` activations at ``l`` landing on each rank, so the
fit maximises the expected log-likelihood of where its activations go) on a sample of training
tokens whose token rows leave their own *sequence* out (:func:`leave_sequence_out`): a held-out
request is never part of the profile, so its tokens' rows are as noisy as these.

The token part folds into ``token_logq[l][v] = a[b(v)] log q_l(r | v) + c_l`` and the history part
is ``W_l`` (the plan's ``history_pmi``), so :meth:`SemanticPlan.rank_scores` evaluates ``s`` with
table lookups and additions only (what the online shuffler does, in the same order).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["FREQUENCY_EDGES", "frequency_bucket", "leave_sequence_out", "history_onehot", "RankModel",
           "fit_rank_model", "minimize_lbfgs"]

FREQUENCY_EDGES = (1, 2, 4, 8, 32, 128)  # profile occurrences: buckets [0], [1], [2, 3], [4, 7], ..., [128, inf)
_ROW_BLOCK = 2048  # rows per block of _SparseRows products (a block's [rows, R] float64 stays in cache)


def frequency_bucket(count: np.ndarray) -> np.ndarray:
    """``[n]`` int64 bucket of profile counts ``[n]`` (bucket ``i`` = ``count < FREQUENCY_EDGES[i]``, first true)."""
    return np.searchsorted(np.asarray(FREQUENCY_EDGES), np.asarray(count), side="right").astype(np.int64)


def leave_sequence_out(rank_probs: np.ndarray, token_freq: np.ndarray, seq_counts: np.ndarray, seq_freq: np.ndarray,
                       top_k: int, smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """Token→rank rows with the token's own sequence taken out of the profile.

    ``rank_probs`` rows are ``(counts + a K p) / (K f + a K)`` (see ``token_rank_probs``); removing the
    ``f_s`` occurrences of the token in its sequence (``seq_counts`` activations per rank) gives
    ``(counts - seq_counts + a K p) / (K (f - f_s) + a K)``.

    Args:
        rank_probs: ``[n, R]`` the tokens' rows of ``Pr(rank | token)``.
        token_freq: ``[n]`` profile occurrences of each token id ``f``.
        seq_counts: ``[n, R]`` activations per rank of the token id within the token's sequence.
        seq_freq: ``[n]`` occurrences of the token id within its sequence ``f_s`` (``>= 1``).

    Returns:
        ``(log_rows [n, R] float32, remaining [n] int64 = f - f_s)``.
    """
    k, a = float(top_k), float(smoothing)
    f = np.asarray(token_freq, dtype=np.float64)
    raw = rank_probs * (k * f + a * k)[:, None] - seq_counts
    rest = f - seq_freq
    rows = np.maximum(raw, 1e-9) / (k * rest + a * k)[:, None]
    return np.log(rows).astype(np.float32), rest.astype(np.int64)


def history_onehot(topk_ids: np.ndarray, layer: int, depth: int, num_experts: int) -> np.ndarray:
    """``[n, depth * E]`` float32 counts of the experts at layers ``layer-1 .. layer-depth`` (block ``d-1`` = ``l-d``).

    Args:
        topk_ids: ``[n, L, K]`` routing of the tokens.

    Returns:
        Zero blocks for ``d > layer``.
    """
    n = topk_ids.shape[0]
    out = np.zeros((n, depth * num_experts), dtype=np.float32)
    rows = np.arange(n)[:, None]
    for d in range(1, min(depth, layer) + 1):  # a token's K experts at a layer are distinct
        out[rows, topk_ids[:, layer - d].astype(np.int64) + (d - 1) * num_experts] = 1.0
    return out


class RankModel:
    """Fitted weights of one layer: ``a [B]`` per frequency bucket, ``c [R]``, ``w [D*E, R]`` (``W`` of the module, flat)."""

    def __init__(self, a: np.ndarray, c: np.ndarray, w: np.ndarray) -> None:
        self.a, self.c, self.w = np.asarray(a, np.float64), np.asarray(c, np.float64), np.asarray(w, np.float32)

    def token_scores(self, log_rows: np.ndarray, bucket: np.ndarray) -> np.ndarray:
        """``[n, R]`` float32 token part ``a[b] log q + c``."""
        return (self.a[bucket][:, None] * log_rows + self.c).astype(np.float32)

    def scores(self, log_rows: np.ndarray, bucket: np.ndarray, hist: np.ndarray) -> np.ndarray:
        """``[n, R]`` float32 scores from the token rows and ``hist [n, D*E]`` (:func:`history_onehot`)."""
        return (self.token_scores(log_rows, bucket) + _SparseRows(hist) @ self.w).astype(np.float32)


class _SparseRows:
    """A mostly-zero ``[n, F]`` matrix (the history one-hot) as its non-zeros, for products summed in
    a fixed order: BLAS splits the sums of a dense product by thread count, so a plan would depend
    on the number of threads. Here each output entry adds its terms one by one in index order, in
    float64 (``np.bincount``; row by row where every row has as many non-zeros, as a history has)."""

    def __init__(self, dense: np.ndarray) -> None:
        # row-major: each row's non-zeros are contiguous, in column order (as np.nonzero's, but
        # contiguous arrays: np.nonzero's are strided views, which every bincount would copy)
        flat = np.flatnonzero(dense)
        f = max(dense.shape[1], 1)
        self._setup(dense.shape, flat // f, flat % f, np.ravel(dense)[flat].astype(np.float64))

    def _setup(self, shape: tuple[int, int], rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        self.shape, self.rows, self.cols, self.vals = tuple(shape), rows, cols, vals
        self.ones = bool(np.all(self.vals == 1.0))  # a one-hot: no products to form
        per_row = np.bincount(self.rows, minlength=self.shape[0])
        self.per_row = int(per_row[0]) if per_row.size and np.all(per_row == per_row[0]) else None
        # the k-th non-zero of every row, contiguous per k (a strided index made every gather 4x slower)
        self._cols_k = (np.ascontiguousarray(self.cols.reshape(self.shape[0], self.per_row).T)
                        if self.per_row is not None else None)
        self._flat: tuple[int, np.ndarray] | None = None  # (R, [nnz * R] bins col * R + j) of rmatmul_t

    @classmethod
    def history(cls, topk_ids: np.ndarray, layer: int, depth: int, num_experts: int) -> _SparseRows:
        """``_SparseRows(history_onehot(topk_ids, layer, depth, num_experts))`` without the dense matrix:
        the same non-zeros in the same order (each row: block by block, each block's experts ascending)."""
        n, k = topk_ids.shape[0], topk_ids.shape[2]
        d = min(depth, layer)
        shape = (n, depth * num_experts)
        if n == 0 or k == 0 or d == 0:
            return cls(history_onehot(topk_ids, layer, depth, num_experts))
        blocks = np.sort(topk_ids[:, layer - d:layer][:, ::-1], axis=2).astype(np.int64)  # [n, d, K]: l-1, l-2, ...
        if blocks[:, :, 0].min() < 0 or blocks[:, :, -1].max() >= num_experts or (blocks[:, :, 1:] == blocks[:, :, :-1]).any():
            return cls(history_onehot(topk_ids, layer, depth, num_experts))  # repeated or bad ids: as the dense does
        blocks += (np.arange(d, dtype=np.int64) * num_experts)[:, None]
        self = cls.__new__(cls)
        self._setup(shape, np.repeat(np.arange(n, dtype=np.int64), d * k), blocks.reshape(-1), np.ones(n * d * k))
        return self

    def __matmul__(self, w: np.ndarray) -> np.ndarray:
        """``dense @ w`` for ``w [F, R]``: ``[n, R]`` float64."""
        n, r = self.shape[0], w.shape[1]
        w64 = np.asarray(w, dtype=np.float64)
        if self.per_row is not None:  # the k-th non-zero of every row at once, k in order
            vals = None if self.ones else self.vals.reshape(n, self.per_row)
            out, term = np.zeros((n, r)), np.empty((min(n, _ROW_BLOCK), r))
            # by blocks of rows, so that the block's sum and the gathered terms stay in cache (each
            # entry still adds its terms in k order, one by one, starting from 0)
            for lo in range(0, n, _ROW_BLOCK):
                o = out[lo:lo + _ROW_BLOCK]
                t = term[:o.shape[0]]
                for k in range(self.per_row):
                    np.take(w64, self._cols_k[k, lo:lo + _ROW_BLOCK], axis=0, out=t)
                    o += t if vals is None else vals[lo:lo + _ROW_BLOCK, k, None] * t
            return out
        out = [np.bincount(self.rows, weights=self.vals * w64[self.cols, j], minlength=n) for j in range(r)]
        return np.stack(out, axis=1) if out else np.zeros((n, 0))

    def rmatmul_t(self, g: np.ndarray) -> np.ndarray:
        """``dense.T @ g`` for ``g [n, R]``: ``[F, R]`` float64: each entry adds its rows' terms one by
        one in row order, starting from 0 (``bincount``)."""
        f, r = self.shape[1], g.shape[1]
        g64 = np.asarray(g, dtype=np.float64)
        if self.per_row is not None:  # rows = [0]*P + [1]*P + ...: one bincount per column j over the
            gt = np.ascontiguousarray(g64.T)  # non-zeros (cache-sized arrays, no [nnz, R] temporaries)
            out = np.empty((f, r))
            for j in range(r):
                terms = np.repeat(gt[j], self.per_row)
                if not self.ones:
                    terms *= self.vals
                out[:, j] = np.bincount(self.cols, weights=terms, minlength=f)
            return out
        if self._flat is None or self._flat[0] != r:
            self._flat = (r, (self.cols[:, None] * r + np.arange(r)).ravel())
        terms = np.take(g64, self.rows, axis=0)  # [nnz, R]
        if not self.ones:
            terms *= self.vals[:, None]
        return np.bincount(self._flat[1], weights=terms.ravel(), minlength=f * r).reshape(f, r)


def fit_rank_model(log_rows: np.ndarray, bucket: np.ndarray, hist: np.ndarray, target: np.ndarray, *,
                   l2: float = 1e-3, maxiter: int = 25) -> RankModel:
    """Multinomial logistic regression of where a token's activations land (soft labels).

    Minimises ``-mean_t sum_r target[t, r] log softmax(s_t)[r] + l2 * |W|^2`` over ``a, c, W`` with
    L-BFGS from ``a = 1, c = 0, W = 0`` (the plain token table); the decisions it drives (argmax
    ranks) settle long before the loss does, so a few tens of iterations suffice.

    Args:
        log_rows: ``[n, R]`` leave-sequence-out ``log Pr(rank | token)``.
        bucket: ``[n]`` frequency bucket of each row (``< len(FREQUENCY_EDGES) + 1``).
        hist: ``[n, D*E]`` :func:`history_onehot` of the tokens (``D = 0``: token table only), or the
            same as ``_SparseRows.history`` (no dense matrix).
        target: ``[n, R]`` share of each token's activations on each rank (rows sum to 1).
        l2: ridge weight of the history table.
        maxiter: L-BFGS iterations.

    Returns:
        :class:`RankModel`; buckets without rows take the nearest fitted bucket's ``a``.
    """
    r = target.shape[1]
    nb = len(FREQUENCY_EDGES) + 1
    x0 = np.concatenate([np.ones(nb), np.zeros(r + hist.shape[1] * r)])
    x = minimize_lbfgs(_rank_loss(log_rows, bucket, hist, target, l2), x0, maxiter=maxiter)
    a, c, w = x[:nb], x[nb:nb + r], x[nb + r:].reshape(hist.shape[1], r)
    a = _fill_nearest(np.where(np.bincount(bucket, minlength=nb) > 0, a, np.nan))
    return RankModel(a, c - c.max(), w)


def _rank_loss(log_rows: np.ndarray, bucket: np.ndarray, hist: np.ndarray, target: np.ndarray,
               l2: float) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    """``x -> (loss, grad)`` of :func:`fit_rank_model` for ``x = [a (B), c (R), W (D*E*R)]``."""
    n, r = target.shape
    nb, nf = len(FREQUENCY_EDGES) + 1, hist.shape[1]
    lq, y = np.asarray(log_rows, np.float32), np.asarray(target, np.float32)
    # products in a fixed order: the fit does not depend on the thread count
    sparse = hist if isinstance(hist, _SparseRows) else _SparseRows(hist)

    def loss_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
        a, c, w = x[:nb], x[nb:nb + r], x[nb + r:].reshape(nf, r)
        z = (a[bucket][:, None] * lq + c).astype(np.float32) + (sparse @ w.astype(np.float32)).astype(np.float32)
        z -= z.max(1, keepdims=True)
        p = np.exp(z)
        s = p.sum(1, keepdims=True)
        p /= s
        loss = -float((y * (z - np.log(s))).sum(dtype=np.float64)) / n + l2 * float((w * w).sum())
        g = (p - y) / np.float32(n)
        ga = np.bincount(bucket, weights=(g * lq).sum(1), minlength=nb)
        gw = sparse.rmatmul_t(g) + 2 * l2 * w
        return loss, np.concatenate([ga, g.sum(0, dtype=np.float64), gw.ravel()])

    return loss_grad


def _fill_nearest(a: np.ndarray) -> np.ndarray:
    """``a`` with every NaN replaced by the nearest (lower on ties) non-NaN entry; all NaN: ones."""
    ok = np.flatnonzero(~np.isnan(a))
    if ok.size == 0:
        return np.ones_like(a)
    return a[ok[np.argmin(np.abs(np.arange(a.size)[:, None] - ok[None, :]), axis=1)]]


def minimize_lbfgs(loss_grad: Callable[[np.ndarray], tuple[float, np.ndarray]], x0: np.ndarray, *, maxiter: int = 60,
                   memory: int = 8, tol: float = 1e-7) -> np.ndarray:
    """Minimise a smooth function with L-BFGS (two-loop recursion, Armijo backtracking).

    Args:
        loss_grad: ``x -> (f(x), grad f(x))``.
        x0: start.
        maxiter: iterations; stops earlier once ``f`` changes by less than ``tol`` (relative).

    Returns:
        The last iterate.
    """
    x = np.array(x0, dtype=np.float64)
    f, g = loss_grad(x)
    mem_s: list[np.ndarray] = []
    mem_y: list[np.ndarray] = []
    for _ in range(maxiter):
        q = g.copy()
        alphas = []
        for s, yv in zip(reversed(mem_s), reversed(mem_y)):
            rho = 1.0 / float(yv @ s)
            alpha = rho * float(s @ q)
            q -= alpha * yv
            alphas.append((rho, alpha))
        if mem_s:
            q *= float(mem_s[-1] @ mem_y[-1]) / float(mem_y[-1] @ mem_y[-1])
        else:
            q /= max(float(np.linalg.norm(g)), 1.0)
        for (s, yv), (rho, alpha) in zip(zip(mem_s, mem_y), reversed(alphas)):
            q += (alpha - rho * float(yv @ q)) * s
        step, slope = -q, -float(g @ q)
        if slope >= 0:  # not a descent direction: restart from the gradient
            mem_s.clear(), mem_y.clear()
            step, slope = -g, -float(g @ g)
        t = 1.0
        while True:
            fn, gn = loss_grad(x + t * step)
            if fn <= f + 1e-4 * t * slope or t < 1e-8:
                break
            t *= 0.5
        s, yv = t * step, gn - g
        if float(s @ yv) > 1e-12:
            mem_s.append(s), mem_y.append(yv)
            if len(mem_s) > memory:
                mem_s.pop(0), mem_y.pop(0)
        x, f_old, f, g = x + s, f, fn, gn
        if abs(f_old - f) <= tol * max(1.0, abs(f)):
            break
    return x
