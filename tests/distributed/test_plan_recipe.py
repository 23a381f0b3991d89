"""recipes/plan.py end to end on small synthetic traces: semantic / linear / eplb / gem, tp and dp, bad input.

Most cases call ``recipes.plan.run`` with the composed Hydra config (fast); two run the script as
a subprocess (``hydra.run.dir`` honoured, a failing run's exit status and message).
"""

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
TPS = 256  # trace.tokens_per_step of these tests
LAR_KEYS = ("planner", "ep", "mode", "lar", "lar_linear", "token_imbalance", "expert_imbalance", "a2a_bytes_ratio",
            "solve_seconds")
GEM_KEYS = ("score", "score_linear", "score_eplb", "score_gem", "gem_vs_linear", "gem_vs_eplb", "solve_seconds")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    """40 sequences of 64..256 tokens, 4 layers, 16 experts, top-2, vocabulary 500."""
    from moelayers.trace import save_trace, synthetic_trace

    path = tmp_path_factory.mktemp("trace") / "trace.npz"
    save_trace(synthetic_trace(40, 4, 16, 2, 500, seq_len=(64, 256), seed=0), path)
    return path


def config(run_dir: Path, trace: Path, *overrides: str) -> dict:
    """The composed conf/plan.yaml (as recipes/plan.py sees it) for ``trace``, written to ``run_dir``."""
    from hydra import compose, initialize_config_dir

    from recipes._common import to_dict

    base = [f"trace.path={trace}", f"trace.tokens_per_step={TPS}", "progress=false"]
    merged = {o.split("=", 1)[0]: o for o in [*base, *overrides]}  # later overrides win
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("plan", overrides=list(merged.values()))
    d = to_dict(cfg)
    d["run_dir"] = str(run_dir)
    return d


def run_plan(run_dir: Path, trace: Path, *overrides: str) -> tuple[dict, dict]:
    """``recipes.plan.run``; returns (report.json, assignment.npz arrays) as read back from ``run_dir``."""
    from recipes.plan import run

    run(config(run_dir, trace, *overrides))
    report = json.loads((run_dir / "report.json").read_text())
    with np.load(run_dir / "assignment.npz", allow_pickle=False) as a:
        return report, {k: a[k] for k in a.files}


def split(trace: Path, fraction: float):
    """(train, held-out) parts of the trace file, as the recipe splits it."""
    from moelayers.trace import load_trace

    return load_trace(trace).split(fraction)


def held_out(trace: Path, fraction: float = 0.5):
    return split(trace, fraction)[1]


def check_lar(report: dict, arrays: dict, trace: Path) -> None:
    """The report's LAR keys are recomputable from assignment.npz; its shapes are the held-out part's.

    The held-out part is the one named by assignment.npz's own ``train_fraction`` (which must be the
    configured one), and its scalar fields must be the run's settings."""
    from moelayers.planning.semantic_eval import lar_from_assignment

    frac = float(arrays["train_fraction"])
    assert frac == report["train_fraction"] == report["config"]["trace"]["train_fraction"]
    assert int(arrays["num_ranks"]) == report["ep"] == report["config"]["parallel"]["ep"]
    assert int(arrays["tokens_per_step"]) == report["tokens_per_step"] == TPS
    assert str(arrays["mode"]) == report["mode"] == report["config"]["mode"]
    held = held_out(trace, frac)
    assert arrays["expert_rank"].shape == (held.num_layers, held.num_experts)
    assert arrays["token_rank"].shape == (held.num_tokens, held.num_layers)
    np.testing.assert_array_equal(arrays["seq_offsets"], held.seq_offsets)
    assert lar_from_assignment(held, arrays["expert_rank"], arrays["token_rank"]) == pytest.approx(report["lar"], abs=1e-12)
    assert 0.0 <= report["lar"] <= 1.0 and 0.0 <= report["lar_linear"] <= 1.0
    check_traffic(report, arrays, held)


def traffic(held, expert_rank: np.ndarray, token_rank: np.ndarray, ranks: int) -> tuple[float, int, float]:
    """``(lar, de-duplicated remote sends, expert imbalance)`` of an assignment, counted token by token:
    a token is sent once to every *other* rank that holds at least one of its K experts; the expert
    imbalance is max / mean of the activations each rank receives, averaged over layers."""
    local, sends, imb = [], 0, []
    for layer in range(held.num_layers):
        where = expert_rank[layer][held.topk_ids[:, layer]]  # [T, K] rank of each activation
        mine = token_rank[:, layer]
        local.append((where == mine[:, None]).mean())
        sends += sum(len(set(row.tolist()) - {own}) for row, own in zip(where, mine.tolist()))
        got = np.bincount(where.ravel(), minlength=ranks)
        imb.append(got.max() / got.mean())
    return float(np.mean(local)), sends, float(np.mean(imb))


def check_traffic(report: dict, arrays: dict, held) -> None:
    """a2a_bytes_ratio, remote_ratio and expert_imbalance recomputed here, not just bounded: the
    reference is the linear placement (experts r*E/R.. on rank r) with the tokens spread evenly."""
    from moelayers.planning.semantic_eval import even_token_rank

    ranks, layers, experts = report["ep"], held.num_layers, held.num_experts
    even = even_token_rank(held, ranks, report["mode"], TPS)
    np.testing.assert_array_equal(arrays["token_rank_linear"], even)  # lar_linear's spread, saved beside it
    if report["planner"] != "semantic":  # no token scheduling: the planners' tokens are the even spread
        np.testing.assert_array_equal(arrays["token_rank"], np.repeat(even[:, None], layers, axis=1))
    linear = np.tile(np.arange(experts) // (experts // ranks), (layers, 1))
    lar, sends, imb = traffic(held, arrays["expert_rank"], arrays["token_rank"], ranks)
    lar_lin, sends_lin, _ = traffic(held, linear, np.repeat(even[:, None], layers, axis=1), ranks)
    assert report["lar"] == pytest.approx(lar, abs=1e-12) and report["lar_linear"] == pytest.approx(lar_lin, abs=1e-12)
    assert report["a2a_bytes_ratio"] == pytest.approx(sends / sends_lin, rel=1e-12)
    assert report["remote_ratio"] == pytest.approx((1 - lar) / (1 - lar_lin), rel=1e-12)
    assert report["expert_imbalance"] == pytest.approx(imb, rel=1e-12)


def one_layer(trace, layer: int):
    """Layer ``layer`` of ``trace`` alone (for per-layer scores)."""
    from moelayers.trace import RoutingTrace

    return RoutingTrace(trace.topk_ids[:, layer:layer + 1], trace.token_ids, trace.seq_offsets, trace.num_experts,
                        vocab_size=trace.vocab_size)


def check_scores(report: dict, arrays: dict, trace: Path, run_dir: Path) -> dict:
    """Every GEM key recomputed from assignment.npz and curves.npz (not only present): each saved
    placement's score on the held-out part (in total and layer by layer) and on the train part
    (gem.evaluate, steps of TPS tokens), and each reduction as 1 - score_x / score_y of those.
    Returns ``{planner: (held-out score, train score)}``."""
    from moelayers.planning.gem import LatencyCurves, evaluate

    curves = LatencyCurves.load(run_dir / "curves.npz")
    train, held = split(trace, float(arrays["train_fraction"]))
    got = {}
    for p in ("linear", "eplb", "gem", "semantic"):
        if f"expert_rank_{p}" not in arrays:
            assert f"score_{p}" not in report, p
            continue
        er = arrays[f"expert_rank_{p}"]
        got[p] = evaluate(held, er, curves, TPS), evaluate(train, er, curves, TPS)
        assert report[f"score_{p}"] == pytest.approx(got[p][0], rel=1e-12), p
        assert report[f"train_score_{p}"] == pytest.approx(got[p][1], rel=1e-12), p
        per_layer = [evaluate(one_layer(held, l), er[l:l + 1], curves, TPS) for l in range(held.num_layers)]
        assert report["per_layer"][p] == pytest.approx(per_layer, rel=1e-12), p
    assert set(report["per_layer"]) == set(got) >= {"linear", "eplb", "gem"}
    name = report["planner"]
    np.testing.assert_array_equal(arrays["expert_rank"], arrays[f"expert_rank_{name}"])
    assert report["score"] == pytest.approx(got[name][0], rel=1e-12)
    assert report["train_score"] == pytest.approx(got[name][1], rel=1e-12)
    held_s = {p: v[0] for p, v in got.items()}
    for key, (x, y) in {"gem_vs_linear": ("gem", "linear"), "gem_vs_eplb": ("gem", "eplb"),
                        "vs_linear": (name, "linear"), "vs_eplb": (name, "eplb")}.items():
        assert report[key] == pytest.approx(1 - held_s[x] / held_s[y], rel=1e-9, abs=1e-12), key
    assert report["train_gem_vs_linear"] == pytest.approx(1 - got["gem"][1] / got["linear"][1], rel=1e-9, abs=1e-12)
    return got


def check_tp_batches(token_rank: np.ndarray, ep: int) -> None:
    """Every full batch gives each rank exactly TPS / ep tokens per layer, the partial one within 1."""
    for start in range(0, token_rank.shape[0], TPS):
        batch = token_rank[start:start + TPS]
        for layer in range(batch.shape[1]):
            counts = np.bincount(batch[:, layer], minlength=ep)
            if batch.shape[0] == TPS:
                assert (counts == TPS // ep).all(), (start, layer, counts)
            else:
                assert counts.max() - counts.min() <= 1 and counts.sum() == batch.shape[0]


def check_dp_requests(token_rank: np.ndarray, offsets: np.ndarray, ep: int) -> np.ndarray:
    """Each sequence keeps one rank at every layer; no rank above 1.3 x the mean tokens. Returns ``[S]`` ranks."""
    req = token_rank[offsets[:-1], 0]
    assert (token_rank == np.repeat(req, np.diff(offsets))[:, None]).all()
    tokens = np.bincount(token_rank[:, 0], minlength=ep)
    assert tokens.max() <= 1.3 * tokens.mean()
    return req


@pytest.fixture(scope="module")
def semantic_runs(trace_file, tmp_path_factory) -> dict:
    """One semantic run per mode at EP4: ``{mode: (run_dir, report, arrays)}``."""
    out = {}
    for mode in ("tp", "dp"):
        run_dir = tmp_path_factory.mktemp(f"semantic_{mode}")
        out[mode] = (run_dir, *run_plan(run_dir, trace_file, "planner=semantic", "parallel.ep=4", f"mode={mode}"))
    return out


# ------------------------------------------------------------------------------------ semantic
@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_semantic_report_and_assignment(semantic_runs, trace_file, mode):
    from moelayers.planning.semantic import SemanticPlan

    run_dir, report, arrays = semantic_runs[mode]
    assert not [k for k in LAR_KEYS + GEM_KEYS if k not in report]
    assert (report["planner"], report["ep"], report["mode"]) == ("semantic", 4, mode)
    assert report["predictor"] == ("combined" if mode == "tp" else None)  # the one that ran
    check_lar(report, arrays, trace_file)
    assert report["lar"] > report["lar_linear"]  # co-clustering beats linear on a clustered trace
    assert report["a2a_bytes_ratio"] < 1.0 and report["remote_ratio"] < 1.0
    check_scores(report, arrays, trace_file, run_dir)  # the chosen planner (semantic) is not gem here
    plan = SemanticPlan.load(run_dir / "plan.npz")
    assert plan.mode == mode and plan.num_ranks == 4
    np.testing.assert_array_equal(plan.expert_rank, arrays["expert_rank"])
    if mode == "tp":
        check_tp_batches(arrays["token_rank"], 4)
        assert report["token_imbalance"] == pytest.approx(1.0, abs=4 / arrays["token_rank"].shape[0])
        assert report["dp_schedule"] is None
    else:
        check_dp_requests(arrays["token_rank"], arrays["seq_offsets"], 4)
        assert report["dp_schedule"] == "greedy"
    assert report["max_ratio_exceeded"] is False


def test_dp_schedule_setting():
    import recipes.plan as recipe

    assert recipe.dp_schedule({}) == "greedy" and recipe.dp_schedule({"dp_schedule": "joint"}) == "joint"


def test_semantic_dp_schedule_joint(semantic_runs, trace_file, tmp_path):
    """planner.dp_schedule=joint gives each mask cycle of held-out requests its ranks together
    (``assign_dp(joint=True)``) from the run's plan file: every cycle still covers the ranks, and the
    schedule differs from the default one by one (Algorithm 2 as published, ``assign_dp``)."""
    from moelayers.planning.semantic import SemanticPlan
    from moelayers.planning.semantic_eval import assign_dp
    from moelayers.trace import load_trace

    run_dir, default, default_arrays = semantic_runs["dp"]
    report, arrays = run_plan(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=4", "mode=dp",
                              f"plan.path={run_dir / 'plan.npz'}", "planner.dp_schedule=joint")
    assert report["dp_schedule"] == "joint"
    req = check_dp_requests(arrays["token_rank"], arrays["seq_offsets"], 4)
    # every mask cycle covers the ranks (here the 1.3x cap never sends a cycle back to one by one)
    assert all(sorted(req[s:s + 4]) == [0, 1, 2, 3] for s in range(0, req.size - req.size % 4, 4))
    held = load_trace(trace_file).split(0.5)[1]
    plan = SemanticPlan.load(run_dir / "plan.npz")
    np.testing.assert_array_equal(arrays["token_rank"], assign_dp(plan, held, joint=True))
    np.testing.assert_array_equal(default_arrays["token_rank"], assign_dp(plan, held))
    assert (arrays["token_rank"] != default_arrays["token_rank"]).any()
    check_lar(report, arrays, trace_file)


@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_semantic_ranks_ignore_the_routing_they_place(semantic_runs, trace_file, tmp_path, mode):
    """tp: a token's rank at layer l never reads layer l's routing (here: the last layer's); dp: a
    request's rank comes from its token ids alone (here: every held-out layer re-routed)."""
    from moelayers.trace import load_trace, save_trace

    trace = load_trace(trace_file)
    first = int(trace.seq_offsets[trace.num_sequences // 2])  # held-out tokens start here
    layers = slice(trace.num_layers - 1, None) if mode == "tp" else slice(None)
    trace.topk_ids[first:, layers] = (trace.topk_ids[first:, layers] + 5) % trace.num_experts
    changed = tmp_path / "rerouted.npz"
    save_trace(trace, changed)
    report, arrays = run_plan(tmp_path / "run", changed, "planner=semantic", "parallel.ep=4", f"mode={mode}")
    np.testing.assert_array_equal(arrays["token_rank"], semantic_runs[mode][2]["token_rank"])
    check_lar(report, arrays, changed)


def test_semantic_plan_file_is_evaluated(semantic_runs, trace_file, tmp_path):
    """plan.path= re-evaluates a saved plan: same assignment and LAR, no solving."""
    run_dir, report, arrays = semantic_runs["tp"]
    again, arrays2 = run_plan(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=4", "mode=tp",
                              f"plan.path={run_dir / 'plan.npz'}")
    assert again["lar"] == report["lar"] and again["solve_seconds"] == 0.0 and again["plan"] == str(run_dir / "plan.npz")
    np.testing.assert_array_equal(arrays2["token_rank"], arrays["token_rank"])
    assert again["in_sample_sequences"] == report["in_sample_sequences"] == 0 and not again["warnings"]


def test_semantic_plan_file_on_its_own_training_sequences_is_flagged(semantic_runs, trace_file, tmp_path):
    """A plan file evaluated with a smaller train fraction holds sequences it was trained on in the
    held-out part: the report counts them and warns (it reported the in-sample LAR as held-out)."""
    run_dir, report, _ = semantic_runs["tp"]
    again, _ = run_plan(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=4", "mode=tp",
                        f"plan.path={run_dir / 'plan.npz'}", "trace.train_fraction=0.25")
    trained = split(trace_file, 0.5)[0].num_sequences - split(trace_file, 0.25)[0].num_sequences
    assert again["in_sample_sequences"] == trained > 0
    assert any(f"{trained} of {again['held_out_sequences']} held-out sequences" in w for w in again["warnings"])


@pytest.mark.timeout(150)
def test_script_refuses_the_synthetic_shape_with_a_trace_file(trace_file, tmp_path):
    """trace.num_experts=... with trace.path=... was ignored silently (and recorded in the report)."""
    out = tmp_path / "out"
    proc = run_script(tmp_path, f"trace.path={trace_file}", "trace.num_experts=32", "trace.seq_len=[8,16]",
                      f"hydra.run.dir={out}")
    assert proc.returncode != 0
    assert "trace.num_experts=32, trace.seq_len=[8,16] shape(s) the synthetic trace" in proc.stderr, proc.stderr[-2000:]


def test_semantic_deterministic_for_a_seed(trace_file, tmp_path):
    runs = [run_plan(tmp_path / f"run{i}", trace_file, "planner=semantic", "planner.solver=cem", "parallel.ep=2",
                     "seed=3")[1] for i in range(2)]
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        np.testing.assert_array_equal(runs[0][key], runs[1][key], err_msg=key)


# ------------------------------------------------------------------------------------ baselines
@pytest.mark.parametrize("planner", ["linear", "eplb"])
@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_baseline_planners_spread_tokens_evenly(trace_file, tmp_path, planner, mode):
    report, arrays = run_plan(tmp_path / "run", trace_file, f"planner={planner}", "parallel.ep=2", f"mode={mode}")
    assert not [k for k in LAR_KEYS + GEM_KEYS if k not in report]
    assert (report["planner"], report["ep"], report["mode"]) == (planner, 2, mode)
    check_lar(report, arrays, trace_file)
    assert (np.bincount(arrays["expert_rank"][0], minlength=2) == 8).all()
    tr = arrays["token_rank"]
    assert (tr == tr[:, :1]).all()  # no plan: the same spread at every layer
    if mode == "tp":
        check_tp_batches(tr, 2)
        np.testing.assert_array_equal(tr[:TPS, 0], np.arange(TPS) // (TPS // 2))  # a batch in 2 chunks in file order
    else:
        req = check_dp_requests(tr, arrays["seq_offsets"], 2)
        np.testing.assert_array_equal(req, np.arange(req.size) % 2)  # round robin in file order
    if planner == "linear":
        assert report["lar"] == report["lar_linear"] and report["a2a_bytes_ratio"] == 1.0
    else:  # EPLB of the train loads, re-planned here (not the linear placement)
        from moelayers.planning.eplb import plan_eplb

        want = np.stack([plan_eplb(l, 2) for l in train_loads(trace_file, arrays)])
        np.testing.assert_array_equal(arrays["expert_rank"], want)
        assert (want != np.arange(16) // 8).any()


def held_out_loads(trace: Path, arrays: dict) -> np.ndarray:
    """``[L, steps, E]`` expert loads of the held-out part in steps of TPS tokens."""
    from moelayers.planning.steps import trace_step_loads

    return trace_step_loads(split(trace, float(arrays["train_fraction"]))[1], TPS)


def train_loads(trace: Path, arrays: dict) -> np.ndarray:
    """``[L, steps, E]`` expert loads of the train part in steps of TPS tokens (what the planners see)."""
    from moelayers.planning.steps import trace_step_loads

    return trace_step_loads(split(trace, float(arrays["train_fraction"]))[0], TPS)


def test_gem_keeps_its_scores(trace_file, tmp_path):
    report, arrays = run_plan(tmp_path / "run", trace_file, "planner=gem", "parallel.ep=4", "variability=high")
    assert not [k for k in LAR_KEYS + GEM_KEYS if k not in report]
    assert report["planner"] == "gem" and report["score"] == report["score_gem"]
    scores = check_scores(report, arrays, trace_file, tmp_path / "run")
    # the baselines are what they claim, not the linear placement in disguise: linear by formula,
    # EPLB re-planned here on the train loads, and GEM beating linear on strongly varying GPUs
    from moelayers.planning.eplb import plan_eplb

    np.testing.assert_array_equal(arrays["expert_rank_linear"], np.tile(np.arange(16) // 4, (4, 1)))
    loads = train_loads(trace_file, arrays)
    np.testing.assert_array_equal(arrays["expert_rank_eplb"], np.stack([plan_eplb(l, 4) for l in loads]))
    assert scores["gem"][1] < scores["linear"][1] and scores["gem"][0] < scores["linear"][0]
    assert report["gem_vs_linear"] > 0 and report["train_gem_vs_linear"] > 0
    check_lar(report, arrays, trace_file)
    assert not (tmp_path / "run" / "plan.npz").exists()
    assert report["train_steps"] >= 8 and report["held_out_steps"] >= 8 and report["warnings"] == []
    assert report["curves_sampled_up_to"] is None  # the preset's tiled curves: exact at any row count
    from moelayers.planning.steps import rank_rows  # the busiest rank-step under any saved placement

    peak = max(int(rank_rows(arrays[f"expert_rank_{p}"][l], part[l], 4).max()) for p in ("linear", "eplb", "gem")
               for part in (train_loads(trace_file, arrays), held_out_loads(trace_file, arrays)) for l in range(4))
    assert report["max_rank_rows"] == peak


def test_few_steps_are_warned_about():
    """A trace of one or two steps per part (a short recorded trace at the default 2048 tokens per
    step) gave GEM scores without a word; the report's warnings (printed too) say they rest on too
    few steps, naming the parts."""
    from recipes.plan import MIN_STEPS, run_warnings

    base = {"train_steps": MIN_STEPS, "held_out_steps": MIN_STEPS, "tokens_per_step": 2048,
            "max_ratio_exceeded": False, "token_imbalance": 1.0, "max_rank_rows": 3000, "curves_sampled_up_to": None}
    assert run_warnings(base) == []
    (few,) = run_warnings(dict(base, train_steps=1, held_out_steps=1))
    assert few.startswith("only 1 train and 1 held-out step(s) of trace.tokens_per_step=2048 tokens (fewer than 8)")
    (few,) = run_warnings(dict(base, held_out_steps=3))
    assert few.startswith("only 3 held-out step(s)")
    assert run_warnings(dict(base, curves_sampled_up_to=3000)) == []
    (beyond,) = run_warnings(dict(base, curves_sampled_up_to=128))  # profiled to 128 rows, read at 3000
    from moelayers.planning.gem import LatencyCurves

    assert LatencyCurves(np.array([0, 64, 128]), np.array([[1e-5, 2e-5, 3e-5]])).sampled_up_to == 128
    assert LatencyCurves.preset("high", 2).sampled_up_to is None
    assert beyond.startswith("a rank computes up to 3000 rows in a step, beyond the latency curves' last sample (128")
    capped = run_warnings(dict(base, max_ratio_exceeded=True, token_imbalance=1.41))
    assert capped == ["a rank holds more than 1.3 x the mean held-out tokens (token imbalance 1.410): no schedule "
                      "of these requests in file order stays within it"]


# ------------------------------------------------------------------------------------ the script
def run_script(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "recipes" / "plan.py"), "progress=false", f"trace.tokens_per_step={TPS}",
           *overrides]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_script_honours_run_dir(trace_file, tmp_path):
    out = tmp_path / "out"
    proc = run_script(tmp_path, f"trace.path={trace_file}", "planner=semantic", "mode=dp", "parallel.ep=2",
                      f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the outputs only: no .hydra/, no plan.log; report.json records the config and the command
    assert {"report.json", "assignment.npz", "plan.npz", "curves.npz", "plan.png"} == {p.name for p in out.iterdir()}
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "dp" and report["config"]["parallel"]["ep"] == 2
    assert report["command"]["overrides"] == ["progress=false", f"trace.tokens_per_step={TPS}",
                                              f"trace.path={trace_file}", "planner=semantic", "mode=dp",
                                              "parallel.ep=2"]
    check_provenance(report["provenance"], {"trace.path": trace_file})
    assert_documented(report, "plan.py")
    with np.load(out / "assignment.npz") as z, np.load(out / "plan.npz") as p, np.load(out / "curves.npz") as c:
        assert_documented({k: None for k in [*z.files, *p.files, *c.files]}, "plan.py")
    assert "lar" in proc.stdout and str(out / "report.json") in proc.stdout
    # the chosen planner's score rows, then the GEM planner's, labelled as a reference (they read as ours)
    assert "semantic score reduction vs linear" in proc.stdout, proc.stdout
    assert "gem score reduction vs linear, reference" in proc.stdout, proc.stdout


@pytest.mark.timeout(150)
def test_script_bad_trace_fails_cleanly(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, topk_ids=np.zeros((4, 1, 2), np.int64), token_ids=np.zeros(4, np.int64), num_experts=np.int64(4))
    out = tmp_path / "out"
    proc = run_script(tmp_path, f"trace.path={bad}", "planner=semantic", f"hydra.run.dir={out}")
    assert proc.returncode != 0
    assert "seq_offsets" in proc.stderr and str(bad) in proc.stderr
    assert not out.exists() or not list(out.iterdir())  # nothing at all: no report, no .hydra/, no plan.log


# ------------------------------------------------------------------------------------ bad input
def write_bad_trace(trace: Path, path: Path, **changes) -> Path:
    """``trace``'s arrays with ``changes`` (a value of None drops the key), written without validation."""
    with np.load(trace, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    for key, value in changes.items():
        if value is None:
            arrays.pop(key)
        else:
            arrays[key] = value(arrays[key]) if callable(value) else value
    np.savez(path, **arrays)
    return path


def other_plan(tmp_path: Path, *, num_experts: int, ep: int, vocab: int = 500, mode: str = "tp") -> Path:
    """A semantic plan for a 4-layer trace of ``num_experts`` experts and vocabulary ``vocab`` at ``ep`` ranks."""
    from moelayers.planning.semantic_solvers import plan_semantic
    from moelayers.trace import synthetic_trace

    path = tmp_path / f"plan_e{num_experts}_ep{ep}_v{vocab}_{mode}.npz"
    trace = synthetic_trace(8, 4, num_experts, 2, vocab, seq_len=64, seed=1)
    plan_semantic(trace, ep, mode, progress=False).save(path)
    return path


def expect_failure(trace_file: Path, tmp_path: Path, bad: dict, match: str, *overrides: str,
                   exc: type[Exception] = ValueError) -> None:
    from recipes.plan import run

    trace = write_bad_trace(trace_file, tmp_path / "bad.npz", **bad) if bad else trace_file
    run_dir = tmp_path / "run"
    with pytest.raises(exc, match=match):
        run(config(run_dir, trace, "planner=semantic", "parallel.ep=4", *overrides))
    assert not (run_dir / "report.json").exists() and not (run_dir / "plan.npz").exists()
    assert not (run_dir / "assignment.npz").exists()


@pytest.mark.parametrize("case", ["missing_key", "expert_out_of_range", "token_too_large", "token_negative"])
def test_bad_trace_is_a_clear_error(trace_file, tmp_path, case):
    bad, match = {
        "missing_key": ({"seq_offsets": None}, r"bad\.npz: missing key\(s\) \['seq_offsets'\]"),
        "expert_out_of_range": ({"topk_ids": lambda a: np.where(np.arange(a.size).reshape(a.shape) == 7, 16, a)},
                                r"bad\.npz: field 'topk_ids' has expert ids out of range \[0, 16\): found 16"),
        "token_too_large": ({"token_ids": lambda a: np.where(np.arange(a.size) == 3, 500, a)},
                            r"bad\.npz: field 'token_ids' has token ids \(vocab_size\) out of range \[0, 500\)"),
        "token_negative": ({"token_ids": lambda a: np.where(np.arange(a.size) == 3, -1, a)},
                           r"bad\.npz: field 'token_ids' has token ids \(vocab_size\) out of range.*found -1"),
    }[case]
    expect_failure(trace_file, tmp_path, bad, match)


@pytest.mark.parametrize("experts, ep, vocab, mode, match", [
    (8, 4, 500, "tp", r"{plan}: semantic plan field 'num_experts' is 8"),
    (16, 2, 500, "tp", r"{plan}: semantic plan field 'num_ranks' is 2"),
    (16, 4, 500, "dp", r"{plan}: semantic plan field 'mode' is 'dp', but mode=tp"),
    (16, 4, 200, "tp", r"{trace}: field 'token_ids' has token id \d+, outside \[0, vocab_size=200\) of the semantic plan"),
])
def test_plan_for_another_setup_is_a_clear_error(trace_file, tmp_path, experts, ep, vocab, mode, match):
    path = other_plan(tmp_path, num_experts=experts, ep=ep, vocab=vocab, mode=mode)
    expect_failure(trace_file, tmp_path, {}, match.format(plan=path.name, trace=trace_file.name), f"plan.path={path}")


def test_bad_embeddings_is_a_clear_error(trace_file, tmp_path):
    emb = tmp_path / "emb.npy"
    np.save(emb, np.zeros((499, 8), np.float32))
    expect_failure(trace_file, tmp_path, {}, r"emb\.npy: planner\.embeddings must be a float \[V=500, D\] array",
                   f"planner.embeddings={emb}")
    nan = np.zeros((500, 8), np.float32)
    nan[[3, 70]] = np.nan  # (named neither the file nor the setting: planfuzz25)
    np.save(emb, nan)
    expect_failure(trace_file, tmp_path, {}, r"emb\.npy: planner\.embeddings has NaN/inf values in 2 row\(s\) "
                   r"\(token ids \[3, 70\]\)", f"planner.embeddings={emb}")


def test_config_errors(trace_file, tmp_path):
    expect_failure(trace_file, tmp_path, {}, r"field 'num_experts' \(16\) must be divisible by parallel\.ep \(3\)",
                   "parallel.ep=3", "mode=dp")
    expect_failure(trace_file, tmp_path, {}, r"trace\.tokens_per_step \(256\) must be divisible by parallel\.ep \(3\)",
                   "parallel.ep=3")
    expect_failure(trace_file, tmp_path, {}, "mode must be one of", "mode=ep")
    from recipes.plan import check_config  # a synthetic trace's shape: both mistakes at once, before it is drawn

    synthetic = config(tmp_path / "run", trace_file, "planner=gem", "parallel.ep=3")
    del synthetic["trace"]["path"]
    with pytest.raises(ValueError, match=r"trace\.tokens_per_step \(256\) must be divisible by parallel\.ep \(3\) in "
                                         r"mode=tp: .*\(e\.g\. trace\.tokens_per_step=255\); trace\.num_experts \(64\) of the "
                                         r"synthetic trace must be divisible by parallel\.ep \(3\) \(e\.g\. "
                                         r"trace\.num_experts=63\)$"):
        check_config(synthetic)
    expect_failure(trace_file, tmp_path, {}, r"parallel\.ep must be an integer >= 1, got 2\.7", "parallel.ep=2.7")
    expect_failure(trace_file, tmp_path, {}, r"trace\.tokens_per_step must be an integer >= 1, got 64\.9",
                   "trace.tokens_per_step=64.9")
    expect_failure(trace_file, tmp_path, {}, "plan.path is a semantic plan file", "planner=eplb", "plan.path=x.npz")
    for bad in ("null", "half", "1.5"):  # null and 'half' used to crash in float() without naming the key
        expect_failure(trace_file, tmp_path, {}, r"trace\.train_fraction must be a number in \(0, 1\)",
                       f"trace.train_fraction={bad}")
    expect_failure(trace_file, tmp_path, {}, "nope.npz: routing trace file not found",
                   f"trace.path={tmp_path / 'nope.npz'}", exc=FileNotFoundError)


@pytest.mark.parametrize("override, match", [
    ("planner.slack=nan", r"planner\.slack must be a finite number >= 1.*got nan"),  # used to lift the load cap
    ("planner.beta=nan", r"planner\.beta must be a finite number >= 1.*got nan"),
    ("planner.sample=0", r"planner\.sample must be an integer >= 1.*got 0"),
    ("planner.history=-1", r"planner\.history must be an integer >= 0.*got -1"),
    ("planner.rho=0", r"planner\.rho must be a number in \(0, 1\].*got 0"),
    ("planner.dp_schedule=best", r"planner\.dp_schedule must be one of \['joint', 'greedy'\], got 'best'"),
    # failed in assign_tp after the whole solve, or (mode=dp) was ignored
    ("planner.predictor=foo", r"planner\.predictor must be one of \['combined', 'alg3', 'token'\], got 'foo'"),
])
def test_bad_semantic_settings_fail_before_planning(trace_file, tmp_path, monkeypatch, override, match):
    """A bad solver setting is refused by the config check, naming its key, before the trace is read."""
    import recipes.plan as recipe

    monkeypatch.setattr(recipe, "load_plan_trace", lambda d: pytest.fail("the trace was read"))
    expect_failure(trace_file, tmp_path, {}, match, override)


@pytest.mark.parametrize("overrides, refused", [
    (["mode=dp", "planner.predictor=alg3"], r"planner\.predictor=alg3 \(mode=dp\)"),
    (["mode=dp", "planner.history=4", "planner.smoothing=1"],
     r"planner\.history=4 \(mode=dp\), planner\.smoothing=1 \(mode=dp\)"),
    (["mode=tp", "planner.dp_schedule=joint"], r"planner\.dp_schedule=joint \(mode=tp\)"),
    (["planner.rho=0.3"], r"planner\.rho=0\.3 \(planner\.solver is not cem\)"),
    (["plan.path=plan.npz", "planner.theta=0.2"], r"planner\.theta=0\.2 \(plan\.path: the file's plan is evaluated"),
    (["mode=tp", "planner.solver=cem", "planner.rho=0.3", "planner.history=4"], None),
    (["mode=dp", "plan.path=plan.npz", "planner.dp_schedule=joint"], None),
])
def test_semantic_settings_the_run_would_ignore_are_refused(trace_file, tmp_path, monkeypatch, overrides, refused):
    """A semantic setting this run does not read (tp-only in dp mode and the other way round, rho
    without the cem solver, the solver's settings with plan.path) was ignored silently (planfuzz25);
    it is refused, before the trace is read, naming each override and why."""
    import recipes._common as common
    import recipes.plan as recipe

    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": overrides})  # as Hydra's command line
    monkeypatch.setattr(recipe, "load_plan_trace", lambda d: pytest.fail("the trace was read"))
    d = config(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=4", *overrides)
    if refused is None:
        mode = d["mode"]
        assert recipe.ignored_semantic_settings(d["planner"], mode, bool((d.get("plan") or {}).get("path"))) == []
        return
    with pytest.raises(ValueError, match=refused + ".*this run would ignore them"):
        recipe.run(d)
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize("override, match", [
    ("planner.restarts=2.5", r"planner\.restarts must be an integer >= 1, got 2\.5"),  # planned with 2
    ("planner.restarts=true", r"planner\.restarts must be an integer >= 1, got True"),  # planned with 1
    ("planner.method=exact", r"planner\.method must be one of \['plain', 'robust'\], got 'exact'"),
    ("seed=1.5", r"seed must be an integer >= 0, got 1\.5"),  # planned with seed 1
])
def test_bad_gem_settings_fail_before_planning(trace_file, tmp_path, monkeypatch, override, match):
    import recipes.plan as recipe

    monkeypatch.setattr(recipe, "load_plan_trace", lambda d: pytest.fail("the trace was read"))
    expect_failure(trace_file, tmp_path, {}, match, "planner=gem", override)


def test_a_reused_run_dir_holds_one_run(trace_file, tmp_path):
    """A gem run into the dir of a semantic run removes the semantic plan it does not write."""
    run_plan(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=2")
    assert (tmp_path / "run" / "plan.npz").exists()
    report, _ = run_plan(tmp_path / "run", trace_file, "planner=gem", "parallel.ep=2")
    assert report["planner"] == "gem" and not (tmp_path / "run" / "plan.npz").exists()
    assert {p.name for p in (tmp_path / "run").iterdir()} >= {"report.json", "assignment.npz", "curves.npz", "plan.png"}
    run_plan(tmp_path / "run", trace_file, "planner=gem", "parallel.ep=2", "plot=false")  # no plot, the old one gone
    assert {p.name for p in (tmp_path / "run").iterdir()} == {"report.json", "assignment.npz", "curves.npz"}


def test_a_failed_write_leaves_nothing(trace_file, tmp_path, monkeypatch):
    import recipes.plan as recipe

    def boom(path, obj):
        raise OSError("disk full")

    monkeypatch.setattr(recipe, "write_json", boom)
    expect_failure(trace_file, tmp_path, {}, "disk full", exc=OSError)
    assert not list((tmp_path / "run").iterdir())  # no temporary files left either


@pytest.mark.parametrize("override, match", [
    ({"num_sequences": 4.9}, r"the synthetic trace's num_sequences must be an integer, got 4\.9"),  # was 4
    ({"top_k": 2.5}, r"the synthetic trace's top_k must be an integer, got 2\.5"),  # was 2
    ({"seq_len": [8.9, 8.9]}, r"seq_len must be an int >= 1 or a \(lo, hi\) pair"),  # was [8, 8]
    ({"seq_len": 0}, r"seq_len must be an int >= 1 or a \(lo, hi\) pair.*got 0"),  # was the default [256, 2048]
    ({"seq_len": []}, r"seq_len must be an int >= 1 or a \(lo, hi\) pair"),
])
def test_synthetic_trace_settings_are_not_truncated_or_replaced(override, match):
    from recipes.plan import load_plan_trace

    tc = dict(path=None, synthetic=True, num_sequences=4, num_layers=1, num_experts=8, top_k=2, vocab_size=100,
              seq_len=[8, 8])
    assert load_plan_trace({"trace": tc, "seed": 0}).num_sequences == 4
    with pytest.raises(ValueError, match=match):
        load_plan_trace({"trace": {**tc, **override}, "seed": 0})
    tc["num_sequences"] = np.int64(3)  # a numpy integer is an integer
    assert load_plan_trace({"trace": tc, "seed": 0}).num_sequences == 3


@pytest.mark.parametrize("overrides, swept, refused", [
    (["mode=dp", "++planner.history=4"], {"mode"}, None),  # -m mode=tp,dp: the tp job reads it
    (["mode=tp", "++planner.dp_schedule=joint"], {"mode"}, None),
    (["++planner.rho=0.3"], {"planner.solver"}, None),  # -m planner.solver=alternating,cem
    (["mode=dp", "++planner.history=4"], {"seed"}, r"\+\+planner\.history=4 \(mode=dp\)"),  # no job reads it
    (["mode=dp", "planner.history=4"], {"mode"}, r"planner\.history=4 \(mode=dp\)"),  # ++ marks a sweep's key
    (["++planner.rho=0.3"], {"mode"}, r"planner\.rho=0\.3 \(planner\.solver is not cem\)"),  # every job ignores it
])
def test_a_sweep_over_what_decides_a_semantic_setting_lets_plus_plus_through(trace_file, tmp_path, monkeypatch,
                                                                           overrides, swept, refused):
    """A review found `plan.py -m mode=tp,dp ++planner.history=4` refused on its dp job (README: ++KEY
    passes in a -m sweep whose other jobs read it); a key no job of the sweep reads is still refused."""
    import re

    import recipes._common as common
    import recipes.plan as recipe

    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": overrides})
    monkeypatch.setattr(recipe, "in_sweep", lambda key: key in swept, raising=False)
    d = config(tmp_path / "run", trace_file, "planner=semantic", "parallel.ep=4", *overrides)
    ignored = recipe.ignored_semantic_settings(d["planner"], d["mode"], False)
    if refused is None:
        assert ignored == []
    else:
        assert len(ignored) == 1 and re.search(refused, ignored[0]), ignored
