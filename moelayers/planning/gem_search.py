"""GEM search: greedy initial mapping, best-swap refinement, restarts (vectorised numpy).

Given objective steps ``X [S, E]`` (rows per expert per step) and curves ``C_r``, minimise
``F(M) = sum_s max_r C_r(rows_r(M, s))`` over placements with ``E / R`` experts per rank.

* greedy: experts by decreasing total load, each onto the rank (with a free slot) whose choice
  raises ``F`` least (ties: the rank whose own latency stays lowest);
* best swap: every round scores *all* swaps ``(i, j)`` of experts on different ranks at once —
  ``A[i, j, s] = C_{r_i}(rows_{r_i, s} - X_{s,i} + X_{s,j})`` is kept incrementally (only the rows
  of the two changed ranks are recomputed), the other ranks enter through the per-step top-3 —
  and applies the best one, until it gains less than ``min_gain`` (0.1 %) of ``F``;
* restarts: run ``k > 0`` starts the greedy from utilisations perturbed by ``noise`` (20 %).
"""

from __future__ import annotations

import numpy as np

__all__ = ["greedy", "refine", "search", "objective"]


def objective(expert_rank: np.ndarray, x: np.ndarray, curves) -> float:
    """``F = sum_s max_r C_r(rows_r)`` for objective steps ``x [S, E]`` (any real loads)."""
    num_r = curves.num_ranks
    rows = np.zeros((x.shape[0], num_r))
    np.add.at(rows.T, expert_rank, x.T)
    return float(curves(rows).max(axis=1).sum())


def greedy(x: np.ndarray, curves, per_rank: int, *, order_loads: np.ndarray | None = None) -> np.ndarray:
    """Greedy initial mapping.

    Args:
        x: ``[S, E]`` objective steps.
        curves: ``R`` latency curves (``eval_ranks``).
        per_rank: experts per rank (``E / R``).
        order_loads: ``[S, E]`` loads that decide the order and the choices (default ``x``; restarts
            pass perturbed utilisations).

    Returns:
        ``expert_rank [E]`` int64.
    """
    x = x if order_loads is None else order_loads
    num_s, num_e = x.shape
    num_r = curves.num_ranks
    ranks = np.arange(num_r)
    rows = np.zeros((num_s, num_r))
    lat = curves.eval_ranks(rows, ranks)
    cur = lat.max(axis=1)  # [S]
    free = np.full(num_r, per_rank)
    er = np.full(num_e, -1, dtype=np.int64)
    for e in np.argsort(-x.sum(axis=0), kind="stable"):
        cand = curves.eval_ranks(rows + x[:, e:e + 1], ranks)  # [S, R]
        rise = np.maximum(cand, cur[:, None]).sum(axis=0) - cur.sum()
        own = cand.sum(axis=0)
        key = np.where(free > 0, rise + 1e-6 * own / max(num_s, 1), np.inf)
        r = int(np.argmin(key))
        er[e] = r
        free[r] -= 1
        rows[:, r] += x[:, e]
        lat[:, r] = cand[:, r]
        cur = lat.max(axis=1)
    return er


def _others_max(lat: np.ndarray) -> np.ndarray:
    """``O [R, R, S]``: per step, the largest latency among ranks other than ``a`` and ``b``."""
    num_s, num_r = lat.shape
    k = min(3, num_r)
    top = np.argsort(-lat, axis=1, kind="stable")[:, :k]  # [S, k]
    vals = np.take_along_axis(lat, top, axis=1)  # [S, k]
    a = np.arange(num_r)[:, None, None, None]
    b = np.arange(num_r)[None, :, None, None]
    ok = (top[None, None] != a) & (top[None, None] != b)  # [R, R, S, k]
    first = np.argmax(ok, axis=-1)  # [R, R, S]
    out = np.take_along_axis(np.broadcast_to(vals, (num_r, num_r, num_s, k)), first[..., None], axis=-1)[..., 0]
    return np.where(ok.any(axis=-1), out, 0.0)


def refine(expert_rank: np.ndarray, x: np.ndarray, curves, *, min_gain: float = 1e-3,
           max_rounds: int | None = None) -> tuple[np.ndarray, float]:
    """Best-swap refinement until the best swap gains less than ``min_gain * F``.

    Args:
        expert_rank: ``[E]`` starting placement.
        x: ``[S, E]`` objective steps.
        curves: ``R`` latency curves.
        min_gain: relative gain below which the search stops.
        max_rounds: cap on swaps (default ``4 E``).

    Returns:
        ``(expert_rank [E], F)``.
    """
    er = np.array(expert_rank, dtype=np.int64)
    num_s, num_e = x.shape
    num_r = curves.num_ranks
    xt = np.ascontiguousarray(x.T)  # [E, S]
    rows = np.zeros((num_r, num_s))
    np.add.at(rows, er, xt)
    lat = curves.eval_ranks(rows.T, np.arange(num_r))  # [S, R]
    # A[i, j, s]: latency of i's rank if i is swapped for j
    A = curves.eval_ranks((rows[er] - xt)[:, None, :] + xt[None, :, :], er[:, None, None])
    f = float(lat.max(axis=1).sum())
    max_rounds = 4 * num_e if max_rounds is None else max_rounds
    for _ in range(max_rounds):
        others = _others_max(lat)[er][:, er]  # [E, E, S]
        new = np.maximum(A, A.transpose(1, 0, 2))
        np.maximum(new, others, out=new)
        tot = new.sum(axis=2)
        tot[er[:, None] == er[None, :]] = np.inf
        flat = int(np.argmin(tot))
        i, j = divmod(flat, num_e)
        if f - tot[i, j] < min_gain * f:
            break
        a, b = er[i], er[j]
        rows[a] += xt[j] - xt[i]
        rows[b] += xt[i] - xt[j]
        er[i], er[j] = b, a
        lat[:, a] = curves.eval_ranks(rows[a], a)
        lat[:, b] = curves.eval_ranks(rows[b], b)
        f = float(lat.max(axis=1).sum())
        moved = np.flatnonzero((er == a) | (er == b))
        A[moved] = curves.eval_ranks((rows[er[moved]] - xt[moved])[:, None, :] + xt[None, :, :],
                                     er[moved][:, None, None])
    return er, f


def search(loads: np.ndarray, curves, *, restarts: int = 8, seed: int = 0, method: str = "robust",
           noise: float = 0.2, min_gain: float = 1e-3) -> np.ndarray:
    """Greedy + best swap with ``restarts`` starts; see :func:`moelayers.planning.gem.plan_gem`.

    Returns:
        ``expert_rank [E]`` int64, ``E / R`` experts per rank.
    """
    if method not in ("plain", "robust"):
        raise ValueError(f"method must be 'plain' or 'robust', got {method!r}")
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    x = np.asarray(loads, dtype=np.float64)
    num_e, num_r = x.shape[1], curves.num_ranks
    per_rank = num_e // num_r
    rng = np.random.default_rng(seed)
    best, best_f = None, np.inf
    for k in range(restarts):
        order = x if k == 0 else x * (1.0 + noise * rng.uniform(-1.0, 1.0, size=(1, num_e)))
        er = greedy(x, curves, per_rank, order_loads=order)
        er, f = refine(er, x, curves, min_gain=min_gain)
        if f < best_f - 1e-15:
            best, best_f = er, f
    return best
