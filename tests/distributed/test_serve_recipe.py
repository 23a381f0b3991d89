"""recipes/serve.py end to end (2 gloo processes), and the tiny model's attention-DP + expert-parallel
step against a single process."""

import hashlib
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed
from tests.unit.test_outputs_doc import assert_documented
from tests.unit.test_provenance import check_provenance

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "recipes" / "serve.py"
KEYS = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p90_s", "lar", "imbalance",
        "world_size", "layer", "config")


def _model(groups):
    from moelayers.models import TinyConfig, TinyDecoder

    moe = ml.MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2, params_dtype=torch.float64,
                       init_std=0.2)
    cfg = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, dtype=torch.float64, init_std=0.2)
    return TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, groups, seed=10 + i), seed=5)


def _requests():
    g = torch.Generator().manual_seed(0)
    return {name: torch.randint(0, 64, (n,), generator=g) for name, n in (("a", 6), ("b", 3), ("c", 5), ("d", 1))}


def _dp_step_worker(rank, world):
    """Rank 0 serves a and b, rank 1 serves c then nothing (0-token MoE calls), then d."""
    model, req = _model(ml.ParallelGroups.from_world()), _requests()
    plan = {0: [[("a", req["a"]), ("b", req["b"])], [("a", req["c"][:1])], [("b", req["d"])]],
            1: [[("c", req["c"])], [], [("c", req["d"])]]}[rank]
    with torch.no_grad():
        return [{k: v.clone() for k, v in model.step(batch).items()} for batch in plan]


@pytest.mark.timeout(120)
def test_dp_attention_ep_moe_step_matches_single_process():
    got = run_distributed(_dp_step_worker, 2)
    model, req = _model(ml.ParallelGroups.single()), _requests()
    with torch.no_grad():
        for rank, reqs in ((0, [("a", req["a"]), ("b", req["b"])]), (1, [("c", req["c"])])):
            want = model.step(reqs)
            assert set(got[rank][0]) == {rid for rid, _ in reqs}
            for rid, _ in reqs:  # every request of the batch, not just the first
                assert torch.allclose(want[rid], got[rank][0][rid], rtol=0, atol=1e-10), (rank, rid)
        ref = model.step([("a", req["c"][:1]), ("b", req["d"]), ("c", req["d"])])
    assert got[1][1] == {}
    torch.testing.assert_close(got[0][1]["a"], ref["a"], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[0][2]["b"], ref["b"], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1][2]["c"], ref["c"], rtol=0, atol=1e-10)


def _run_serve(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """recipes/serve.py on 2 gloo processes, writing into ``run_dir``."""
    cmd = [sys.executable, str(SERVE), "parallel.world_size=2", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)


def _serve(run_dir: Path, *overrides: str) -> dict:
    proc = _run_serve(run_dir, *overrides)
    assert proc.returncode == 0, f"serve failed:\n{proc.stdout}\n{proc.stderr}"
    assert "throughput" in proc.stdout and "LAR" in proc.stdout  # the summary table
    assert (run_dir / "rank_load.png").stat().st_size > 1000
    # the run dir holds the recipe's outputs only (no .hydra/, no serve.log): results.json records
    # the config and the command itself
    assert {p.name for p in run_dir.iterdir()} == {"results.json", "rank_load.png"}
    res = json.loads((run_dir / "results.json").read_text())
    assert res["command"]["overrides"] == ["parallel.world_size=2", *overrides]
    assert_documented(res, "serve.py: `results.json` (single")
    for key in KEYS:
        assert key in res, key
    assert res["world_size"] == 2 and res["layer"] == "vanilla"
    assert res["throughput_tok_s"] > 0 and res["output_tokens"] > 0
    assert 0 <= res["ttft_p50_s"] <= res["ttft_p99_s"] and res["tpot_mean_s"] > 0 and res["tpot_p90_s"] > 0
    assert 0.0 <= res["lar"] <= 1.0 and res["imbalance"] >= 1.0
    assert len(res["rank_load_per_step"]) == res["steps"] > 0
    assert all(len(row) == 2 for row in res["rank_load_per_step"])
    return res


@pytest.mark.timeout(90)
def test_serve_default(tmp_path):
    res = _serve(tmp_path / "run", "workload.num_requests=8")
    assert res["num_requests"] == 8 and res["config"]["workload"]["num_requests"] == 8
    assert res["router"] == "learned" and res["scheduler"] == "round_robin"
    assert sorted(q["rank"] for q in res["requests"]) == [0] * 4 + [1] * 4  # round robin
    assert all(q["generated_tokens"] > 0 and q["ttft_s"] >= 0 for q in res["requests"])
    assert res["output_tokens"] == sum(q["generated_tokens"] for q in res["requests"])
    assert all(q["generated_tokens"] == q["output_len"] and q["finish_s"] == q["last_token_s"] >= q["arrival_s"]
               for q in res["requests"])  # (every request of this run finished)
    out = res["config"]["workload"]["output_len"]
    assert all(out["min"] <= q["output_len"] <= out["max"] for q in res["requests"])


@pytest.mark.timeout(90)
def test_serve_reads_off_and_no_as_false(tmp_path):
    """Hydra passes ``plot=off`` as the string 'off' (truthy in Python): it means false, for the
    recipe's own switches and the layer's; a value that is not on/off is refused before any rank.
    (``per_request=no``: results.json without the per-request records, the summary all there.)"""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("compare.png", "rank_load.png", "results.json"):  # a reused run dir: an earlier run's files
        (run / name).write_text("stale")
    (run / "notes.txt").write_text("mine")  # not a serve output: kept
    proc = _run_serve(run, "workload.num_requests=4", "progress=off", "plot=no", "layer.kwargs.dedup=off", "per_request=no")
    assert proc.returncode == 0, proc.stderr
    assert "serve vanilla x2" not in proc.stderr  # no progress bar
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "results.json"]  # no plot, no stale plots
    res = json.loads((run / "results.json").read_text())
    assert res["config"]["layer"]["kwargs"]["dedup"] is False and res["config"]["plot"] is False
    assert res["config"]["per_request"] is False and "requests" not in res
    assert res["num_requests"] == res["finished_requests"] == 4 and res["output_tokens"] > 0
    proc = _serve_fails(tmp_path / "bad", "plot=sometimes")
    assert "plot must be true or false" in proc.stderr
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").iterdir())


def test_flag_reads_on_off_settings():
    from recipes._common import flag, normalize_flags

    for value, want in ((True, True), ("off", False), ("No", False), ("ON", True), ("1", True), (0, False), (None, None)):
        assert flag({"k": value}, "k", None) is want, value
    for value in ("maybe", 2, 0.5, ["x"]):
        with pytest.raises(ValueError, match="k must be true or false"):
            flag({"k": value}, "k", True)
    d = {"bench": {"profile": "off", "check": {"strict": "yes"}}, "layer": None}
    normalize_flags(d, ("bench.profile", "bench.check.strict", "bench.missing", "layer.kwargs.dedup"))
    assert d == {"bench": {"profile": False, "check": {"strict": True}}, "layer": None}
    with pytest.raises(ValueError, match=r"bench\.profile must be true or false"):
        normalize_flags({"bench": {"profile": "maybe"}}, ("bench.profile",))


@pytest.mark.timeout(90)
def test_serve_replay_trace_file(tmp_path):
    from moelayers.trace import save_trace, synthetic_trace

    # 4 experts (model has 8), 3 trace layers (model has 2), vocab 700 (model has 512), length-1 sequences
    trace = synthetic_trace(6, 3, 4, 2, 700, seq_len=(1, 10), seed=1)
    path = tmp_path / "trace.npz"
    save_trace(trace, path)
    res = _serve(tmp_path / "run", "router=replay", f"trace.path={path}", "workload.num_requests=16")
    assert res["router"] == "replay" and res["num_requests"] == 6
    assert res["model"]["num_experts"] == 4 and res["model"]["vocab_size"] == 700 and res["notes"]
    # Every position of sequence i is fed on rank i % 2; model layer j replays trace layer j % 3;
    # expert e lives on rank e // 2: LAR and loads follow from the trace alone.
    local = total = 0
    loads = np.zeros(2, dtype=np.int64)
    out_tokens = 0
    for s in range(trace.num_sequences):
        ids = trace.topk_ids[trace.sequence_slice(s)]  # [n, L, K]
        n = ids.shape[0]
        p = min(n, max(1, int(round(0.5 * n))))
        out_tokens += n - p + 1
        for j in range(2):
            where = ids[:, j % 3] // 2
            local += int((where == s % 2).sum())
            total += where.size
            loads += np.bincount(where.ravel(), minlength=2)
    assert res["output_tokens"] == out_tokens
    assert res["lar"] == pytest.approx(local / total, abs=1e-12)
    assert res["rank_loads"] == loads.tolist()
    assert np.asarray(res["rank_load_per_step"]).sum(0).tolist() == loads.tolist()


# ---------------------------------------------------------------------- bad input, checked up front
def _serve_fails(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = _run_serve(run_dir, "progress=false", *overrides)
    assert proc.returncode != 0, proc.stdout
    return proc


def _config(*overrides: str) -> dict:
    """serve.py's resolved config for these overrides (what main hands check_config)."""
    from hydra import compose, initialize_config_dir

    from recipes._common import to_dict

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return to_dict(compose("config", overrides=["parallel.world_size=2", *overrides]))


def _trace_with_empty_sequences(path: Path, lengths: list[int]):
    """A replay trace (4 experts, 2 layers, top-2, vocab 100) whose sequences have these lengths (0: empty)."""
    from moelayers.trace import RoutingTrace, save_trace

    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    topk = np.stack([rng.permutation(4)[:2] for _ in range(n * 2)]).reshape(n, 2, 2).astype(np.int64)
    trace = RoutingTrace(topk, rng.integers(0, 100, size=n).astype(np.int64), offsets, 4, vocab_size=100)
    save_trace(trace, path)
    return trace


def test_plan_split_is_checked_before_the_ranks_start():
    """A replay trace too short to split for the plan, or a plan_train_fraction outside (0, 1),
    failed inside the spawned ranks (a RuntimeError that named no setting)."""
    from recipes.serve import check_config

    semantic = ("layer=semantic", "scheduler=semantic", "router=replay")
    check_config(_config(*semantic, "workload.num_requests=4"))
    with pytest.raises(ValueError, match="first 0.5 of its sequences.*empty part.*workload.num_requests"):
        check_config(_config(*semantic, "workload.num_requests=1"))
    for bad in ("1.0", "0", "abc", "true"):
        with pytest.raises(ValueError, match=r"plan_train_fraction .* must be null \(0\.5\) or a number in \(0, 1\)"):
            check_config(_config(*semantic, "workload.num_requests=4", f"layer.plan_train_fraction={bad}"))
    # given once, in the scheduler: the layer's config default (null) does not contradict it
    check_config(_config("layer=semantic", "scheduler={name:semantic,plan_train_fraction:0.3}", "router=replay",
                         "workload.num_requests=4"))
    with pytest.raises(ValueError, match="scheduler.plan_train_fraction=0.3 and layer.plan_train_fraction=0.4 differ"):
        check_config(_config("layer=semantic", "scheduler={name:semantic,plan_train_fraction:0.3}", "router=replay",
                             "workload.num_requests=4", "layer.plan_train_fraction=0.4"))


@pytest.mark.timeout(90)
def test_serve_bad_input_writes_nothing_in_the_run_dir(tmp_path):
    """A run refused on bad input leaves the run dir as it was: no .hydra/, no serve.log, and a
    reused dir keeps the earlier run's files untouched (the error names the plan file)."""
    from tests.distributed.test_semantic import make_plan

    plan = tmp_path / "plan16.npz"
    make_plan(16, 2, vocab=512, mode="dp").save(plan)  # the tiny model has 8 experts
    run = tmp_path / "run"
    proc = _serve_fails(run, "layer=semantic", "scheduler=semantic", f"layer.plan_path={plan}")
    assert str(plan) in proc.stderr and "num_experts" in proc.stderr
    assert not run.exists() or not list(run.iterdir())
    reused = tmp_path / "reused"
    reused.mkdir()
    (reused / "results.json").write_text('{"earlier": true}\n')
    _serve_fails(reused, "layer=semantic", "scheduler=semantic", f"layer.plan_path={plan}")
    assert [p.name for p in reused.iterdir()] == ["results.json"]
    assert (reused / "results.json").read_text() == '{"earlier": true}\n'


@pytest.mark.parametrize("overrides, match", [
    (("parallel.world_size=4", "parallel.ep=3"), r"parallel\.ep=3 must divide the world size 4"),
    (("parallel.ep=0",), r"parallel\.ep must be an integer >= 1, got 0"),
    (("seed=-1",), r"seed must be an integer >= 0, got -1"),  # numpy's bare "expected non-negative integer"
    (("router=replay", "trace.seq_len=[48,16]"), r"trace\.seq_len \[lo, hi\] needs lo <= hi"),
    (("router=replay", "trace.num_sequences=2.5"), r"trace\.num_sequences must be an integer >= 1, got 2\.5"),
    (("model.num_experts=7",), r"model\.num_experts: 7 experts per layer, which do not split over parallel\.ep=2 "
                               r"ranks \(parallel\.ep defaults to parallel\.world_size\): e\.g\. model\.num_experts=6 or 8"),
    # the scheduler planned over 4 ranks, the layers over 2: LAR below round robin's, silently
    (("parallel.world_size=4", "parallel.ep=2", "layer=semantic", "scheduler=semantic", "router=replay"),
     r"scheduler=semantic .* parallel\.ep must be null or the world size \(4\), got 2"),
    # (a fuzzer of the command line: "invalid literal for int()" named no key; os.getcwd failed in every rank)
    (("model.hidden_size=abc",), r"model\.hidden_size must be an integer >= 1, got 'abc'"),
    (("scheduler=os:getcwd",), r"scheduler='os:getcwd' cannot be called as \(requests, world_size, cfg\)"),
])
def test_serve_config_mistakes_are_named_before_the_ranks_start(overrides, match):
    """These used to pass check_config and fail inside every spawned rank (or not at all)."""
    from recipes import serve

    with pytest.raises(ValueError, match=match):
        serve.check_config(_config(*overrides))


def test_serve_trace_file_checks(tmp_path):
    """A trace file whose experts do not split over the EP ranks, and trace.num_sequences (which
    sizes the synthetic trace only) beside a file, are refused naming the setting."""
    from moelayers.trace import RoutingTrace, save_trace
    from recipes import serve

    rng = np.random.default_rng(0)
    path = tmp_path / "e3.npz"
    save_trace(RoutingTrace(np.stack([rng.permutation(3)[:2] for _ in range(40)]).reshape(20, 2, 2).astype(np.int64),
                            rng.integers(0, 100, size=20).astype(np.int64), np.array([0, 10, 20]), 3,
                            vocab_size=100), path)
    with pytest.raises(ValueError, match=rf"trace\.path={path} has 3 experts per layer, which do not split over "
                                         r"parallel\.ep=2 ranks.*: e\.g\. a parallel\.ep that divides 3 and the world "
                                         r"size 2$"):
        serve.check_config(_config("router=replay", f"trace.path={path}"))
    serve.check_config(_config("router=replay", f"trace.path={path}", "parallel.world_size=1"))
    with pytest.raises(ValueError, match=r"trace\.num_sequences=4 sizes the synthetic trace; with trace\.path"):
        serve.check_config(_config("router=replay", f"trace.path={path}", "parallel.world_size=1",
                                   "trace.num_sequences=4"))
    with pytest.raises(IsADirectoryError, match=rf"trace\.path={tmp_path} is a directory, not a routing trace"):
        serve.check_config(_config("router=replay", f"trace.path={tmp_path}"))  # was "does not exist"


def test_serve_plan_file_checked_before_the_ranks_start(tmp_path):
    """layer.plan_path / scheduler.plan_path: experts, ranks, mode dp and the vocabulary, checked in
    check_config with the file named (not inside the spawned ranks)."""
    from recipes import serve
    from tests.distributed.test_semantic import make_plan

    def plan_file(name, *args, **kw):
        path = tmp_path / f"{name}.npz"
        make_plan(*args, **kw).save(path)
        return path

    ok = plan_file("ok", 8, 2, vocab=512, mode="dp")
    both = ("layer=semantic", "scheduler=semantic")
    serve.check_config(_config(*both, f"layer.plan_path={ok}"))
    for path, match in ((plan_file("e16", 16, 2, vocab=512, mode="dp"), "'num_experts' is 16, but .* needs 8"),
                        (plan_file("r4", 8, 4, vocab=512, mode="dp"), "'num_ranks' is 4, but .* needs 2"),
                        (plan_file("tp", 8, 2, vocab=512, mode="tp"), "'mode' is 'tp', but serve.py runs attention "
                                                                      "data-parallel"),
                        (plan_file("v500", 8, 2, vocab=500, mode="dp"), "'vocab_size' is 500, smaller than the "
                                                                        "vocab_size 512 of the model")):
        with pytest.raises(ValueError, match=match) as e:
            serve.check_config(_config(*both, f"layer.plan_path={path}"))
        assert str(path) in str(e.value)
    # the scheduler alone reads the plan's token table and ranks; the layer alone its experts and ranks
    with pytest.raises(ValueError, match="scheduler.plan_path=.*v500.npz.*'vocab_size' is 500"):
        serve.check_config(_config("scheduler={name:semantic,plan_path:" + str(tmp_path / "v500.npz") + "}"))
    with pytest.raises(ValueError, match="'num_ranks' is 4"):
        serve.check_config(_config("scheduler={name:semantic,plan_path:" + str(tmp_path / "r4.npz") + "}"))
    serve.check_config(_config("layer=semantic", f"layer.plan_path={tmp_path / 'v500.npz'}"))  # no token ids read
    with pytest.raises(ValueError, match="'num_experts' is 16"):
        serve.check_config(_config("layer=semantic", f"layer.plan_path={tmp_path / 'e16.npz'}"))
    # one plan serves the layer and the scheduler: two different paths would leave one unread (unchecked)
    with pytest.raises(ValueError, match="scheduler.plan_path=.*ok.npz and layer.plan_path=.*missing.npz differ"):
        serve.check_config(_config("layer=semantic", "scheduler={name:round_robin,plan_path:" + str(ok) + "}",
                                   f"layer.plan_path={tmp_path / 'missing.npz'}"))
    serve.check_config(_config(*both[:1], "scheduler={name:semantic,plan_path:" + str(ok) + "}",
                               f"layer.plan_path={tmp_path / 'sub' / '..' / 'ok.npz'}"))  # the same file
    # replay: the requests' tokens come from the trace (vocab 100), the experts too (4)
    trace = tmp_path / "trace.npz"
    _trace_with_empty_sequences(trace, [5, 6, 7, 8])
    replay = ("router=replay", f"trace.path={trace}")
    serve.check_config(_config(*both, *replay,
                               f"layer.plan_path={plan_file('t4', 4, 2, vocab=100, layers=2, mode='dp')}"))
    with pytest.raises(ValueError, match="'num_experts' is 8, but .* needs 4"):
        serve.check_config(_config(*both, *replay, f"layer.plan_path={ok}"))
    with pytest.raises(ValueError, match="'vocab_size' is 50, smaller than the vocab_size 100 of the replay trace"):
        serve.check_config(_config(*both, *replay, f"layer.plan_path="
                                                   f"{plan_file('t4v50', 4, 2, vocab=100 // 2, unseen=2, layers=2, mode='dp')}"))
    # model layer i replays trace layer i mod L with plan layer i mod P: a plan of other layers than the
    # trace paired mismatched layers silently (plan.py refused the same pair)
    with pytest.raises(ValueError, match=r"'expert_rank \(layers\)' is 3, but .* needs 2"):
        serve.check_config(_config(*both, *replay,
                                   f"layer.plan_path={plan_file('t4l3', 4, 2, vocab=100, layers=3, mode='dp')}"))
    from moelayers.trace import load_trace

    _, notes = serve.fit_model_to_trace(dict(_config()["model"], num_layers=3), load_trace(trace))
    assert "model.num_layers 3 with a trace of 2 layer(s): MoE layer i replays trace layer i mod 2" in notes


def test_serve_curves_file_checked_before_the_ranks_start(tmp_path):
    """variability.curves.path: curves for the wrong number of ranks are an error naming the file,
    also where this run would not use them."""
    from moelayers.planning.gem import LatencyCurves
    from recipes import serve

    c2, c4 = tmp_path / "c2.npz", tmp_path / "c4.npz"
    LatencyCurves.preset("high", 2).save(c2)
    LatencyCurves.preset("high", 4).save(c4)
    for layer, mode in (("variability", "measured"), ("variability", "curve"), ("vanilla", "measured"),
                        ("vanilla", "off")):
        args = (f"layer={layer}", "variability=high", f"emulation.mode={mode}")
        serve.check_config(_config(*args, f"+variability.curves.path={c2}"))
        with pytest.raises(ValueError, match="latency curves are for 4 ranks, but the placement has 2") as e:
            serve.check_config(_config(*args, f"+variability.curves.path={c4}"))
        assert str(c4) in str(e.value)
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        serve.check_config(_config("variability=high", f"+variability.curves.path={tmp_path / 'nope.npz'}"))
    bad = tmp_path / "bad.npz"
    np.savez(bad, rows=np.array([1, 2]))
    with pytest.raises(ValueError, match="bad.npz"):
        serve.check_config(_config("layer=vanilla", "variability=high", f"+variability.curves.path={bad}"))


def test_curves_path_is_one_setting_for_plan_and_serve(tmp_path):
    """plan.py's curves.path and serve.py's variability.curves.path name the same file in both recipes:
    serve.py ran on the preset's curves with curves.path=FILE given (and recorded the file in its
    config), plan.py on the preset with variability.curves.path=FILE."""
    from moelayers.planning.gem import LatencyCurves
    from recipes import serve
    from recipes._common import merge_curves_path

    c4 = tmp_path / "c4.npz"
    LatencyCurves.preset("high", 4).save(c4)
    d = _config("layer=variability", "variability=high", f"curves.path={c4}")
    assert merge_curves_path(d) == str(c4) and d["variability"]["curves"]["path"] == str(c4)
    with pytest.raises(ValueError, match="latency curves are for 4 ranks, but the placement has 2"):
        serve.check_config(d)  # the file is read, not the preset
    plan_cfg = {"curves": {"path": None}, "variability": {"name": "high", "curves": {"path": str(c4)}}}
    assert merge_curves_path(plan_cfg) == str(c4) and plan_cfg["curves"]["path"] == str(c4)
    with pytest.raises(ValueError, match="name different files: give one"):
        merge_curves_path({"curves": {"path": "a.npz"}, "variability": {"name": "high", "curves": {"path": "b.npz"}}})
    assert merge_curves_path({"curves": {"path": None}, "variability": {"name": "high"}}) is None


def test_serve_replay_window(tmp_path):
    """Requests replay the non-empty sequences of request_offset .. + num_requests; an offset past
    the trace's end, or a window of empty sequences only, is an error naming the file."""
    from recipes import serve

    path = tmp_path / "trace.npz"
    trace = _trace_with_empty_sequences(path, [5, 0, 6, 0, 0, 7, 8, 0, 0])
    cfg = _config("router=replay", f"trace.path={path}", "workload.num_requests=4")
    serve.check_config(cfg)
    reqs = serve.make_requests(cfg, 512, trace)
    assert [r.trace_seq for r in reqs] == [0, 2] and [r.rid for r in reqs] == [0, 1]
    assert all(r.prompt for r in reqs)
    _, notes, skipped = serve.replay_sequences(cfg, trace)
    assert skipped == 2 and notes == [f"skipped 2 empty sequence(s) of trace {path} (no tokens to replay): 1, 3"]
    cfg["trace"]["request_offset"] = 5  # sequences 5..8 of 9: 5, 6 served, 7, 8 empty
    assert [r.trace_seq for r in serve.make_requests(cfg, 512, trace)] == [5, 6]
    cfg["trace"]["request_offset"] = 6  # sequences 6..8: a short window (3 of 4), 7 and 8 empty
    _, notes, skipped = serve.replay_sequences(cfg, trace)
    assert skipped == 2 and notes[0] == (f"trace {path} has 9 sequence(s): trace.request_offset=6 leaves 3 of "
                                         f"workload.num_requests=4 requests (sequences 6..8)")
    for offset, match in ((9, "trace.request_offset=9 leaves no request: trace .*trace.npz has 9 sequence"),
                          (40, "trace.request_offset=40 leaves no request: trace .*trace.npz has 9 sequence"),
                          (7, "no request left: sequences 7..8 of trace .*trace.npz \\(9 sequence\\(s\\)\\) are all "
                              "empty")):
        with pytest.raises(ValueError, match=match):
            serve.check_config(_config("router=replay", f"trace.path={path}", "workload.num_requests=4",
                                       f"trace.request_offset={offset}"))


@pytest.mark.timeout(90)
def test_serve_replay_skips_empty_sequences_and_notes_a_short_trace(tmp_path):
    """End to end: empty sequences are skipped (not a crash inside a rank), a trace shorter than
    workload.num_requests gives fewer requests; results.json notes both."""
    path = tmp_path / "trace.npz"
    _trace_with_empty_sequences(path, [3, 5, 0, 6, 0, 4, 7])
    res = _serve(tmp_path / "run", "router=replay", f"trace.path={path}", "trace.request_offset=1",
                 "workload.num_requests=10", "progress=false")
    assert res["num_requests"] == res["finished_requests"] == 4 and res["skipped_empty_sequences"] == 2
    assert f"skipped 2 empty sequence(s) of trace {path} (no tokens to replay): 2, 4" in res["notes"]
    assert (f"trace {path} has 7 sequence(s): trace.request_offset=1 leaves 6 of workload.num_requests=10 "
            f"requests (sequences 1..6)") in res["notes"]


def test_serve_workload_checked_before_the_ranks_start():
    """workload.* and max_steps: a bad value is an error naming the key in check_config, not a crash
    in a rank (numpy's "low >= high"), a burst at t=0 (rate nan / negative) or one-token requests
    (prompt_fraction 7); a run that would serve nothing (no request, no step) is refused too."""
    from recipes import serve

    rate = r"workload.rate must be a finite number > 0 \(requests per second\) or null"
    fraction = r"workload.prompt_fraction must be a number in \(0, 1\] .*"
    lognormal = ("workload.output_len.dist=lognormal", "+workload.output_len.median=20")
    for overrides, match in (
            (("workload.rate=nan",), rate + r".*, got nan"), (("workload.rate=-50",), rate + r".*, got -50"),
            (("workload.rate=0",), rate), (("workload.rate=inf",), rate), (("workload.rate=fast",), rate),
            (("workload.num_requests=0",), "workload.num_requests must be an integer >= 1, got 0"),
            (("max_steps=0",), "max_steps must be an integer >= 1, got 0"),
            (("workload.prompt_len.min=64", "workload.prompt_len.max=16"),
             "workload.prompt_len.min=64 is greater than workload.prompt_len.max=16"),
            (("workload.output_len.min=0",), "workload.output_len.min must be an integer >= 1, got 0"),
            (("workload.prompt_len.max=2.5",), "workload.prompt_len.max must be an integer >= 1, got 2.5"),
            (("workload.prompt_len.dist=zipf",), "workload.prompt_len.dist must be one of uniform, fixed, lognormal"),
            (("workload.prompt_len.dist=fixed",), "workload.prompt_len.value must be an integer >= 1, got None"),
            ((*lognormal, "+workload.output_len.sigma=nan"), "workload.output_len.sigma must be a finite number >= 0"),
            (("router=replay", "workload.prompt_fraction=7"), fraction + ", got 7"),
            (("router=replay", "workload.prompt_fraction=nan"), fraction + ", got nan"),
            (("workload.prompt_fraction=0",), fraction + ", got 0"),
            (("trace.path=/nonexistent.npz",), r"trace.path=/nonexistent.npz is read with router=replay only"),
            (("trace.request_offset=4",), r"trace.request_offset=4 is read with router=replay only"),
            # a sweep found raw TypeError / ModuleNotFoundError / AttributeError here (some inside the ranks)
            (("scheduler=os:path",), r"scheduler='os:path' is a module, not a function"),
            (("scheduler=nosuchmod:fn",), r"scheduler='nosuchmod:fn': cannot import 'nosuchmod'"),
            (("layer.cls=moelayers.NoSuch",), r"layer.cls='moelayers.NoSuch': module 'moelayers' has no 'NoSuch'")):
        with pytest.raises(ValueError, match=match):
            serve.check_config(_config(*overrides))
    for overrides in (("workload.rate=null",), ("router=replay", "workload.prompt_fraction=1"),
                      ("workload.prompt_len.dist=fixed", "+workload.prompt_len.value=8"),
                      (*lognormal, "+workload.output_len.sigma=0.5")):
        serve.check_config(_config(*overrides))
    burst = _config("workload.rate=null", "workload.num_requests=4")  # null: every request arrives at t=0
    assert [r.arrival for r in serve.make_requests(burst, 512)] == [0.0] * 4


def test_plot_rank_load_without_steps(tmp_path):
    """A run of zero steps has an empty rank_load_per_step: the plot says so instead of crashing
    after results.json was written."""
    from recipes._plots import plot_rank_load

    plot_rank_load([], tmp_path / "empty.png", "no steps")
    assert (tmp_path / "empty.png").stat().st_size > 1000


def test_serve_scheduler_output_checked(monkeypatch):
    """A custom scheduler must give every request one rank in [0, world): a short list (zip would
    truncate) or a rank outside the world would silently drop requests."""
    from recipes import _serve_workload as workload, serve

    cfg = _config("workload.num_requests=4")
    requests = serve.make_requests(cfg, 512)
    assert serve.assign_requests(requests, 2, cfg) == [0, 1, 0, 1]
    for name, fn, match in (
            ("short", lambda r, w, c: [0] * (len(r) // 2), r"returned 2 rank\(s\) for 4 request\(s\)"),
            ("long", lambda r, w, c: [0] * (len(r) + 1), r"returned 5 rank\(s\) for 4 request\(s\)"),
            ("world", lambda r, w, c: [i % w for i in range(len(r) - 1)] + [w], r"gave request 3 rank 2: .*\[0, 2\)"),
            ("negative", lambda r, w, c: [-1] * len(r), "gave request 0 rank -1"),
            ("float", lambda r, w, c: [0.0] * len(r), "gave request 0 rank 0.0"),
            ("none", lambda r, w, c: None, "returned None, not a list of ranks")):
        monkeypatch.setitem(workload.SCHEDULERS, name, fn)
        with pytest.raises(ValueError, match=f"scheduler '{name}' {match}"):
            serve.assign_requests(requests, 2, dict(cfg, scheduler=name))
    monkeypatch.setitem(workload.SCHEDULERS, "numpy", lambda r, w, c: np.arange(len(r)) % w)
    assert serve.assign_requests(requests, 2, dict(cfg, scheduler="numpy")) == [0, 1, 0, 1]


def test_latency_summary_counts_unserved_requests():
    """Requests without a first token (max_steps ended the run) count as inf in the TTFT figures,
    not left out; the summary says the run was truncated and how many got no token."""
    from recipes import serve
    from recipes._common import percentile

    inf, nan = float("inf"), float("nan")
    assert percentile([1.0, 2.0, inf, inf], 50) == inf and percentile([1.0, 3.0, nan, None], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, inf], 50) == 2.5 and percentile([1.0, inf], 0) == 1.0

    def req(ttft, tokens, finished):
        return {"ttft_s": ttft, "tpot_s": 0.1 if tokens > 1 else nan, "generated_tokens": tokens, "finished": finished}

    lat = serve.latency_summary([req(1.0, 3, True), req(2.0, 1, False), req(nan, 0, False), req(nan, 0, False)])
    assert lat["truncated"] and lat["finished_requests"] == 1 and lat["unserved_requests"] == 2
    assert lat["ttft_p50_s"] == lat["ttft_p99_s"] == lat["ttft_mean_s"] == inf
    assert lat["tpot_mean_s"] == pytest.approx(0.1)  # TPOT: the requests with two tokens or more
    lat = serve.latency_summary([req(1.0, 3, True)] * 9 + [req(nan, 0, False)])
    assert lat["ttft_p50_s"] == 1.0 and lat["ttft_p99_s"] == inf and lat["unserved_requests"] == 1
    lat = serve.latency_summary([req(1.0, 3, True), req(3.0, 2, True)])
    assert not lat["truncated"] and lat["unserved_requests"] == 0 and lat["ttft_p50_s"] == 2.0
    # requests due after the run ended never waited: left out of the TTFT figures, counted apart
    # (a run that max_steps ended early counted 27 of 32 requests unserved, TTFT p50 inf)
    due = [dict(req(1.0, 3, True), arrival_s=0.1), dict(req(nan, 0, False), arrival_s=0.4),
           dict(req(nan, 0, False), arrival_s=2.0), dict(req(nan, 0, False), arrival_s=3.0)]
    lat = serve.latency_summary(due, elapsed=1.0)
    assert lat["unserved_requests"] == 1 and lat["unarrived_requests"] == 2 and lat["truncated"]
    assert lat["ttft_p50_s"] == inf and lat["ttft_mean_s"] == inf  # of the two that arrived: 1.0 and inf
    lat = serve.latency_summary(due[:1] * 3 + due[2:], elapsed=1.0)
    assert lat["ttft_p50_s"] == 1.0 and lat["unserved_requests"] == 0 and lat["unarrived_requests"] == 2


@pytest.mark.timeout(90)
def test_settings_the_run_would_ignore_are_refused(tmp_path):
    """Found by a sweep: under router=replay workload.output_len / prompt_len were ignored (the trace's
    sequences are the requests), under router=learned the synthetic trace's sizes and
    workload.prompt_fraction; parallel.timeout_s=0 failed every run as "timed out"."""
    for overrides, match in (
            (("router=replay", "workload.output_len.max=20"), "workload.output_len.max=20 is read with router=learned only"),
            (("trace.seq_len=[4,8]", "workload.prompt_fraction=0.9"),
             r"trace.seq_len=\[4,8\], workload.prompt_fraction=0.9 is read with router=replay only"),
            (("parallel.timeout_s=0",), r"parallel.timeout_s must be a number of seconds > 0 .*got 0")):
        proc = _run_serve(tmp_path / "run", *overrides)
        assert proc.returncode != 0 and re.search(match, proc.stderr), proc.stderr[-2000:]
        assert "rank 0" not in proc.stderr  # refused before any rank started


@pytest.mark.timeout(60)
def test_compare_settings_without_a_comparison_are_refused(tmp_path):
    """compare.seeds=5 without compare.layer ran one seed, no comparison, without a word."""
    proc = _run_serve(tmp_path / "run", "compare.seeds=5", "compare.scheduler=round_robin")
    assert proc.returncode != 0
    assert ("compare.seeds=5, compare.scheduler=round_robin is read with compare.layer=NAME only"
            in proc.stderr), proc.stderr[-2000:]


@pytest.mark.timeout(90)
def test_a_setting_of_another_layer_option_is_refused(tmp_path):
    """`+layer.plan_path=FILE` with layer=vanilla (no semantic scheduler), or `+layer.placement_path`
    with layer=semantic, served without a word: the override check took every layer option's keys.
    (The first is refused on the command line's overrides, which a subprocess alone has; the second
    in check_config, which main runs before any rank starts: checked in-process, as the other
    check_config refusals are.)"""
    from recipes import serve

    proc = _run_serve(tmp_path / "run", "+layer.plan_path=plan.npz")
    assert proc.returncode != 0 and re.search(r"\+layer.plan_path=plan.npz: a semantic plan is read with layer=semantic "
                                              r"or scheduler=semantic only, and this run has layer=vanilla",
                                              proc.stderr), proc.stderr[-2000:]
    assert "rank 0" not in proc.stderr  # refused before any rank started
    with pytest.raises(ValueError, match=r"layer.placement_path=\S*p.json: layer=semantic takes its placement from its "
                                         r"semantic plan"):
        serve.check_config(_config("layer=semantic", "router=replay", "+layer.placement_path=p.json"))


@pytest.mark.timeout(90)
def test_serve_truncated_by_max_steps_says_so(tmp_path):
    """End to end: max_steps ends the run with requests unserved; results.json says truncated, counts
    them and notes it, and the TTFT figures (inf: null in JSON) do not look like a normal run's."""
    run = tmp_path / "run"
    # every request arrives at t=0; 2 in flight per rank, >= 8 output tokens each: after 3 steps
    # each rank has served 2 of its 4 requests (none finished) and 2 wait
    proc = _run_serve(run, "progress=false", "workload.num_requests=8", "workload.rate=null", "max_batch_size=2",
                      "max_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert (run / "rank_load.png").stat().st_size > 1000
    res = json.loads((run / "results.json").read_text())
    assert res["truncated"] is True and res["steps"] == 3
    assert res["num_requests"] == 8 and res["finished_requests"] == 0 and res["unserved_requests"] == 4
    assert sum(q["ttft_s"] is None for q in res["requests"]) == 4
    # an unfinished request has no finish time (it had the run's end), and keeps its requested length
    assert all(q["finish_s"] is None and q["generated_tokens"] < q["output_len"] for q in res["requests"])
    assert sum(q["last_token_s"] is not None for q in res["requests"]) == 4
    assert res["ttft_p50_s"] is None and res["ttft_p99_s"] is None and res["ttft_mean_s"] is None
    assert res["tpot_mean_s"] > 0
    assert res["unarrived_requests"] == 0  # all arrived at t=0
    assert res["notes"] == ["max_steps=3 ended the run with 8 of 8 request(s) unfinished, 4 arrived without a first "
                            "token (their TTFT counts as inf in the TTFT figures, null in results.json)"]
    assert "| TTFT p99 (s)" in proc.stdout and "inf |" in proc.stdout


def test_warm_up_records_nothing_and_replans_nothing():
    """With a window of 1 or 2 steps, the warm-up's two forwards used to fill GEM's window and move
    the experts on warm-up routing; now they record nothing."""
    from moelayers.models import TinyConfig, TinyDecoder
    from recipes.serve import warm_up

    moe = ml.MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2)
    for window in (1, 2):
        model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4),
                            lambda i: ml.VariabilityAwareMoE(moe, ml.ParallelGroups.single(), seed=i, window=window,
                                                             auto_replan=True, variability="high"))
        before = [m.placement for m in model.moe_layers]
        warm_up(model, torch.device("cpu"))
        assert [(m.num_replans, m.steps, m.record_loads) for m in model.moe_layers] == [(0, 0, True)] * 2
        assert [m.placement for m in model.moe_layers] == before
    # a vocabulary below 5: the warm-up's hard-coded ids 0..4 used to fail every rank before serving
    model = TinyDecoder(TinyConfig(vocab_size=2, hidden_size=32, num_layers=1, num_heads=4),
                        lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=i))
    warm_up(model, torch.device("cpu"))


def test_serve_sizes_refuses_a_world_of_zero():
    """parallel.world_size=0 crashed in check_config with a ZeroDivisionError, before launch's check."""
    from recipes.serve import serve_sizes

    with pytest.raises(ValueError, match="parallel.world_size must be an integer >= 1, got 0"):
        serve_sizes({"parallel": {"world_size": 0, "ep": None}})
    assert serve_sizes({"parallel": {"world_size": 4, "ep": 2}}) == (4, 2)


def _emulation_probe_worker(rank, world, cfg):
    """serve_worker with the curve emulation's imposed times recorded from the first served step on."""
    import moelayers.emulation as emulation
    import recipes.serve as serve

    imposed, computed, curve_latency, warm_up = [], [], emulation.curve_latency, serve.warm_up

    def probe(curves, r, n, rows):
        out = curve_latency(curves, r, n, rows)
        imposed.append(out)
        computed.append(int(rows))
        return out

    def warm_then_forget(*args):
        warm_up(*args)
        imposed.clear()
        computed.clear()

    emulation.curve_latency, serve.warm_up = probe, warm_then_forget
    try:
        res = serve.serve_worker(rank, world, cfg)
    finally:
        emulation.curve_latency, serve.warm_up = curve_latency, warm_up
    return res, imposed, computed


@pytest.mark.timeout(240)
def test_emulated_expert_time_with_several_expert_parallel_groups(tmp_path):
    """world 4, parallel.ep=2: each EP group's rows are costed on their own (not the sum of the two
    groups' rows through a tiled curve), emulated_expert_s is the critical path the hooks imposed
    (every step as long as its slowest rank, layer by layer) and emulated_expert_rank_s each world
    rank's own imposed time."""
    from recipes._common import LAYER_FLAGS, normalize_flags

    d = _config("parallel=cpu4", "parallel.ep=2", "layer=variability", "variability=high", "emulation.mode=curve",
                "emulation.time_scale=1", "router=replay", "workload.num_requests=12", "trace.seq_len=[150,300]",
                "layer.kwargs.auto_replan=false", "progress=false", "model.num_layers=1")
    normalize_flags(d, ("progress", "plot", "trace.synthetic", *LAYER_FLAGS, "layer.kwargs.auto_replan"))
    d["run_dir"] = str(tmp_path)
    out = run_distributed(_emulation_probe_worker, 4, d, timeout=200)
    res = out[0][0]
    imposed = np.array([times for _, times, _ in out])  # [W, steps] (one MoE layer)
    assert imposed.shape == (4, res["steps"])
    np.testing.assert_allclose(res["emulated_expert_rank_s"], imposed.sum(1), rtol=1e-9)
    assert res["emulated_expert_s"] == pytest.approx(imposed.max(0).sum(), rel=1e-9)
    # the rows each world rank computed: rank_loads and rank_load_per_step held one entry per EP rank,
    # summed over the two groups (an imbalance of the group sums, not of the ranks)
    rows = np.array([r for _, _, r in out])  # [W, steps]
    assert res["rank_load_per_step"] == rows.T.tolist()
    assert res["rank_loads"] == rows.sum(1).tolist()
    assert res["imbalance"] == pytest.approx(rows.sum(1).max() / rows.sum(1).mean())


def test_emulated_expert_time_takes_the_slowest_rank_layer_by_layer():
    """Each layer waits for its own slowest rank: layer 0 for rank 0 (400 rows), layer 1 for rank 1."""
    import recipes.serve as serve

    d = _config("layer=variability", "variability=high", "emulation.mode=curve", "emulation.time_scale=1")
    loads = torch.tensor([[[[400, 0], [0, 400]]]])  # [W=1, steps=1, L=2, R=2]
    got = serve.emulated_expert_time(d, loads, [0])
    slow = 1 / 0.88  # the high preset's rank 0; C(n) = s (20 us + 10 us ceil(n / 128))
    assert got["emulated_expert_s"] == pytest.approx(60e-6 * slow + 60e-6)
    assert got["emulated_expert_rank_s"] == pytest.approx([(60e-6 + 20e-6) * slow])


def test_serve_counts_the_padded_combine_of_capacity_layers(tmp_path):
    """With capacity the combine sends the whole fixed buffer back (C rows to every other rank), as
    the dispatch does (bytes_sent counted it): a2a_combine_bytes counted only the real rows, about a
    hundredth of what moved."""
    res = _serve(tmp_path / "run", "workload.num_requests=4", "+layer.kwargs.capacity=64")  # (the longest prompt)
    h, layers, steps = res["config"]["model"]["hidden_size"], res["config"]["model"]["num_layers"], res["steps"]
    per_forward = 64 * (2 - 1) * h * 4  # float32 rows to the one other rank
    assert res["a2a_combine_bytes"] == 2 * steps * layers * per_forward  # both ranks, every layer and step
    assert res["a2a_bytes"] == res["a2a_dispatch_bytes"] + res["a2a_combine_bytes"]


def test_serve_with_several_capacities_pads_each_step_to_the_one_it_fits(tmp_path):
    """``+layer.kwargs.capacity=[16,64]``: a decode step runs at 16 rows, a prefill at 64, and the
    combine bytes count each step's own buffer (with the NaN check deferred: read at the next step)."""
    res = _serve(tmp_path / "run", "workload.num_requests=4", "+layer.kwargs.capacity=[16,64]",
                 "+layer.kwargs.check_finite=deferred")
    assert res["config"]["layer"]["kwargs"]["check_finite"] == "deferred"
    h, layers, steps = res["config"]["model"]["hidden_size"], res["config"]["model"]["num_layers"], res["steps"]
    units, rest = divmod(res["a2a_combine_bytes"], 2 * layers * h * 4)  # rows per rank and layer, all steps
    small, rest2 = divmod(64 * steps - units, 64 - 16)
    assert rest == rest2 == 0 and 1 <= small < steps, (units, steps)  # some steps at 16 rows, some at 64
    # every layer forward of every rank, at the size it ran at
    assert res["capacity_forwards"] == {"16": 2 * layers * small, "64": 2 * layers * (steps - small)}


def test_serve_beyond_the_largest_capacity_runs_exact(tmp_path):
    """Prompts longer than every size with ``beyond_capacity=exact``: their prefills run exact (the
    run would otherwise be refused before it starts), the decode steps padded."""
    res = _serve(tmp_path / "run", "workload.num_requests=4", "+layer.kwargs.capacity=[4,8]",
                 "+layer.kwargs.beyond_capacity=exact")
    sizes = res["capacity_forwards"]
    assert set(sizes) <= {"4", "8", "exact"} and sizes.get("exact", 0) > 0 and sizes.get("4", 0) > 0, sizes
    assert res["finished_requests"] == 4


def _combine_rows_after_moves(rank, world):
    import moelayers as ml
    from recipes.serve import _combine_rows

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    groups = ml.ParallelGroups.from_world()
    planner = lambda loads, curves, *, restarts, seed: np.array([1, 1, 0, 0])  # noqa: E731 (a move)
    layers = [ml.VanillaMoE(cfg, groups, capacity=(2, 64)),
              ml.VariabilityAwareMoE(cfg, groups, capacity=(2, 64), window=1, auto_replan=True, planner=planner)]
    counted = []
    for layer in layers:
        with torch.no_grad():
            layer(torch.randn(1, 8))  # at 2 rows (a re-plan moving the weights after it)
        if isinstance(layer, ml.VanillaMoE):
            layer.apply_placement(ml.ExpertPlacement(torch.tensor([[3, 2], [1, 0]]), 4))
        counted.append((layer.last_capacity, _combine_rows(layer, layer.last_stats), getattr(layer, "num_moves", 1)))
    return counted


def test_combine_rows_count_the_size_the_forward_ran_at_after_a_move():
    """A move rebuilds the layer's dispatchers (the largest size's first): the combine's rows of a
    step whose re-plan moved weights were counted at the largest capacity (64 rows for 2)."""
    for counted in run_distributed(_combine_rows_after_moves, 2, timeout=120):
        assert counted == [(2, 2, 1), (2, 2, 1)], counted


def test_capacity_below_the_longest_prompt_is_refused_before_the_ranks_start():
    """+layer.kwargs.capacity=4 failed inside the spawned ranks at the first prefill; now check_config
    says so (learned routing and a replayed synthetic trace), and a capacity that fits passes."""
    from recipes import serve

    for extra in ((), ("router=replay",)):
        with pytest.raises(ValueError, match=r"layer\.kwargs\.capacity=4 is below the longest prompt \(\d+ tokens\)"):
            serve.check_config(_config("+layer.kwargs.capacity=4", *extra))
        serve.check_config(_config("+layer.kwargs.capacity=4096", *extra))
    with pytest.raises(ValueError, match=r"layer\.kwargs\.capacity must be an integer >= 1"):
        serve.check_config(_config("+layer.kwargs.capacity=0"))
    with pytest.raises(ValueError, match=r"layer\.kwargs\.capacity\[1\] must be an integer >= 1"):
        serve.check_config(_config("+layer.kwargs.capacity=[8,0]"))
    with pytest.raises(ValueError, match=r"layer\.kwargs\.capacity=\[4, 8\] \(largest 8\) is below the longest prompt"):
        serve.check_config(_config("+layer.kwargs.capacity=[4,8]"))  # (the largest decides)
    serve.check_config(_config("+layer.kwargs.capacity=[16,4096]"))
    serve.check_config(_config("+layer.kwargs.capacity=[4,8]", "+layer.kwargs.beyond_capacity=exact"))  # no bound


def test_a_step_admits_prompts_within_the_capacity(tmp_path):
    """A step prefilled every waiting prompt that fit max_batch_size, so several prompts together
    overflowed a capacity that each one fits, and capacity mode failed inside the ranks. The
    capacity is now the step's token budget: every request is served and no step ran more."""
    from recipes import serve

    d = _config("workload.num_requests=8", "workload.rate=null")
    longest = max(len(r.prompt) for r in serve.make_requests(d, int(d["model"]["vocab_size"])))
    capacity = max(longest, 8)  # above every prompt, below the prompts of one rank together
    res = _serve(tmp_path / "run", "workload.num_requests=8", "workload.rate=null", "max_batch_size=8",
                 f"+layer.kwargs.capacity={capacity}")
    assert res["finished_requests"] == 8 and not res["truncated"]
    assert longest <= res["max_step_tokens"] <= capacity
    prompts = sum(r["prompt_len"] for r in res["requests"] if r["rank"] == 0)
    assert prompts > capacity  # without the budget, the first step of rank 0 took them all


def test_step_budget_is_checked_against_the_capacity_and_the_prompts():
    from recipes import serve

    with pytest.raises(ValueError, match=r"max_tokens_per_step=600 is above layer\.kwargs\.capacity=512"):
        serve.check_config(_config("+layer.kwargs.capacity=512", "max_tokens_per_step=600"))
    with pytest.raises(ValueError, match=r"max_tokens_per_step=2 is below the longest prompt"):
        serve.check_config(_config("max_tokens_per_step=2"))
    with pytest.raises(ValueError, match=r"max_tokens_per_step must be an integer >= 1"):
        serve.check_config(_config("max_tokens_per_step=0"))
    serve.check_config(_config("+layer.kwargs.capacity=512", "max_tokens_per_step=256"))
    assert serve.step_token_budget(_config("+layer.kwargs.capacity=512")) == 512
    assert serve.step_token_budget(_config("+layer.kwargs.capacity=512", "max_tokens_per_step=256")) == 256
    assert serve.step_token_budget(_config()) == float("inf")


def test_a_comparison_batches_both_sides_within_the_smaller_capacity():
    from recipes import _serve_compare as compare

    ours = {"name": "semantic", "kwargs": {"capacity": 256}}
    assert compare.shared_step_budget({}, [ours, {"name": "vanilla"}]) == 256
    assert compare.shared_step_budget({}, [ours, {"name": "v", "kwargs": {"capacity": 128}}]) == 128
    assert compare.shared_step_budget({"max_tokens_per_step": 64}, [ours, {"name": "vanilla"}]) == 64
    assert compare.shared_step_budget({}, [{"name": "semantic"}, {"name": "vanilla"}]) is None
    # a list's largest; beyond_capacity=exact bounds no step (a comparison capped its steps, or refused)
    assert compare.shared_step_budget({}, [{"name": "v", "kwargs": {"capacity": [16, 96]}}, {"name": "vanilla"}]) == 96
    beyond = {"name": "v", "kwargs": {"capacity": [4, 8], "beyond_capacity": "exact"}}
    assert compare.shared_step_budget({}, [beyond, {"name": "vanilla", "kwargs": dict(beyond["kwargs"])}]) is None


def test_serve_notes_loads_past_the_profiled_curves(tmp_path):
    """plan.py warned when a rank's rows went past the curves' last sample; serve.py read the
    curves there silently (curve-mode emulation, GEM's re-plans), on extrapolated numbers."""
    from moelayers.planning.gem import LatencyCurves
    from recipes import serve

    short = tmp_path / "short.npz"
    LatencyCurves(np.array([1, 8, 16]), np.array([[1e-5, 2e-5, 3e-5], [1e-5, 2e-5, 3e-5]])).save(short)
    res = _serve(tmp_path / "run", "workload.num_requests=4", "variability=high", "emulation.mode=curve",
                 f"curves.path={short}")
    assert res["curves_sampled_up_to"] == 16 and res["max_rank_rows"] > 16
    assert any(f"beyond the last sample of the latency curves {short} (16 rows)" in n for n in res["notes"])
    d = _config("variability=high", "emulation.mode=curve", f"curves.path={short}")
    from recipes._common import merge_curves_path

    merge_curves_path(d)
    assert serve.curves_coverage(d, 16) == {"notes": [], "curves_sampled_up_to": 16, "max_rank_rows": 16}
    assert serve.curves_coverage(_config("variability=high"), 10 ** 6) == {"notes": []}  # preset: exact everywhere


def test_serve_takes_a_variability_layers_own_slowdown(tmp_path):
    """`+layer.kwargs.slowdown=[2.0,1.0]` under serve's default variability (none) was refused inside
    the ranks as a double slowdown, though the config's emulation slows nothing."""
    proc = _run_serve(tmp_path / "run", "layer=variability", "+layer.kwargs.slowdown=[1.25,1.0]",
                      "workload.num_requests=2", "model.num_layers=1", "progress=false", "plot=false")
    assert proc.returncode == 0, f"serve failed:\n{proc.stdout}\n{proc.stderr}"
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["layer"] == "variability" and res["finished_requests"] == 2


def test_a_second_slowdown_is_refused_before_the_ranks_start():
    from recipes import serve

    with pytest.raises(ValueError, match=r"layer\.kwargs\.slowdown=\[2\.0, 1\.0\] and the config's emulation"):
        serve.check_config(_config("layer=variability", "variability=high", "+layer.kwargs.slowdown=[2.0,1.0]"))
    serve.check_config(_config("layer=variability", "+layer.kwargs.slowdown=[2.0,1.0]"))  # variability none


def _built_placements(rank, world, *configs):
    """Each config's model built in turn, in one spawn: every MoE layer's placement, per config."""
    from recipes import serve

    out = []
    for d in configs:
        model = serve.build_model(d["model"], d["layer"], ml.ParallelGroups.from_world(), torch.device("cpu"), 0)
        out.append([m.placement.phy2log.tolist() for m in model.moe_layers])
    return out


def test_run_origin_names_each_sides_input_files(tmp_path):
    """A comparison's baseline started in another placement file: both files are recorded, each by
    content; a file both sides read is recorded once."""
    from recipes import serve

    ours, theirs, trace = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "t.npz"
    for path, rows in ((ours, [1, 0] * 4), (theirs, [0, 1] * 4)):
        np.savez(path, expert_rank=np.array(rows))
    trace.write_bytes(b"not read here")
    d = _config(f"layer.placement_path={ours}", f"trace.path={trace}")
    baseline = {**d, "layer": {**d["layer"], "placement_path": str(theirs)}}
    origin = serve.run_origin(d, baseline)
    assert set(origin) == {"command", "provenance"}
    check_provenance(origin["provenance"], {"layer.placement_path": ours, "trace.path": trace,
                                            "baseline:layer.placement_path": theirs})


def test_serve_starts_in_a_planned_placement(tmp_path):
    """plan.py's GEM / EPLB placements (assignment.npz) could not be served: serve.py had no way to
    take a placement. layer.placement_path starts MoE layer i in row i mod L of expert_rank."""
    from moelayers.placement import ExpertPlacement
    from recipes import serve

    path = tmp_path / "assignment.npz"
    rows = np.array([[1, 1, 1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 1]])  # 2 layers, 8 experts over 2 ranks
    np.savez(path, expert_rank=rows, token_rank=np.zeros((1, 2), dtype=np.int64))
    want = [[[4, 5, 6, 7], [0, 1, 2, 3]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
    assert [p.phy2log.tolist() for p in serve.layer_placements(str(path), 8, 2)] == want
    d = _config(f"layer.placement_path={path}")
    serve.check_config(d)
    np.savez(tmp_path / "row.npz", expert_rank=rows[1])  # one placement: every layer
    d_row = _config(f"layer.placement_path={tmp_path / 'row.npz'}", "model.num_layers=3")
    serve.check_config(d_row)
    built = run_distributed(_built_placements, 2, d, d_row, timeout=60)  # both models in one spawn
    assert [per_config[0] for per_config in built] == [want] * 2, "a placement per layer"
    assert [per_config[1] for per_config in built] == [[want[1]] * 3] * 2, "one placement for every layer"
    proc = _run_serve(tmp_path / "run", "workload.num_requests=4", f"layer.placement_path={path}")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert any(f"start in the placements of {path}" in n for n in res["notes"]), res["notes"]
    assert res["layer"] == "vanilla+assignment.npz"  # told apart from the plain layer in comparisons
    assert res["placement_file"] == {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    check_provenance(res["provenance"], {"layer.placement_path": path})
    one = tmp_path / "one.npz"
    ExpertPlacement.from_expert_rank(np.array([1, 0] * 4), num_ranks=2).save(one)
    assert [p.phy2log.tolist() for p in serve.layer_placements(str(one), 8, 2)] == [[[1, 3, 5, 7], [0, 2, 4, 6]]]
    with pytest.raises(ValueError, match=r"planned for 2 expert-parallel ranks, 1 here: plan with parallel\.ep=1"):
        serve.layer_placements(str(path), 8, 1)
    # plan.py's num_ranks: a plan for 2 ranks served on 4 left ranks 2 and 3 without experts, silently
    np.savez(path, expert_rank=rows, num_ranks=np.int64(2))
    with pytest.raises(ValueError, match=r"planned for 2 expert-parallel ranks, 4 here: ranks 2\.\.3 would hold no expert"):
        serve.layer_placements(str(path), 8, 4)
    np.savez(path, expert_rank=rows, num_ranks=np.int64(2), format_version=np.int64(2))  # of a newer plan.py
    with pytest.raises(ValueError, match=r"assignment\.npz: this plan\.py assignment\.npz is of format 2, written by a newer"):
        serve.layer_placements(str(path), 8, 2)
    np.savez(path, expert_rank=rows, num_ranks=np.int64(2))
    odd = tmp_path / "odd.npz"
    np.savez(odd, expert_rank=-rows)
    with pytest.raises(ValueError, match="expert_rank holds rank -1: ranks are >= 0"):
        serve.layer_placements(str(odd), 8, 2)
    np.savez(odd, expert_rank=rows, phy2log=np.zeros((2, 4), dtype=np.int64), num_experts=np.int64(8))
    with pytest.raises(ValueError, match="holds both a placement"):
        serve.layer_placements(str(odd), 8, 2)
    np.savez(odd, expert_rank=np.concatenate([rows, rows, rows]))  # 6 layers for a 2-layer model
    with pytest.raises(ValueError, match=r"holds placements of 6 layers, the model \(model\.num_layers\) has 2"):
        serve.check_config(_config(f"layer.placement_path={odd}"))
    with pytest.raises(IsADirectoryError, match="is a directory, not placements .*name the file in its run dir"):
        serve.check_config(_config(f"layer.placement_path={tmp_path}"))
    os.mkfifo(tmp_path / "pipe")  # (serve said "does not exist", as for a semantic plan)
    with pytest.raises(ValueError, match="layer.placement_path=.*pipe is not a regular file"):
        serve.check_config(_config(f"layer.placement_path={tmp_path / 'pipe'}"))
    with pytest.raises(ValueError, match="layer.plan_path=.*pipe is not a regular file .*names a semantic plan"):
        serve.check_config(_config("layer=semantic", f"layer.plan_path={tmp_path / 'pipe'}"))
    with pytest.raises(IsADirectoryError, match="scheduler.plan_path=.* is a directory, not a semantic plan"):
        serve.check_config(_config("scheduler={name:semantic,plan_path:" + str(tmp_path) + "}"))
    with pytest.raises(ValueError, match=r"places 8 experts per layer, the model has 16"):
        serve.layer_placements(str(path), 16, 2)
    with pytest.raises(ValueError, match="takes its placement from its semantic plan"):
        serve.check_config(_config("layer=semantic", "router=replay", f"+layer.placement_path={path}"))
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        serve.check_config(_config(f"layer.placement_path={tmp_path / 'nope.npz'}"))
    bad = tmp_path / "bad.npz"
    np.savez(bad, rows=np.array([1, 2]))
    with pytest.raises(ValueError, match="neither a placement file"):
        serve.check_config(_config(f"layer.placement_path={bad}"))


@pytest.mark.parametrize("override,match", [
    ("layer.kwargs.dispatcher=all2all", r"layer=vanilla layer\.kwargs: dispatcher must be one of"),
    ("model.top_k=9", r"model: MoEConfig\.top_k \(9\) must not exceed num_experts"),
    ("model.hidden_size=30", r"model: num_heads \(4\) must divide hidden_size \(30\)"),
])
def test_check_config_checks_the_model_and_the_layer_settings(override, match):
    """These failed inside every spawned rank, as a 30-line traceback per rank naming neither key."""
    from recipes.serve import check_config

    with pytest.raises(ValueError, match=match):
        check_config(_config(override))


def test_check_config_checks_a_variability_layers_settings():
    from recipes.serve import check_config

    for override, match in (("layer.kwargs.window=0", "window must be a positive int, got 0"),
                            ("layer.kwargs.restarts=0", "restarts must be a positive int, got 0")):
        with pytest.raises(ValueError, match=rf"layer=variability layer\.kwargs: {match}"):
            check_config(_config("layer=variability", override))
    check_config(_config("layer=variability", "variability=high"))  # per-rank curves and slowdowns: fine


def test_layer_kwargs_take_a_replica_policy_or_planner_by_import_path():
    """``+layer.kwargs.replica_policy=mypkg.Policy`` was refused ("must be callable, got str"), while
    layer.cls and scheduler take import paths."""
    import moelayers as ml
    from recipes import serve
    from recipes._common import layer_objects

    made = layer_objects({"replica_policy": "moelayers.dispatch.LocalFirstPolicy",
                          "planner": "moelayers.planning.eplb:plan_eplb", "dedup": False})
    assert isinstance(made["replica_policy"], ml.LocalFirstPolicy) and callable(made["planner"])
    assert made["dedup"] is False
    serve.check_config(_config("+layer.kwargs.replica_policy=moelayers.dispatch.LocalFirstPolicy"))
    with pytest.raises(ValueError, match=r"layer\.kwargs\.replica_policy='nope\.Policy': cannot import 'nope'"):
        serve.check_config(_config("+layer.kwargs.replica_policy=nope.Policy"))
    with pytest.raises(ValueError, match=r"layer\.kwargs\.planner='moelayers\.ExpertPlacement': a class is made "
                                         r"without arguments here"):
        layer_objects({"planner": "moelayers.ExpertPlacement"})
    groups = ml.ParallelGroups.single()
    d = _config("layer=variability", "+layer.kwargs.planner=moelayers.planning.eplb:plan_eplb")
    model = serve.build_model(d["model"], d["layer"], groups, torch.device("cpu"), 0)
    assert model.moe_layers and all(callable(m.planner) for m in model.moe_layers)


@pytest.mark.timeout(120)
def test_settings_a_fuzzer_found_ignored_are_refused(tmp_path):
    """Found by a fuzzer of the command line: each ran to the end with the setting read nowhere:
    trace.synthetic under router=learned; layer.plan_train_fraction beside a plan file (the file is
    served as it is); emulation.wait where no rank is slowed; a variability preset with
    emulation.mode=off, and a curves file outside curve mode, for a layer that takes no curves; a
    scheduler dict's plan_path with round_robin and a vanilla layer (recorded in provenance.inputs
    as if served), and a key of the scheduler dict that no scheduler reads."""
    from tests.distributed.test_semantic import make_plan

    plan = tmp_path / "plan.npz"
    make_plan(8, 2, vocab=512, mode="dp").save(plan)
    curves = tmp_path / "curves.npz"
    from moelayers.planning.gem import LatencyCurves

    LatencyCurves(np.array([1, 64, 2048]), np.array([[1e-5, 2e-5, 3e-4], [1e-5, 2e-5, 3e-4]])).save(curves)
    for overrides, match in (
            (("trace.synthetic=false",), r"trace.synthetic=false is read with router=replay only"),
            (("layer=semantic", "scheduler=semantic", f"layer.plan_path={plan}", "layer.plan_train_fraction=0.25"),
             r"layer.plan_train_fraction=0.25 splits the replay trace for a plan made by the run"),
            (("emulation.wait=spin",), r"emulation.wait=spin: nothing in this run reads it"),
            (("variability=high", "emulation.mode=off"), r"variability=high: nothing in this run reads it"),
            ((f"curves.path={curves}",), r"curves.path=.*: nothing in this run reads it"),
            ((f"scheduler={{name:round_robin,plan_path:{plan}}}",),
             r"scheduler.plan_path=.*: a semantic plan is read with layer=semantic or scheduler=semantic only"),
            ((f"scheduler={{name:semantic,plan_path:{plan},foo:1}}",), r"scheduler.foo=1: scheduler=semantic reads no key foo")):
        proc = _run_serve(tmp_path / "run", "progress=false", *overrides)
        assert proc.returncode != 0 and re.search(match, proc.stderr), (overrides, proc.stderr[-2000:])
        assert "rank 0" not in proc.stderr  # refused before any rank started


@pytest.mark.parametrize("overrides, swept, refused", [
    (("layer=vanilla", "++curves.path=/c.npz"), {"layer"}, None),  # -m layer=vanilla,variability: GEM reads it
    (("variability=none", "++emulation.wait=sleep"), {"variability"}, None),  # -m variability=none,high
    (("emulation.mode=off", "variability=high", "++emulation.wait=sleep"), {"emulation.mode"}, None),
    (("layer=vanilla", "variability=high", "emulation.mode=off"), {"layer"}, None),  # (an option takes no ++)
    (("layer=vanilla", "variability=high", "emulation.mode=off"), {"seed"}, r"variability=high: nothing in this run"),
    (("layer=vanilla", "++curves.path=/c.npz"), {"seed"}, r"\+\+curves\.path=/c\.npz: nothing in this run reads it"),
    (("layer=vanilla", "curves.path=/c.npz"), {"layer"}, r"curves\.path=/c\.npz: nothing in this run reads it"),
])
def test_a_sweep_over_what_decides_an_emulation_setting_lets_plus_plus_through(monkeypatch, overrides, swept, refused):
    """A review found `serve.py -m layer=vanilla,variability ++curves.path=F` refused on its vanilla job,
    and `-m variability=none,high ++emulation.wait=sleep` on its none job (README: ++KEY passes in a
    -m sweep whose other jobs read it)."""
    import recipes._common as common
    import recipes.serve as serve
    from moelayers.emulation import VariabilitySettings

    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": list(overrides)})
    monkeypatch.setattr(serve, "in_sweep", lambda key: key in swept)
    d = _config(*overrides)
    if common.merge_curves_path(d) and not isinstance(d.get("variability"), dict):  # (as main does)
        d["variability"] = {"name": d.get("variability") or "none", "curves": dict(d["curves"])}
    var = VariabilitySettings.from_config(d)
    if refused is None:
        serve.check_emulation_read(d, var, 2)
    else:
        with pytest.raises(ValueError, match=refused):
            serve.check_emulation_read(d, var, 2)


def test_emulation_refusals_give_each_setting_its_own_reason(monkeypatch):
    """emulation.wait with layer=variability was told to `use layer=variability` (chosen already)
    because 'the layer plans with no latency curves' (GEM plans with the preset's)."""
    import recipes._common as common
    import recipes.serve as serve
    from moelayers.emulation import VariabilitySettings

    overrides = ("layer=variability", "emulation.wait=spin")
    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": list(overrides)})
    d = _config(*overrides)
    with pytest.raises(ValueError, match=r"emulation\.wait=spin: nothing in this run reads it") as err:
        serve.check_emulation_read(d, VariabilitySettings.from_config(d), 2)
    assert "layer=variability" not in str(err.value).split("(", 1)[1] and "latency curves" not in str(err.value)


def test_the_baseline_reads_a_plan_path_of_our_scheduler_dict(monkeypatch):
    """`scheduler={name:round_robin,plan_path:F} compare.layer=vanilla compare.scheduler=semantic`: the
    baseline's semantic scheduler takes ours' plan (pin_semantic_plan); a review found it refused."""
    import recipes._common as common
    import recipes.serve as serve

    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": []})
    sched = "scheduler={name:round_robin,plan_path:/p.npz}"
    serve.check_scheduler_keys(_config("router=replay", sched, "compare.layer=vanilla", "compare.scheduler=semantic"))
    with pytest.raises(ValueError, match=r"scheduler\.plan_path=/p\.npz: a semantic plan is read with"):
        serve.check_scheduler_keys(_config("router=replay", sched))  # nothing reads it without the comparison
