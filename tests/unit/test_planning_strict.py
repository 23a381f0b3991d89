"""Strict checks of the planners' pieces (GEM search internals, EPLB, step loads) with exact answers.

Each test pins a behaviour that the broader tests of ``test_planning_gem.py`` let through when
the code is subtly changed (found by mutation testing): exact values on small hand-made inputs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moelayers.planning import gem_search
from moelayers.planning.eplb import balanced_packing, plan_eplb, plan_eplb_placement, replicate_experts
from moelayers.planning.gem import LatencyCurves, score
from moelayers.planning.steps import LoadWindow, rank_rows, step_loads


def identity_curves(num_ranks: int, top: int = 100_000) -> LatencyCurves:
    """``C_r(n) = n`` on every rank (latency in rows): objectives are plain row counts."""
    return LatencyCurves(np.array([0, top]), np.tile([0.0, float(top)], (num_ranks, 1)))


# ---------------------------------------------------------------------- GEM search internals
def test_objective_is_the_sum_over_steps_of_the_slowest_rank() -> None:
    x = np.array([[10.0, 1.0, 3.0, 0.0], [0.0, 8.0, 2.0, 5.0]])  # 2 steps, 4 experts
    er = np.array([0, 1, 2, 2])  # rows per rank: step 0 = [10, 1, 3], step 1 = [0, 8, 7]
    assert gem_search.objective(er, x, identity_curves(3)) == pytest.approx(10.0 + 8.0)
    rng = np.random.default_rng(0)
    curves = LatencyCurves.preset("moderate", 3)
    loads = rng.integers(0, 400, size=(5, 9)).astype(np.float64)
    er = rng.integers(0, 3, size=9)
    assert gem_search.objective(er, loads, curves) == pytest.approx(score(er, loads, curves), rel=1e-12)


def test_greedy_ties_go_to_the_rank_with_the_lower_own_latency() -> None:
    """Identity curves, 2 steps. e0 -> rank 0; e1 raises F by 90 on either rank (tie): it goes to
    rank 1, whose own latency stays lower; e2 then fits under rank 0's peak of step 0 in step 1
    (no rise; a greedy that forgot the current peaks would pick the rank with fewer rows)."""
    x = np.array([[100.0, 0.0, 0.0, 5.0], [0.0, 90.0, 20.0, 5.0]])
    np.testing.assert_array_equal(gem_search.greedy(x, identity_curves(2), 2), [0, 1, 0, 1])


def test_others_max_excludes_both_ranks_of_a_swap() -> None:
    rng = np.random.default_rng(1)
    for num_r in (1, 2, 3, 4, 6):
        lat = rng.random((5, num_r))
        lat[0] = 0.5  # ties in a step
        got = gem_search._others_max(lat)
        assert got.shape == (num_r, num_r, 5)
        for a, b in itertools.product(range(num_r), repeat=2):
            rest = [r for r in range(num_r) if r not in (a, b)]
            want = lat[:, rest].max(axis=1) if rest else np.zeros(5)
            np.testing.assert_array_equal(got[a, b], want)


def test_refine_ends_in_a_local_optimum_with_the_exact_objective() -> None:
    """With min_gain = 0 no single swap of two experts on different ranks lowers F any more, and the
    F returned is the placement's objective (4 ranks: swaps whose ranks are not the slowest)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        curves = LatencyCurves.preset("high", 4) if seed % 2 else identity_curves(4)
        x = rng.integers(0, 400, size=(3, 12)).astype(np.float64)
        start = np.arange(12) // 3
        er, f = gem_search.refine(start, x, curves, min_gain=0.0)
        assert np.bincount(er, minlength=4).tolist() == [3] * 4
        assert f == pytest.approx(gem_search.objective(er, x, curves), rel=1e-12)
        for i, j in itertools.combinations(range(12), 2):
            if er[i] != er[j]:
                sw = er.copy()
                sw[i], sw[j] = er[j], er[i]
                assert gem_search.objective(sw, x, curves) >= f * (1 - 1e-12), (seed, i, j)


def _refine_by_scanning_all_swaps(er: np.ndarray, x: np.ndarray, curves: LatencyCurves,
                                  min_gain: float) -> tuple[np.ndarray, float]:
    """The readable reference of ``gem_search.refine``: every round scores each swap of two experts
    on different ranks with the full objective and applies the best (ties: the first (i, j))."""
    er = er.copy()
    f = gem_search.objective(er, x, curves)
    while True:
        best, best_er = np.inf, None
        for i, j in itertools.combinations(range(er.size), 2):
            if er[i] != er[j]:
                sw = er.copy()
                sw[i], sw[j] = er[j], er[i]
                g = gem_search.objective(sw, x, curves)
                if g < best:
                    best, best_er = g, sw
        if best_er is None or not f - best > max(min_gain * f, 0.0):
            return er, f
        er, f = best_er, best


@pytest.mark.parametrize("chunk", ["default", "one pair"])
def test_refine_makes_the_swaps_of_a_scan_over_all_pairs(chunk, monkeypatch) -> None:
    """The incremental, rank-blocked refinement applies exactly the swaps of the reference above, in
    the same order (integer loads: every latency is computed from the same exact row count), whether
    it scores all pairs of ranks at once or (a large layer's bounded memory) one pair at a time."""
    if chunk == "one pair":
        monkeypatch.setattr(gem_search, "_CHUNK_FLOATS", 1)
    rng = np.random.default_rng(11)
    for case in range(40):
        num_r, m, num_s = int(rng.integers(2, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 7))
        curves = LatencyCurves.preset(("high", "moderate", "low")[case % 3], num_r)
        if case % 2:
            curves = curves.smoothed(float(rng.uniform(10, 400)))
        x = rng.integers(0, 300, size=(num_s, num_r * m)).astype(np.float64)
        start = rng.permutation(np.arange(num_r * m) // m)
        for min_gain in (0.0, 1e-3):
            got = gem_search.refine(start, x, curves, min_gain=min_gain)
            want = _refine_by_scanning_all_swaps(start, x, curves, min_gain)
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"case {case}")
            assert got[1] == want[1], case


def test_refine_of_nothing_to_swap_or_score() -> None:
    """No step, no expert, one rank: the start and its score (no step or expert raised
    ZeroDivisionError once the swap scores were computed in chunks; a review)."""
    curves = LatencyCurves.preset("high", 2)
    er, f = gem_search.refine(np.array([0, 1]), np.zeros((0, 2)), curves)
    assert er.tolist() == [0, 1] and f == 0.0
    er, f = gem_search.refine(np.zeros(0, dtype=np.int64), np.zeros((3, 0)), curves)
    assert er.size == 0 and f == pytest.approx(gem_search.objective(er, np.zeros((3, 0)), curves))
    x = np.arange(12.0).reshape(3, 4)
    er, f = gem_search.refine(np.zeros(4, dtype=np.int64), x, LatencyCurves.preset("high", 1))
    assert er.tolist() == [0] * 4 and f == pytest.approx(gem_search.objective(er, x, LatencyCurves.preset("high", 1)))


def test_refine_needs_equal_experts_per_rank() -> None:
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match=r"E / R = 4 / 2 experts on every rank, got \[3, 1\]"):
        gem_search.refine(np.array([0, 0, 0, 1]), x, identity_curves(2))
    er, f = gem_search.refine(np.zeros(4, dtype=np.int64), x, identity_curves(1))  # one rank: nothing to swap
    assert er.tolist() == [0, 0, 0, 0] and f == 8.0


def test_refine_only_applies_swaps_that_gain_min_gain() -> None:
    """One step, identity curves: rank 0 holds 100 + 90 rows, rank 1 holds 10 + 0 (F = 190). The best
    swap (100 <-> 10, or 90 <-> 0) gives F = 100, a gain of 47 %: applied for min_gain 0.4, not for 0.5."""
    x = np.array([[100.0, 90.0, 10.0, 0.0]])
    start = np.array([0, 0, 1, 1])
    er, f = gem_search.refine(start, x, identity_curves(2), min_gain=0.5)
    np.testing.assert_array_equal(er, start)
    assert f == 190.0
    er, f = gem_search.refine(start, x, identity_curves(2), min_gain=0.4)
    assert er.tolist() in ([1, 0, 0, 1], [0, 1, 1, 0]) and f == 100.0


# ---------------------------------------------------------------------- robust scenarios
def test_scenario_count_values() -> None:
    """128 up to 64 experts, then SCENARIO_WORK // E^2 rounded down to even, at least 32."""
    want = {1: 128, 8: 128, 64: 128, 70: 106, 72: 100, 96: 56, 100: 52, 128: 32, 256: 32, 1024: 32}
    assert {e: gem_search.scenario_count(e) for e in want} == want


def test_predictive_scenarios_thresholds() -> None:
    """Steps themselves (scaled by sqrt(1 + 1/S)) exactly when N / 2 < S - 1 and S <= 2 N; the
    Gaussian scenarios otherwise (2 N of them beyond 2 N steps); two steps are not 'one step'."""
    rng = np.random.default_rng(2)
    num = 8
    for num_s, rows in ((2, 8), (5, 8), (6, 6), (16, 16), (17, 16)):
        loads = rng.poisson(rng.uniform(300, 900, size=6), size=(num_s, 6)).astype(np.float64)
        x = gem_search.predictive_scenarios(loads, num, np.random.default_rng(0))
        assert x.shape == (rows, 6), num_s
        np.testing.assert_allclose(x.mean(axis=0), loads.mean(axis=0), rtol=1e-9)
        mu = loads.mean(axis=0)
        if rows == num_s:  # the steps, fluctuations inflated for the error of the mean
            np.testing.assert_allclose(x, mu + np.sqrt(1 + 1 / num_s) * (loads - mu), rtol=1e-12)
        else:  # the predictive covariance, matched exactly
            dev, sx = loads - mu, x - x.mean(axis=0)
            np.testing.assert_allclose(sx.T @ sx / rows, (1 + 1 / num_s) * dev.T @ dev / (num_s - 1),
                                       rtol=1e-9, atol=1e-6)


def test_predictive_scenarios_clip_at_zero_and_constant_steps_give_one() -> None:
    """Loads are never negative: an expert near 0 with a large spread gets clipped scenarios; steps
    that are all the same are the one scenario."""
    rng = np.random.default_rng(3)
    loads = np.column_stack([rng.choice([0.0, 0.0, 0.0, 400.0], size=5), rng.poisson(500, size=(5, 3))])
    x = gem_search.predictive_scenarios(loads, 64, rng)
    assert x.shape == (64, 4) and x.min() == 0.0 and (x[:, 0] == 0.0).any()
    const = np.repeat([[3.0, 0.0, 7.0]], 4, axis=0)
    np.testing.assert_array_equal(gem_search.predictive_scenarios(const, 8, rng), const[:1])


def test_smoothing_width_follows_silverman_for_the_rows_of_a_rank() -> None:
    """sigma^2 is the variance of the rows of m random distinct experts (averaged over all
    m-subsets); the window is sqrt(12) * 1.06 sigma N^(-1/5)."""
    rng = np.random.default_rng(4)
    x = rng.poisson(rng.uniform(50, 500, size=6), size=(40, 6)).astype(np.float64)
    x[:, 1] += 0.5 * x[:, 0]  # some covariance
    for m in (1, 2, 3):
        sigma2 = np.mean([x[:, list(c)].sum(axis=1).var() for c in itertools.combinations(range(6), m)])
        want = np.sqrt(12.0 * sigma2) * 1.06 * 40 ** -0.2
        assert gem_search.smoothing_width(x, m) == pytest.approx(want, rel=1e-9), m


def test_robust_objective_smooths_with_the_width_of_e_over_r_experts() -> None:
    rng = np.random.default_rng(5)
    loads = rng.poisson(rng.uniform(100, 900, size=8), size=(6, 8)).astype(np.float64)
    curves = LatencyCurves.preset("high", 2)
    x, smooth = gem_search.robust_objective(loads, curves, np.random.default_rng(1), num_scenarios=16)
    width = gem_search.smoothing_width(x, 4)
    assert width >= 1.0
    probe = np.array([0.0, 100.0, 700.0, 1500.0, 4000.0])
    for r in range(2):
        np.testing.assert_array_equal(smooth.eval_ranks(probe, r), curves.smoothed(width).eval_ranks(probe, r))


def test_search_rejects_bad_restarts_noise_and_scenarios() -> None:
    curves = LatencyCurves.preset("high", 2)
    loads = np.ones((4, 4))
    for bad in (True, 0, 1.5):
        with pytest.raises(ValueError, match="restarts must be a positive int"):
            gem_search.search(loads, curves, restarts=bad)
    for bad in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
            gem_search.search(loads, curves, noise=bad)
    for bad in (0, -2, 3):
        with pytest.raises(ValueError, match="even number >= 2"):
            gem_search.search(loads, curves, scenarios=bad)


# ---------------------------------------------------------------------- EPLB
def test_balanced_packing_is_heaviest_first_into_the_lightest_pack() -> None:
    """LPT by hand: 5 -> p0, 4 -> p1, 3 -> p1, 3 -> p0, 3 -> p1 (full), 2 -> p0: loads 10 and 10
    (lightest-first would leave 9 and 11)."""
    w = np.array([5.0, 4.0, 3.0, 3.0, 3.0, 2.0])
    pack = balanced_packing(w, 2)
    np.testing.assert_array_equal(pack, [0, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(np.bincount(pack, weights=w), [10.0, 10.0])


def test_balanced_packing_prefers_a_pack_without_the_group() -> None:
    """The second replica of group 1 skips the lighter pack that already holds group 1 (rather than
    being put there and swapped away afterwards)."""
    pack = balanced_packing(np.array([6.0, 5.0, 5.0, 1.0]), 2, item_group=np.array([0, 1, 1, 2]))
    np.testing.assert_array_equal(pack, [0, 1, 0, 1])


def test_balanced_packing_and_replication_refuse_impossible_requests() -> None:
    with pytest.raises(ValueError, match="do not split evenly into 0 packs"):
        balanced_packing(np.ones(4), 0)
    with pytest.raises(ValueError, match=r"group 0 has 3 items for 2 packs: one pack would hold two"):
        balanced_packing(np.ones(4), 2, item_group=np.array([0, 0, 0, 1]))
    with pytest.raises(ValueError, match="3 physical experts cannot hold 4 experts"):
        replicate_experts(np.ones(4), 3)


def test_plan_eplb_table_by_hand() -> None:
    """loads [8, 4, 2, 2], 2 ranks, 2 replicas: experts 0 and 1 get a second replica (one per rank);
    replicas weigh load / replicas = [4, 2, 2, 2 | 4, 2] and are packed heaviest first; each row of
    the table is sorted."""
    table = plan_eplb(np.array([8, 4, 2, 2]), 2, num_replicas=2)
    np.testing.assert_array_equal(table, [[0, 1, 3], [0, 1, 2]])
    placement = plan_eplb_placement(np.array([8, 4, 2, 2]), 2, num_replicas=2)
    assert placement.phy2log.tolist() == [[0, 1, 3], [0, 1, 2]] and placement.logcnt.tolist() == [2, 2, 1, 1]


def test_plan_eplb_rejects_bad_arguments() -> None:
    loads = np.ones((3, 4))
    with pytest.raises(ValueError, match="finite and >= 0"):
        plan_eplb(np.array([1.0, -1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match="num_replicas must be an int >= 0, got -1"):
        plan_eplb(np.ones(5), 2, num_replicas=-1)
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="num_ranks must be a positive int"):
            plan_eplb(loads, bad)


# ---------------------------------------------------------------------- step loads
def test_step_loads_refuses_negative_ids_and_bool_step_sizes() -> None:
    """An id of -1 would otherwise be counted silently as the last expert of the previous step."""
    ids = np.array([[0, 1], [2, -1], [1, 1]])
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 3\)"):
        step_loads(ids, 3, 1)
    with pytest.raises(ValueError, match="tokens_per_step must be a positive int, got True"):
        step_loads(np.array([[0, 1]]), 3, True)


def test_rank_rows_checks_ranks_and_shapes_and_keeps_fractions() -> None:
    er = np.array([0, 1, 1])
    np.testing.assert_array_equal(rank_rows(er, np.array([[0.5, 0.25, 0.5]]), 2), [[0.5, 0.75]])
    assert rank_rows(er, np.array([[1, 2, 3]], dtype=np.uint8), 2).dtype == np.int64
    with pytest.raises(ValueError, match=r"ranks outside \[0, 2\)"):
        rank_rows(np.array([0, -1, 1]), np.ones((2, 3)), 2)
    with pytest.raises(ValueError, match=r"ranks outside \[0, 2\)"):
        rank_rows(np.array([0, 2, 1]), np.ones((2, 3)), 2)
    with pytest.raises(ValueError, match=r"expected \[4\]"):
        rank_rows(er, np.ones((2, 4)), 2)


def test_load_window_copies_refuses_negatives_and_clears() -> None:
    win = LoadWindow(num_layers=1, num_experts=3, window=2)
    counts = np.array([1, 2, 3], dtype=np.int64)
    win.push(counts)
    counts[0] = 99  # the caller reuses its buffer: the window keeps what was pushed
    np.testing.assert_array_equal(win.loads()[0, 0], [1, 2, 3])
    with pytest.raises(ValueError, match="counts must be >= 0"):
        win.push(np.array([1, -1, 0]))
    assert len(win) == 1
    win.clear()
    assert len(win) == 0
    with pytest.raises(ValueError, match="empty"):
        win.loads()
    for kw in (dict(window=0), dict(num_layers=0), dict(num_experts=0), dict(window=True)):
        args = dict(num_layers=1, num_experts=3, window=2) | kw
        with pytest.raises(ValueError, match="must be a positive int"):
            LoadWindow(**args)


# ---------------------------------------------------------------------- input checks of the step loads
def test_step_loads_checks_the_id_dtype_and_accepts_unsigned_ids() -> None:
    ids = np.array([[0, 1], [2, 3], [3, 0]])
    expected = step_loads(ids, 4, 2)
    for dtype in (np.int32, np.uint8, np.uint64):
        np.testing.assert_array_equal(step_loads(ids.astype(dtype), 4, 2), expected)
    np.testing.assert_array_equal(step_loads(ids[:, None, :].astype(np.uint64), 4, 2), expected[None])
    for bad in (ids.astype(np.float64), ids.astype(bool)):
        with pytest.raises(TypeError, match=f"topk_ids must have an integer dtype, got {bad.dtype}"):
            step_loads(bad, 4, 2)
    with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\)"):
        step_loads(np.array([[0, 2**63 + 1]], dtype=np.uint64), 4, 2)  # not wrapped to a negative id


def test_step_loads_refuses_a_fractional_offset() -> None:
    ids = np.array([[0], [1], [2], [3]])
    for bad in (2.7, 2.0, True):
        with pytest.raises(ValueError, match=f"offset must be an int, got {bad!r}"):
            step_loads(ids, 4, 4, offset=bad)
    np.testing.assert_array_equal(step_loads(ids, 4, 4, offset=np.int64(2)), step_loads(ids, 4, 4, offset=2))


def test_rank_rows_refuses_fractional_ranks() -> None:
    loads = np.array([[1, 2, 3, 4]])
    for bad in (np.array([0.0, 1.9, 1.2, 0.5]), np.array([0.0, 1.0, 1.0, 0.0])):
        with pytest.raises(TypeError, match="expert_rank must have an integer dtype, got float64"):
            rank_rows(bad, loads, 2)
    np.testing.assert_array_equal(rank_rows(np.array([0, 1, 1, 0], dtype=np.uint8), loads, 2), [[5, 5]])


def test_load_window_push_topk_refuses_one_layer_walked_as_layers() -> None:
    """One layer's ``[T, K]`` routing with ``T == L`` must not be read as ``T`` layers."""
    import torch

    win = LoadWindow(num_layers=2, num_experts=4)
    for bad in (np.array([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 3]]), np.array([0, 1])):
        with pytest.raises(ValueError, match=r"one \[T, L, K\] array or a list of L \[T, K\] arrays"):
            win.push_topk(bad)
    with pytest.raises(ValueError, match=r"layer 0 routing must be a \[T, K\] array, got shape \[2\]"):
        win.push_topk([np.array([0, 1]), np.array([2, 3])])
    assert len(win) == 0
    win.push_topk([np.array([[0, 1]], dtype=np.int32), torch.tensor([[2, 3]])])
    np.testing.assert_array_equal(win.loads()[:, -1], [[1, 1, 0, 0], [0, 0, 1, 1]])


def test_planners_refuse_what_their_docstrings_refuse() -> None:
    """Found by a property sweep: EPLB summed the steps before checking them (a negative step hid
    behind a positive one; two finite steps of 1e308 were called non-finite), rank_rows wrapped
    around int64, plan_linear took 2.0 ranks and returned floats, and a tiled curve counted
    ceil(1 / 2e9) tiles as 0."""
    from moelayers.planning.gem import plan_linear

    with pytest.raises(ValueError, match="finite and >= 0"):
        plan_eplb(np.array([[-5, 2, 1, 1], [6, 0, 1, 1]]), 2)
    with pytest.raises(ValueError, match="overflow"):
        plan_eplb(np.full((2, 4), 1e308), 2)
    with pytest.raises(ValueError, match="could pass int64"):
        rank_rows(np.array([0, 0]), np.array([[2**62, 2**62]]), 1)
    with pytest.raises(ValueError, match="could pass int64"):
        rank_rows(np.array([0]), np.array([[2**63 + 5]], dtype=np.uint64), 1)
    assert rank_rows(np.array([0, 1]), np.array([[2**61, 3]]), 2).tolist() == [[2**61, 3]]
    for bad in (2.0, True, 0, -1):
        with pytest.raises(ValueError, match="positive int"):
            plan_linear(4, bad)
    assert plan_linear(np.int64(4), 2).dtype == np.int64
    big = LatencyCurves.tiled(np.ones(1), base_s=0.0, per_tile_s=1.0, tile=2_000_000_000)
    n = 96 * 86281385168082 + 1  # below 2^53: ceil(n / 96) = 86281385168083
    assert big.eval_ranks(np.array([1.0]), 0)[0] == 1.0
    assert LatencyCurves.tiled(np.ones(1), base_s=0.0, per_tile_s=1.0, tile=96).eval_ranks(np.array([float(n)]), 0)[0] == 86281385168083
