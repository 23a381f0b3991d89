"""GEM: variability-aware expert placement — latency curves, the score, and the planners' entry points.

Each rank ``r`` (GPU) has its own latency curve ``C_r(n)``: seconds to compute ``n`` (token,
expert) rows of its experts in one step. A placement ``expert_rank [E]`` (equal experts per rank)
is scored on per-step loads ``loads [steps, E]`` by the time the slowest rank finishes, summed
over steps::

    S(M) = sum_steps max_rank C_rank(rows_rank(M, step)),   rows_rank = sum of its experts' loads

Curve file format (written by ``recipes/profile.py``, read by :meth:`LatencyCurves.load`), npz:

=============  ==========  ==================================================================
key            shape       meaning
=============  ==========  ==================================================================
``rows``       ``[N]``     int sample points (rows per rank per step), strictly ascending, ``N >= 2``
``latency_s``  ``[R, N]``  float seconds per rank at each sample, finite, ``>= 0``, non-decreasing
=============  ==========  ==================================================================

Between samples the latency is interpolated linearly, below the first sample held at the first value,
and beyond the last sample extrapolated linearly with the least-squares slope of the samples in the
upper half of the sampled range (at least the last two), or of all the samples where the upper half is
flat: a last segment, or an upper half, that the profiler's non-decreasing fit flattened does not make
every row beyond it free. Synthetic ("tiled") curves
``C_r(n) = s_r * (base + per_tile * ceil(n / tile))`` are evaluated exactly; their file also holds
the optional keys ``tile``, ``base_s``, ``per_tile_s`` (scalars) and ``scale [R]``. ``format_version``
(int scalar, 1; absent in files written before it existed) is the layout's version: a file of a newer
one is refused as such. A profile's file also holds ``latency_raw_s``, ``device_names`` and ``config``
(recipes/profile.py), which the reader skips; other entries are ignored with a warning.

The search itself lives in :mod:`moelayers.planning.gem_search`.
"""

from __future__ import annotations

import os

import numpy as np

from moelayers.files import atomic_write, check_format_version, read_npz, warn_unknown_entries
from moelayers.placement import _check_positive, indivisible_experts
from moelayers.planning.steps import DEFAULT_TOKENS_PER_STEP, rank_rows, trace_step_loads

__all__ = [
    "LatencyCurves", "PRESETS", "score", "score_layers", "evaluate", "plan_linear", "plan_gem", "check_expert_rank",
]

SLOW_FACTOR = 1.0 / 0.88  # the slow rank of the synthetic presets runs at 88 % speed
BASE_S = 20e-6
PER_TILE_S = 10e-6
TILE_ROWS = 128
PRESETS = ("high", "moderate", "low", "none")
#: the layout of latency curve files (see the module docstring)
FILE_FORMAT = 1
_TILED_KEYS = ("scale", "base_s", "per_tile_s", "tile")
_PROFILE_KEYS = ("latency_raw_s", "device_names", "config")  # recipes/profile.py's record of the measurement (not read)


def preset_scale(name: str, num_ranks: int) -> np.ndarray:
    """``[R]`` slowdown of each rank under a variability preset (:meth:`LatencyCurves.preset`; the
    runtime emulation's factors, ``moelayers.emulation.slowdown_preset``, are these).

    Raises:
        ValueError: unknown preset or ``num_ranks`` not a positive int.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if name not in PRESETS:
        raise ValueError(f"unknown variability preset {name!r}; choose one of {list(PRESETS)} or give curves.path=FILE")
    if name == "moderate":
        return np.linspace(SLOW_FACTOR, 1.0, int(num_ranks))
    scale = np.ones(int(num_ranks))
    if name == "high":
        scale[0] = SLOW_FACTOR
    return scale


_TILED_MAX_ROWS = 1 << 17  # samples of a tiled curve cover this many rows (the formula is exact beyond)
_SMOOTH_GRID_POINTS = 1 << 16  # past this, a smoothed curve keeps only the lattice points near its samples
_MAX_ROWS = 1 << 53  # sample points at or above this are not exact in float64 (the interpolation's type)


class LatencyCurves:
    """Per-rank latency as a function of the rows a rank computes in one step.

    Construct from samples (``LatencyCurves(rows, latency_s)``, :meth:`load`) or analytically
    (:meth:`tiled`, :meth:`preset`). Call it on ``rank_rows [..., R]`` to get ``[..., R]`` seconds.

    Args:
        rows: ``[N]`` int sample points, strictly ascending, ``>= 0`` and ``< 2**53``, ``N >= 2``.
        latency_s: ``[R, N]`` seconds per rank at the samples (finite, ``>= 0``, non-decreasing in rows).
        source: names the curves in error messages.

    Raises:
        ValueError: any of the above is violated (the message names the problem).
    """

    def __init__(self, rows: np.ndarray, latency_s: np.ndarray, *, source: str = "<memory>") -> None:
        rows_a, lat = np.asarray(rows), np.asarray(latency_s)
        if rows_a.dtype.kind == "u":  # unsigned differences would wrap around instead of going negative
            rows_a = rows_a.astype(np.int64)
        if rows_a.ndim != 1 or rows_a.shape[0] < 2:
            raise ValueError(f"{source}: latency curve 'rows' must be 1-D with >= 2 samples, got shape {list(rows_a.shape)}")
        if rows_a.dtype.kind not in "iuf" or not np.all(np.isfinite(rows_a)) or np.any(rows_a != np.round(rows_a)):
            raise ValueError(f"{source}: latency curve 'rows' must be integers")
        if rows_a.min() < 0:
            raise ValueError(f"{source}: latency curve 'rows' must be >= 0, found {rows_a.min()}")
        if rows_a.max() >= _MAX_ROWS:  # int64 overflow, or counts that float64 rounds together
            raise ValueError(f"{source}: latency curve 'rows' must be < 2**53, found {rows_a.max()}")
        if np.any(np.diff(rows_a) <= 0):
            raise ValueError(f"{source}: latency curve 'rows' must be strictly ascending")
        if lat.ndim != 2 or lat.shape[1] != rows_a.shape[0] or lat.shape[0] < 1:
            raise ValueError(f"{source}: 'latency_s' must be [R, N={rows_a.shape[0]}], got shape {list(lat.shape)}")
        if lat.dtype.kind not in "iuf" or not np.all(np.isfinite(lat)):
            raise ValueError(f"{source}: 'latency_s' must be finite numbers")
        lat = lat.astype(np.float64)  # unsigned differences would wrap around: a decrease would pass as monotone
        if (lat < 0).any():
            r, n = np.argwhere(lat < 0)[0]
            raise ValueError(f"{source}: negative latency {lat[r, n]:.3g} s on rank {r} at {int(rows_a[n])} rows")
        if (np.diff(lat, axis=1) < 0).any():
            r, n = np.argwhere(np.diff(lat, axis=1) < 0)[0]
            raise ValueError(f"{source}: latency curve of rank {r} is not monotone (non-decreasing): "
                             f"{lat[r, n]:.4g} s at {int(rows_a[n])} rows > {lat[r, n + 1]:.4g} s at {int(rows_a[n + 1])} rows")
        self.source = source
        self.rows = rows_a.astype(np.int64)
        self.latency_s = lat.astype(np.float64)
        # segments of the evaluation: the N-1 between the samples, then the tail beyond the last sample
        # (one more grid point one gap further, so a uniform grid stays uniform)
        x = self.rows.astype(np.float64)
        self._x = np.append(x, 2 * x[-1] - x[-2])  # [N+1]
        tail = tail_slope(x, self.latency_s)
        self._slope = np.concatenate([np.diff(self.latency_s, axis=1) / np.diff(x), tail[:, None]], axis=1)  # [R, N]
        self._icept = self.latency_s - self._slope * self._x[:-1]  # segment k: icept + slope * rows
        gaps = np.diff(self.rows)
        self._spacing = float(gaps[0]) if np.all(gaps == gaps[0]) else None  # uniform grid: index by division
        self._tiled: tuple[np.ndarray, float, float, int] | None = None  # (scale [R], base_s, per_tile_s, tile)

    @property
    def sampled_up_to(self) -> int | None:
        """The last sampled row count: beyond it the curves extrapolate (:func:`tail_slope`; ``None``
        for analytic tiled curves, exact for any count below 2^53)."""
        return None if self._tiled is not None else int(self.rows[-1])

    # ------------------------------------------------------------------ constructors
    @classmethod
    def tiled(cls, scale: np.ndarray, *, base_s: float = BASE_S, per_tile_s: float = PER_TILE_S,
              tile: int = TILE_ROWS, source: str = "tiled curves") -> LatencyCurves:
        """Synthetic curves ``C_r(n) = scale[r] * (base_s + per_tile_s * ceil(n / tile))``, exact.

        Args:
            scale: ``[R]`` slowdown of each rank (``1`` = nominal, ``1/0.88`` = 12 % slower).
        """
        scale = np.asarray(scale, dtype=np.float64)
        if scale.ndim != 1 or scale.size < 1 or not np.all(np.isfinite(scale)) or (scale <= 0).any():
            raise ValueError(f"{source}: scale must be [R] positive finite values, got {scale}")
        if isinstance(tile, (bool, np.bool_)) or not isinstance(tile, (int, np.integer)):  # 1.5 broke the rows
            raise TypeError(f"{source}: tile must be an int (rows per tile), got {tile!r}")
        if not tile >= 1 or not base_s >= 0 or not per_tile_s >= 0:  # NaN fails these too
            raise ValueError(f"{source}: need tile >= 1, base_s >= 0, per_tile_s >= 0 (got {tile}, {base_s}, {per_tile_s})")
        k = np.arange(max(_TILED_MAX_ROWS // tile, 1) + 1)  # at least one whole tile, however large
        rows = np.unique(np.concatenate([[0], k[1:] * tile - tile + 1, k[1:] * tile]))  # 0, 1, t, t+1, 2t, ...
        lat = scale[:, None] * (base_s + per_tile_s * np.ceil(rows / tile))[None, :]
        out = cls(rows, lat, source=source)
        out._tiled = (scale, float(base_s), float(per_tile_s), int(tile))
        return out

    @classmethod
    def preset(cls, name: str, num_ranks: int) -> LatencyCurves:
        """Synthetic tiled curves ``s_r * (20 us + 10 us * ceil(n / 128))`` for a variability preset.

        Args:
            name: ``high`` (rank 0 at 88 % speed: ``s_0 = 1/0.88``, others 1), ``moderate`` (``s``
                evenly spaced from ``1/0.88`` on rank 0 down to 1 on the last rank), ``low`` or
                ``none`` (all 1).
            num_ranks: ``R``.
        """
        return cls.tiled(preset_scale(name, num_ranks))

    @classmethod
    def load(cls, path: str | os.PathLike) -> LatencyCurves:
        """Read curves from an npz file (see the module docstring for the format).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not an npz, missing keys, invalid samples, or tiled parameters that are
                incomplete or disagree with the samples; the message names the file.
        """
        data = read_npz(path, "latency curve file")
        check_format_version(data, path, "latency curve file", FILE_FORMAT, ("curves",))
        missing = [k for k in ("rows", "latency_s") if k not in data]
        if missing:
            raise ValueError(f"{path}: not a latency curve file, missing key(s) {missing} (need rows [N], latency_s [R, N])")
        warn_unknown_entries(data, "rows [N], latency_s [R, N] and optionally the tiled parameters "
                             "scale [R], base_s, per_tile_s, tile", ("rows", "latency_s") + _TILED_KEYS + _PROFILE_KEYS,
                             path, "latency curve files")
        curves = cls(data["rows"], data["latency_s"], source=str(path))
        present = [k for k in _TILED_KEYS if k in data]
        if not present:
            return curves
        if len(present) < len(_TILED_KEYS):
            raise ValueError(f"{path}: tiled curve parameters {present} without {sorted(set(_TILED_KEYS) - set(present))}")
        tile = data["tile"]
        if tile.ndim or tile.dtype.kind not in "iu":
            raise ValueError(f"{path}: 'tile' must be an integer scalar, got {tile!r}")
        for key in ("base_s", "per_tile_s"):
            if data[key].ndim or data[key].dtype.kind not in "iuf":
                raise ValueError(f"{path}: '{key}' must be a real scalar, got {data[key]!r}")
        if data["scale"].ndim != 1 or data["scale"].dtype.kind not in "iuf":
            raise ValueError(f"{path}: 'scale' must be [R] real numbers, got shape {list(data['scale'].shape)} "
                             f"dtype {data['scale'].dtype}")
        tiled = cls.tiled(data["scale"], base_s=float(data["base_s"]), per_tile_s=float(data["per_tile_s"]),
                          tile=int(tile), source=str(path))
        if tiled.latency_s.shape != curves.latency_s.shape:
            raise ValueError(f"{path}: the tiled parameters (scale for {tiled.num_ranks} ranks) disagree with the "
                             f"samples rows/latency_s ({curves.num_ranks} ranks, {curves.rows.size} samples)")
        if not np.allclose(tiled.latency_s, curves.latency_s, rtol=1e-9, atol=0.0):
            raise ValueError(f"{path}: the tiled parameters (scale, base_s, per_tile_s, tile) disagree with the "
                             f"samples latency_s")
        return tiled

    def save(self, path: str | os.PathLike) -> None:
        """Write ``rows`` and ``latency_s`` (plus the tiled parameters, if any) to ``path`` atomically."""
        arrays = {"rows": self.rows, "latency_s": self.latency_s, "format_version": np.int64(FILE_FORMAT)}
        if self._tiled is not None:
            scale, base_s, per_tile_s, tile = self._tiled
            arrays.update(scale=scale, base_s=np.float64(base_s), per_tile_s=np.float64(per_tile_s), tile=np.int64(tile))
        atomic_write(path, lambda f: np.savez(f, **arrays))

    # ------------------------------------------------------------------ evaluation
    @property
    def num_ranks(self) -> int:
        """``R``."""
        return int(self.latency_s.shape[0])

    @property
    def tiled_params(self) -> tuple[np.ndarray, float, float, int] | None:
        """``(scale [R], base_s, per_tile_s, tile)`` of tiled curves, else ``None``."""
        return self._tiled

    def check_ranks(self, num_ranks: int) -> None:
        """Raise ``ValueError`` unless these curves are for ``num_ranks`` ranks."""
        if self.num_ranks != num_ranks:
            raise ValueError(f"{self.source}: latency curves are for {self.num_ranks} ranks, but the placement has "
                             f"{num_ranks} (parallel.ep); profile or choose curves for {num_ranks} ranks")

    def eval_ranks(self, rows: np.ndarray, ranks: np.ndarray | int) -> np.ndarray:
        """Latency of rank ``ranks`` at ``rows`` (both broadcast against each other).

        Args:
            rows: ``[...]`` rows per rank (any real, ``>= 0``).
            ranks: ``[...]`` int ranks, broadcastable to ``rows``.

        Returns:
            ``[...]`` float64 seconds.
        """
        x = np.asarray(rows, dtype=np.float64)
        r = np.asarray(ranks, dtype=np.int64)
        if self._tiled is not None:
            scale, base_s, per_tile_s, tile = self._tiled
            out = np.ceil(x / tile)  # exact for integer rows below 2^53 (a correctly rounded quotient)
            out *= per_tile_s
            out += base_s
            return out * scale[r]
        xc = np.maximum(x, self._x[0])
        num = self._x.size
        if self._spacing is not None:
            # clip first: no int overflow; fmin, not minimum: NaN rows give NaN seconds, not a bad index
            idx = np.fmin((xc - self._x[0]) * (1.0 / self._spacing), num - 2).astype(np.int64)
        else:
            idx = np.clip(np.searchsorted(self._x, x, side="right") - 1, 0, num - 2)
        flat = idx + r * (num - 1)  # gather from the flattened [R, N-1] tables: faster than 2-D fancy indexing
        out = np.take(self._slope.ravel(), flat)
        out *= xc
        out += np.take(self._icept.ravel(), flat)
        return out

    def smoothed(self, width: float) -> LatencyCurves:
        """Moving average of every curve over a window of ``width`` rows (a box kernel).

        ``C~_r(n) = (1 / w) * integral of C_r over [n - w/2, n + w/2]``: the expected latency when the
        rows are only known to within ``+- w/2`` (a tiled curve averaged over one tile becomes a
        straight line). Computed exactly from the piecewise-linear samples (piecewise quadratic
        antiderivative), on a uniform grid of ``max(1, w / 8)`` rows from half a window before the
        first sample (or 0) to half a window past the last; beyond that every window lies on the
        linear tail, whose average is the tail itself, so the smoothed curve continues with this
        curve's tail slope. A grid of more than 2^16 points keeps only those near the samples
        (where no sample is within half a window, the average is the straight curve itself).

        Args:
            width: window ``w`` in rows, ``> 0``.

        Returns:
            Sampled curves for the same ``R`` ranks.
        """
        if not np.isfinite(width) or width <= 0:
            raise ValueError(f"smoothing width must be a positive number of rows, got {width}")
        half = 0.5 * float(width)
        step = max(1, int(width // 8))
        top = int(np.ceil(self.rows[-1] + half))  # from here on every window lies on the linear tail
        # from half a window below the first sample: below that every window lies where the curve is
        # held at its first value, whose average is that value (the smoothed curve is held there too)
        start = max(0, int(np.floor(self.rows[0] - half)))
        grid = np.arange(start, top + step, step, dtype=np.int64)
        if grid.size > _SMOOTH_GRID_POINTS:
            grid = self._curved_points(grid, half, step)
        ranks = np.arange(self.num_ranks)[:, None]
        hi, lo = self._antiderivative(grid + half, ranks), self._antiderivative(grid - half, ranks)
        lat = np.maximum.accumulate((hi - lo) / width, axis=1)  # guard monotonicity against rounding
        out = LatencyCurves(grid, lat, source=f"{self!r} smoothed over {width:.4g} rows")
        out._slope[:, -1] = self._slope[:, -1]  # the tail: this curve's slope, not one fitted to the window
        out._icept[:, -1] = out.latency_s[:, -1] - out._slope[:, -1] * out._x[-2]
        return out

    def _curved_points(self, grid: np.ndarray, half: float, step: int) -> np.ndarray:
        """The points of the uniform ``grid`` within one ``step`` of a window around a sample.

        A window that holds no sample lies on one straight segment, so there the smoothed curve is
        the curve itself, a straight line: interpolating between the lattice points on either side
        of such a stretch gives what the whole lattice would (curves sampled sparsely up to 2^24
        rows need thousands of points instead of millions).
        """
        first = int(grid[0])
        lo = np.floor((self.rows - half - step - first) / step).astype(np.int64)  # lattice index of each window's start
        count = int(np.ceil((2 * half + 2 * step) / step)) + 2
        idx = (np.maximum(lo, 0)[:, None] + np.arange(count)[None, :]).ravel()
        idx = np.unique(np.concatenate([[0, grid.size - 1], idx[idx < grid.size]]))
        return grid[idx]

    def _antiderivative(self, x: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """``I_r(x) = integral of C_r from rows[0] to x`` (negative below ``rows[0]``); broadcast shapes."""
        x = np.asarray(x, dtype=np.float64)
        seg = self.latency_s + 0.5 * self._slope * np.diff(self._x)  # mean latency per segment (the tail's last)
        cum = np.concatenate([np.zeros((self.num_ranks, 1)), np.cumsum(seg * np.diff(self._x), axis=1)], axis=1)
        idx = np.clip(np.searchsorted(self._x, x, side="right") - 1, 0, self._x.size - 2)
        dx = np.maximum(x, self._x[0]) - self._x[idx]
        below = np.minimum(x - self._x[0], 0.0) * self.latency_s[ranks, 0]  # curve held at its first value
        return cum[ranks, idx] + dx * (self.latency_s[ranks, idx] + 0.5 * dx * self._slope[ranks, idx]) + below

    def __call__(self, rank_rows: np.ndarray) -> np.ndarray:
        """Latency of every rank: ``rank_rows [..., R]`` -> ``[..., R]`` seconds (vectorised)."""
        x = np.asarray(rank_rows)
        if x.ndim < 1 or x.shape[-1] != self.num_ranks:
            raise ValueError(f"rank_rows must be [..., R={self.num_ranks}], got shape {list(x.shape)}")
        return self.eval_ranks(x, np.arange(self.num_ranks))

    def __repr__(self) -> str:
        kind = "tiled" if self._tiled is not None else f"{self.rows.size} samples"
        return f"LatencyCurves(R={self.num_ranks}, {kind})"


def tail_slope(rows: np.ndarray, latency_s: np.ndarray) -> np.ndarray:
    """Seconds per row beyond the last sample: ``[R]`` least-squares slopes of each curve over the
    samples at ``rows >= rows[-1] / 2`` (at least the last two). Non-negative for non-decreasing
    curves; steadier than the last segment alone, which the monotone fit of noisy measurements
    may flatten (a dip at the last sample made every row beyond it cost nothing). Where those
    samples are flat (a coarse profile whose fit pooled its few upper samples into one block), the
    least-squares slope of all the samples; zero only for a curve that is flat throughout.

    Args:
        rows: ``[N]`` ascending sample points (float or int), ``N >= 2``.
        latency_s: ``[R, N]`` seconds.
    """
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(latency_s, dtype=np.float64)
    keep = max(int(np.count_nonzero(x >= 0.5 * x[-1])), 2)
    upper = _ls_slope(x[-keep:], y[:, -keep:])
    # a few upper samples that the monotone fit pooled into one flat block: the whole curve's slope
    # (flatness read from the samples: the slope of a flat block rounds to +1e-38 as often as to 0)
    flat = np.ptp(y[:, -keep:], axis=1) == 0
    return np.where(flat | (upper <= 0), _ls_slope(x, y), upper)


def _ls_slope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``[R]`` non-negative least-squares slopes of ``y [R, N]`` over ``x [N]``."""
    dx = x - x.mean()
    return np.maximum(((y - y.mean(axis=1, keepdims=True)) * dx).sum(axis=1) / (dx * dx).sum(), 0.0)


# ---------------------------------------------------------------------- placements and scores
def check_expert_rank(expert_rank: np.ndarray, num_experts: int, num_ranks: int, *, equal: bool = True) -> np.ndarray:
    """Validate ``expert_rank [E]`` (ranks in range; equal experts per rank if ``equal``); int64 copy."""
    er = np.asarray(expert_rank)
    if er.ndim != 1 or er.shape[0] != num_experts or er.dtype.kind not in "iu":
        raise ValueError(f"expert_rank must be [E={num_experts}] integers, got shape {list(er.shape)} dtype {er.dtype}")
    if er.min() < 0 or er.max() >= num_ranks:
        raise ValueError(f"expert_rank has ranks outside [0, {num_ranks})")
    if equal:
        counts = np.bincount(er, minlength=num_ranks)
        if (counts != num_experts // num_ranks).any():
            raise ValueError(f"expert_rank must put {num_experts // num_ranks} experts on every rank, got {counts.tolist()}")
    return er.astype(np.int64)


def _check_loads(loads: np.ndarray) -> np.ndarray:
    loads = np.asarray(loads)
    if loads.ndim != 2:
        raise ValueError(f"loads must be [steps, E], got shape {list(loads.shape)}")
    if loads.dtype.kind not in "iuf":  # bool, complex, objects: not rows
        raise ValueError(f"loads must be numbers of rows, got dtype {loads.dtype}")
    if loads.shape[0] == 0:
        raise ValueError("loads has no steps (empty trace): nothing to plan or score")
    if loads.shape[1] == 0:
        raise ValueError("loads has no experts")
    if not np.all(np.isfinite(loads)) or (loads < 0).any():
        raise ValueError("loads must be finite and >= 0")
    with np.errstate(over="ignore"):  # (an overflow to inf is what this refuses)
        most = loads.sum(axis=1, dtype=np.float64).max()
    if most >= 2.0 ** 53:  # a rank's rows stay exact (and finite) in float64
        raise ValueError(f"loads must sum to fewer than 2**53 rows per step, got {most:.3g}")
    return loads


def score(expert_rank: np.ndarray, loads: np.ndarray, curves: LatencyCurves) -> float:
    """``S(M) = sum_steps max_rank C_rank(rows_rank)`` of one layer.

    Args:
        expert_rank: ``[E]`` rank of each expert (any counts per rank).
        loads: ``[steps, E]`` rows of each expert per step.
        curves: latency curves of the ``R`` ranks.

    Returns:
        Seconds (sum over steps of the slowest rank's latency).
    """
    loads = _check_loads(loads)
    er = check_expert_rank(expert_rank, loads.shape[1], curves.num_ranks, equal=False)  # integers: no silent truncation
    return float(curves(rank_rows(er, loads, curves.num_ranks)).max(axis=1).sum())


def score_layers(expert_rank: np.ndarray, loads: np.ndarray, curves: LatencyCurves) -> np.ndarray:
    """Per-layer scores: ``expert_rank [L, E]``, ``loads [L, steps, E]`` -> ``[L]`` seconds."""
    er, loads = np.asarray(expert_rank), np.asarray(loads)
    if er.ndim != 2 or loads.ndim != 3 or er.shape[0] != loads.shape[0] or er.shape[1] != loads.shape[2]:
        raise ValueError(f"expert_rank [L, E] and loads [L, steps, E] disagree: {list(er.shape)} vs {list(loads.shape)}")
    return np.array([score(er[i], loads[i], curves) for i in range(er.shape[0])])


def evaluate(trace, expert_rank: np.ndarray, curves: LatencyCurves,
             tokens_per_step: int = DEFAULT_TOKENS_PER_STEP) -> float:
    """Score of a whole-model placement on a trace: the sum over layers of per-layer ``S``.

    Steps are ``tokens_per_step`` consecutive tokens of ``trace`` in file order (the last may be
    shorter); the rows of a rank in a step are the (token, expert) activations of its experts.
    ``recipes/plan.py`` reports ``evaluate(held_out, expert_rank, curves, tokens_per_step)`` with
    ``held_out = trace.split(train_fraction)[1]`` and ``expert_rank`` from ``assignment.npz``.

    Args:
        trace: a :class:`~moelayers.trace.RoutingTrace` with ``L`` layers.
        expert_rank: ``[L, E]`` rank of each expert per layer (``[E]``: the same for every layer).
        curves: latency curves of the ``R`` ranks.
        tokens_per_step: tokens per step.

    Returns:
        Seconds.
    """
    er = np.asarray(expert_rank)
    if er.ndim == 1:
        er = np.broadcast_to(er, (trace.num_layers, er.shape[0]))
    if er.shape != (trace.num_layers, trace.num_experts):
        raise ValueError(f"expert_rank must be [L={trace.num_layers}, E={trace.num_experts}], got {list(er.shape)}")
    used = np.unique(er) if er.size else er
    if used.size < curves.num_ranks:
        raise ValueError(f"expert_rank places experts on {used.size} of the curves' {curves.num_ranks} ranks "
                         f"(no layer uses the others): curves for another number of ranks?")
    return float(score_layers(er, trace_step_loads(trace, tokens_per_step), curves).sum())


def plan_linear(num_experts: int, num_ranks: int) -> np.ndarray:
    """Linear placement: experts ``r*E/R .. (r+1)*E/R - 1`` on rank ``r``; ``[E]`` int64."""
    _check_positive(num_experts=num_experts, num_ranks=num_ranks)
    if num_experts % num_ranks:
        raise indivisible_experts(num_experts, num_ranks)
    return np.arange(num_experts, dtype=np.int64) // (num_experts // num_ranks)


def plan_gem(loads: np.ndarray, curves: LatencyCurves, *, restarts: int = 8, seed: int = 0,
             method: str = "robust", **options) -> np.ndarray:
    """GEM placement of one layer: equal experts per rank, minimising ``S`` (see the module docstring).

    Args:
        loads: ``[steps, E]`` rows per expert per step (e.g. the train steps of a trace, or the
            last 16 steps online).
        curves: latency curves of the ``R`` ranks (``E`` divisible by ``R``).
        restarts: ``K`` greedy + swap runs; runs after the first perturb the expert
            utilisations by 20 % noise. The best (by the objective) wins.
        seed: makes the result deterministic (restarts, and the scenarios of ``robust``).
        method: ``"plain"`` (the paper: greedy + best swap on the given steps) or ``"robust"``
            (the same search on the expected ``S`` over steps like the given ones: moment-matched
            Gaussian scenarios with the steps' predictive mean and covariance, scored with the
            curves averaged over the rows' uncertainty; see :mod:`moelayers.planning.gem_search`).
        **options: passed to :func:`moelayers.planning.gem_search.search` (``noise``,
            ``min_gain``, ``scenarios``).

    Returns:
        ``expert_rank [E]`` int64 with ``E / R`` experts on every rank.

    Raises:
        ValueError: no steps (empty trace), negative or non-finite loads, ``E`` not divisible by
            the curves' ``R``, an unknown ``method``, a ``seed`` that is not an int >= 0.
    """
    from moelayers.planning.gem_search import search

    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"plan_gem: seed must be an int >= 0, got {seed!r}")
    return search(loads, curves, restarts=restarts, seed=seed, method=method, **options)  # checks the loads
