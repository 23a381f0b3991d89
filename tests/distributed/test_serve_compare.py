"""recipes/serve.py with a `compare` block: ours against a baseline on the same requests, once per seed,
one results.json (2 gloo processes)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.unit.test_outputs_doc import assert_documented
from tests.unit.test_provenance import check_provenance

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "recipes" / "serve.py"
KEYS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p90_s", "lar", "imbalance", "a2a_bytes",
        "world_size", "layer")
MEDIANS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p90_s", "lar", "imbalance",
           "a2a_bytes", "bytes_sent", "output_tokens", "steps", "elapsed_s")


def _compare(run_dir: Path, *overrides: str) -> tuple[dict, str]:
    cmd = [sys.executable, str(SERVE), "parallel.world_size=2", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"serve failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads((run_dir / "results.json").read_text()), proc.stdout


def _check_structure(res: dict, seeds: list[int], ours: str, base: str) -> None:
    assert res["seeds"] == seeds and res["layer"] == ours and res["baseline"]["layer"] == base
    for key in KEYS:
        assert key in res and key in res["baseline"], key
    runs = res["runs"]
    assert set(runs) == {"ours", "baseline"}
    for side, name in (("ours", ours), ("baseline", base)):
        assert [r["seed"] for r in runs[side]] == seeds
        assert all(r["layer"] == name and r["side"] == side and r["output_tokens"] > 0 for r in runs[side])
        summary = res if side == "ours" else res["baseline"]
        for key in MEDIANS:  # the summaries are medians over the seeds
            assert summary[key] == pytest.approx(float(np.median([r[key] for r in runs[side]])), rel=1e-12), (side, key)
    for ro, rb in zip(runs["ours"], runs["baseline"]):  # same seed -> the same requests on both sides
        assert ro["requests_digest"] == rb["requests_digest"]
        assert ("requests" in ro) is ("requests" in rb) is (res["config"].get("per_request") is not False)
        if "requests" in ro:  # (per_request=false leaves them out)
            strip = [[(q["id"], q["arrival_s"], q["prompt_len"], q["output_len"]) for q in r["requests"]] for r in (ro, rb)]
            assert strip[0] == strip[1]
        assert ro["output_tokens"] == rb["output_tokens"]
        assert ro["a2a_bytes"] == ro["a2a_dispatch_bytes"] + ro["a2a_combine_bytes"] > 0
    for ra, rb in zip(runs["ours"], runs["ours"][1:]):  # different seeds -> different requests
        assert ra["requests_digest"] != rb["requests_digest"]
    cmp = res["comparison"]
    assert cmp["same_requests"] is True
    assert set(cmp["metrics"]) >= set(BETTER) - {"emulated_expert_s"}
    for key, m in cmp["metrics"].items():  # every flag recomputed from the medians and the runs
        direction, flag = BETTER[key]
        assert m["better"] == direction, key
        assert m["ours"] == res[key] and m["baseline"] == res["baseline"][key]
        assert m["ratio"] == pytest.approx(res[key] / res["baseline"][key])
        assert m["ours_better"] is _better(res[key], res["baseline"][key], direction), key
        assert cmp[flag] is m["ours_better"], key
        wins = sum(_better(ro[key], rb[key], direction) for ro, rb in zip(runs["ours"], runs["baseline"]))
        assert m["seeds_ours_better"] == wins and m["seeds"] == len(seeds), key


# which direction is better for each compared metric, and its flag in `comparison` (written out here,
# not imported: the recipe's table is what is tested)
BETTER = {"lar": ("higher", "lar_higher"), "a2a_bytes": ("lower", "a2a_bytes_lower"),
          "tpot_p90_s": ("lower", "tpot_p90_lower"), "tpot_mean_s": ("lower", "tpot_mean_lower"),
          "throughput_tok_s": ("higher", "throughput_higher"), "ttft_p50_s": ("lower", "ttft_p50_lower"),
          "ttft_p99_s": ("lower", "ttft_p99_lower"), "imbalance": ("lower", "imbalance_lower"),
          "emulated_expert_s": ("lower", "emulated_expert_lower")}


def _better(ours, base, direction: str) -> bool:
    """Strictly better; a missing (null) or infinite figure is never better."""
    if ours is None or base is None or not (np.isfinite(ours) and np.isfinite(base)):
        return False
    return bool(ours > base) if direction == "higher" else bool(ours < base)


@pytest.mark.timeout(150)
def test_compare_semantic_vs_vanilla(tmp_path):
    seeds = [0, 2]
    # (layer.plan_train_fraction: a review found a comparison setting it refused on the baseline's side)
    res, out = _compare(tmp_path / "run", "layer=semantic", "scheduler=semantic", "router=replay",
                        "layer.plan_train_fraction=0.5",
                        "workload.num_requests=8", "trace.num_sequences=64", "trace.request_offset=32",
                        "compare.layer=vanilla", "compare.scheduler=round_robin",
                        f"compare.seeds=[{seeds[0]},{seeds[1]}]")
    assert "compare: semantic (scheduler=semantic) vs vanilla (scheduler=round_robin)" in out  # side-by-side table
    assert (tmp_path / "run" / "compare.png").stat().st_size > 1000
    assert (tmp_path / "run" / "rank_load.png").stat().st_size > 1000
    _check_structure(res, seeds, "semantic", "vanilla")
    assert res["scheduler"] == "semantic" and res["baseline"]["scheduler"] == "round_robin"
    assert res["config"]["compare"]["layer"] == "vanilla"
    # held-out requests: sequences 32.. of the trace (the plan is built on sequences 0..31)
    assert all(r["in_sample_requests"] == 0 and r["num_requests"] == 8 for r in res["runs"]["ours"])
    # routing is replayed: LAR depends only on the trace, the plan and the scheduler -> deterministic
    assert all(ro["lar"] > rb["lar"] for ro, rb in zip(res["runs"]["ours"], res["runs"]["baseline"]))
    assert res["lar"] > res["baseline"]["lar"] and res["comparison"]["lar_higher"] is True
    assert res["a2a_bytes"] < res["baseline"]["a2a_bytes"] and res["comparison"]["a2a_bytes_lower"] is True


@pytest.mark.timeout(150)
def test_compare_variability_vs_vanilla_same_emulated_hardware(tmp_path):
    seeds = [3, 4]
    res, _ = _compare(tmp_path / "run", "layer=variability", "variability=high", "emulation.mode=curve",
                      "emulation.time_scale=20", "router=replay", "workload.num_requests=8", "layer.kwargs.window=4",
                      "compare.layer=vanilla", "compare.seeds=2", "seed=3", "progress=false", "per_request=false",
                      "plot=false")
    _check_structure(res, seeds, "variability", "vanilla")
    assert not any("requests" in r for side in ("ours", "baseline") for r in res["runs"][side])  # per_request=false
    assert all(r["num_requests"] == 8 and r["requests_digest"] for r in res["runs"]["ours"])
    assert not (tmp_path / "run" / "compare.png").exists()
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"results.json"}  # no .hydra/, no serve.log
    assert res["command"]["overrides"][-1] == "plot=false"
    check_provenance(res["provenance"], {})  # (a synthetic trace: no input files)
    assert_documented(res, "serve.py: `results.json` of a comparison")
    # 2 seeds (for speed) run, flagged: medians want at least 3
    assert res["seeds_below_minimum"] is True and "below the minimum of 3" in res["warnings"][0]
    for side in ("ours", "baseline"):  # both sides run on the same emulated slow rank 0
        for r in res["runs"][side]:
            assert ("emulated variability (curve mode): every rank's expert time padded to 20 x its latency "
                    "curve, from variability=high") in r["notes"]
            assert r["emulated_expert_s"] > 0 and len(r["emulated_expert_rank_s"]) == 2
    assert all(len(r["replans"]) == 2 for r in res["runs"]["ours"])  # each MoE layer re-planned once
    assert all(r["replans"] == [] for r in res["runs"]["baseline"])
    assert "emulated_expert_s" in res["comparison"]["metrics"]


def test_compare_config_errors(tmp_path):
    from recipes import _serve_compare as compare

    conf = str(ROOT / "conf")
    cfg = {"seed": 5, "layer": {"name": "variability", "cls": "x"}, "scheduler": "round_robin",
           "compare": {"layer": "vanilla", "seeds": 3}}
    assert compare.enabled(cfg) and not compare.enabled({"compare": {"layer": None}})
    assert compare.seeds(cfg) == [5, 6, 7]
    runs = compare.run_configs(cfg, conf)
    assert [(r["_side"], r["seed"]) for r in runs] == [("ours", 5), ("baseline", 5), ("baseline", 6), ("ours", 6),
                                                        ("ours", 7), ("baseline", 7)]
    assert all("compare" not in r for r in runs)
    assert runs[1]["layer"]["cls"] == "moelayers.VanillaMoE" and runs[1]["scheduler"] == "round_robin"
    for bad in (0, [], [1, 1], "3", True, [-1, 0]):  # a negative seed failed in numpy, inside every rank
        with pytest.raises(ValueError, match="compare.seeds"):
            compare.seeds(dict(cfg, compare={"layer": "vanilla", "seeds": bad}))
    # fewer than 3 seeds: allowed (quick checks, the tests above) but warned about and flagged
    assert compare.MIN_SEEDS == 3 and compare.seeds_warning(cfg) is None
    assert compare.seeds_warning(dict(cfg, compare={"layer": "vanilla", "seeds": [4, 9, 1]})) is None
    for few, got in ((1, [5]), (2, [5, 6]), ([7, 3], [7, 3])):
        warning = compare.seeds_warning(dict(cfg, compare={"layer": "vanilla", "seeds": few}))
        assert f"{len(got)} seed(s) {got}: below the minimum of 3" in warning and "seeds_below_minimum=true" in warning
    with pytest.raises(FileNotFoundError, match="no_such_layer"):
        compare.run_configs(dict(cfg, compare={"layer": "no_such_layer"}), conf)


def test_compare_baseline_executes_like_ours_and_reads_our_plan():
    """A named baseline takes ours' execution kwargs; a semantic scheduler on its side reads ours' plan."""
    from recipes import _serve_compare as compare

    conf = str(ROOT / "conf")
    ours = {"name": "semantic", "cls": "moelayers.SemanticMoE", "plan_path": "plan.npz", "plan_train_fraction": 0.25,
            "kwargs": {"mode": "dp", "dispatcher": "allgather", "dedup": False, "check_finite": False}}
    cfg = {"seed": 0, "layer": ours, "scheduler": "semantic", "compare": {"layer": "vanilla", "seeds": 1}}
    base = next(r for r in compare.run_configs(cfg, conf) if r["_side"] == "baseline")
    assert base["layer"]["kwargs"] == {"dispatcher": "allgather", "dedup": False, "check_finite": False}
    assert base["scheduler"] == {"name": "semantic", "plan_path": "plan.npz", "plan_train_fraction": 0.25}
    # an explicit baseline scheduler is kept; a dict baseline layer is taken as given
    cfg["compare"] = {"layer": {"name": "mine", "cls": "moelayers.VanillaMoE", "kwargs": {"dedup": True}},
                      "scheduler": "round_robin", "seeds": 1}
    base = next(r for r in compare.run_configs(cfg, conf) if r["_side"] == "baseline")
    assert base["layer"]["kwargs"] == {"dedup": True} and base["scheduler"] == "round_robin"
    cfg["compare"] = {"layer": "vanilla", "scheduler": {"name": "semantic", "plan_path": "other.npz"}, "seeds": 1}
    base = next(r for r in compare.run_configs(cfg, conf) if r["_side"] == "baseline")
    assert base["scheduler"] == {"name": "semantic", "plan_path": "other.npz", "plan_train_fraction": 0.25}
    # capacity mode is how the exchange runs (found by a sweep: the baseline ran exact, 18x fewer bytes)
    cfg = {"seed": 0, "layer": {"name": "vanilla", "cls": "moelayers.VanillaMoE", "kwargs": {"capacity": 64}},
           "scheduler": "round_robin", "compare": {"layer": "vanilla", "seeds": 1}}
    assert [r["layer"]["kwargs"]["capacity"] for r in compare.run_configs(cfg, conf)] == [64, 64]
    # ours' scheduler reads the plan settings; a named semantic baseline layer (its config's null
    # defaults) agrees with the pinned values instead of contradicting them
    from recipes._serve_workload import plan_train_fraction

    cfg = {"seed": 0, "layer": {"name": "vanilla", "cls": "moelayers.VanillaMoE"},
           "scheduler": {"name": "semantic", "plan_train_fraction": 0.3}, "compare": {"layer": "semantic", "seeds": 1}}
    assert [plan_train_fraction(r) for r in compare.run_configs(cfg, conf)] == [0.3, 0.3]


def test_compare_results_flag_fewer_than_three_seeds():
    """build_results: ``seeds_below_minimum`` and the warning follow the number of seeds run."""
    from recipes import _serve_compare as compare

    def run(side, seed):
        return {"side": side, "seed": seed, "layer": side, "router": "replay", "scheduler": "round_robin",
                "world_size": 2, "model": {}, "notes": [], "rank_loads": [1, 1], "requests_digest": str(seed),
                **{k: 1.0 for k in compare.MEDIAN_KEYS}}

    cfg = {"seed": 0, "compare": {"layer": "vanilla"}}
    for seeds, below in (([0, 1], True), ([0], True), ([0, 1, 2], False), ([0, 1, 2, 3], False)):
        res = compare.build_results([run(side, s) for s in seeds for side in compare.SIDES], cfg, 1.0,
                                    origin={"command": {"argv": ["serve.py"], "overrides": []}})
        assert res["seeds"] == seeds and res["seeds_below_minimum"] is below
        assert len(res["warnings"]) == below and res["command"]["argv"] == ["serve.py"]
    # a comparison cut short says so in both summaries, with the unserved requests (they were missing there)
    runs = [dict(run(side, s), truncated=(side, s) == ("baseline", 1), unserved_requests=float(s))
            for s in (0, 1, 2) for side in compare.SIDES]
    res = compare.build_results(runs, cfg, 1.0)
    assert res["truncated"] is False and res["baseline"]["truncated"] is True
    assert res["unserved_requests"] == res["baseline"]["unserved_requests"] == 1.0


def test_a_finite_value_beats_an_infinite_one():
    """A truncated run's unserved requests have an infinite TTFT: a side that served everyone was
    never counted better than such a baseline. NaN (no value) still counts for neither."""
    from recipes._serve_compare import _better

    inf, nan = float("inf"), float("nan")
    assert _better(0.05, inf, "lower") and not _better(inf, 0.05, "lower") and not _better(inf, inf, "lower")
    assert _better(inf, 1.0, "higher") and not _better(nan, 1.0, "lower") and not _better(1.0, nan, "higher")


@pytest.mark.timeout(60)
def test_a_baseline_side_config_error_names_the_compare_setting(tmp_path):
    """compare.layer=semantic without a plan fails in check_config on the baseline's side: the error
    names the compare block (it read like an error in our own layer=... setting), before any rank starts."""
    cmd = [sys.executable, str(SERVE), "parallel.world_size=2", "compare.layer=semantic", "compare.seeds=1",
           "progress=false", "plot=false", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0
    assert "ValueError: compare.layer / compare.scheduler (the baseline's side): layer=semantic" in proc.stderr
    assert not (tmp_path / "results.json").exists()
