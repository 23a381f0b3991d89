"""Held-out evaluation of a :class:`~moelayers.planning.semantic.SemanticPlan` (pure functions).

``evaluate_tp`` (attention-TP, Sem-MoE Algorithm 3): held-out tokens in file order, in batches of
``tokens_per_step``; in every batch each rank receives exactly ``tokens_per_step / R`` tokens
(the last, partial batch as evenly as possible: counts differ by at most one). A token's rank at
layer ``l`` is chosen from what the online shuffler knows when layer ``l``'s input is shuffled:
its token id and the routing (experts) of layers *before* ``l`` — never layer ``l``'s routing.

* ``predictor='combined'`` (default): the plan's log-linear scores of the token id and the token's
  actual experts at layers ``l-1 .. l-D`` (:meth:`SemanticPlan.rank_scores`, fitted by
  :mod:`moelayers.planning.semantic_predict`); per batch, per-rank prices balance the demand
  (:func:`price_balance`), then :func:`capacity_assign` groups tokens by rank
  (:func:`balanced_assign`). The online shuffler (``SemanticMoE.forward_tp``) computes exactly this
  assignment for a batch (``moelayers.schedule.token_shuffle.balanced_ranks``).
* ``predictor='alg3'``: Algorithm 3 as published: the rank from the token table (``token_rank``,
  ``token_conf``) or from the device n-gram ``A`` (context: the ranks holding most of the token's
  actual experts at layers ``l-2, l-1`` under the plan's placements), whichever is more confident.
* ``predictor='token'``: the token part of ``combined`` alone.

In every case tokens are grouped by their preferred rank into equal chunks; a full rank keeps its
most confident tokens and the overflow goes to ranks with room, least confident first.

``evaluate_dp`` (attention-DP, Sem-MoE Algorithm 2): a sequence is one request and keeps one rank
for all layers; requests in file order are scored by their tokens' votes (``token_conf`` on
``token_rank``), each takes an unmasked rank which is then masked (the mask resets when all ranks
are taken, so every cycle of ``R`` requests covers the ranks): by default each request in turn its
best unmasked rank (as published), or with ``joint`` the requests of a cycle get their ranks
together, the largest total vote (:func:`request_schedule`); no rank holds more than ``max_ratio``
(1.3) × the mean tokens per rank, unless a request finds no rank with room left for it (it then goes to the least-loaded rank; the report's
``token_imbalance`` shows it; the schedule closes a rank to a request when the requests still to
come would no longer pack under the cap, so this happens only where no packing exists or
first-fit decreasing misses it).

Report keys: ``lar`` (local activation rate: share of (token, layer, k) activations whose expert
lives on the token's rank at that layer), ``lar_linear`` (linear placement; tp: tokens in file
order chunks, dp: requests round robin, skipping a rank the cap closes), ``lar_per_layer``, ``token_imbalance`` (max / mean
tokens per rank; in tp mode 1.0 up to the last, partial batch, whose counts differ by at most one), ``expert_imbalance`` (max / mean activations received per rank, mean over
layers; ``expert_imbalance_max`` over layers), ``a2a_bytes_ratio`` (tokens sent to remote ranks,
de-duplicated — a token goes once to each remote rank holding any of its experts — relative to
linear; ``remote_ratio``: the same without de-duplication, i.e. ``(1 - lar) / (1 - lar_linear)``).
Everything is recomputable: :func:`lar_from_assignment` gives ``lar`` from the returned arrays.
"""

from __future__ import annotations

import numpy as np

from moelayers.planning.semantic import (PREDICTORS, PRICE_DECAY, PRICE_ITERS, PRICE_STEP, SemanticPlan, check_token_ids,
                                         majority_rank, rank_counts)

__all__ = ["even_token_rank", "assignment_metrics", "lar_report", "capacity_assign", "price_balance", "balanced_assign", "step_capacity", "request_schedule", "schedule_requests", "schedule_one", "best_matching", "lar_from_assignment",
           "linear_expert_rank", "tp_scores", "assign_tp", "assign_dp", "evaluate_tp", "evaluate_dp", "evaluate",
           "PREDICTORS"]

# request_schedule(joint=True): votes a request gives up per token per unit of (rank load / mean - 1);
# 3 keeps the token balance of the one-by-one order (measured on synthetic and tiny-model traces, EP4/EP8)
JOINT_BALANCE = 3.0


def capacity_assign(scores: np.ndarray, capacity: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """Group items by their best rank into chunks of bounded size; overflow to ranks with room.

    In rounds, each unplaced item wants its highest-scoring rank that still has room in its group;
    a rank with more candidates than room keeps the highest-scoring ones (ties: the earlier item)
    and is then full, so the rest try again among the ranks with room. Scores are compared as
    float32 (the online shuffler, ``moelayers.schedule.token_shuffle.capacity_ranks``, does the
    same with the bucketing kernel and gets the same result).

    Args:
        scores: ``[n, R]`` float, higher = better (e.g. expected share of local activations).
        capacity: ``[G, R]`` int room per (group, rank); ``sum`` over ranks ``>=`` items of the group.
        group: ``[n]`` int group (batch) of each item in ``[0, G)``; default all 0.

    Returns:
        ``[n]`` int64 rank per item.

    Raises:
        ValueError: ``capacity`` is not ``[G, R]``, ``group`` not ``[n]`` ids in ``[0, G)``, or a
            group has more items than room.
    """
    with np.errstate(over="ignore"):  # finite: a rank with room (even one scored -inf) beats a full one
        s = np.nan_to_num(np.asarray(scores, dtype=np.float32), nan=-3e38, neginf=-3e38, posinf=3e38)
    n, r = s.shape
    room = np.array(capacity, dtype=np.int64).reshape(-1)
    if room.size % r:
        raise ValueError(f"capacity must be [G, R={r}], got {np.shape(capacity)}")
    grp = _groups(group, n, room.size // r)
    if (np.bincount(grp, minlength=room.size // r) > room.reshape(-1, r).sum(1)).any():
        raise ValueError("capacity_assign: a group has more items than its total capacity")
    out = np.full(n, -1, dtype=np.int64)
    todo = np.arange(n)  # ascending, always
    while todo.size:
        every = todo.size == n  # no gathers in the first round
        g = grp if every else grp[todo]
        cand = np.where((room.reshape(-1, r) > 0).take(g, axis=0), s if every else s.take(todo, axis=0), -np.inf)
        choice = np.argmax(cand, axis=1)
        key = g * r + choice
        wanted = np.bincount(key, minlength=room.size)
        over = wanted > room
        keep = ~over[key]  # a rank with room for all its candidates takes them all
        contested = np.flatnonzero(~keep)
        if contested.size:  # the others keep their best ones: by key, then best first, then item order (stable)
            order = contested[np.lexsort((-cand[contested, choice[contested]], key[contested]))]
            ks = key[order]
            pos = np.arange(ks.size) - np.searchsorted(ks, ks, side="left")
            keep[order[pos < room[ks]]] = True
        out[todo[keep]] = choice[keep]
        room = np.where(over, 0, room - wanted)
        todo = todo[~keep]
    return out


def price_balance(scores: np.ndarray, capacity: np.ndarray, group: np.ndarray | None = None, *,
                  iters: int = PRICE_ITERS, step: float = PRICE_STEP, decay: float = PRICE_DECAY) -> np.ndarray:
    """Log-scores minus per-(group, rank) prices that spread the demand to the capacities (dual ascent).

    A rank wanted by more items than it holds gets dearer (``step * decay^i * excess / mean room``
    at round ``i``, in the units of ``scores``), so the items that lose least by moving move; a
    group stops once no rank is over-demanded. :func:`capacity_assign` on the result settles what
    remains. Element-wise float64 arithmetic only: the online shuffler
    (``moelayers.schedule.token_shuffle.price_balance``) reproduces it bit for bit.

    Args:
        scores: ``[n, R]`` log-scores (e.g. :meth:`SemanticPlan.rank_scores`), compared as float32.
        capacity: ``[G, R]`` room per (group, rank).
        group: ``[n]`` group of each item; default all 0.

    Returns:
        ``[n, R]`` float32 adjusted scores.

    Raises:
        ValueError: ``group`` is not ``[n]`` ids in ``[0, G)``.
    """
    s = np.asarray(scores, dtype=np.float32).astype(np.float64)
    n, r = s.shape
    cap = np.asarray(capacity, dtype=np.float64).reshape(-1, r)
    grp = _groups(group, n, cap.shape[0])
    per = np.maximum(cap.mean(1, keepdims=True), 1.0)
    price = np.zeros_like(cap)
    b = _batch_size(grp)
    if b and not np.isnan(s).any():  # batches in order (step_capacity's, or one group): the same, faster
        _batch_prices(s, cap, per, price, b, iters, step, decay)
        out = np.empty((n, r), dtype=np.float32)
        full = n - n % b
        out[:full].reshape(-1, b, r)[...] = s[:full].reshape(-1, b, r) - price[:full // b, None, :]
        if full < n:
            out[full:] = s[full:] - price[full // b]
        return out
    # a group without over-demand keeps its prices, hence its choices, for good: only the items of
    # groups still over-demanded are looked at again (the same result, much less work on long traces)
    live = np.arange(n)
    for _ in range(iters):
        every = live.size == n  # no gathers while every group is still live
        g = grp if every else grp[live]
        choice = np.argmax((s if every else s[live]) - price[g], axis=1)
        excess = np.bincount(g * r + choice, minlength=cap.size).reshape(cap.shape) - cap
        over = (excess > 0).any(1)
        price += np.where(over[:, None], step * excess / per, 0.0)
        step *= decay
        live = live[over[g]]
        if live.size == 0:
            break
    return (s - price[grp]).astype(np.float32)


def _groups(group: np.ndarray | None, n: int, num_groups: int) -> np.ndarray:
    """``group`` as ``[n]`` int64 in ``[0, num_groups)`` (all 0 if ``None``), or a ``ValueError``."""
    if group is None:
        return np.zeros(n, np.int64)
    grp = np.asarray(group, dtype=np.int64)
    if grp.shape != (n,):
        raise ValueError(f"group must be [n={n}] (one group per item), got shape {list(grp.shape)}")
    if n and (grp.min() < 0 or grp.max() >= num_groups):
        raise ValueError(f"group ids must lie in [0, {num_groups}) (capacity has {num_groups} rows), got "
                         f"{int(grp.min())}..{int(grp.max())}")
    return grp


def _batch_size(grp: np.ndarray) -> int:
    """``b`` where ``grp == arange(n) // b`` (consecutive batches of ``b`` items, the last one maybe
    shorter: :func:`step_capacity`'s groups, or one group), else 0."""
    n = grp.size
    if n == 0 or grp[0] != 0:
        return 0
    b = int(np.count_nonzero(grp == 0))
    return b if np.array_equal(grp, np.arange(n) // b) else 0


def _batch_prices(s: np.ndarray, cap: np.ndarray, per: np.ndarray, price: np.ndarray, b: int, iters: int,
                  step: float, decay: float) -> None:
    """:func:`price_balance`'s dual ascent for groups of ``b`` consecutive items, ``price`` updated in place.

    The same float64 numbers as the general loop, without its per-item gathers and row-wise argmax:
    scores are laid out ``[R, groups, b]`` so a group's price of a rank is broadcast over its items,
    and each item's choice (the first rank of highest ``s - price``, as ``np.argmax``; ``s`` has no
    NaN) is a running maximum over the ranks. The last group's missing items are scored ``-inf``:
    they choose rank 0, and are taken off its count.
    """
    n, r = s.shape
    ng = -(-n // b)
    pad = ng * b - n
    st = np.full((r, ng * b), -np.inf)
    st[:, :n] = s.T
    st = st.reshape(r, ng, b)
    ctype = np.int8 if r <= 127 else np.int64
    live = np.arange(ng)
    for _ in range(iters):
        every = live.size == ng  # no gathers while every group is still live
        pl = price[:ng] if every else price[live]
        best = (st[0] if every else st[0].take(live, axis=0)) - pl[:, :1]
        choice = np.zeros(best.shape, dtype=ctype)
        for j in range(1, r):
            dj = (st[j] if every else st[j].take(live, axis=0)) - pl[:, j:j + 1]
            np.maximum(choice, (dj > best).view(np.int8) * ctype(j), out=choice)  # choice < j so far
            np.maximum(best, dj, out=best)
        count = np.bincount(np.add(choice, (np.arange(live.size) * r)[:, None], dtype=np.int64).ravel(),
                            minlength=live.size * r).reshape(-1, r)
        if pad and live[-1] == ng - 1:
            count[-1, 0] -= pad
        excess = count - cap[live]
        over = (excess > 0).any(1)
        price[live] += np.where(over[:, None], step * excess / per[live], 0.0)
        step *= decay
        live = live[over]
        if live.size == 0:
            break


def balanced_assign(scores: np.ndarray, capacity: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """:func:`capacity_assign` of :func:`price_balance`: the tp shuffle of log-scores ``[n, R]`` -> ``[n]`` ranks."""
    return capacity_assign(price_balance(scores, capacity, group), capacity, group)


def step_capacity(num_tokens: int, tokens_per_step: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Batches of ``tokens_per_step`` tokens in file order and the tokens each rank takes of each.

    Returns:
        ``(step [T] int64, capacity [B, R] int64)``: full batches give every rank
        ``tokens_per_step / R``; the last partial batch differs by at most one between ranks.
    """
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, (int, np.integer)) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
    if tokens_per_step % num_ranks:
        raise ValueError(f"tokens_per_step ({tokens_per_step}) must be divisible by the number of ranks ({num_ranks}) "
                         "so that every rank receives the same number of tokens per batch")
    step = np.arange(num_tokens, dtype=np.int64) // tokens_per_step
    sizes = np.bincount(step)
    cap = (sizes[:, None] // num_ranks + (np.arange(num_ranks)[None, :] < (sizes % num_ranks)[:, None])).astype(np.int64)
    return step, cap


def request_schedule(scores: np.ndarray, lengths: np.ndarray, num_ranks: int, *, max_ratio: float = 1.3,
                     mask: bool = True, lookahead: bool = True, joint: bool = False,
                     balance: float = JOINT_BALANCE) -> np.ndarray:
    """Sem-MoE Algorithm 2: requests in order, each to its best unmasked rank, then mask it.

    The mask resets once every rank is taken, so every mask cycle (``R`` consecutive requests from
    an empty mask) covers all ranks. With ``joint`` the requests of a cycle are given
    their ranks together, the assignment with the largest total score (:func:`best_matching`),
    instead of greedily in order, where the last request of a cycle takes whatever rank is left.
    A rank is closed to a request that would take it above ``max_ratio * total_tokens / R`` or,
    with ``lookahead``, after which the requests still to come would not pack under that cap. Where
    the best joint assignment of a cycle breaks either (or a score is not finite), the cycle's first
    request is placed on its own (:func:`schedule_one`) and the joint assignment is tried again for
    the rest of the cycle. On its own, a request takes its best open unmasked rank; if every unmasked
    rank is closed, the best open masked rank, and if none is open (a request longer than the room
    anywhere) the least-loaded rank.

    Args:
        scores: ``[S, R]`` preference of each request for each rank (ties: the lower rank).
        lengths: ``[S]`` tokens per request.
        mask: ``False``: no mask, the ``max_ratio`` cap alone balances (each request takes its best
            open rank; ``joint`` does not apply).
        lookahead: close a rank to a request when the requests still to come would no longer
            pack under the cap (first-fit decreasing, :func:`packs`). The default: the held-out
            evaluation knows every length, and the report promises no rank above the cap.
            ``False`` is exactly what the online ``SemanticScheduler`` does given
            ``total_tokens`` (both call :func:`schedule_requests`): it cannot know the lengths to
            come, and late long requests may take a rank above the cap.
        joint: assign each mask cycle's requests together (a batch known up front; a request's rank
            then depends on the later requests of its cycle too). ``False`` (default): one by one,
            as published, each rank depending on the requests before it only.
        balance: with ``joint``, a request's score on a rank is lowered by ``balance`` × its tokens ×
            (the rank's tokens / the mean - 1), so that long requests lean away from loaded ranks
            (without it, the long requests, whose votes are largest, all win the most wanted rank).

    Returns:
        ``[S]`` int64 rank per request.

    Raises:
        ValueError: ``scores`` not ``[S, R]`` for the ``S`` lengths and ``num_ranks``, a negative
            length, or ``max_ratio`` not a number >= 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    shape = np.shape(scores)
    if lengths.ndim != 1 or shape != (lengths.size, num_ranks):
        raise ValueError(f"scores must be [S, R] = [{lengths.size if lengths.ndim == 1 else '?'}, {num_ranks}] "
                         f"(one row per request length, one column per rank), got {list(shape)} for lengths "
                         f"{list(lengths.shape)}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"request lengths must be >= 0, got {lengths.min()}")
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float, np.integer, np.floating)) \
            or not max_ratio >= 1.0:  # nan fails too
        raise ValueError(f"max_ratio must be a number >= 1 (the token cap per rank, times the mean), got {max_ratio!r}")
    cap = max_ratio * lengths.sum() / num_ranks
    return schedule_requests(scores, lengths, np.zeros(num_ranks, dtype=np.int64), np.zeros(num_ranks, dtype=bool),
                             cap, mask=mask, lookahead=lookahead, joint=joint, balance=balance)


def schedule_requests(scores: np.ndarray, lengths: np.ndarray, load: np.ndarray, masked: np.ndarray, cap: float, *,
                      mask: bool = True, lookahead: bool = False, joint: bool = False,
                      balance: float = JOINT_BALANCE) -> np.ndarray:
    """Requests in order onto ranks with a running ``load [R]`` (tokens) and ``masked [R]`` (both
    updated in place): :func:`request_schedule` from any state (the online ``SemanticScheduler``).

    Args:
        scores: ``[S, R]`` preference of each request for each rank.
        lengths: ``[S]`` tokens per request.
        cap: no rank above this many tokens (``np.inf``: no cap).
        mask, lookahead, joint, balance: as in :func:`request_schedule`; ``lookahead`` looks at the
            requests of this call only.

    Returns:
        ``[S]`` int64 rank per request.
    """
    sc = np.asarray(scores, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.empty(sc.shape[0], dtype=np.int64)
    # the look-ahead's sum and longest length of every suffix, once (sorting each suffix would make
    # the schedule quadratic in the requests)
    suffix_sum = np.concatenate([np.cumsum(lengths[::-1])[::-1], [0]])
    suffix_max = np.concatenate([np.maximum.accumulate(lengths[::-1])[::-1], [0]]) if lengths.size else [0]

    def pending(i: int) -> Pending | None:
        return Pending(lengths[i:], int(suffix_sum[i]), int(suffix_max[i])) if lookahead else None

    s = 0
    while s < sc.shape[0]:
        if joint and mask:
            k = min(int((~masked).sum()), sc.shape[0] - s)
            ranks = _joint_cycle(sc[s:s + k], lengths[s:s + k], load, masked, cap, pending(s + k), balance)
            if ranks is not None:
                out[s:s + k] = ranks
                s += k
                continue
        out[s] = schedule_one(sc[s], int(lengths[s]), load, masked, cap, mask=mask, remaining=pending(s + 1))
        s += 1
    return out


def _joint_cycle(scores: np.ndarray, lengths: np.ndarray, load: np.ndarray, masked: np.ndarray, cap: float,
                 remaining: Pending | None, balance: float) -> np.ndarray | None:
    """The ``k`` requests of ``scores [k, R]`` onto ``k`` distinct unmasked ranks, largest total
    score less ``balance × tokens × (rank load / mean load - 1)``, each within ``cap`` (and the
    ``remaining`` lengths still packable); commits to ``load`` and ``masked`` and returns the ranks,
    or ``None`` (nothing changed) where no such assignment is the best one."""
    free = np.flatnonzero(~masked)
    fits = load[free][None, :] + lengths[:, None] <= cap
    if not fits.any(1).all() or not np.isfinite(scores[:, free]).all():  # inf / NaN votes: one by one
        return None
    mean = load.mean()
    w = scores[:, free] - (balance * lengths[:, None] * (load[free][None, :] / mean - 1.0) if mean > 0 else 0.0)
    penalty = np.abs(w).sum() + 1.0  # a closed rank loses against any open one
    cols = best_matching(np.where(fits, w, w - penalty))
    if not fits[np.arange(cols.size), cols].all():
        return None
    ranks = free[cols]
    new_load = load.copy()
    np.add.at(new_load, ranks, lengths.astype(load.dtype))  # exact integer counts
    if remaining is not None and not packs(cap - new_load.astype(np.float64), remaining):
        return None
    load[:] = new_load
    masked[ranks] = True
    if masked.all():
        masked[:] = False
    return ranks


def best_matching(weights: np.ndarray) -> np.ndarray:
    """Rows onto distinct columns with the largest total weight (the Hungarian method, O(k² n)).

    Args:
        weights: ``[k, n]`` finite, ``k <= n``.

    Returns:
        ``[k]`` int64 column of each row. Among equal totals the result is deterministic; a single
        row takes its first best column.
    """
    w = np.asarray(weights, dtype=np.float64)
    k, n = w.shape
    if k > n:
        raise ValueError(f"best_matching needs rows <= columns, got {k} x {n}")
    cost = np.concatenate([np.zeros((1, n)), w.max() - w]) if k else np.zeros((1, n))  # row 0: the dummy
    u, v = np.zeros(k + 1), np.zeros(n + 1)
    row_of = np.zeros(n + 1, dtype=np.int64)  # column j (1-based) -> matched row (1-based), 0: free
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, k + 1):
        row_of[0], j0 = i, 0
        slack = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:  # grow an alternating tree from row i until it reaches a free column
            used[j0] = True
            cur = cost[row_of[j0]] - u[row_of[j0]] - v[1:]
            better = ~used[1:] & (cur < slack[1:])
            slack[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(used[1:], np.inf, slack[1:])
            j1 = int(np.argmin(cand)) + 1
            delta = cand[j1 - 1]
            u[row_of[used]] += delta
            v[used] -= delta
            slack[1:][~used[1:]] -= delta
            j0 = j1
            if row_of[j0] == 0:
                break
        while j0:  # flip the augmenting path
            j1 = way[j0]
            row_of[j0] = row_of[j1]
            j0 = j1
    out = np.empty(k, dtype=np.int64)
    cols = np.flatnonzero(row_of[1:])
    out[row_of[1:][cols] - 1] = cols
    return out


class Pending:
    """Request lengths still to come (the look-ahead): their sum, the longest, and the lengths in
    descending order, sorted on first use (most checks of :func:`packs` need the sum alone)."""

    __slots__ = ("lengths", "total", "longest", "_desc")

    def __init__(self, lengths: np.ndarray, total: int | None = None, longest: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.total = int(self.lengths.sum()) if total is None else total
        self.longest = (int(self.lengths.max()) if self.lengths.size else 0) if longest is None else longest
        self._desc: np.ndarray | None = None

    @property
    def size(self) -> int:
        return self.lengths.size

    def descending(self) -> np.ndarray:
        if self._desc is None:
            self._desc = np.sort(self.lengths)[::-1]
        return self._desc


def packs(room: np.ndarray, pending: "Pending | np.ndarray") -> bool:
    """Whether the ``pending`` request lengths fit into ranks with ``room [R]`` tokens left, by
    first-fit decreasing (a sufficient test; exact when it says yes)."""
    if not isinstance(pending, Pending):
        pending = Pending(pending)
    if pending.size == 0:
        return True
    if room.sum() - room.size * (pending.longest - 1) >= pending.total:
        return True  # any fit succeeds: each rank wastes less than the longest request
    room = room.astype(np.float64)
    for n in pending.descending():
        fit = np.flatnonzero(room >= n)
        if fit.size == 0:
            return False
        room[fit[0]] -= n
    return True


def schedule_one(scores: np.ndarray, length: int, load: np.ndarray, masked: np.ndarray, cap: float, *,
                 mask: bool = True, remaining: Pending | np.ndarray | None = None) -> int:
    """One request of :func:`request_schedule` (also the online ``SemanticScheduler.assign``).

    The best rank among those unmasked that stay within ``cap`` tokens with this request, else
    among all that stay within it, else (a request no rank can take within the cap, e.g. a long
    prompt among fewer requests than ranks) the best of the least-loaded ranks, unmasked ones
    first; ties: the lowest rank. Updates
    ``load [R]`` (tokens) and ``masked [R]`` in place (the mask clears once every rank is taken).
    With ``remaining`` (``request_schedule(lookahead=True)``, offline: the lengths still to come, a
    :class:`Pending` or an array) a rank only stays within ``cap`` if the remaining requests still
    pack under the cap afterwards (:func:`packs`), when some rank allows that.

    Returns:
        The rank.
    """
    fits = load + length <= cap
    for allowed in (~masked & fits, fits):
        order = [int(r) for r in np.lexsort((np.arange(scores.size), -np.asarray(scores, np.float64))) if allowed[r]]
        if not order:
            continue
        r = order[0]
        if remaining is not None and remaining.size:
            room = cap - load.astype(np.float64)
            keep = next((c for c in order if packs(room - length * (np.arange(room.size) == c), remaining)), None)
            if keep is None and allowed is not fits:
                continue  # no unmasked rank keeps the rest packable: try the masked ones too
            r = r if keep is None else keep
        break
    else:  # over the cap wherever it goes: the least load, then the mask and the votes decide
        least = load == load.min()
        r = next(int(c) for c in np.lexsort((np.arange(scores.size), -np.asarray(scores, np.float64), masked))
                 if least[c])
    load[r] += length
    masked[r] = mask
    if masked.all():
        masked[:] = False
    return r


def lar_from_assignment(trace, expert_rank: np.ndarray, token_rank: np.ndarray, num_ranks: int | None = None) -> float:
    """Local activation rate of an assignment, averaged over layers.

    Args:
        trace: :class:`~moelayers.trace.RoutingTrace` with ``T`` tokens, ``L`` layers.
        expert_rank: ``[L, E]`` rank of each expert per layer.
        token_rank: ``[T, L]`` rank of each token per layer.
        num_ranks: ``R``, when known: every rank must be in ``[0, R)`` (else only ``>= 0``).

    Returns:
        Share of (token, layer, k) activations whose expert's rank equals the token's rank.

    Raises:
        ValueError: shapes off, or a rank out of range (it would count as remote, silently).
    """
    er = np.asarray(expert_rank, dtype=np.int64)
    tr = np.asarray(token_rank, dtype=np.int64)
    _check_assignment_shapes(trace, er, tr)
    top = np.inf if num_ranks is None else num_ranks
    for name, a in (("expert_rank", er), ("token_rank", tr)):
        if a.size and (a.min() < 0 or a.max() >= top):
            bound = "be >= 0" if num_ranks is None else f"be in [0, {num_ranks})"
            raise ValueError(f"{name} holds ranks in [{a.min()}, {a.max()}]: they must {bound}")
    return float(np.mean([_layer_local(trace.topk_ids[:, l], er[l], tr[:, l]).mean() for l in range(trace.num_layers)]))


def _check_assignment_shapes(trace, expert_rank: np.ndarray, token_rank: np.ndarray) -> None:
    if expert_rank.shape != (trace.num_layers, trace.num_experts) or \
            token_rank.shape != (trace.num_tokens, trace.num_layers):
        raise ValueError(f"expert_rank must be [L, E] = {[trace.num_layers, trace.num_experts]} and token_rank "
                         f"[T, L] = {[trace.num_tokens, trace.num_layers]}; got {list(expert_rank.shape)}, "
                         f"{list(token_rank.shape)}")


def linear_expert_rank(num_layers: int, num_experts: int, num_ranks: int) -> np.ndarray:
    """``[L, E]`` linear placement: experts ``r*E/R .. (r+1)*E/R - 1`` on rank ``r``.

    Raises:
        ValueError: ``E`` is not a positive multiple of ``R``.
    """
    if num_ranks < 1 or num_experts < num_ranks or num_experts % num_ranks:
        raise ValueError(f"a linear placement needs the experts ({num_experts}) to be a positive multiple of the "
                         f"ranks ({num_ranks})")
    return np.tile(np.arange(num_experts, dtype=np.int64) // (num_experts // num_ranks), (num_layers, 1))


def _layer_local(topk: np.ndarray, er: np.ndarray, tr: np.ndarray) -> np.ndarray:
    return er[np.asarray(topk).astype(np.int64, copy=False)] == tr[:, None]


def even_token_rank(trace, num_ranks: int, mode: str, tokens_per_step: int = 2048, *,
                    max_ratio: float = 1.3) -> np.ndarray:
    """Ranks of the tokens spread evenly, the same at every layer (no plan).

    Args:
        trace: held-out :class:`~moelayers.trace.RoutingTrace` with ``T`` tokens.
        num_ranks: ``R``.
        mode: ``'tp'`` (each batch of ``tokens_per_step`` cut into ``R`` chunks in file order, the last
            partial batch's chunks differing by at most one) or ``'dp'`` (requests round robin in file
            order, at most ``max_ratio`` × the mean tokens per rank: :func:`request_schedule` with no
            votes, so a rank that the cap, with its look-ahead, closes to a request is skipped; where
            no schedule keeps the cap, the least-loaded rank).
        tokens_per_step: batch size (tp; divisible by ``R``).

    Returns:
        ``[T]`` int64 rank per token.
    """
    if mode == "tp":
        step, cap = step_capacity(trace.num_tokens, tokens_per_step, num_ranks)
        starts = np.searchsorted(step, np.arange(cap.shape[0]))
        pos = np.arange(step.size) - starts[step]  # position within the batch
        return (pos[:, None] >= np.cumsum(cap, axis=1)[step]).sum(1).astype(np.int64)
    if mode != "dp":
        raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
    lengths = trace.seq_lengths
    req = request_schedule(np.zeros((lengths.size, num_ranks)), lengths, num_ranks, max_ratio=max_ratio, joint=False)
    return np.repeat(req, lengths).astype(np.int64)


def assignment_metrics(trace, expert_rank: np.ndarray, token_rank: np.ndarray, num_ranks: int) -> dict:
    """Per-layer local activations, loads and de-duplicated remote sends of an assignment.

    Args:
        trace: :class:`~moelayers.trace.RoutingTrace` with ``T`` tokens, ``L`` layers.
        expert_rank: ``[L, E]`` rank of each expert.
        token_rank: ``[T, L]`` rank of each token at each layer.
        num_ranks: ``R``.

    Returns:
        ``lar_per_layer [L]``, ``token_imbalance``, ``tokens_per_rank [R]`` (layer 0),
        ``expert_imbalance_per_layer [L]`` and ``remote_sends`` (int).
    """
    er, tr = np.asarray(expert_rank, dtype=np.int64), np.asarray(token_rank, dtype=np.int64)
    _check_assignment_shapes(trace, er, tr)
    lar, e_imb, t_imb, sends = [], [], [], 0
    rows = np.arange(trace.num_tokens)
    for layer in range(trace.num_layers):
        ranks = er[layer][trace.topk_ids[:, layer].astype(np.int64)]  # [T, K] rank of each activation
        lar.append(float((ranks == tr[:, layer, None]).mean()))
        got = np.bincount(ranks.ravel(), minlength=num_ranks)
        e_imb.append(float(got.max() / got.mean()))
        tokens = np.bincount(tr[:, layer], minlength=num_ranks)
        t_imb.append(float(tokens.max() / tokens.mean()))
        hit = rank_counts(trace.topk_ids[:, layer], er[layer], num_ranks) > 0
        sends += int(hit.sum() - hit[rows, tr[:, layer]].sum())
    return {"lar_per_layer": lar, "token_imbalance": float(np.mean(t_imb)),
            "tokens_per_rank": np.bincount(tr[:, 0], minlength=num_ranks).tolist(),
            "expert_imbalance_per_layer": e_imb, "remote_sends": sends}


def lar_report(trace, expert_rank: np.ndarray, token_rank: np.ndarray, linear_token_rank: np.ndarray,
               num_ranks: int) -> dict:
    """The LAR keys of ``report.json`` (see the module docstring).

    Args:
        trace: held-out trace (``T`` tokens, ``L`` layers, ``E`` experts).
        expert_rank: ``[L, E]`` the planner's placement.
        token_rank: ``[T, L]`` the planner's token ranks.
        linear_token_rank: ``[T]`` the even spread (:func:`even_token_rank`), used with the linear
            placement for ``lar_linear`` and the ``a2a_bytes_ratio`` reference.
        num_ranks: ``R``.
    """
    mine = assignment_metrics(trace, expert_rank, token_rank, num_ranks)
    lin_tr = np.repeat(np.asarray(linear_token_rank, dtype=np.int64)[:, None], trace.num_layers, axis=1)
    lin = assignment_metrics(trace, linear_expert_rank(trace.num_layers, trace.num_experts, num_ranks), lin_tr,
                             num_ranks)
    lar, lar_lin = float(np.mean(mine["lar_per_layer"])), float(np.mean(lin["lar_per_layer"]))
    return {
        "lar": lar, "lar_linear": lar_lin,
        "lar_per_layer": mine["lar_per_layer"], "lar_linear_per_layer": lin["lar_per_layer"],
        "token_imbalance": mine["token_imbalance"], "tokens_per_rank": mine["tokens_per_rank"],
        "expert_imbalance": float(np.mean(mine["expert_imbalance_per_layer"])),
        "expert_imbalance_max": float(np.max(mine["expert_imbalance_per_layer"])),
        "expert_imbalance_linear": float(np.mean(lin["expert_imbalance_per_layer"])),
        "a2a_bytes_ratio": mine["remote_sends"] / lin["remote_sends"] if lin["remote_sends"] else 1.0,
        "remote_ratio": (1 - lar) / (1 - lar_lin) if lar_lin < 1 else 1.0,
    }


def _check(plan: SemanticPlan, trace) -> np.ndarray:
    plan.check_compatible(trace.num_experts, plan.num_ranks, trace.num_layers)
    return check_token_ids(trace.token_ids, plan.vocab_size, "token_ids")


def tp_scores(plan: SemanticPlan, trace, layer: int, predictor: str = "combined") -> np.ndarray:
    """``[T, R]`` preference of each token for each rank at ``layer`` (uses layers ``< layer`` only).

    ``combined`` and ``token`` give float32 log-scores (:meth:`SemanticPlan.rank_scores`, with and
    without the experts of the previous layers); ``alg3`` gives the chosen source's confidence on
    its rank and -1 elsewhere.
    """
    ids = check_token_ids(trace.token_ids, plan.vocab_size, "token_ids")
    r, l = plan.num_ranks, layer
    if predictor in ("combined", "token"):
        depth = 0 if predictor == "token" or plan.history_pmi is None else min(plan.history_pmi.shape[1], l)
        prev = np.take(trace.topk_ids, np.arange(l - 1, l - depth - 1, -1), axis=1) if depth else None  # l-1, l-2, ..
        return plan.rank_scores(l, ids, prev)
    if predictor != "alg3":
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {predictor!r}")
    rank_, conf = plan.token_rank[l][ids], plan.token_conf[l][ids].astype(np.float64)
    if l >= 2:
        ctx2 = majority_rank(trace.topk_ids[:, l - 2], plan.expert_rank[l - 2], r)
        ctx1 = majority_rank(trace.topk_ids[:, l - 1], plan.expert_rank[l - 1], r)
        a_rank, a_conf = plan.ngram_rank[l][ctx2, ctx1], plan.ngram_conf[l][ctx2, ctx1].astype(np.float64)
        use_a = a_conf > conf
        rank_, conf = np.where(use_a, a_rank, rank_), np.where(use_a, a_conf, conf)
    out = np.full((ids.size, r), -1.0)  # below any confidence: a token with confidence 0 still asks for its rank
    out[np.arange(ids.size), rank_] = conf  # as online (``rebatch_tokens``); the overflow fills in rank order
    return out


def assign_tp(plan: SemanticPlan, heldout_trace, tokens_per_step: int = 2048, *,
              predictor: str = "combined", progress: bool = False) -> np.ndarray:
    """Attention-TP token ranks of :func:`evaluate_tp`, without the metrics: ``token_rank [T, L]`` int64.

    ``predictor``: as ``SemanticMoE(predictor=...)`` runs online (a plan without ``token_logq`` runs
    ``alg3`` whatever is asked, there and here).

    ``progress``: a tqdm bar over the layers (one thread: about 0.8 s a layer per million tokens at
    EP4, 1.4 s at EP8).
    """
    if predictor not in PREDICTORS:
        raise ValueError(f"predictor must be one of {PREDICTORS}, got {predictor!r}")
    _check(plan, heldout_trace)
    if plan.token_logq is None:  # Algorithm 3 tables only: what SemanticMoE runs on such a plan
        predictor = "alg3"
    step, cap = step_capacity(heldout_trace.num_tokens, tokens_per_step, plan.num_ranks)
    out = np.empty((heldout_trace.num_tokens, heldout_trace.num_layers), dtype=np.int64)
    layers = range(heldout_trace.num_layers)
    if progress:
        from moelayers._progress import progress_bar

        layers = progress_bar(layers, desc=f"held-out token ranks (tp, EP{plan.num_ranks})", unit="layer")
    for l in layers:
        sc = tp_scores(plan, heldout_trace, l, predictor)
        out[:, l] = capacity_assign(sc, cap, step) if predictor == "alg3" else balanced_assign(sc, cap, step)
    return out


def evaluate_tp(plan: SemanticPlan, heldout_trace, tokens_per_step: int = 2048, *,
                predictor: str = "combined", progress: bool = False) -> tuple[dict, np.ndarray]:
    """Held-out evaluation in attention-TP mode (see the module docstring).

    Args:
        plan: the plan (any mode; ``tp`` plans carry the tables this mode needs).
        heldout_trace: routing of held-out tokens (same ``E`` and ``L`` as the plan).
        tokens_per_step: batch size, divisible by ``R``.
        predictor: ``'combined'``, ``'alg3'`` or ``'token'``.
        progress: a bar over the layers (:func:`assign_tp`; a minute or more for tens of layers of
            hundreds of thousands of held-out tokens).

    Returns:
        ``(report, token_rank [T, L] int64)``.
    """
    out = assign_tp(plan, heldout_trace, tokens_per_step, predictor=predictor, progress=progress)
    linear_tr = even_token_rank(heldout_trace, plan.num_ranks, "tp", tokens_per_step)
    report = {"mode": "tp", "ep": plan.num_ranks, "num_tokens": int(heldout_trace.num_tokens),
              "num_layers": heldout_trace.num_layers,
              **lar_report(heldout_trace, plan.expert_rank, out, linear_tr, plan.num_ranks),
              "tokens_per_step": int(tokens_per_step),
              "predictor": predictor if plan.token_logq is not None else "alg3"}
    return report, out


def assign_dp(plan: SemanticPlan, heldout_trace, *, max_ratio: float = 1.3, mask: bool = True,
              joint: bool = False) -> np.ndarray:
    """Attention-DP token ranks of :func:`evaluate_dp`, without the metrics: ``token_rank [T, L]`` int64."""
    ids = _check(plan, heldout_trace)
    r = plan.num_ranks
    lengths = heldout_trace.seq_lengths
    seq = np.repeat(np.arange(lengths.size), lengths)
    votes = np.bincount(seq * r + plan.token_rank[0][ids], weights=plan.token_conf[0][ids].astype(np.float64),
                        minlength=lengths.size * r).reshape(-1, r)
    req = request_schedule(votes, lengths, r, max_ratio=max_ratio, mask=mask, joint=joint)
    return np.repeat(req[seq][:, None], heldout_trace.num_layers, axis=1)


def evaluate_dp(plan: SemanticPlan, heldout_trace, *, max_ratio: float = 1.3, mask: bool = True,
                joint: bool = False) -> tuple[dict, np.ndarray]:
    """Held-out evaluation in attention-DP mode (Algorithm 2, see the module docstring).

    Votes use the plan's layer-0 ``token_rank`` / ``token_conf`` rows (identical over layers in a
    dp plan) of every token of the sequence: here a request is a whole trace sequence (a prompt;
    ``recipes/serve.py``, which splits a sequence into a prompt and teacher-forced output, votes
    on the prompt alone). The ``max_ratio`` cap applies to the final tokens per rank: a rank is closed to a
    request that would take it above ``max_ratio * T / R``. ``mask=False`` schedules by the cap
    alone (see :func:`request_schedule`; not what the online scheduler does today). ``joint``: each
    mask cycle's requests are assigned together (``SemanticScheduler.assign_batch``); ``False``
    (default): one by one, ``SemanticScheduler.assign``'s choices plus a look-ahead that keeps the
    remaining requests packable under the cap (``request_schedule(lookahead=True)``; an online
    server cannot look ahead, and where the cap binds the two can differ).

    Returns:
        ``(report, token_rank [T, L] int64)``, each token's rank the rank of its request.
    """
    tr = assign_dp(plan, heldout_trace, max_ratio=max_ratio, mask=mask, joint=joint)
    r = plan.num_ranks
    linear_tr = even_token_rank(heldout_trace, r, "dp", max_ratio=max_ratio)
    report = {"mode": "dp", "ep": r, "num_tokens": int(heldout_trace.num_tokens),
              "num_layers": heldout_trace.num_layers, **lar_report(heldout_trace, plan.expert_rank, tr, linear_tr, r),
              "max_ratio": float(max_ratio), "mask": bool(mask), "joint": bool(mask and joint)}
    return report, tr


def evaluate(plan: SemanticPlan, heldout_trace, tokens_per_step: int = 2048, **kwargs) -> tuple[dict, np.ndarray]:
    """:func:`evaluate_tp` or :func:`evaluate_dp`, by ``plan.mode``; ``(report, token_rank [T, L])``.

    ``tokens_per_step`` is the tp batch (a dp request keeps its sequence whole, so dp takes none);
    ``progress=True`` draws a bar over the layers in tp mode (dp's schedule takes a moment).
    """
    if plan.mode == "dp":
        kwargs.pop("progress", None)
        return evaluate_dp(plan, heldout_trace, **kwargs)
    return evaluate_tp(plan, heldout_trace, tokens_per_step, **kwargs)
