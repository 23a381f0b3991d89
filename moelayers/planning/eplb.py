"""EPLB-style rearrangement (after DeepSeek's Expert Parallelism Load Balancer, reimplemented).

The global policy of EPLB, for one layer:

1. *replicate* (optional): starting from one replica per expert, repeatedly give one more replica
   to the expert with the largest load per replica, until ``E + num_replicas`` physical experts
   exist;
2. *balanced packing*: physical experts (load = expert load / its replica count) in decreasing
   order of load, each onto the least-loaded rank that still has a free slot (and, here, does not
   already hold a replica of that expert), so every rank gets the same number of slots.

Only mean loads matter: EPLB balances the total rows per rank and ignores per-step variation and
per-rank speed (which GEM uses).
"""

from __future__ import annotations

import numpy as np

from moelayers.placement import ExpertPlacement

__all__ = ["balanced_packing", "replicate_experts", "plan_eplb", "plan_eplb_placement"]


def _numbers(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as float64, refusing what is not a number of rows (bool, complex, strings, objects)."""
    v = np.asarray(values)
    if v.dtype.kind not in "iuf":
        raise ValueError(f"{what} must be numbers of rows, got dtype {v.dtype}")
    return v.astype(np.float64)


def _mean_loads(loads: np.ndarray) -> np.ndarray:
    w = _numbers(loads, "loads")
    if w.ndim == 2 and w.shape[0] == 0:
        raise ValueError("loads has no steps (empty trace): nothing to plan")
    if w.ndim not in (1, 2) or w.size == 0:
        raise ValueError(f"loads must be [E] or [steps, E], got shape {list(np.shape(loads))}")
    if not np.all(np.isfinite(w)) or (w < 0).any():  # every step's, before the sum hides one
        raise ValueError("loads must be finite and >= 0")
    if w.ndim == 2:
        w = w.sum(axis=0)
        if not np.all(np.isfinite(w)):
            raise ValueError("loads overflow float64 when summed over the steps")
    return w


def balanced_packing(weights: np.ndarray, num_packs: int, *, item_group: np.ndarray | None = None) -> np.ndarray:
    """Pack ``N`` items into ``num_packs`` packs of ``N / num_packs`` items, balancing the weight.

    Heaviest item first, each into the lightest pack with a free place (ties: the lower pack);
    with ``item_group``, a pack takes at most one item of a group: where the greedy pass had to put
    two in one pack (every open pack already held the group), the later one is swapped with the
    closest-weighing item of another pack that can take it (:func:`_separate_groups`).

    Args:
        weights: ``[N]`` item weights.
        num_packs: packs (``N`` divisible by it).
        item_group: ``[N]`` optional group id per item (e.g. the logical expert of a replica).

    Returns:
        ``pack [N]`` int64.
    """
    w = _numbers(weights, "balanced_packing: weights")
    num = w.size
    if w.ndim != 1 or not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError(f"balanced_packing: weights must be [N] finite numbers >= 0, got shape {list(w.shape)}"
                         + ("" if w.ndim != 1 else f" with min {w.min() if num else None}"))
    if item_group is not None and np.shape(item_group) != (num,):
        raise ValueError(f"balanced_packing: item_group must be [N={num}], got shape {list(np.shape(item_group))}")
    if isinstance(num_packs, bool) or not isinstance(num_packs, (int, np.integer)):
        raise ValueError(f"balanced_packing: num_packs must be an int, got {num_packs!r}")
    if num_packs < 1 or num % num_packs:
        raise ValueError(f"balanced_packing: {num} items do not split evenly into {num_packs} packs")
    cap = num // num_packs
    pack = np.full(num, -1, dtype=np.int64)
    load, count = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    held: list[set] = [set() for _ in range(num_packs)]
    for i in np.argsort(-w, kind="stable"):
        open_ = count < cap
        if item_group is not None:
            fresh = open_ & np.array([int(item_group[i]) not in h for h in held])
            open_ = fresh if fresh.any() else open_
        p = int(np.argmin(np.where(open_, load, np.inf)))
        pack[i] = p
        load[p] += w[i]
        count[p] += 1
        if item_group is not None:
            held[p].add(int(item_group[i]))
    if item_group is not None:
        _separate_groups(pack, w, np.asarray(item_group, dtype=np.int64))
    return pack


def _separate_groups(pack: np.ndarray, w: np.ndarray, group: np.ndarray) -> None:
    """Swap items in place until no pack holds two items of one group.

    Each clash (item ``i`` in a pack that holds another item of its group) is resolved by swapping
    ``i`` with the item ``j`` of another pack whose weight is closest to ``i``'s, such that neither
    pack then holds a group twice; pack sizes are unchanged.

    Raises:
        ValueError: a group has more items than there are packs, or no such swap exists.
    """
    num_packs = int(pack.max()) + 1 if pack.size else 0
    counts = np.bincount(group)
    if counts.size and counts.max() > num_packs:
        raise ValueError(f"balanced_packing: group {int(counts.argmax())} has {int(counts.max())} items for "
                         f"{num_packs} packs: one pack would hold two")
    while True:
        pairs = pack * (group.max() + 1) + group
        _, first, times = np.unique(pairs, return_index=True, return_counts=True)
        clashes = [k for k, c in zip(first, times) if c > 1]
        if not clashes:
            return
        k = int(clashes[0])
        i = int(np.flatnonzero((pack == pack[k]) & (group == group[k]))[-1])  # the later of the two
        p, g = int(pack[i]), int(group[i])
        in_p = set(group[pack == p].tolist())
        best, best_gap = -1, np.inf
        for j in np.flatnonzero(pack != p):
            q, h = int(pack[j]), int(group[j])
            if h in in_p or g in set(group[(pack == q) & (np.arange(pack.size) != j)].tolist()):
                continue
            if abs(w[j] - w[i]) < best_gap:
                best, best_gap = int(j), abs(w[j] - w[i])
        if best < 0:
            raise ValueError(f"balanced_packing: cannot place the items of group {g} on distinct packs")
        pack[i], pack[best] = pack[best], p


def replicate_experts(weights: np.ndarray, num_physical: int, max_replicas: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replicas for the hottest experts: ``num_physical >= E`` physical experts in all.

    Args:
        weights: ``[E]`` expert loads.
        num_physical: total physical experts.
        max_replicas: at most this many replicas of one expert (``plan_eplb``: the ranks, one each).

    Returns:
        ``phy2log [num_physical]`` (logical expert of each physical one; the first ``E`` are the
        experts themselves) and ``logcnt [E]`` (replicas per expert).
    """
    w = _numbers(weights, "replicate_experts: weights")
    num_e = w.size
    if w.ndim != 1 or num_e == 0 or not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError(f"replicate_experts: weights must be [E] finite numbers >= 0 with E >= 1, got shape "
                         f"{list(w.shape)}")
    if num_physical < num_e:
        raise ValueError(f"replicate_experts: {num_physical} physical experts cannot hold {num_e} experts")
    if max_replicas is not None and num_physical > num_e * max_replicas:
        raise ValueError(f"replicate_experts: {num_physical} physical experts need more than {max_replicas} "
                         f"replicas of some of the {num_e} experts (at most one per rank)")
    phy2log = list(range(num_e))
    logcnt = np.ones(num_e, dtype=np.int64)
    for _ in range(num_physical - num_e):
        share = w / logcnt
        if max_replicas is not None:
            share = np.where(logcnt < max_replicas, share, -np.inf)
        e = int(np.argmax(share))
        phy2log.append(e)
        logcnt[e] += 1
    return np.array(phy2log, dtype=np.int64), logcnt


def plan_eplb(loads: np.ndarray, num_ranks: int, *, num_replicas: int = 0) -> np.ndarray:
    """EPLB placement of one layer.

    Args:
        loads: ``[E]`` expert loads, or ``[steps, E]`` (summed over steps).
        num_ranks: ``R`` (``E + num_replicas`` divisible by ``R``).
        num_replicas: extra physical experts (redundant replicas of hot experts); 0 = none.

    Returns:
        ``expert_rank [E]`` int64 with ``E / R`` experts per rank when ``num_replicas == 0``;
        otherwise ``phy2log [R, (E + num_replicas) / R]`` int64 (EPLB's table, for
        :meth:`moelayers.placement.ExpertPlacement.from_phy2log`).
    """
    w = _mean_loads(loads)
    num_e = w.size
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 0:
        raise ValueError(f"num_replicas must be an int >= 0, got {num_replicas!r}")
    num_phy = num_e + int(num_replicas)
    if num_phy % num_ranks:
        raise ValueError(f"E + num_replicas ({num_phy}) must be divisible by num_ranks ({num_ranks})")
    if num_replicas == 0:
        return balanced_packing(w, num_ranks)
    phy2log, logcnt = replicate_experts(w, num_phy, max_replicas=num_ranks)  # a rank holds one replica at most
    pack = balanced_packing(w[phy2log] / logcnt[phy2log], num_ranks, item_group=phy2log)
    per = num_phy // num_ranks
    table = np.empty((num_ranks, per), dtype=np.int64)
    for r in range(num_ranks):
        table[r] = np.sort(phy2log[pack == r])
    return table


def plan_eplb_placement(loads: np.ndarray, num_ranks: int, *, num_replicas: int = 0) -> ExpertPlacement:
    """:func:`plan_eplb` as an :class:`~moelayers.placement.ExpertPlacement`."""
    out = plan_eplb(loads, num_ranks, num_replicas=num_replicas)
    num_e = _mean_loads(loads).size
    if num_replicas == 0:
        return ExpertPlacement.from_expert_rank(out, num_ranks=num_ranks)
    return ExpertPlacement.from_phy2log(out, num_e)
