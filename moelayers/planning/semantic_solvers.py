"""Co-clustering solvers of Sem-MoE / Speculative MoE, and :func:`plan_semantic`.

Objective (both papers), per layer, for a placement ``expert_rank [E]`` (``E / R`` experts per rank,
expert loads per rank within ``slack`` of the mean) and a token→rank assignment::

    J = theta * (token-load imbalance: max / mean tokens per rank - 1)
      + (1 - theta) * (expected remote activations: share of (token, k) activations off the token's rank)

The tokens are the profiled token occurrences (each with its routing at the layer; at most
``sample`` of them, drawn with the seed); given a placement each token takes the rank holding most
of its experts, at most ``beta * mean`` tokens per rank (:func:`~moelayers.planning.semantic_eval.capacity_assign`).

* ``alternating`` (Sem-MoE Algorithm 1): start from a co-activation clustering of the experts
  (best of a few seeded restarts), then alternate request scheduling (tokens → ranks) and expert
  placement (experts → ranks maximising co-location, :func:`assign_experts`) until stable, then
  random-swap fine-tuning (swap two experts of different ranks, keep it if ``J`` drops).
* ``cem`` (Speculative MoE Algorithm 1, cross-entropy method): a ``[E, R]`` categorical matrix;
  each round samples placements (Gumbel-perturbed, capacity-respecting), keeps the ``rho`` elite
  by ``J`` and moves the matrix towards their frequencies; ``beta`` is the token capacity factor.

In ``tp`` mode the plan also carries the online predictor of a token's rank at each layer, fitted
once the layer is placed (:mod:`moelayers.planning.semantic_predict`: token table and the token's
experts at the previous ``history`` layers, leave-sequence-out). Expert loads per rank are capped
at ``slack`` × the mean, or at the least a single hot expert allows (:func:`load_cap`).

In ``dp`` mode a request keeps one rank at every layer, so requests are clustered once and the
placements of all layers are solved against the same clusters (:func:`solve_dp`).
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from moelayers.placement import indivisible_experts
from moelayers.planning.semantic import (
    SemanticPlan, build_token_table, nearest_seen_tokens, ngram_tables, rank_counts, token_rank_probs,
)
from moelayers.planning.semantic_eval import capacity_assign, request_schedule
from moelayers.planning.semantic_predict import _SparseRows, fit_rank_model, frequency_bucket, leave_sequence_out

__all__ = ["load_cap", "assign_experts", "coactivation_clusters", "LayerObjective", "solve_alternating", "solve_cem",
           "solve_dp", "plan_semantic", "SOLVERS", "SETTINGS", "check_settings"]

SOLVERS = ("alternating", "cem")


def load_cap(load: np.ndarray, num_ranks: int, slack: float) -> float:
    """Most expert load a rank may hold: ``slack`` × the mean, or the least any placement can do.

    With ``E / R`` experts per rank, the rank of the heaviest expert holds at least it plus the
    ``E / R - 1`` lightest others; when that exceeds ``slack`` × mean it is the cap, so a single hot
    expert does not free the other ranks (nor its own) from balancing.

    Args:
        load: ``[E]`` expert loads.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.size == 0:
        return 0.0
    per = load.size // num_ranks
    floor = load.max() + np.sort(load)[: per - 1].sum() if per > 1 else load.max()
    return float(max(load.sum() / num_ranks * slack, floor))


def assign_experts(affinity: np.ndarray, load: np.ndarray, num_ranks: int, *, slack: float = 1.1,
                   max_swaps: int = 4000) -> np.ndarray:
    """Experts → ranks maximising ``sum_e affinity[e, rank(e)]``, ``E / R`` per rank, load ``<= slack * mean``.

    Greedy by regret (experts with the most to lose first), then best pairwise swaps.

    Args:
        affinity: ``[E, R]`` gain of each expert on each rank.
        load: ``[E]`` expert loads (activations).
        num_ranks: ``R`` (must be ``affinity``'s second size).
        slack: the load cap, ``slack`` times the mean rank load (see :func:`load_cap`).
        max_swaps: the most pairwise swaps tried after the greedy pass.

    Returns:
        ``expert_rank [E]`` int64.

    Raises:
        ValueError: ``affinity`` is not ``[E, num_ranks]``.
    """
    a = np.asarray(affinity, dtype=np.float64)
    load = np.asarray(load, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != num_ranks:
        raise ValueError(f"affinity must be [E, num_ranks={num_ranks}], got {list(a.shape)}")
    num_e, r = a.shape
    per = num_e // r
    cap = load_cap(load, r, slack)
    er = np.full(num_e, -1, dtype=np.int64)
    cnt, rl = np.zeros(r, np.int64), np.zeros(r)
    srt = np.sort(a, axis=1)
    regret = srt[:, -1] - (srt[:, -2] if r > 1 else 0)
    for e in np.lexsort((-load, -regret)):
        room = (cnt < per) & (rl + load[e] <= cap)
        if not room.any():
            room = cnt < per
            choice = int(np.argmin(np.where(room, rl, np.inf)))
        else:
            choice = int(np.argmax(np.where(room, a[e], -np.inf)))
        er[e] = choice
        cnt[choice] += 1
        rl[choice] += load[e]
    return _swap_improve(_repair_load(er, load, r, cap), a, load, r, cap, max_swaps)


def _repair_load(er: np.ndarray, load: np.ndarray, r: int, cap: float) -> np.ndarray:
    """Swap experts of the busiest rank with experts of any other rank until every rank is within
    ``cap`` (each swap: the one that lowers the pair's larger load most), or no swap helps."""
    for _ in range(er.size):
        rl = np.bincount(er, weights=load, minlength=r)
        hi = int(np.argmax(rl))
        if rl[hi] <= cap:
            break
        a, b = np.flatnonzero(er == hi), np.flatnonzero(er != hi)
        diff = load[a][:, None] - load[b][None, :]  # load moved off the busiest rank by swapping a <-> b
        new_max = np.maximum(rl[hi] - diff, rl[er[b]][None, :] + diff)
        new_max[diff <= 0] = np.inf
        i, j = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
        if not new_max[i, j] < rl[hi]:
            break
        er[a[i]], er[b[j]] = er[b[j]], hi
    return er


def _swap_improve(er: np.ndarray, aff: np.ndarray, load: np.ndarray, r: int, cap: float, max_swaps: int,
                  pair: np.ndarray | None = None) -> np.ndarray:
    """Best-improvement pairwise swaps of experts between ranks, loads within ``cap``.

    The value of a placement is ``sum_i aff[i, er[i]]``; with ``pair`` (``[E, E]``, zero diagonal)
    ``aff`` is the co-activation with each rank's experts, ``pair @ onehot(er)``, kept up to date
    as experts move (quadratic objective: a swapped pair's own term is subtracted twice). Each step
    takes the swap that raises the value most; it stops when none does (by more than a relative
    ``1e-9``) or after ``max_swaps``.

    The swap gains ``delta [E, E]`` are computed once, then after each swap only for the experts
    on the two ranks it changed (rows and columns of ``2 E / R`` experts; the others' gains are
    unchanged): ``O(E^2 / R)`` a swap instead of ``O(E^2)`` passes and an ``O(E^2 R)`` product. The
    same numbers, so the same swaps, as :func:`_swap_improve_reference` (which recomputes
    everything each step) wherever ``pair`` holds integers (co-activation counts), whose sums are
    exact in any order.

    Args:
        er: ``[E]`` starting ranks (changed in place and returned).
        aff: ``[E, R]`` value of each expert on each rank (with ``pair``: ignored, made from it).
        load, r, cap, max_swaps: expert loads ``[E]``, ranks, the per-rank load cap, the step limit.
    """
    num_e = er.size
    load = np.asarray(load, dtype=np.float64)
    aff = pair @ np.eye(r)[er] if pair is not None else aff  # (a fresh array with pair: updated below)
    pair2 = None if pair is None else 2 * pair
    every = np.arange(num_e)
    rl = np.bincount(er, weights=load, minlength=r)
    cur = aff[every, er]

    def gains(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``delta[rows][:, cols]``, swaps that would break a cap or pair two experts of one rank -inf."""
        d = aff[rows][:, er[cols]] + aff[cols][:, er[rows]].T
        d -= cur[rows][:, None]
        d -= cur[cols][None, :]
        if pair2 is not None:
            d -= pair2[np.ix_(rows, cols)]
        bad = er[rows][:, None] == er[cols][None, :]
        bad |= (rl[er[rows]] - load[rows])[:, None] + load[cols][None, :] > cap  # row's rank after the swap
        bad |= (rl[er[cols]] - load[cols])[None, :] + load[rows][:, None] > cap  # column's rank after it
        np.copyto(d, -np.inf, where=bad)
        return d

    delta = gains(every, every)
    for _ in range(max_swaps):
        best = int(np.argmax(delta))
        i, j = divmod(best, num_e)
        if not delta[i, j] > 1e-9 * (abs(cur).sum() + 1e-12):
            break
        a, b = er[i], er[j]
        er[i], er[j] = b, a
        if pair is not None:  # i leaves rank a for b, j the other way
            moved = pair[:, j] - pair[:, i]
            aff[:, a] += moved
            aff[:, b] -= moved
        rl = np.bincount(er, weights=load, minlength=r)
        changed = np.flatnonzero((er == a) | (er == b))  # the experts whose gains moved
        if 2 * changed.size >= num_e:
            cur = aff[every, er]
            delta = gains(every, every)
            continue
        cur[changed] = aff[changed, er[changed]]
        delta[changed] = gains(changed, every)
        delta[:, changed] = gains(every, changed)
    return er


def _swap_improve_reference(er: np.ndarray, aff: np.ndarray, load: np.ndarray, r: int, cap: float, max_swaps: int,
                            pair: np.ndarray | None = None) -> np.ndarray:
    """:func:`_swap_improve` recomputing every gain at every step (``O(E^2 R)`` a swap): the
    readable version, kept for the tests."""
    num_e = er.size
    idx = np.arange(num_e)
    load = np.asarray(load, dtype=np.float64)
    for _ in range(max_swaps):
        g = (pair @ np.eye(r)[er] if pair is not None else aff)[:, er]  # [E, E] value of i on the rank of j
        cur = g[idx, idx]
        delta = g + g.T - cur[:, None] - cur[None, :] - (0 if pair is None else 2 * pair)
        rl = np.bincount(er, weights=load, minlength=r)
        over = (rl[er] - load)[:, None] + load[None, :] > cap  # i's rank after swapping i <-> j
        delta[(er[:, None] == er[None, :]) | over | over.T] = -np.inf
        i, j = divmod(int(np.argmax(delta)), num_e)
        if not delta[i, j] > 1e-9 * (abs(cur).sum() + 1e-12):
            break
        er[i], er[j] = er[j], er[i]
    return er


def coactivation_clusters(coact: np.ndarray, load: np.ndarray, num_ranks: int, rng: np.random.Generator, *,
                          restarts: int = 4, slack: float = 1.1) -> list[np.ndarray]:
    """Expert clusters maximising within-rank co-activation (``E / R`` per rank, loads within ``slack``).

    Args:
        coact: ``[E, E]`` how often two experts serve the same token.

    Returns:
        ``restarts`` local optima (``expert_rank [E]`` each), from seeded random balanced starts.
    """
    m = np.array(coact, dtype=np.float64)
    np.fill_diagonal(m, 0.0)
    num_e = m.shape[0]
    load = np.asarray(load, dtype=np.float64)
    cap = load_cap(load, num_ranks, slack)
    out = []
    for _ in range(restarts):
        er = _repair_load(rng.permutation(np.arange(num_e) % num_ranks), load, num_ranks, cap)  # random, within cap
        out.append(_swap_improve(er, None, load, num_ranks, cap, 4 * num_e, pair=m))
    return out


def objective_value(theta: float, tokens: np.ndarray, local: np.ndarray | float) -> np.ndarray:
    """``J = theta * (max / mean tokens per rank - 1) + (1 - theta) * (1 - local)`` of ``tokens [..., R]``
    (tokens per rank; ``[R]`` or ``[S, R]`` for ``S`` placements) and ``local`` (the share of local
    activations, a scalar or ``[S]``); ``[...]``. No tokens at all count as balanced."""
    mean = tokens.mean(-1)
    imbalance = np.where(mean > 0, tokens.max(-1) / np.maximum(mean, 1e-300), 1.0) - 1.0
    return theta * imbalance + (1.0 - theta) * (1.0 - np.asarray(local, dtype=np.float64))


class LayerObjective:
    """``J`` of one layer on a token sample (see the module docstring).

    Args:
        acts: ``[n, K]`` expert ids of the sampled tokens at this layer.
        num_ranks: ``R``.
        theta: weight of the token-load imbalance.
        beta: token capacity factor: at most ``ceil(beta * n / R)`` tokens per rank.
    """

    def __init__(self, acts: np.ndarray, num_ranks: int, *, theta: float = 0.1, beta: float = 1.1) -> None:
        self.acts = np.asarray(acts).astype(np.int64, copy=False)
        self.n, self.k = self.acts.shape
        self.r, self.theta = num_ranks, float(theta)
        self.cap = int(math.ceil(beta * self.n / num_ranks))

    def assign(self, expert_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens → ranks under ``expert_rank``: ``(token_rank [n], counts [n, R])``."""
        counts = rank_counts(self.acts, expert_rank, self.r)
        tr = capacity_assign(counts.astype(np.float64), np.full((1, self.r), self.cap))
        return tr, counts

    def __call__(self, expert_rank: np.ndarray) -> float:
        tr, counts = self.assign(expert_rank)
        return self.value(tr, counts)

    def batch(self, expert_ranks: np.ndarray) -> np.ndarray:
        """``J`` of ``S`` placements ``[S, E]`` at once: ``[S]``."""
        ers = np.asarray(expert_ranks, dtype=np.int64)
        num_s, n, r = ers.shape[0], self.n, self.r
        ranks = ers[:, self.acts]  # [S, n, K]
        rows = np.arange(num_s * n).reshape(num_s, n, 1)
        counts = np.bincount((rows * r + ranks).ravel(), minlength=num_s * n * r).reshape(num_s * n, r)
        grp = np.repeat(np.arange(num_s), n)
        tr = capacity_assign(counts.astype(np.float64), np.full((num_s, r), self.cap), grp)
        local = counts[np.arange(num_s * n), tr].reshape(num_s, n).sum(1) / (n * self.k)
        tl = np.bincount(grp * r + tr, minlength=num_s * r).reshape(num_s, r)
        return objective_value(self.theta, tl, local)

    def value(self, token_rank: np.ndarray, counts: np.ndarray) -> float:
        local = counts[np.arange(self.n), token_rank].sum() / (self.n * self.k)
        tl = np.bincount(token_rank, minlength=self.r)
        return float(objective_value(self.theta, tl, local))


def solve_alternating(obj: LayerObjective, coact: np.ndarray, load: np.ndarray, rng: np.random.Generator, *,
                      restarts: int = 24, keep: int = 4, slack: float = 1.1, max_iter: int = 10,
                      swaps: int = 64) -> tuple[np.ndarray, float]:
    """Sem-MoE Algorithm 1 for one layer: returns ``(expert_rank [E], J)``.

    ``restarts`` co-activation clusterings (cheap); the ``keep`` with the most within-rank
    co-activation start the alternation; the best by ``J`` gets ``swaps`` random-swap trials.
    """
    num_e, r = coact.shape[0], obj.r
    cap = load_cap(load, r, slack)
    m = coact - np.diag(np.diag(coact))
    starts = coactivation_clusters(coact, load, r, rng, restarts=restarts, slack=slack)
    within = [float((m * (er[:, None] == er[None, :])).sum()) for er in starts]
    best, best_j = None, np.inf
    for i in np.argsort(within, kind="stable")[::-1][:keep]:
        er = starts[i]
        j = obj(er)
        for _ in range(max_iter):  # request scheduling <-> expert placement
            tr, _ = obj.assign(er)
            aff = np.zeros((num_e, r))
            for c in range(r):
                aff[:, c] = np.bincount(obj.acts[tr == c].ravel(), minlength=num_e)
            cand = assign_experts(aff, load, r, slack=slack)
            cj = obj(cand)
            if cj >= j - 1e-12:
                break
            er, j = cand, cj
        if j < best_j:
            best, best_j = er.copy(), j
    return _random_swaps(obj, best, load, rng, cap, swaps)


def _sample_placements(logits: np.ndarray, load: np.ndarray, r: int, cap: float) -> np.ndarray:
    """Capacity-respecting placements ``[S, E]`` from perturbed logits ``[S, E, R]``.

    In each sample the experts, most decided first, take their best rank with room (``E / R``
    experts and load ``<= cap``), then loads are repaired if a rank still exceeds ``cap``.
    """
    num_s, num_e, _ = logits.shape
    per = num_e // r
    order = np.argsort(-logits.max(2), axis=1, kind="stable")
    er = np.empty((num_s, num_e), dtype=np.int64)
    cnt, rl = np.zeros((num_s, r), np.int64), np.zeros((num_s, r))
    rows = np.arange(num_s)
    for p in range(num_e):
        e = order[:, p]
        room = cnt < per
        fits = room & (rl + load[e][:, None] <= cap)
        allowed = np.where(fits.any(1, keepdims=True), fits, room)
        c = np.argmax(np.where(allowed, logits[rows, e], -np.inf), axis=1)
        er[rows, e] = c
        cnt[rows, c] += 1
        rl[rows, c] += load[e]
    for i in np.flatnonzero(rl.max(1) > cap):
        er[i] = _repair_load(er[i], load, r, cap)
    return er


CEM_STEP = 0.7  # how far one round of the cross-entropy method moves P toward its elite


def solve_cem(obj: LayerObjective, load: np.ndarray, rng: np.random.Generator, *, rho: float = 0.2,
              samples: int = 48, iters: int = 25, step: float = CEM_STEP, slack: float = 1.1, batch_tokens: int = 2048,
              swaps: int = 64, init: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Speculative MoE Algorithm 1 (cross-entropy method) for one layer: ``(expert_rank [E], J)``.

    A categorical matrix ``P [E, R]`` (uniform at first) is sampled ``samples`` times a round
    (Gumbel-perturbed, capacity-respecting); the ``rho`` elite by ``J`` (evaluated on at most
    ``batch_tokens`` of the token sample, every ``ceil(n / batch_tokens)``-th: spread over the file)
    move it: ``P <- step * elite_freq + (1 - step) * P``.
    Stops after ``iters`` rounds or once ``P`` is near-deterministic; the best placement seen then
    gets ``swaps`` random-swap trials on the full sample, as in :func:`solve_alternating`.

    Args:
        init: optional ``[E]`` placement whose one-hot (mixed 50/50 with uniform) starts ``P``.
    """
    num_e, r = load.size, obj.r
    cap = load_cap(load, r, slack)
    prob = np.full((num_e, r), 1.0 / r)
    if init is not None:
        prob = 0.5 * prob + 0.5 * np.eye(r)[init]
    spread = obj.acts[:: max(1, -(-obj.n // batch_tokens))]  # strided: the sample is in file order
    small = LayerObjective(spread, r, theta=obj.theta, beta=obj.cap * r / obj.n)
    n_elite = max(1, int(math.ceil(rho * samples)))
    best, best_j = None, np.inf
    for _ in range(iters):
        gumbel = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=(samples, num_e, r))))
        cands = _sample_placements(np.log(prob + 1e-12)[None] + gumbel, load, r, cap)
        js = small.batch(cands)
        elite = np.argsort(js, kind="stable")[:n_elite]
        if js[elite[0]] < best_j:
            best, best_j = cands[elite[0]].copy(), float(js[elite[0]])
        freq = np.zeros((num_e, r))
        np.add.at(freq, (np.tile(np.arange(num_e), n_elite), cands[elite].ravel()), 1.0 / n_elite)
        prob = step * freq + (1 - step) * prob
        if prob.max(1).min() > 0.995:
            break
    return _random_swaps(obj, best, load, rng, cap, swaps)


def _random_swaps(obj: LayerObjective, er: np.ndarray, load: np.ndarray, rng: np.random.Generator, cap: float,
                  swaps: int) -> tuple[np.ndarray, float]:
    """Random-swap fine-tuning: swap two experts of different ranks, keep it if ``J`` drops."""
    r, num_e = obj.r, er.size
    j = obj(er)
    for _ in range(swaps):
        a, b = rng.integers(0, num_e, size=2)
        if er[a] == er[b]:
            continue
        rl = np.bincount(er, weights=load, minlength=r)
        if rl[er[a]] - load[a] + load[b] > cap or rl[er[b]] - load[b] + load[a] > cap:
            continue
        cand = er.copy()
        cand[a], cand[b] = er[b], er[a]
        cj = obj(cand)
        if cj < j:
            er, j = cand, cj
    return er, float(j)


# ------------------------------------------------------------------------------------ dp mode
def _request_profiles(topk_ids: np.ndarray, offsets: np.ndarray, num_experts: int) -> np.ndarray:
    """``[S, L, E]`` float32 expert counts of each request at each layer."""
    num_t, num_l, k = topk_ids.shape
    seq = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    out = np.zeros((offsets.size - 1, num_l, num_experts), dtype=np.float32)
    for layer in range(num_l):
        out[:, layer] = np.bincount((seq[:, None] * num_experts + topk_ids[:, layer]).ravel(),
                                    minlength=out.shape[0] * num_experts).reshape(-1, num_experts)
    return out


def solve_dp(profiles: np.ndarray, loads: np.ndarray, num_ranks: int, rng: np.random.Generator, *,
             theta: float = 0.1, beta: float = 1.1, slack: float = 1.1, restarts: int = 3, max_iter: int = 20,
             solver: str = "alternating", rho: float = 0.2, progress: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """Cluster requests once and place every layer's experts against the same clusters.

    Alternates: per-layer placements maximising co-location with the request clusters
    (:func:`assign_experts`, or CEM for ``solver='cem'``), and requests → the rank holding most of
    their activations over all layers (at most ``ceil(beta * S / R)`` requests per rank).

    Args:
        profiles: ``[S, L, E]`` expert counts per request and layer.
        loads: ``[L, E]`` expert loads.

    Returns:
        ``(request_rank [S], expert_rank [L, E], J)``.

    Raises:
        ValueError: ``restarts`` below 1 (nothing would be solved).
    """
    if isinstance(restarts, bool) or not isinstance(restarts, (int, np.integer)) or restarts < 1:
        raise ValueError(f"restarts must be an int >= 1, got {restarts!r}")
    num_s, num_l, num_e = profiles.shape
    r = num_ranks
    cap = np.full((1, r), int(math.ceil(beta * num_s / r)))
    flat = profiles.reshape(num_s, num_l * num_e)
    total = flat.sum()

    def place(req: np.ndarray) -> np.ndarray:
        onehot = np.eye(r, dtype=np.float32)[req]
        ers = np.empty((num_l, num_e), dtype=np.int64)
        for layer in range(num_l):
            aff = profiles[:, layer].T @ onehot
            ers[layer] = assign_experts(aff, loads[layer], r, slack=slack)
            if solver == "cem":  # the dp objective is linear in a layer's placement; CEM refines it
                ers[layer] = _cem_linear(aff, loads[layer], r, rng, slack, ers[layer], rho=rho)
        return ers

    def score(ers: np.ndarray) -> np.ndarray:
        hot = np.zeros((num_l * num_e, r), dtype=np.float32)
        hot[np.arange(num_l * num_e), ers.ravel()] = 1
        return flat @ hot  # [S, R] activations of each request on each rank

    def value(req: np.ndarray, sc: np.ndarray) -> float:
        local = sc[np.arange(num_s), req].sum() / total
        tl = np.bincount(req, weights=profiles[:, 0].sum(1), minlength=r)
        return float(objective_value(theta, tl, local))

    best = (None, None, np.inf)
    for _ in _progress(range(restarts), progress, f"clustering requests (EP{r})"):
        req = rng.permutation(np.arange(num_s) % r)
        ers = place(req)
        j = np.inf
        for _ in range(max_iter):
            sc = score(ers)
            new = capacity_assign(sc / np.maximum(sc.sum(1, keepdims=True), 1e-12), cap)
            cand = place(new)
            cj = value(new, score(cand))
            if cj >= j - 1e-9:
                break
            req, ers, j = new, cand, cj
        if j < best[2]:
            best = (req, ers, j)
    return best


def _cem_linear(aff: np.ndarray, load: np.ndarray, r: int, rng: np.random.Generator, slack: float,
                init: np.ndarray, samples: int = 32, iters: int = 15, rho: float = 0.2) -> np.ndarray:
    """CEM over placements for a linear co-location objective ``-sum_e aff[e, rank(e)]``."""
    num_e = aff.shape[0]
    cap = load_cap(load, r, slack)
    prob = 0.5 / r + 0.5 * np.eye(r)[init]
    best, best_v = init, aff[np.arange(num_e), init].sum()
    n_elite = max(1, int(math.ceil(rho * samples)))
    for _ in range(iters):
        g = -np.log(-np.log(rng.uniform(1e-12, 1.0, size=(samples, num_e, r))))
        cands = _sample_placements(np.log(prob + 1e-12)[None] + g, load, r, cap)
        vals = aff[np.arange(num_e)[None, :], cands].sum(1)
        order = np.argsort(-vals, kind="stable")[:n_elite]
        if vals[order[0]] > best_v:
            best, best_v = cands[order[0]], vals[order[0]]
        prob = CEM_STEP * np.eye(r)[cands[order]].mean(0) + (1 - CEM_STEP) * prob
    return best


# ------------------------------------------------------------------------------------ entry point
def _progress(iterable, enabled: bool, desc: str, total: int | None = None):
    """A tqdm bar over ``iterable`` (or, with ``iterable=None``, one updated by hand up to ``total``);
    disabled: ``iterable`` itself (``None``)."""
    if not enabled:
        return iterable
    from moelayers._progress import progress_bar

    return progress_bar(iterable, desc=desc, leave=False, total=total)


def _coactivation(acts: np.ndarray, num_e: int) -> np.ndarray:
    k = acts.shape[1]
    keys = (acts[:, :, None] * num_e + acts[:, None, :]).reshape(acts.shape[0], k * k)
    return np.bincount(keys.ravel(), minlength=num_e * num_e).reshape(num_e, num_e).astype(np.float64)


def _finite(value) -> bool:
    """Whether ``value`` is a finite real number (Python or numpy; a bool is not one)."""
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))


def _integer(value) -> bool:
    """Whether ``value`` is an integer (Python or numpy; a bool or a whole float is not one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


#: the solver settings of :func:`plan_semantic`: name -> (whether a value is valid, what a valid one is)
SETTINGS = {
    "solver": (lambda v: v in SOLVERS, f"one of {SOLVERS}"),
    "theta": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1] (objective weight of token-load imbalance)"),
    "history": (lambda v: _integer(v) and v >= 0, "an integer >= 0 (previous layers the tp predictor reads)"),
    "sample": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (profiled tokens of the objective)"),
    "beta": (lambda v: _finite(v) and v >= 1, "a finite number >= 1 (token capacity factor: below 1 the ranks "
                                              "cannot hold every token)"),
    "rho": (lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1] (elite fraction of the cross-entropy method)"),
    "slack": (lambda v: _finite(v) and v >= 1, "a finite number >= 1 (expert loads per rank at most slack x mean; "
                                               "no placement keeps every rank below the mean)"),
    "smoothing": (lambda v: _finite(v) and v > 0, "a finite number > 0 (pseudo-occurrences of the layer distribution)"),
    "max_requests": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (requests clustered in dp mode)"),
    "predictor_sample": (lambda v: _integer(v) and v >= 1, "an integer >= 1 (profiled tokens the tp predictor "
                                                           "is fitted on)"),
    "threads": (lambda v: v is None or (_integer(v) and v >= 1), "None or an integer >= 1 (threads fitting the tp "
                                                                 "predictor; None: the usable CPUs, at most 4)"),
}


def check_settings(settings: dict, *, prefix: str = "") -> None:
    """Check solver settings of :func:`plan_semantic` (any subset of :data:`SETTINGS`) for type and range.

    A NaN or infinite number is refused everywhere (``slack=nan`` would otherwise lift the expert-load
    cap silently), as is a float where an integer is meant (``sample=2.7`` is not silently 2).

    Args:
        settings: setting name -> value.
        prefix: put before the name in the message (e.g. ``"planner."`` for a recipe's config key).

    Raises:
        ValueError: the first invalid or unknown setting, named.
    """
    for name, value in settings.items():
        if name not in SETTINGS:
            raise ValueError(f"{prefix}{name} is not a setting of the semantic planner: one of {sorted(SETTINGS)}")
        valid, what = SETTINGS[name]
        if not valid(value):
            raise ValueError(f"{prefix}{name} must be {what}, got {value!r}")


def table_bytes(num_layers: int, vocab_size: int, num_ranks: int, mode: str) -> int:
    """Bytes of a semantic plan's per-token tables: ``token_rank`` (int64) and ``token_conf`` (float32)
    ``[L, V]``, plus ``token_logq`` (float16) ``[L, V, R]`` in tp mode. Planning holds more than this
    (temporaries of the same shapes), so it is a lower bound of what a plan of this vocabulary needs."""
    return int(num_layers) * int(vocab_size) * (8 + 4 + (2 * int(num_ranks) if mode == "tp" else 0))


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # (no sysconf, e.g. on Windows: not checked)
        return None


def check_vocab_size(trace, ep: int, mode: str, source: str | None = None) -> None:
    """Refuse a vocabulary whose per-token tables (:func:`table_bytes`) would not fit in this
    machine's memory, naming ``vocab_size`` (and ``source``): a clear error instead of a
    ``MemoryError`` from deep inside the planner (token ids are vocabulary ids ``[0, V)``; a trace
    keyed by hashes or with a huge ``vocab_size`` needs its ids mapped to a dense range first)."""
    need, have = table_bytes(trace.num_layers, trace.vocab_size, ep, mode), _physical_memory()
    if have is not None and need > have:
        where = f"{source}: " if source else ""
        raise ValueError(f"{where}field 'vocab_size' ({trace.vocab_size}) is too large for the semantic planner: its "
                         f"per-token tables of {trace.num_layers} layer(s) x {trace.vocab_size} token ids would take "
                         f"{need / 2 ** 30:.3g} GiB, more than this machine's {have / 2 ** 30:.3g} GiB of memory; map "
                         f"the token ids to a dense range [0, V) of the ids that occur (and set vocab_size to V)")


def _check_args(trace, ep: int, mode: str, **settings) -> None:
    if isinstance(ep, bool) or not isinstance(ep, (int, np.integer)) or ep < 1:
        raise ValueError(f"ep must be a positive int, got {ep!r}")
    if trace.num_experts % ep:
        raise indivisible_experts(trace.num_experts, ep, "ep")
    if mode not in ("tp", "dp"):
        raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
    check_vocab_size(trace, ep, mode, trace._name())
    seed = settings.pop("seed", 0)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    check_settings(settings)


def plan_semantic(train_trace, ep: int, mode: str = "tp", *, solver: str = "alternating", theta: float = 0.1,
                  seed: int = 0, progress: bool = True, embeddings: np.ndarray | None = None, history: int = 8,
                  sample: int = 8192, beta: float = 1.1, rho: float = 0.2, slack: float = 1.1,
                  smoothing: float = 2.0, max_requests: int = 4096, predictor_sample: int = 16384,
                  threads: int | None = None) -> SemanticPlan:
    """Semantic plan from a (training) routing trace. Deterministic for a ``seed``.

    Args:
        train_trace: :class:`~moelayers.trace.RoutingTrace` to profile.
        ep: ranks ``R`` (``E`` divisible by it).
        mode: ``'tp'`` (tokens shuffled per layer: one co-clustering per layer, plus the online
            rank predictor and the Algorithm 3 n-gram) or ``'dp'`` (requests clustered once; every
            layer placed against them).
        solver: ``'alternating'`` (Sem-MoE Algorithm 1) or ``'cem'`` (Speculative MoE Algorithm 1).
        theta: weight of token-load imbalance vs remote activations in the objective.
        seed: seeds every random choice.
        progress: tqdm bar over layers.
        embeddings: optional ``[V, D]`` token embeddings: unseen tokens take their cosine-nearest
            seen token's row (else the layer distribution).
        history: ``D``, previous layers whose experts the tp predictor reads (0: token table only).
        sample: profiled tokens the per-layer objective is evaluated on (tp).
        beta: token capacity factor of the objective (at most ``beta`` × mean tokens per rank; >= 1).
        rho: elite fraction of the cross-entropy method, in ``(0, 1]``.
        slack: expert loads per rank at most ``slack`` × mean (profiled loads; >= 1).
        smoothing: pseudo-occurrences of the layer distribution in ``Pr(rank | token)``.
        max_requests: requests clustered in dp mode (a seeded subset; all are used for the tables).
        predictor_sample: profiled tokens the tp predictor is fitted on (a seeded sample).
        threads: tp: the layers' predictors are fitted on this many threads while the main thread
            places the next layers (default: the usable CPUs, at most 4). The plan is the same for
            any number: each fit is deterministic and the random draws stay on the main thread.

    Returns:
        :class:`~moelayers.planning.semantic.SemanticPlan`.

    Raises:
        ValueError: a bad ``ep`` or ``mode``, or a solver setting out of range (:func:`check_settings`), named.
    """
    _check_args(train_trace, ep, mode, seed=seed, solver=solver, theta=theta, history=history, sample=sample,
                beta=beta, rho=rho, slack=slack, smoothing=smoothing, max_requests=max_requests,
                predictor_sample=predictor_sample, threads=threads)
    rng = np.random.default_rng(seed)
    v = train_trace.vocab_size
    seen = np.bincount(train_trace.token_ids, minlength=v) > 0
    src = nearest_seen_tokens(embeddings, seen, seed=seed) if embeddings is not None else None
    fn = _plan_tp if mode == "tp" else _plan_dp
    plan = fn(train_trace, int(ep), rng, src, solver=solver, theta=float(theta), seed=int(seed), progress=progress,
              history=int(history), sample=int(sample), beta=beta, rho=rho, slack=slack, smoothing=smoothing,
              max_requests=int(max_requests), predictor_sample=int(predictor_sample),
              threads=_fit_threads() if threads is None else int(threads))
    plan.train_sequences = train_trace.sequence_digests()  # what it was trained on: in-sample checks later
    plan.top_k = train_trace.topk_ids.shape[2]  # the routing it was made from (from_plan warns on another)
    return plan


def _sequence_pairs(tr) -> tuple[np.ndarray, np.ndarray]:
    """``(pair [T], pair_freq [P])``: each token's (sequence, token id) pair and the pair's occurrences."""
    seq = np.repeat(np.arange(tr.num_sequences, dtype=np.int64), tr.seq_lengths)
    _, pair = np.unique(seq * tr.vocab_size + tr.token_ids, return_inverse=True)
    pair = pair.reshape(-1)
    return pair, np.bincount(pair)


def _fit_threads() -> int:
    """The usable CPUs, at most 4 (the default ``threads`` of :func:`plan_semantic`)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(4, usable))


def _plan_tp(tr, r: int, rng, src, *, solver, theta, seed, progress, history, sample, beta, rho, slack, smoothing,
             predictor_sample, threads, **_) -> SemanticPlan:
    num_t, num_l, k = tr.topk_ids.shape
    num_e, v, ids = tr.num_experts, tr.vocab_size, tr.token_ids
    sub = np.sort(rng.choice(num_t, size=min(num_t, sample), replace=False))
    big = np.sort(rng.choice(num_t, size=min(num_t, 100_000), replace=False))
    co = big[:: max(1, big.size // 50_000)]
    fit = np.sort(rng.choice(num_t, size=min(num_t, predictor_sample), replace=False))
    pair, pair_freq = _sequence_pairs(tr)
    fit_topk = tr.topk_ids[fit]
    borrowed = ~(np.bincount(ids, minlength=v) > 0) & (src >= 0) if src is not None else np.zeros(v, bool)
    vocab_bucket = frequency_bucket(np.where(borrowed, 1, np.bincount(ids, minlength=v)))  # borrowed rows: least trusted
    expert_rank = np.empty((num_l, num_e), np.int64)
    token_rank = np.empty((num_l, v), np.int64)
    token_conf = np.empty((num_l, v), np.float32)
    token_logq = np.empty((num_l, v, r), np.float16)
    hist_w = np.zeros((num_l, history, num_e, r), np.float32)
    objective = np.empty(num_l)

    def fit_layer(l: int, q: np.ndarray, rows: np.ndarray, bucket: np.ndarray, hist: np.ndarray, target: np.ndarray):
        model = fit_rank_model(rows, bucket, hist, target)
        # q = 0 where no expert of a rank was used
        token_logq[l] = model.token_scores(np.log(np.maximum(q, 1e-9)), vocab_bucket)
        hist_w[l] = model.w.reshape(history, num_e, r)

    # the fits (most of the time: numpy releases the GIL) run beside the placements of the next
    # layers; at most `threads` wait, so that their inputs do not pile up. The bar counts fitted layers.
    pool, pending = ThreadPoolExecutor(max_workers=threads), deque()
    bar = _progress(None, progress, f"semantic plan (tp, {solver}, EP{r})", total=num_l)

    def finish_one() -> None:
        pending.popleft().result()  # raises a fit's exception here
        if bar is not None:
            bar.update(1)

    try:
        for l in range(num_l):
            table = build_token_table(ids, tr.topk_ids[:, l], num_e, v)
            load = table.expert_load.astype(np.float64)
            obj = LayerObjective(tr.topk_ids[sub, l], r, theta=theta, beta=beta)
            if solver == "alternating":
                coact = _coactivation(tr.topk_ids[co, l].astype(np.int64), num_e)
                er, j = solve_alternating(obj, coact, load, rng, slack=slack)
            else:
                er, j = solve_cem(obj, load, rng, rho=rho, slack=slack)
            expert_rank[l], objective[l] = er, j
            q = token_rank_probs(table, er, r, smoothing=smoothing, source=src)
            token_rank[l] = np.argmax(q, axis=1)
            token_conf[l] = q.max(1)
            # the online predictor, fitted on a sample whose token rows leave their own sequence out
            counts = rank_counts(tr.topk_ids[:, l], er, r)
            pair_counts = np.stack([np.bincount(pair, weights=counts[:, j], minlength=pair_freq.size)
                                    for j in range(r)], 1)
            rows, rest = leave_sequence_out(q[ids[fit]], table.token_freq[ids[fit]], pair_counts[pair[fit]],
                                            pair_freq[pair[fit]], k, smoothing)
            hist = _SparseRows.history(fit_topk, l, history, num_e)  # history_onehot's non-zeros
            if len(pending) >= threads:
                finish_one()
            pending.append(pool.submit(fit_layer, l, q, rows, frequency_bucket(rest), hist, counts[fit] / k))
        while pending:
            finish_one()
    finally:
        for job in pending:
            job.cancel()
        pool.shutdown(wait=True)
        if bar is not None:
            bar.close()
    ngram_rank, ngram_conf = ngram_tables(tr.topk_ids[big], expert_rank, r)
    return SemanticPlan(expert_rank, token_rank, token_conf, ngram_rank, ngram_conf, r, num_e, v, "tp",
                        token_logq=token_logq, history_pmi=hist_w if history else None,
                        history_weight=np.ones(history, np.float32) if history else None, solver=solver, theta=theta,
                        seed=seed, objective=objective)


def _plan_dp(tr, r: int, rng, src, *, solver, theta, seed, progress, beta, rho, slack, max_requests, **_) -> SemanticPlan:
    num_t, num_l, k = tr.topk_ids.shape
    num_e, v, ids = tr.num_experts, tr.vocab_size, tr.token_ids
    num_s, lengths = tr.num_sequences, tr.seq_lengths
    seq = np.repeat(np.arange(num_s), lengths)
    loads = tr.expert_counts().astype(np.float64)
    pick = np.sort(rng.choice(num_s, size=min(num_s, max_requests), replace=False))
    pick = pick[lengths[pick] > 0]
    part = tr.select_sequences(pick)
    profiles = _request_profiles(part.topk_ids, part.seq_offsets, num_e)
    _, ers, _ = solve_dp(profiles, loads, r, rng, theta=theta, beta=beta, slack=slack, solver=solver, rho=rho,
                         progress=progress)
    # every training request to its cluster, then the token -> cluster votes
    sc = np.zeros(num_s * r)
    for l in range(num_l):
        sc += np.bincount((seq[:, None] * r + ers[l][tr.topk_ids[:, l].astype(np.int64)]).ravel(), minlength=num_s * r)
    sc = sc.reshape(num_s, r)
    cluster = capacity_assign(sc / np.maximum(sc.sum(1, keepdims=True), 1e-12), np.full((1, r), int(math.ceil(beta * num_s / r))))
    cnt = np.bincount(ids * r + cluster[seq], minlength=v * r).reshape(v, r).astype(np.float64)
    prior = cnt.sum(0) / cnt.sum()
    p = (cnt + prior) / (cnt.sum(1, keepdims=True) + 1.0)
    if src is not None:
        unseen = (np.bincount(ids, minlength=v) == 0) & (src >= 0)
        p[unseen] = p[src[unseen]]
    rank_v = np.argmax(p, axis=1)
    conf_v = np.clip((p.max(1) - 1.0 / r) / (1.0 - 1.0 / r), 0.0, 1.0) if r > 1 else np.ones(v)
    # the clusters the online scheduler will realise (Algorithm 2 on the training requests), and
    # every layer placed against them
    votes = np.bincount(seq * r + rank_v[ids], weights=conf_v[ids], minlength=num_s * r).reshape(num_s, r)
    realised = request_schedule(votes, lengths, r)
    objective = np.empty(num_l)
    tokens = np.bincount(realised, weights=lengths, minlength=r)
    for l in _progress(range(num_l), progress, f"semantic plan (dp, {solver}, EP{r})"):
        acts = tr.topk_ids[:, l].astype(np.int64)
        aff = np.bincount((acts * r + realised[seq][:, None]).ravel(), minlength=num_e * r).reshape(num_e, r).astype(np.float64)
        ers[l] = assign_experts(aff, loads[l], r, slack=slack)
        if solver == "cem":
            ers[l] = _cem_linear(aff, loads[l], r, rng, slack, ers[l], rho=rho)
        local = aff[np.arange(num_e), ers[l]].sum() / aff.sum()
        objective[l] = objective_value(theta, tokens, local)
    token_rank = np.tile(rank_v, (num_l, 1))
    token_conf = np.tile(conf_v.astype(np.float32), (num_l, 1))
    big = np.sort(rng.choice(num_t, size=min(num_t, 200_000), replace=False))
    ngram_rank, ngram_conf = ngram_tables(tr.topk_ids[big], ers, r)
    return SemanticPlan(ers, token_rank, token_conf, ngram_rank, ngram_conf, r, num_e, v, "dp", solver=solver,
                        theta=theta, seed=seed, objective=objective)
