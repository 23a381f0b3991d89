"""GEM planning: latency curves, scores, steps, the greedy + swap search (plain and robust), EPLB."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from moelayers.placement import ExpertPlacement
from moelayers.planning.eplb import balanced_packing, plan_eplb, plan_eplb_placement, replicate_experts
from moelayers.planning.gem import (
    LatencyCurves, check_expert_rank, evaluate, plan_gem, plan_linear, score, score_layers,
)
from moelayers.planning.gem_search import (
    greedy, predictive_scenarios, robust_objective, scenario_count, search, smoothing_width,
)
from moelayers.planning.steps import LoadWindow, rank_rows, step_loads, trace_step_loads
from moelayers.trace import RoutingTrace

US = 1e-6


def tiled_formula(scale: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``[R, n]``: ``s_r (20 us + 10 us ceil(n / 128))`` computed directly."""
    return np.array([[s * (20 * US + 10 * US * -(-int(n) // 128)) for n in rows] for s in scale])


def brute_score(expert_rank: np.ndarray, loads: np.ndarray, curves: LatencyCurves) -> float:
    """``sum_steps max_rank C_rank(rows_rank)`` with plain loops."""
    total = 0.0
    for step in loads:
        worst = 0.0
        for r in range(curves.num_ranks):
            rows = sum(step[e] for e in range(len(step)) if expert_rank[e] == r)
            worst = max(worst, float(curves.eval_ranks(np.array(rows), r)))
        total += worst
    return total


def topic_steps(rng: np.random.Generator, num_steps: int, profiles: np.ndarray, tokens: int) -> np.ndarray:
    """``[steps, E]`` loads: each step mixes the topic ``profiles [P, E]`` with Dirichlet(0.5) weights."""
    weights = rng.dirichlet(np.full(profiles.shape[0], 0.5), size=num_steps)
    return np.stack([rng.multinomial(tokens, p) for p in weights @ profiles])


# ---------------------------------------------------------------------- latency curves
def test_presets_follow_the_formula() -> None:
    rows = np.array([0, 1, 127, 128, 129, 256, 3000, 200_000])
    slow = 1 / 0.88
    expected = {"high": [slow, 1, 1, 1], "moderate": np.linspace(slow, 1, 4), "low": [1] * 4, "none": [1] * 4}
    for name, scale in expected.items():
        curves = LatencyCurves.preset(name, 4)
        assert curves.num_ranks == 4
        got = curves(np.broadcast_to(rows[:, None], (rows.size, 4))).T
        np.testing.assert_allclose(got, tiled_formula(np.asarray(scale), rows), rtol=1e-12)
        sampled = LatencyCurves(curves.rows, curves.latency_s)  # the sampled form agrees within the samples
        np.testing.assert_allclose(sampled(np.full((1, 4), 3000)), curves(np.full((1, 4), 3000)), rtol=1e-12)
    with pytest.raises(ValueError, match="unknown variability preset 'extreme'"):
        LatencyCurves.preset("extreme", 4)
    with pytest.raises(ValueError, match="num_ranks must be a positive int"):
        LatencyCurves.preset("high", 0)


def test_sampled_curves_interpolate_hold_and_extrapolate() -> None:
    curves = LatencyCurves(np.array([10, 20, 40]), np.array([[1.0, 2.0, 2.0], [0.0, 1.0, 5.0]]))
    x = np.array([0, 10, 15, 30, 60])
    # rank 0's upper half (20, 40) is flat: beyond 40 rows, the whole curve's slope (2/70 per row)
    np.testing.assert_allclose(curves.eval_ranks(x, 0), [1.0, 1.0, 1.5, 2.0, 2.0 + 20 * 2 / 70])
    np.testing.assert_allclose(curves.eval_ranks(x, 1), [0.0, 0.0, 0.5, 3.0, 9.0])
    uniform = LatencyCurves(np.array([0, 10, 20]), np.array([[0.0, 1.0, 3.0]]))  # the uniform-grid fast path
    np.testing.assert_allclose(uniform.eval_ranks(np.array([0, 5, 10, 15, 30, -3]), 0), [0, 0.5, 1, 2, 5, 0])


def test_smoothed_curves_average_over_the_window() -> None:
    curves = LatencyCurves.preset("high", 2)
    smooth = curves.smoothed(128.0)  # a tile-wide moving average of a tiled curve is a straight line
    n = np.array([500.0, 1000.0, 3000.0, 150_000.0])
    line = (20 * US + 10 * US * (n / 128 + 0.5))
    np.testing.assert_allclose(smooth.eval_ranks(n, 1), line, rtol=2e-3)
    np.testing.assert_allclose(smooth.eval_ranks(n, 0), line / 0.88, rtol=2e-3)
    sampled = LatencyCurves(np.array([0, 10, 300, 1000]), np.array([[1.0, 2.0, 2.5, 9.0]]))
    width = 50.0
    for x in (5.0, 30.0, 700.0, 1200.0):
        window = np.linspace(x - width / 2, x + width / 2, 100_001)
        assert sampled.smoothed(width).eval_ranks(np.array(x), 0) == pytest.approx(
            sampled.eval_ranks(window, 0).mean(), rel=2e-3)
    # a profile-like curve whose last segment is steep: the grid used to stop half a window before the
    # last sample and the tail took the slope of the smoothed samples (35 % low at 1,000 rows)
    profile = LatencyCurves(np.array([1, 16, 32, 48, 64, 96, 128]),
                            np.array([[60.0, 167.0, 167.0, 167.0, 170.0, 176.0, 274.0]]) * US)
    width = 100.0
    smooth = profile.smoothed(width)
    for x in (40.0, 100.0, 120.0, 178.0, 200.0, 400.0, 1000.0, 1e5):
        window = np.linspace(x - width / 2, x + width / 2, 200_001)
        assert smooth.eval_ranks(np.array(x), 0) == pytest.approx(profile.eval_ranks(window, 0).mean(), rel=3e-3), x
    # a first sample above 0 rows: the grid started there, so every row below it read the average
    # around the first sample (1.25 ms at 0 rows, where the whole window lies on the held 1 ms)
    late = LatencyCurves(np.array([128, 256]), np.array([[1.0, 2.0]]) * 1e-3)
    width = 256.0
    for x in (0.0, 64.0, 128.0, 300.0):
        window = np.linspace(x - width / 2, x + width / 2, 200_001)
        assert late.smoothed(width).eval_ranks(np.array(x), 0) == pytest.approx(late.eval_ranks(window, 0).mean(), rel=1e-3), x
    with pytest.raises(ValueError, match="positive number of rows"):
        curves.smoothed(0.0)


def test_smoothing_a_curve_sampled_far_keeps_the_points_near_its_samples(monkeypatch) -> None:
    """Curves sampled sparsely up to 2^24 rows: the smoothing lattice of a narrow window had millions
    of points (3.4 M and 1.2 GB at a 40-row window); away from the samples the average is the straight
    curve itself, so only the lattice near the samples is kept, with the same values."""
    import moelayers.planning.gem as gem

    rows = np.unique(np.concatenate([np.arange(0, 16_385, 128), np.geomspace(16_384, 2**24, 40).astype(np.int64)]))
    kinks = 1.0 + 0.3 * np.sin(rows / 3000.0) ** 2  # slopes that change at every sample
    lat = np.cumsum(np.concatenate([[0.0], np.diff(rows) * kinks[1:]]))[None, :] * np.array([[1.1], [1.0]]) * 1e-8 + 1e-5
    curves = LatencyCurves(rows, lat)
    x = np.concatenate([np.random.default_rng(0).uniform(0, 2**24, 20_000), rows + 0.5, rows - 7.0, [0.0, 2.0**25]])
    x = np.maximum(x, 0.0)
    for width in (40.0, 300.0):
        thin = curves.smoothed(width)
        assert thin.rows.size < 4 * 16 * rows.size  # about 2w/step + 4 points per sample at most
        monkeypatch.setattr(gem, "_SMOOTH_GRID_POINTS", 1 << 40)
        whole = curves.smoothed(width)
        monkeypatch.undo()
        assert whole.rows.size > 100 * thin.rows.size
        for r in (0, 1):
            np.testing.assert_allclose(thin.eval_ranks(x, r), whole.eval_ranks(x, r), rtol=1e-9, atol=0.0)


def test_curves_save_load_round_trip(tmp_path) -> None:
    tiled = LatencyCurves.preset("moderate", 3)
    tiled.save(tmp_path / "tiled.npz")
    back = LatencyCurves.load(tmp_path / "tiled.npz")
    assert back.tiled_params is not None
    np.testing.assert_allclose(back.tiled_params[0], tiled.tiled_params[0])
    probe = np.array([[0, 77, 5000], [1, 128, 129], [300, 301, 100_000]])
    np.testing.assert_array_equal(back(probe), tiled(probe))
    sampled = LatencyCurves(np.array([0, 64, 512]), np.array([[1e-5, 2e-5, 9e-5], [2e-5, 2e-5, 3e-5]]))
    sampled.save(tmp_path / "sampled.npz")
    back = LatencyCurves.load(tmp_path / "sampled.npz")
    assert back.tiled_params is None
    np.testing.assert_array_equal(back.rows, sampled.rows)
    np.testing.assert_array_equal(back.latency_s, sampled.latency_s)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write left nothing behind


@pytest.mark.parametrize("rows, lat, match", [
    ([0, 10, 20], [[1.0, 0.5, 2.0]], "rank 0 is not monotone"),
    ([0, 10, 20], [[1.0, 2.0, 3.0], [-1.0, 1.0, 2.0]], "negative latency"),
    ([0, 20, 10], [[1.0, 2.0, 3.0]], "strictly ascending"),
    ([0, 10], [[1.0, np.nan]], "finite"),
    ([0], [[1.0]], ">= 2 samples"),
    ([0, 10, 20], [[1.0, 2.0]], r"must be \[R, N=3\]"),
    ([0, 1.5, 3], [[1.0, 2.0, 3.0]], "integers"),
])
def test_bad_curves_are_rejected(rows, lat, match) -> None:
    with pytest.raises(ValueError, match=match):
        LatencyCurves(np.array(rows), np.array(lat))


def test_bad_curve_files_and_rank_mismatch(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        LatencyCurves.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "wrong.npz", rows=np.arange(3))
    with pytest.raises(ValueError, match=r"missing key\(s\) \['latency_s'\]"):
        LatencyCurves.load(tmp_path / "wrong.npz")
    np.savez(tmp_path / "bent.npz", rows=np.array([0, 10, 20]), latency_s=np.array([[1.0, 3.0, 2.0]]))
    with pytest.raises(ValueError, match="bent.npz: latency curve of rank 0 is not monotone"):
        LatencyCurves.load(tmp_path / "bent.npz")
    curves = LatencyCurves.preset("high", 4)
    with pytest.raises(ValueError, match="curves are for 4 ranks, but the placement has 8"):
        curves.check_ranks(8)
    with pytest.raises(ValueError, match=r"rank_rows must be \[..., R=4\]"):
        curves(np.zeros((3, 8)))
    loads = np.ones((2, 12))
    with pytest.raises(ValueError, match="ranks outside"):
        score(np.arange(12) % 8, loads, curves)  # a placement for 8 ranks scored with 4-rank curves
    with pytest.raises(ValueError, match="divisible by the number of ranks"):
        plan_gem(np.ones((2, 10)), curves)  # 10 experts cannot go evenly onto 4 ranks


def test_empty_or_bad_loads_are_rejected() -> None:
    curves = LatencyCurves.preset("low", 2)
    for method in ("plain", "robust"):
        with pytest.raises(ValueError, match="no steps"):
            plan_gem(np.zeros((0, 4)), curves, method=method)
    with pytest.raises(ValueError, match="no experts"):
        plan_gem(np.zeros((3, 0)), curves)
    with pytest.raises(ValueError, match="finite and >= 0"):
        plan_gem(np.array([[1.0, -2.0, 3.0, 4.0]]), curves)
    with pytest.raises(ValueError, match=r"loads must be \[steps, E\]"):
        score(np.zeros(4, dtype=np.int64), np.ones(4), curves)
    with pytest.raises(ValueError, match="method must be one of"):
        plan_gem(np.ones((2, 4)), curves, method="fancy")
    # the public search checked nothing: E=5 over 2 ranks gave [3, 2] experts, NaN loads returned None
    with pytest.raises(ValueError, match=r"num_experts \(5\) must be divisible by the number of ranks of the curves \(2\)"):
        search(np.ones((2, 5)), curves)
    with pytest.raises(ValueError, match="finite and >= 0"):
        search(np.array([[1.0, np.nan, 3.0, 4.0]]), curves, method="plain")
    with pytest.raises(ValueError, match="no steps"):
        search(np.zeros((0, 4)), curves)
    with pytest.raises(ValueError, match="loads must be numbers of rows, got dtype bool"):
        plan_gem(np.ones((2, 4), dtype=bool), curves)
    with pytest.raises(ValueError, match="restarts must be a positive int"):
        plan_gem(np.ones((2, 4)), curves, restarts=0)
    with pytest.raises(ValueError, match="empty routing"):
        step_loads(np.zeros((0, 2), dtype=np.int64), 4)
    with pytest.raises(ValueError, match="no steps"):
        plan_eplb(np.zeros((0, 4)), 2)


# ---------------------------------------------------------------------- steps and scores
def test_step_loads_counts_and_last_partial_step() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, size=(11, 3, 2))  # T=11 tokens, L=3 layers, K=2
    loads = step_loads(ids, 6, tokens_per_step=4)
    assert loads.shape == (3, 3, 6) and loads.dtype == np.int64  # ceil(11 / 4) = 3 steps, the last has 3 tokens
    np.testing.assert_array_equal(loads.sum(axis=2), [[8, 8, 6]] * 3)  # rows = tokens * K
    for layer in range(3):
        for s, sl in enumerate([slice(0, 4), slice(4, 8), slice(8, 11)]):
            np.testing.assert_array_equal(loads[layer, s], np.bincount(ids[sl, layer].ravel(), minlength=6))
    np.testing.assert_array_equal(step_loads(ids[:, 1], 6, 4), loads[1])  # [T, K]: one layer
    shifted = step_loads(ids, 6, tokens_per_step=4, offset=1)  # tokens [0, 1) first, then steps of 4
    np.testing.assert_array_equal(shifted.sum(axis=2)[0], [2, 8, 8, 4])
    assert step_loads(ids, 6, tokens_per_step=11).shape == (3, 1, 6)
    with pytest.raises(ValueError, match="tokens_per_step must be a positive int"):
        step_loads(ids, 6, 0)
    with pytest.raises(ValueError, match="offset must be in"):
        step_loads(ids, 6, 4, offset=4)
    with pytest.raises(ValueError, match="expert ids outside"):
        step_loads(ids, 5, 4)


def test_trace_step_loads_and_rank_rows() -> None:
    rng = np.random.default_rng(1)
    ids = np.argsort(rng.random((10, 2, 8)), axis=-1)[..., :2]  # 2 distinct experts of 8 per token and layer
    trace = RoutingTrace(ids, np.arange(10), np.array([0, 3, 10]), 8)
    loads = trace_step_loads(trace, 4)
    np.testing.assert_array_equal(loads, step_loads(ids, 8, 4))
    np.testing.assert_array_equal(trace_step_loads(trace, 4, layers=[1]), loads[1:])
    er = np.array([0, 1, 2, 0, 1, 2, 0, 1])
    rr = rank_rows(er, loads[0], 3)
    assert rr.shape == (3, 3)
    np.testing.assert_array_equal(rr[:, 0], loads[0][:, er == 0].sum(axis=1))
    curves = LatencyCurves.preset("high", 4)
    expert_rank = np.stack([plan_linear(8, 4), np.roll(plan_linear(8, 4), 3)])
    assert evaluate(trace, expert_rank, curves, 4) == pytest.approx(score_layers(expert_rank, loads, curves).sum())


def test_load_window_keeps_the_last_steps() -> None:
    win = LoadWindow(num_layers=2, num_experts=4, window=3)
    with pytest.raises(ValueError, match="empty"):
        win.loads()
    for s in range(5):
        win.push(np.full((2, 4), s))
    assert len(win) == 3 and win.loads().shape == (2, 3, 4)
    np.testing.assert_array_equal(win.loads()[0, :, 0], [2, 3, 4])
    win.push_topk(np.array([[[0, 1], [2, 3]], [[0, 0], [1, 1]]]))  # [T=2, L=2, K=2]
    np.testing.assert_array_equal(win.loads()[:, -1], [[3, 1, 0, 0], [0, 2, 1, 1]])
    # the same routing as a torch tensor (the layers' last_topk_ids): it was split by token, not layer
    win.push_topk(torch.tensor([[[0, 1], [2, 3]], [[0, 0], [1, 1]]]))
    np.testing.assert_array_equal(win.loads()[:, -1], [[3, 1, 0, 0], [0, 2, 1, 1]])
    win.push_topk([torch.tensor([[0, 1], [0, 0]]), torch.tensor([[2, 3], [1, 1]])])
    np.testing.assert_array_equal(win.loads()[:, -1], [[3, 1, 0, 0], [0, 2, 1, 1]])
    with pytest.raises(ValueError, match="counts must be"):
        win.push(np.zeros(4))


def test_score_matches_brute_force() -> None:
    rng = np.random.default_rng(2)
    curves = LatencyCurves.preset("moderate", 3)
    sampled = LatencyCurves(np.array([0, 100, 1000]), np.array([[1.0, 2.0, 9.0], [0.5, 3.0, 4.0], [0.0, 1.0, 10.0]]))
    loads = rng.integers(0, 400, size=(4, 5, 9))  # [L, steps, E]
    ers = np.stack([rng.integers(0, 3, size=9) for _ in range(4)])  # any counts per rank
    for c in (curves, sampled):
        per_layer = score_layers(ers, loads, c)
        for layer in range(4):
            assert per_layer[layer] == pytest.approx(brute_score(ers[layer], loads[layer], c), rel=1e-12)
            assert score(ers[layer], loads[layer], c) == per_layer[layer]
    with pytest.raises(ValueError, match="disagree"):
        score_layers(ers[:, :8], loads, curves)


# ---------------------------------------------------------------------- the search
def test_greedy_swap_finds_the_optimum_of_small_instances() -> None:
    """8 experts on 2 ranks: every one of the 35 distinct equal-size placements is scored."""
    for seed in range(12):
        rng = np.random.default_rng(seed)
        curves = LatencyCurves.preset("high" if seed % 2 else "none", 2)
        loads = rng.integers(0, 160, size=(3, 8))
        best = min(score(np.isin(np.arange(8), combo).astype(np.int64), loads, curves)
                   for combo in itertools.combinations(range(8), 4))
        er = plan_gem(loads, curves, method="plain", seed=seed, min_gain=0.0)
        assert np.bincount(er, minlength=2).tolist() == [4, 4]
        assert score(er, loads, curves) == pytest.approx(best, rel=1e-12), seed


@pytest.mark.parametrize("method", ["plain", "robust"])
def test_slow_rank_gets_fewer_rows_and_placements_are_equal(method: str) -> None:
    rng = np.random.default_rng(3)
    loads = rng.poisson(rng.uniform(100, 300, size=32), size=(12, 32))
    for num_r in (2, 4, 8):
        er = plan_gem(loads, LatencyCurves.preset("high", num_r), method=method)
        check_expert_rank(er, 32, num_r)  # equal experts per rank
        rows = rank_rows(er, loads, num_r).mean(axis=0)
        assert rows[0] < rows[1:].min(), (num_r, rows)
    er = plan_gem(loads, LatencyCurves.preset("low", 4), method=method)
    rows = rank_rows(er, loads, 4).mean(axis=0)
    assert rows.max() / rows.min() < 1.05  # equal ranks: balanced
    assert score(er, loads, LatencyCurves.preset("low", 4)) < score(plan_linear(32, 4), loads,
                                                                      LatencyCurves.preset("low", 4))


@pytest.mark.parametrize("method", ["plain", "robust"])
def test_search_is_deterministic_for_a_seed(method: str) -> None:
    rng = np.random.default_rng(4)
    loads = rng.poisson(150, size=(6, 24))
    curves = LatencyCurves.preset("moderate", 4)
    a = plan_gem(loads, curves, seed=7, method=method)
    np.testing.assert_array_equal(a, plan_gem(loads.copy(), curves, seed=7, method=method))
    assert a.dtype == np.int64 and a.shape == (24,)


def test_one_step_and_constant_steps() -> None:
    """Online windows may hold one step, or identical steps: robust then searches on that step."""
    curves = LatencyCurves.preset("high", 2)
    loads = np.array([[50, 10, 300, 20, 5, 80]])
    for x in (loads, np.repeat(loads, 5, axis=0)):
        np.testing.assert_array_equal(plan_gem(x, curves, method="robust"), plan_gem(loads, curves, method="plain"))


def test_robust_scenarios_have_the_predictive_moments() -> None:
    rng = np.random.default_rng(5)
    loads = rng.poisson(rng.uniform(200, 900, size=10), size=(7, 10)).astype(float)
    x = predictive_scenarios(loads, 64, rng)
    assert x.shape == (64, 10)
    np.testing.assert_allclose(x.mean(axis=0), loads.mean(axis=0), rtol=1e-9)  # no clipping at these loads
    dev, sx = loads - loads.mean(axis=0), x - x.mean(axis=0)
    np.testing.assert_allclose(sx.T @ sx / 64, (1 + 1 / 7) * dev.T @ dev / 6, rtol=1e-9, atol=1e-6)
    many = rng.poisson(300, size=(40, 10)).astype(float)  # 2 (S - 1) > N: the steps themselves
    assert predictive_scenarios(many, 64, rng).shape == (40, 10)
    lots = rng.poisson(rng.uniform(200, 900, size=10), size=(300, 10)).astype(float)  # S > 2 N: 2 N Gaussian ones
    x = predictive_scenarios(lots, 64, rng)
    assert x.shape == (128, 10)
    np.testing.assert_allclose(x.mean(axis=0), lots.mean(axis=0), rtol=1e-9)
    dev, sx = lots - lots.mean(axis=0), x - x.mean(axis=0)
    np.testing.assert_allclose(sx.T @ sx / 128, (1 + 1 / 300) * dev.T @ dev / 299, rtol=1e-9, atol=1e-6)
    # many steps of more experts than 2 N scenarios span (128 experts: N = 32): one pair per direction
    wide = rng.poisson(rng.uniform(200, 900, size=128), size=(100, 128)).astype(float)
    x = predictive_scenarios(wide, 32, rng)
    assert x.shape == (2 * 99, 128)  # 99 directions (S - 1), more than 2 N = 64
    np.testing.assert_allclose(x.mean(axis=0), wide.mean(axis=0), rtol=1e-9)
    dev, sx = wide - wide.mean(axis=0), x - x.mean(axis=0)
    np.testing.assert_allclose(sx.T @ sx / 198, (1 + 1 / 100) * dev.T @ dev / 99, rtol=1e-9, atol=1e-6)
    assert smoothing_width(np.ones((5, 4)), 2) == 0.0
    _, smooth = robust_objective(loads, LatencyCurves.preset("high", 2), rng)
    assert smooth.tiled_params is None and smooth.num_ranks == 2
    with pytest.raises(ValueError, match="even number"):
        search(loads, LatencyCurves.preset("high", 2), scenarios=63)


def test_robust_generalises_better_than_plain_on_few_steps() -> None:
    """Planted: each step mixes 4 topic profiles (which experts burst together) with random weights.

    Fitted on 8 steps, ``plain`` tunes the ranks' rows to those steps and to where they sit between
    tile boundaries (512 rows per rank = 4 tiles at EP4); ``robust`` fits the expected score over
    steps drawn like them. Scored on 300 unseen steps of the same process, over 20 instances.
    """
    gains = {"low": [], "high": []}
    for seed in range(20):
        rng = np.random.default_rng(seed)
        base = rng.uniform(0.5, 1.5, size=16)
        profiles = np.stack([base * rng.gamma(2.0, 0.5, size=16) for _ in range(4)])
        profiles /= profiles.sum(axis=1, keepdims=True)
        train, held_out = topic_steps(rng, 8, profiles, 2048), topic_steps(rng, 300, profiles, 2048)
        for preset in gains:
            curves = LatencyCurves.preset(preset, 4)
            plain = score(plan_gem(train, curves, method="plain"), held_out, curves)
            robust = score(plan_gem(train, curves, method="robust"), held_out, curves)
            gains[preset].append(1.0 - robust / plain)
    for preset, g in gains.items():
        g = np.array(g)
        assert g.mean() > 0.005 and (g > 0).sum() >= 12, (preset, g.round(4))


def test_plan_gem_speed_256_experts() -> None:
    """One layer of 256 experts at EP8 from a 16-step window: well within 10 s (loose bound, shared CPUs)."""
    rng = np.random.default_rng(6)
    loads = topic_steps(rng, 16, rng.dirichlet(np.ones(256), size=6), 2048 * 8)
    curves = LatencyCurves.preset("high", 8)
    t0 = time.perf_counter()
    er = plan_gem(loads, curves)
    assert time.perf_counter() - t0 < 10.0
    check_expert_rank(er, 256, 8)


@pytest.mark.slow
def test_plan_gem_speed_whole_model() -> None:
    """26 layers x 64 experts at EP8 from ~27 train steps each: within 30 s."""
    rng = np.random.default_rng(7)
    curves = LatencyCurves.preset("high", 8)
    layers = [topic_steps(rng, 27, rng.dirichlet(np.ones(64), size=6), 2048 * 6) for _ in range(26)]
    t0 = time.perf_counter()
    for loads in layers:
        plan_gem(loads, curves)
    assert time.perf_counter() - t0 < 30.0


# ---------------------------------------------------------------------- EPLB
def test_balanced_packing_properties() -> None:
    rng = np.random.default_rng(8)
    w = rng.exponential(100, size=24)
    pack = balanced_packing(w, 4)
    assert np.bincount(pack, minlength=4).tolist() == [6] * 4
    loads = np.bincount(pack, weights=w, minlength=4)
    assert loads.max() - loads.min() <= w.max() + 1e-9  # greedy: within one item of balance
    heaviest = np.argsort(-w)[:4]
    assert sorted(pack[heaviest].tolist()) == [0, 1, 2, 3]  # the 4 heaviest spread first
    groups = np.repeat(np.arange(12), 2)  # pairs of replicas: never two of a pair on one pack
    pack = balanced_packing(np.repeat(rng.exponential(100, size=12), 2), 4, item_group=groups)
    for p in range(4):
        members = groups[pack == p]
        assert len(set(members.tolist())) == members.size
    with pytest.raises(ValueError, match="do not split evenly"):
        balanced_packing(w, 5)


def test_plan_eplb_never_puts_two_replicas_on_a_rank() -> None:
    """When every open rank already holds a hot expert, greedy packing used to put two of its
    replicas on one rank (a placement the layer refuses): now they are swapped apart."""
    table = plan_eplb(np.array([30, 30, 30]), 3, num_replicas=3)
    assert all(len(set(row)) == len(row) for row in table.tolist()), table
    plan_eplb_placement(np.array([30, 30, 30]), 3, num_replicas=3)
    rng = np.random.default_rng(0)
    tried = 0
    while tried < 300:  # small integer loads: many ties, the hard case
        r = int(rng.integers(2, 6))
        e = int(rng.integers(r, 4 * r + 1))
        rep = int(rng.integers(1, 2 * r + 1))
        if (e + rep) % r or e + rep > e * r:
            continue
        tried += 1
        loads = rng.integers(0, 4, size=e) * int(rng.choice([1, 10]))
        table = plan_eplb(loads, r, num_replicas=rep)
        assert all(len(set(row)) == len(row) for row in table.tolist()), (loads, r, rep, table)
        assert sorted(np.unique(table).tolist()) == list(range(e))


def test_plan_eplb_balances_and_replicates() -> None:
    rng = np.random.default_rng(9)
    loads = rng.poisson(rng.exponential(200, size=16), size=(5, 16))
    er = plan_eplb(loads, 4)
    check_expert_rank(er, 16, 4)
    totals = np.bincount(er, weights=loads.sum(axis=0), minlength=4)
    lin = np.bincount(plan_linear(16, 4), weights=loads.sum(axis=0), minlength=4)
    assert totals.max() <= lin.max() and totals.max() - totals.min() <= loads.sum(axis=0).max()
    w = loads.sum(axis=0).astype(float)
    phy2log, logcnt = replicate_experts(w, 20)
    assert logcnt.sum() == 20 and phy2log.size == 20 and (np.bincount(phy2log, minlength=16) == logcnt).all()
    extra = logcnt > 1  # each extra replica went to the largest load per replica at its time
    assert extra.any() and (w[extra] / (logcnt[extra] - 1)).min() >= (w / logcnt).max()
    table = plan_eplb(loads, 4, num_replicas=4)
    assert table.shape == (4, 5)
    for r in range(4):
        assert len(set(table[r].tolist())) == 5  # no duplicate replica on one rank
    placement = plan_eplb_placement(loads, 4, num_replicas=4)
    assert isinstance(placement, ExpertPlacement)
    placement.validate()
    with pytest.raises(ValueError, match="divisible by num_ranks"):
        plan_eplb(loads, 3)


def test_scores_sum_narrow_integer_loads_without_wrapping():
    """uint8 / int32 loads are summed per rank in int64 (they used to wrap around silently)."""
    curves = LatencyCurves.preset("moderate", 2)
    er = np.array([0, 0, 1, 1])
    for dtype, value in ((np.uint8, 200), (np.int32, 2 ** 30)):
        loads = np.full((3, 4), value, dtype=dtype)
        assert score(er, loads, curves) == score(er, loads.astype(np.int64), curves)


def test_load_window_refuses_fractions_and_nan():
    w = LoadWindow(1, 4)
    w.push(np.array([1.0, 2.0, 0.0, 3.0]))  # whole numbers as floats are fine
    for bad in ([1, np.nan, 2, 3], [1, 2.5, 2, 3]):
        with pytest.raises(ValueError, match="whole numbers"):
            w.push(np.array(bad))


def test_eplb_replicas_one_per_rank():
    """A very hot expert gets at most one replica per rank (two on one rank broke the placement)."""
    from moelayers.planning.eplb import plan_eplb, plan_eplb_placement

    table = plan_eplb(np.array([100.0, 1, 1, 1]), 2, num_replicas=2)
    assert all(len(set(row)) == len(row) for row in table.tolist())
    plan_eplb_placement(np.array([100.0, 1, 1, 1]), 2, num_replicas=2).validate()
    with pytest.raises(ValueError, match="at most one per rank"):
        plan_eplb(np.array([5.0, 1]), 2, num_replicas=4)


def test_sampled_curves_extrapolate_huge_row_counts():
    curves = LatencyCurves(np.array([0, 10, 20]), np.array([[1.0, 2.0, 3.0]]))
    assert curves(np.array([[1e30]]))[0, 0] == pytest.approx(1e29)  # was an IndexError (int64 overflow)


def test_tiled_curves_with_a_tile_larger_than_the_sampled_range():
    tile = 1 << 18  # was "'rows' must be 1-D with >= 2 samples": the samples stopped before the first tile
    curves = LatencyCurves.tiled(np.ones(2), tile=tile)
    rows = np.array([0, 1, tile, tile + 1, 5 * tile])
    expected = 20e-6 + 10e-6 * np.ceil(rows / tile)
    np.testing.assert_allclose(curves(np.broadcast_to(rows[:, None], (rows.size, 2)))[:, 0], expected, rtol=1e-12)


def test_unsigned_latency_must_still_be_monotone():
    lat = np.array([[3, 1]], dtype=np.uint8)  # was accepted (3 - 1 wrapped to 254 >= 0), then extrapolated below 0
    with pytest.raises(ValueError, match="rank 0 is not monotone"):
        LatencyCurves(np.array([1, 2]), lat)
    ok = LatencyCurves(np.array([1, 2]), np.array([[1, 3]], dtype=np.uint8))
    np.testing.assert_allclose(ok.eval_ranks(np.array([0, 2, 10]), 0), [1.0, 3.0, 19.0])


def test_rows_beyond_float64_precision_are_rejected():
    lat = np.array([[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match=r"'rows' must be < 2\*\*53, found 1e\+20"):  # was cast to int64's minimum
        LatencyCurves(np.array([1.0, 16.0, 1e20]), lat)
    with pytest.raises(ValueError, match=r"'rows' must be < 2\*\*53"):  # 2**53 + 1 rounds to 2**53: zero-width segment
        LatencyCurves(np.array([1, 2**53, 2**53 + 1]), lat)


def test_nan_rows_give_nan_on_the_uniform_grid_too():
    uniform = LatencyCurves(np.array([0, 10, 20]), np.array([[0.0, 1.0, 3.0]]))  # was an IndexError (index -2**63)
    uneven = LatencyCurves(np.array([0, 10, 30]), np.array([[0.0, 1.0, 3.0]]))
    for curves in (uniform, uneven):
        got = curves.eval_ranks(np.array([np.nan, 5.0]), 0)
        assert np.isnan(got[0]) and got[1] == pytest.approx(0.5)


def test_bad_tiled_parameters_in_a_file_name_the_file_and_the_field(tmp_path):
    LatencyCurves.preset("high", 2).save(tmp_path / "good.npz")
    with np.load(tmp_path / "good.npz") as f:
        arrays = dict(f)
    cases = {"base_s": (np.array([1e-5, 2e-5]), r"vector\.npz: 'base_s' must be a real scalar"),  # was a TypeError
             "per_tile_s": (np.str_("fast"), r"text\.npz: 'per_tile_s' must be a real scalar"),  # no file named
             "tile": (np.int64(0), r"zero\.npz: need tile >= 1"),  # was "tiled curves: ..."
             "scale": (-arrays["scale"], r"negative\.npz: scale must be \[R\] positive")}
    for (key, (value, match)), name in zip(cases.items(), ("vector", "text", "zero", "negative")):
        np.savez(tmp_path / f"{name}.npz", **{**arrays, key: value})
        with pytest.raises(ValueError, match=match):
            LatencyCurves.load(tmp_path / f"{name}.npz")
    with pytest.raises(ValueError, match=r"base_s >= 0"):  # NaN passed "base_s < 0"; the error named latency_s
        LatencyCurves.tiled(np.ones(2), base_s=float("nan"))


def test_refine_stops_when_nothing_can_be_gained() -> None:
    """With F = 0 (curves through the origin, a window without tokens) no swap gains anything: the
    search stops at once instead of swapping for 1000 E rounds per restart."""
    from moelayers.planning import gem_search

    curves = LatencyCurves.tiled(np.ones(4), base_s=0.0)
    x = np.zeros((16, 32))
    start = gem_search.greedy(x, curves, 8)
    er, f = gem_search.refine(start, x, curves, max_rounds=50)
    assert f == 0.0 and np.array_equal(er, start)
    t0 = time.perf_counter()
    plan_gem(np.zeros((16, 32), dtype=np.int64), curves)
    assert time.perf_counter() - t0 < 2.0
    for bad in (float("nan"), -0.1, float("inf")):
        with pytest.raises(ValueError, match="min_gain must be a finite number >= 0"):
            search(np.ones((4, 8)), curves, min_gain=bad)


def test_greedy_puts_the_hot_expert_on_the_fast_rank() -> None:
    """Greedy alone (the swaps and restarts of search hide it): heaviest first, each onto the rank
    whose choice raises F least; with rank 0 slow, the hot expert goes to rank 1."""
    out = greedy(np.array([[900.0, 10, 10, 10]]), LatencyCurves.preset("high", 2), 2)
    assert out[0] == 1 and np.bincount(out, minlength=2).tolist() == [2, 2]


def test_robust_searches_predictive_scenarios() -> None:
    """robust's objective runs on scenario steps with the observed steps' mean (not on the steps)."""
    loads = np.random.default_rng(0).poisson(50, (7, 10)).astype(np.float64)
    x, _ = robust_objective(loads, LatencyCurves.preset("high", 2), np.random.default_rng(1))
    assert x.shape == (scenario_count(10), 10)
    np.testing.assert_allclose(x.mean(0), loads.mean(0), rtol=1e-9)


def test_extrapolation_of_a_coarse_profile_whose_upper_half_was_pooled():
    """profile=cpu_smoke samples 1-128 rows; one dip at 96 rows made the monotone fit pool the whole
    upper half (64, 96, 128) into one flat block, so 6,144 rows cost what 128 did and every placement
    scored the same (gem_vs_linear 0). The whole curve's slope now prices the rows beyond it."""
    from recipes.profile import monotone_fit, sample_rows

    rows = np.asarray(sample_rows(16, 64, 32, 128))
    fit = monotone_fit(np.array([[10, 20, 30, 40, 52, 48, 50]], dtype=float) * 1e-6)
    assert np.ptp(fit[0, rows >= 64]) == 0  # the pooled block
    c = LatencyCurves(rows, fit)
    far = c.eval_ranks(np.array([128.0, 1024.0, 6144.0]), 0)
    assert far[0] == pytest.approx(50e-6) and far[2] > far[1] > 2 * far[0]
    # an asymmetric upper half (64, 96, 120): its flat block's slope rounds to +6e-38, not 0
    rows = np.asarray(sample_rows(16, 64, 32, 120))
    fit = monotone_fit(np.array([[10.0, 20.0, 30.0, 40.0, 50.7, 48.5, 49.6]]) * 1e-6)
    far = LatencyCurves(rows, fit).eval_ranks(np.array([120.0, 6144.0]), 0)
    assert far[1] > 10 * far[0]


def test_extrapolation_uses_the_tail_slope_not_a_flattened_last_segment():
    """A dip at the last measurement, flattened by the profiler's non-decreasing fit, made every row
    beyond the curve cost nothing (139.5 us at 10,000 rows); the tail's least-squares slope keeps
    rows beyond the samples paying. Straight curves extrapolate exactly as before."""
    rows = np.array([1, 128, 256, 384, 512])
    fitted = np.array([[20.0, 60.0, 100.0, 139.75, 139.75], [10.0, 20.0, 30.0, 40.0, 50.0]]) * 1e-6
    c = LatencyCurves(rows, fitted)
    # samples in the upper half (256, 384, 512) of rank 0: slope 39.75 us / 256 rows
    assert c.eval_ranks(np.array([512.0, 768.0]), 0) * 1e6 == pytest.approx([139.75, 139.75 + 39.75])
    assert c.eval_ranks(np.array([384.0, 448.0]), 0) * 1e6 == pytest.approx([139.75, 139.75])  # between samples: as sampled
    straight = 50.0 + (np.array([1024.0, 5000.0]) - 512.0) * 10.0 / 128.0
    assert c.eval_ranks(np.array([1024.0, 5000.0]), 1) * 1e6 == pytest.approx(straight)
    # a flat upper half (samples 10 and 30) takes the whole curve's least-squares slope, 2/70 per row
    uneven = LatencyCurves(np.array([0, 10, 30]), np.array([[1.0, 2.0, 2.0]]))
    assert uneven.eval_ranks(np.array([60.0]), 0) == pytest.approx([2.0 + 30 * 2 / 70])
    assert LatencyCurves(np.array([0, 10]), np.array([[3.0, 3.0]])).eval_ranks(np.array([99.0]), 0) == pytest.approx([3.0])
    # smoothing integrates the same extended curve: continuous across the last sample
    s = c.smoothed(64)
    assert np.all(np.diff(s(np.stack([np.arange(0, 2000, 7.0)] * 2, axis=1)), axis=0) >= -1e-15)


@pytest.mark.parametrize("num_experts, num_ranks", [(8, 16), (256, 48), (6, 4)])
def test_an_indivisible_expert_count_names_the_replicas_that_fill_the_ranks(num_experts, num_ranks):
    """Mixtral on EP16, 256 experts on EP48: refused with the rule only (a scale journey); the
    message now gives the EPLB call with replicas, which plans it."""
    import re

    from moelayers.planning.eplb import plan_eplb
    from moelayers.planning.gem import plan_linear

    with pytest.raises(ValueError, match=r"replicate hot experts") as err:
        plan_linear(num_experts, num_ranks)
    replicas = int(re.search(r"num_replicas=(\d+)", str(err.value)).group(1))
    phy2log = plan_eplb(np.arange(num_experts) + 1.0, num_ranks, num_replicas=replicas)
    assert phy2log.shape[0] == num_ranks and set(phy2log.ravel().tolist()) == set(range(num_experts))
