"""Per-step expert loads: how many (token, expert) rows each expert gets in each forward batch.

A *step* is one forward batch: ``tokens_per_step`` consecutive tokens of a trace in file order
(the last step of a trace may be shorter). The load of expert ``e`` in a step is the number of
``(token, k)`` activations routed to it; the rows a rank computes in a step are the sum of the
loads of its experts (no de-duplication: every activation is one row of a grouped GEMM).

Offline planners read these from a :class:`~moelayers.trace.RoutingTrace`
(:func:`trace_step_loads`); online planners keep a sliding window of the last steps
(:class:`LoadWindow`, default 16 steps).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from moelayers.trace import RoutingTrace

__all__ = [
    "DEFAULT_TOKENS_PER_STEP", "DEFAULT_WINDOW", "step_loads", "trace_step_loads", "rank_rows", "LoadWindow",
]

DEFAULT_TOKENS_PER_STEP = 2048
DEFAULT_WINDOW = 16
#: fewer train or held-out steps than this: step scores (GEM's ``score*``, ``gem_vs_*``) rest on too few steps
MIN_STEPS = 8


def _check_tokens_per_step(tokens_per_step: int) -> int:
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, (int, np.integer)) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
    return int(tokens_per_step)


def step_loads(topk_ids: np.ndarray, num_experts: int, tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
               *, offset: int = 0) -> np.ndarray:
    """Expert loads per step of one layer's routing.

    Args:
        topk_ids: ``[T, K]`` integer (signed or unsigned) expert ids of ``T`` tokens in order (or
            ``[T, L, K]`` for ``L`` layers at once).
        num_experts: ``E``.
        tokens_per_step: tokens per step; the last step may be shorter.
        offset: tokens ``[0, offset)`` form a first, shorter step and the regular steps start at
            ``offset`` (``0 <= offset < tokens_per_step``): the same tokens cut at other step
            boundaries.

    Returns:
        ``[steps, E]`` int64 (``[L, steps, E]`` for a 3-D input): rows of each expert per step.

    Raises:
        TypeError: ``topk_ids`` does not have an integer dtype.
        ValueError: no tokens, bad ``tokens_per_step``/``offset`` or expert ids out of range.
    """
    tps = _check_tokens_per_step(tokens_per_step)
    ids = np.asarray(topk_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"step_loads: topk_ids must have an integer dtype, got {ids.dtype}")
    if ids.ndim == 2:
        return step_loads(ids[:, None, :], num_experts, tps, offset=offset)[0]
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be [T, K] or [T, L, K], got shape {list(ids.shape)}")
    num_t, num_l, _ = ids.shape
    if num_t == 0:
        raise ValueError("step_loads: empty routing (no tokens), there are no steps to plan from")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ValueError(f"offset must be an int, got {offset!r}")
    if not 0 <= int(offset) < tps:
        raise ValueError(f"offset must be in [0, tokens_per_step={tps}), got {offset}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_ids has expert ids outside [0, {num_experts})")
    step = (np.arange(num_t, dtype=np.int64) + (tps - int(offset)) % tps) // tps
    num_steps = int(step[-1]) + 1
    out = np.empty((num_l, num_steps, num_experts), dtype=np.int64)
    for layer in range(num_l):  # int64 one layer at a time: a compact file's ids, not all of them (memory)
        ids_l = ids[:, layer, :].astype(np.int64)  # uint64 + int64 would promote to float64
        flat = (step[:, None] * num_experts + ids_l).ravel()
        out[layer] = np.bincount(flat, minlength=num_steps * num_experts).reshape(num_steps, num_experts)
    return out


def trace_step_loads(trace: RoutingTrace, tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
                     *, layers: Sequence[int] | None = None, offset: int = 0) -> np.ndarray:
    """Expert loads per step of every layer of a trace, steps of consecutive tokens in file order.

    Args:
        trace: the routing trace.
        tokens_per_step: tokens per step (one forward batch); the last step may be shorter.
        layers: which MoE layers (default all ``L``).
        offset: see :func:`step_loads`.

    Returns:
        ``[L', steps, E]`` int64 with ``steps = ceil(T / tokens_per_step)`` (for ``offset = 0``).
    """
    ids = trace.topk_ids if layers is None else trace.topk_ids[:, list(layers), :]
    return step_loads(ids, trace.num_experts, tokens_per_step, offset=offset)


def rank_rows(expert_rank: np.ndarray, loads: np.ndarray, num_ranks: int) -> np.ndarray:
    """Rows each rank computes per step: the summed loads of its experts.

    Args:
        expert_rank: ``[E]`` rank of each expert.
        loads: ``[..., E]`` expert loads (e.g. ``[steps, E]``).
        num_ranks: ``R``.

    Returns:
        ``[..., R]``: int64 for integer loads (summed in int64: no int32 wrap-around), float64 for float loads.

    Raises:
        TypeError: ``expert_rank`` does not have an integer dtype (a rank of 1.9 is not truncated to 1).
        ValueError: ``expert_rank`` has the wrong shape or ranks outside ``[0, num_ranks)``; integer
            loads so large that a rank's sum could pass int64 (``E × max load >= 2^63``).
    """
    er = np.asarray(expert_rank)
    loads = np.asarray(loads)
    if er.ndim != 1 or er.shape[0] != loads.shape[-1]:
        raise ValueError(f"expert_rank has shape {list(er.shape)}, expected [{loads.shape[-1]}] (one rank per expert)")
    if er.size and er.dtype.kind not in "iu":
        raise TypeError(f"rank_rows: expert_rank must have an integer dtype, got {er.dtype}")
    if er.size and (er.min() < 0 or er.max() >= num_ranks):
        raise ValueError(f"expert_rank has ranks outside [0, {num_ranks})")
    er = er.astype(np.int64, copy=False)
    acc = np.float64 if loads.dtype.kind == "f" else np.int64
    if acc is np.int64 and loads.size and int(loads.max()) > (2**63 - 1) // max(er.size, 1):
        raise ValueError(f"loads up to {int(loads.max())} over {er.size} experts could pass int64 when summed: "
                         f"pass them as float64")
    onehot = np.zeros((er.size, num_ranks), dtype=acc)
    onehot[np.arange(er.size), er] = 1
    return loads.astype(acc, copy=False) @ onehot


class LoadWindow:
    """Sliding window of the expert loads of the last ``window`` steps, for online planning.

    Example::

        win = LoadWindow(num_layers=26, num_experts=64)          # 16 steps
        win.push(counts)                                         # [L, E] rows per expert this step
        loads = win.loads()                                      # [L, steps<=16, E]
        expert_rank = plan_gem(loads[layer], curves)

    Args:
        num_layers: ``L``.
        num_experts: ``E``.
        window: steps kept (the oldest is dropped first).
    """

    def __init__(self, num_layers: int, num_experts: int, window: int = DEFAULT_WINDOW) -> None:
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LoadWindow: {name} must be a positive int, got {value!r}")
        self.num_layers, self.num_experts, self.window = int(num_layers), int(num_experts), int(window)
        self._steps: deque[np.ndarray] = deque(maxlen=self.window)

    def __len__(self) -> int:
        return len(self._steps)

    def push(self, counts: np.ndarray) -> None:
        """Add one step: ``counts [L, E]`` (or ``[E]`` when ``L = 1``) rows per expert."""
        c = np.asarray(counts)
        if c.ndim == 1 and self.num_layers == 1:
            c = c[None]
        if c.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"LoadWindow.push: counts must be [{self.num_layers}, {self.num_experts}], got {list(c.shape)}")
        if c.dtype.kind not in "iu" and not (c.dtype.kind == "f" and np.isfinite(c).all() and (c == np.round(c)).all()):
            raise ValueError(f"LoadWindow.push: counts must be whole numbers of rows, got dtype {c.dtype} "
                             "with fractions or NaN/inf")
        if (c < 0).any():
            raise ValueError("LoadWindow.push: counts must be >= 0")
        if c.size and c.max() > np.iinfo(np.int64).max:  # (the int64 copy would wrap them negative)
            raise ValueError(f"LoadWindow.push: counts must fit int64, got {c.max()}")
        self._steps.append(c.astype(np.int64, copy=True))

    def push_topk(self, topk_ids: Sequence[np.ndarray] | np.ndarray) -> None:
        """Add one step from the routing of each layer: ``[L]`` arrays ``[T, K]`` (or one ``[T, L, K]``
        array); numpy arrays or torch tensors (on any device).

        Raises:
            ValueError: a single array that is not ``[T, L, K]`` (one layer's ``[T, K]`` would be read
                as ``T`` layers), a layer's array that is not ``[T, K]``, or expert ids out of range.
            TypeError: expert ids that are not integers.
        """
        def host(a):  # a torch tensor (any device) as numpy; planning/ does not import torch
            return np.asarray(a.detach().cpu() if hasattr(a, "detach") else a)

        ndim = getattr(topk_ids, "ndim", None)
        if ndim is not None and ndim != 3:
            raise ValueError(f"LoadWindow.push_topk: topk_ids must be one [T, L, K] array or a list of L [T, K] "
                             f"arrays, got one array of shape {list(topk_ids.shape)} (for one layer pass [topk_ids])")
        ids = host(topk_ids) if ndim == 3 else None
        per_layer = [ids[:, i, :] for i in range(ids.shape[1])] if ids is not None else [host(t) for t in topk_ids]
        for i, t in enumerate(per_layer):
            if t.ndim != 2:
                raise ValueError(f"LoadWindow.push_topk: layer {i} routing must be a [T, K] array, got shape {list(t.shape)}")
        flat = [t.ravel() for t in per_layer]
        for i, t in enumerate(flat):
            if t.dtype.kind not in "iu":
                raise TypeError(f"LoadWindow.push_topk: layer {i} expert ids must be integers, got dtype {t.dtype}")
            if t.size and (int(t.min()) < 0 or int(t.max()) >= self.num_experts):
                bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
                raise ValueError(f"LoadWindow.push_topk: layer {i} has expert id {bad} outside [0, {self.num_experts})")
        self.push(np.stack([np.bincount(t.astype(np.int64), minlength=self.num_experts) for t in flat]))

    def loads(self) -> np.ndarray:
        """``[L, steps, E]`` int64, oldest step first.

        Raises:
            ValueError: the window is empty.
        """
        if not self._steps:
            raise ValueError("LoadWindow is empty: push at least one step before planning")
        return np.stack(list(self._steps), axis=1)

    def clear(self) -> None:
        """Forget all steps."""
        self._steps.clear()
