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

Two objectives (``method``), searched the same way:

``plain`` (the paper)
    ``X`` = the given steps and ``C_r`` = the given curves. Fitted on a few dozen train steps it
    over-fits them: it tunes each rank's rows to the particular fluctuations of those steps and
    to where they fall between the tile boundaries of the curves, neither of which recurs.

``robust`` (default)
    ``F`` in expectation over the steps the placement will *meet*, estimated from the given ones:

    1. *Predictive steps.* A future step is modelled by the mean ``mu`` and the covariance of
       the given steps, inflated by ``1 + 1/S`` for the error of the mean (the predictive
       distribution of one more step). The covariance is kept whole — it says which experts burst
       together, which is what a placement must spread over the ranks — and realised by
       ``N`` moment-matched Gaussian scenarios: ``X = mu + c * Q @ diag(sv) @ V^T`` with the SVD
       ``steps - mu = U diag(sv) V^T`` and ``Q [N, k]`` orthonormal random directions drawn in
       antithetic pairs, so the scenarios' mean and covariance equal the predictive ones exactly
       while the fluctuations point everywhere in the span of the observed ones instead of at
       ``S`` fixed points. Loads are clipped at 0. With ``N / 2 < S - 1`` and ``S <= 2 N`` the
       steps themselves (fluctuations scaled by ``sqrt(1 + 1/S)``) are the scenarios; with more
       than ``2 N`` steps (a long trace: 523 train steps for 1M tokens) ``2 N`` Gaussian scenarios
       of their moments are, so the search costs the same for any trace length (on such a trace
       they scored within 0.1 point of all the steps, in a fifth to a half of the time). ``N`` is
       128 for ``E <= 64`` and shrinks as ``1 / E^2`` (the refinement's work per round is
       ``E^2 N``), at least 32.
    2. *Smoothed curves.* The rows a rank gets in an unseen step are known only to within the
       spread of the scenario estimate, so each curve is replaced by its moving average over a
       window (a box kernel) whose standard deviation follows Silverman's rule for ``N`` samples
       of one rank's rows: ``h = 1.06 sigma N^(-1/5)``, window ``sqrt(12) h``, with ``sigma`` the
       standard deviation of the rows of ``E / R`` random experts under the predictive
       covariance. A tiled curve averaged over a tile is a straight line: no tile boundary is
       left to over-fit.

    There is no tuning constant: the mean, covariance and bandwidth come from the given steps,
    ``N`` from the time budget. What was measured and did not help (``tools/gem_yardstick.py``):
    shrinking the covariance towards its diagonal (Ledoit-Wolf, also projected on the fixed total
    load) or to a low-rank factor model — always worse, the off-diagonal structure generalises;
    inflating the covariance for drift, or scaling the fluctuations down (trusting the mean
    more); independent or permuted per-expert resampling (destroys the co-bursts: much worse);
    sums of random pairs or triples of observed fluctuations instead of Gaussian ones (about the
    same); empirical-Bayes shrinkage of the mean; fitting on the latest steps only; more
    scenarios or restarts, a lower ``min_gain``, a stronger search; mixing the raw steps into the
    scenarios. The smoothed curves alone (on the raw steps) give most of the gain at small cost;
    the scenarios add to it where the steps are few or bursty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moelayers.placement import indivisible_experts

if TYPE_CHECKING:  # gem imports this module lazily (plan_gem); only the annotations need it here
    from moelayers.planning.gem import LatencyCurves

__all__ = ["METHODS", "greedy", "refine", "search", "objective", "robust_objective", "predictive_scenarios",
           "smoothing_width", "scenario_count"]

METHODS = ("plain", "robust")
MAX_SCENARIOS = 128  # robust: scenarios for E <= 64 ...
MIN_SCENARIOS = 32  # ... and at least this many
SCENARIO_WORK = MAX_SCENARIOS * 64 * 64  # N * E^2 kept at this for E > 64 (the work of one swap round)
_CHUNK_FLOATS = 1 << 22  # refine: floats of the swap scores computed at once (32 MB)


def objective(expert_rank: np.ndarray, x: np.ndarray, curves: LatencyCurves) -> float:
    """``F = sum_s max_r C_r(rows_r)`` for objective steps ``x [S, E]`` (any real loads)."""
    num_r = curves.num_ranks
    rows = np.zeros((x.shape[0], num_r))
    np.add.at(rows.T, expert_rank, x.T)
    return float(curves(rows).max(axis=1).sum())


def greedy(x: np.ndarray, curves: LatencyCurves, per_rank: int, *, order_loads: np.ndarray | None = None) -> np.ndarray:
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


def refine(expert_rank: np.ndarray, x: np.ndarray, curves: LatencyCurves, *, min_gain: float = 1e-3,
           max_rounds: int | None = None) -> tuple[np.ndarray, float]:
    """Best-swap refinement until the best swap gains less than ``min_gain * F``.

    The experts are kept in *slots* ordered by rank (slot ``k`` on rank ``k // m``, ``m = E / R``), so
    that ``A`` (module docstring) is a ``[R, m, R, m, S]`` array of rank blocks: a round scores the
    swaps of each pair of ranks ``a < b`` once, from the blocks ``(a, b)`` and ``(b, a)``, and a
    swap exchanges two slots' experts (the other ranks' columns of ``A`` trade places) and
    recomputes the rows of the two ranks. Ties go to the lowest ``(i, j)`` in expert order.
    Memory: ``A`` (``8 E^2 S`` bytes: 1.1 GB for 256 experts and 2,048 steps) and temporaries of
    about 100 MB, or three of one pair of ranks' ``8 m^2 S`` bytes where that is more (``A`` is
    built and the pairs of ranks are scored in chunks; 0.8 GB at 2 ranks in that example).

    Args:
        expert_rank: ``[E]`` starting placement, ``E / R`` experts on every rank.
        x: ``[S, E]`` objective steps.
        curves: ``R`` latency curves.
        min_gain: relative gain below which the search stops.
        max_rounds: a safety cap on swaps (default ``1000 E``; the gain threshold ends the search
            long before: every swap lowers ``F`` by at least ``min_gain``).

    Returns:
        ``(expert_rank [E], F)``.

    Raises:
        ValueError: ``expert_rank`` does not hold ``E / R`` experts on each of the ``R`` ranks.
    """
    er = np.array(expert_rank, dtype=np.int64)
    num_s, num_e = x.shape
    num_r = curves.num_ranks
    m = num_e // num_r
    if er.shape != (num_e,) or num_e % num_r or not np.array_equal(np.bincount(er, minlength=num_r), np.full(num_r, m)):
        raise ValueError(f"refine needs E / R = {num_e} / {num_r} experts on every rank, got "
                         f"{np.bincount(er.ravel(), minlength=num_r).tolist() if er.size and er.min() >= 0 else er}")
    xt = np.ascontiguousarray(x.T)  # [E, S]
    slot = np.argsort(er, kind="stable")  # slot -> expert, rank blocks of m
    rows = np.zeros((num_r, num_s))
    np.add.at(rows, er, xt)
    lat = curves.eval_ranks(rows.T, np.arange(num_r))  # [S, R]
    f = float(lat.max(axis=1).sum())
    if num_r == 1 or num_s == 0:  # nothing to swap, or no step to score a swap on
        return er, f
    xs = xt[slot]
    # A[k, l, s]: latency of slot k's rank if its expert is swapped for slot l's (built a few slots'
    # rows at a time, as after a swap: the [E, E, S] temporaries of one expression were 3x A's memory)
    A = np.empty((num_e, num_e, num_s))
    per = max(1, _CHUNK_FLOATS // max(1, num_e * num_s))  # slots' rows at once

    def rank_rows(r: int) -> None:
        for k in range(r * m, (r + 1) * m, per):
            k1 = min(k + per, (r + 1) * m)
            A[k:k1] = curves.eval_ranks((rows[r] - xs[k:k1])[:, None, :] + xs[None, :, :], r)

    for r in range(num_r):
        rank_rows(r)
    blocks = A.reshape(num_r, m, num_r, m, num_s)
    pa, pb = np.triu_indices(num_r, 1)
    chunk = max(1, _CHUNK_FLOATS // max(1, m * m * num_s))  # pairs scored at once: bounded temporaries
    tot = np.empty((pa.size, m, m))
    max_rounds = 1000 * num_e if max_rounds is None else max_rounds
    for _ in range(max_rounds):
        # tot[p, u, v]: F after swapping the u-th expert of rank pa[p] with the v-th of rank pb[p]
        others = _others_max(lat)
        for c0 in range(0, pa.size, chunk):
            ca, cb = pa[c0:c0 + chunk], pb[c0:c0 + chunk]
            new = np.maximum(blocks[ca, :, cb], blocks[cb, :, ca].transpose(0, 2, 1, 3))  # [P', m, m, S]
            np.maximum(new, others[ca, cb][:, None, None, :], out=new)
            new.sum(axis=3, out=tot[c0:c0 + chunk])
        best = tot.min()
        if not f - best > max(min_gain * f, 0.0):  # a swap must gain something (F = 0: nothing to gain)
            break
        # ties go to the lowest (i, j) in expert order, as a scan of all pairs of experts would find them
        p, u, v = np.unravel_index(np.flatnonzero(tot.ravel() == best), tot.shape)
        k, l = pa[p] * m + u, pb[p] * m + v
        c = np.argmin(np.minimum(slot[k], slot[l]) * num_e + np.maximum(slot[k], slot[l]))
        a, b, k, l = int(pa[p[c]]), int(pb[p[c]]), int(k[c]), int(l[c])
        i, j = slot[k], slot[l]
        rows[a] += xt[j] - xt[i]
        rows[b] += xt[i] - xt[j]
        er[i], er[j] = b, a
        slot[k], slot[l] = j, i
        lat[:, a] = curves.eval_ranks(rows[a], a)
        lat[:, b] = curves.eval_ranks(rows[b], b)
        f = float(lat.max(axis=1).sum())
        A[:, [k, l]] = A[:, [l, k]]  # the other ranks' rows: slots k and l traded experts
        xs = xt[slot]
        rank_rows(a)
        rank_rows(b)
    return er, f


def _best_of_restarts(x: np.ndarray, curves: LatencyCurves, per_rank: int, restarts: int, rng: np.random.Generator,
                      noise: float, min_gain: float) -> np.ndarray:
    """Greedy + best swap from ``restarts`` starts on objective steps ``x [S, E]``; the lowest ``F`` wins."""
    num_e = x.shape[1]
    best, best_f = None, np.inf
    for k in range(restarts):
        order = x if k == 0 else x * (1.0 + noise * rng.uniform(-1.0, 1.0, size=(1, num_e)))
        er = greedy(x, curves, per_rank, order_loads=order)
        er, f = refine(er, x, curves, min_gain=min_gain)
        if f < best_f - 1e-15:
            best, best_f = er, f
    return best


def scenario_count(num_experts: int) -> int:
    """Predictive scenarios ``N`` for ``E`` experts: 128 up to ``E = 64``, then ``~ 1 / E^2``, at least 32."""
    return int(np.clip(SCENARIO_WORK // max(num_experts, 1) ** 2, MIN_SCENARIOS, MAX_SCENARIOS)) // 2 * 2


def predictive_scenarios(loads: np.ndarray, num: int, rng: np.random.Generator) -> np.ndarray:
    """Scenario steps with the predictive mean and covariance of one more step (module docstring, 1.).

    Args:
        loads: ``[S, E]`` observed steps.
        num: scenarios ``N`` (even) when the steps are few (``S - 1 <= N / 2``); ``2 N`` when
            they are many (``S > 2 N``), and at least twice the directions the steps vary in
            (``2 k``, so that every one of them is matched: many steps of more than ``N`` experts).
        rng: source of the random directions.

    Returns:
        ``[N, E]`` float64 (``[S, E]`` when the steps themselves are used, ``[max(2 N, 2 k), E]``
        for many steps; the one step if ``S = 1``).
    """
    x = np.asarray(loads, dtype=np.float64)
    num_s = x.shape[0]
    if num_s < 2:
        return x.copy()
    mu = x.mean(axis=0)
    dev = x - mu
    if 2 * (num_s - 1) > num and num_s <= 2 * num:
        return np.maximum(mu + np.sqrt(1.0 + 1.0 / num_s) * dev, 0.0)
    if num_s > 2 * num:  # many steps: a bounded set with their moments
        num = 2 * num
    _, sv, vt = np.linalg.svd(dev, full_matrices=False)
    keep = sv > sv[0] * 1e-9 if sv[0] > 0 else np.zeros_like(sv, dtype=bool)
    if not keep.any():
        return x[:1].copy()  # every step the same: it is the scenario
    sv, vt = sv[keep], vt[keep]
    num = max(num, 2 * sv.size)  # N / 2 antithetic pairs span at most N / 2 directions (many steps of > N experts)
    half = rng.standard_normal((num // 2, sv.size))
    q, _ = np.linalg.qr(np.concatenate([half, -half]))  # [N, k] orthonormal, columns sum to 0
    scale = np.sqrt(num * (1.0 + 1.0 / num_s) / (num_s - 1))  # (1/N) X^T X = (1 + 1/S) dev^T dev / (S - 1)
    return np.maximum(mu + (scale * q * sv) @ vt, 0.0)


def smoothing_width(x: np.ndarray, per_rank: int) -> float:
    """Box-kernel window (rows) for the curves: ``sqrt(12) * 1.06 sigma N^(-1/5)`` (module docstring, 2.).

    Args:
        x: ``[N, E]`` scenario steps.
        per_rank: experts per rank ``m``.

    Returns:
        Window in rows (0 when the scenarios do not vary).
    """
    num_n, num_e = x.shape
    if num_n < 2:
        return 0.0
    var = x.var(axis=0)  # [E]
    cov_sum = x.sum(axis=1).var() - var.sum()  # sum of the off-diagonal covariances
    off = cov_sum / (num_e * (num_e - 1)) if num_e > 1 else 0.0
    sigma2 = per_rank * var.mean() + per_rank * (per_rank - 1) * off  # rows of m random experts
    return float(np.sqrt(12.0 * max(sigma2, 0.0)) * 1.06 * num_n ** -0.2)


def robust_objective(loads: np.ndarray, curves: LatencyCurves, rng: np.random.Generator,
                     num_scenarios: int | None = None) -> tuple[np.ndarray, LatencyCurves]:
    """The ``robust`` objective: ``(scenarios [N, E], smoothed curves)`` (module docstring).

    Args:
        loads: ``[S, E]`` observed steps.
        curves: :class:`~moelayers.planning.gem.LatencyCurves` of the ``R`` ranks.
        rng: source of the scenario directions.
        num_scenarios: ``N`` (default :func:`scenario_count`).
    """
    num_e, num_r = loads.shape[1], curves.num_ranks
    num = scenario_count(num_e) if num_scenarios is None else int(num_scenarios)
    if num < 2 or num % 2:
        raise ValueError(f"scenarios must be an even number >= 2, got {num_scenarios}")
    x = predictive_scenarios(loads, num, rng)
    width = smoothing_width(x, num_e // num_r)
    return x, (curves.smoothed(width) if width >= 1.0 else curves)


def search(loads: np.ndarray, curves: LatencyCurves, *, restarts: int = 8, seed: int = 0, method: str = "robust",
           noise: float = 0.2, min_gain: float = 1e-3, scenarios: int | None = None) -> np.ndarray:
    """Greedy + best swap with ``restarts`` starts; see :func:`moelayers.planning.gem.plan_gem`.

    Args:
        loads: ``[S, E]`` rows per expert per step.
        curves: latency curves of the ``R`` ranks.
        restarts: greedy + swap runs.
        seed: seeds the restarts' noise (and the robust scenarios).
        method: ``"plain"`` or ``"robust"`` (module docstring).
        noise: relative perturbation of the utilisations for restarts after the first.
        min_gain: relative gain below which the swaps stop.
        scenarios: ``N`` for ``robust`` (default :func:`scenario_count`).

    Returns:
        ``expert_rank [E]`` int64, ``E / R`` experts per rank.

    Raises:
        ValueError: no steps, non-numeric, negative or non-finite loads, ``E`` not divisible by ``R``,
            or a bad option.
    """
    from moelayers.planning.gem import _check_loads

    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if isinstance(restarts, bool) or not isinstance(restarts, (int, np.integer)) or restarts < 1:
        raise ValueError(f"restarts must be a positive int, got {restarts!r}")
    if scenarios is not None and (isinstance(scenarios, bool) or not isinstance(scenarios, (int, np.integer))):
        raise ValueError(f"scenarios must be an even int >= 2 or None, got {scenarios!r}")  # 4.7 is not silently 4
    for name, value in (("min_gain", min_gain), ("noise", noise)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    x = _check_loads(loads).astype(np.float64)
    if x.shape[1] % curves.num_ranks:
        raise indivisible_experts(x.shape[1], curves.num_ranks, "the number of ranks of the curves")
    per_rank = x.shape[1] // curves.num_ranks
    rng = np.random.default_rng(seed)
    if method == "robust":
        x, curves = robust_objective(x, curves, rng, scenarios)
    return _best_of_restarts(x, curves, per_rank, int(restarts), rng, noise, min_gain)
