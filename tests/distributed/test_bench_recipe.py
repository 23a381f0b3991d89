"""recipes/bench.py end to end on CPU: 2 gloo processes, the cpu_smoke shape, one JSON per size."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.unit.test_outputs_doc import assert_documented
from tests.unit.test_provenance import check_provenance

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("device_name", "world_size", "layer", "shape", "tokens_per_rank", "ms", "peer", "peer_ms", "ratio",
        "date", "command", "dtype", "iters", "torch", "triton")


def run_bench(tmp_path: Path, *overrides: str, shape: str | None = "cpu_smoke") -> subprocess.CompletedProcess:
    """recipes/bench.py on 2 gloo processes (``shape=None``: the default shape, no ``bench=`` override)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None), env.pop("RANK", None), env.pop("LOCAL_RANK", None)  # not a torchrun child
    cmd = [sys.executable, str(ROOT / "recipes" / "bench.py"), *([f"bench={shape}"] if shape else []),
           "parallel.world_size=2", f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def bench_record(tmp_path: Path, pattern: str, *overrides: str) -> dict:
    """Run the bench (one tokens_per_rank value), check it succeeded, return its one JSON record."""
    proc = run_bench(tmp_path, *overrides)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (f,) = (tmp_path / "run").glob(pattern)
    return json.loads(f.read_text())


@pytest.mark.timeout(90)
def test_bench_defaults_run_on_cpu(tmp_path):
    """`python recipes/bench.py` with no shape runs on CPU (DESIGN.md: the recipes' defaults do)."""
    proc = run_bench(tmp_path, shape=None)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert len(list((tmp_path / "run").glob("vanilla_cpu_smoke_t*_ws2_*.json"))) == 2


@pytest.mark.timeout(150)
def test_bench_writes_its_plot_and_plot_false_removes_an_earlier_one(tmp_path):
    proc = run_bench(tmp_path)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    png = tmp_path / "run" / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in proc.stdout
    proc = run_bench(tmp_path, "plot=false")
    assert proc.returncode == 0 and not png.exists(), proc.stdout[-2000:]
    assert f"removed {png}, an earlier run's output" in proc.stdout


def test_a_failing_plot_keeps_the_records_and_removes_an_earlier_plot(tmp_path, monkeypatch, capsys):
    """The records took the device time: a plot that fails must not take them along, and an earlier
    run's bench.png must not stay beside them."""
    import recipes._bench_records as bench

    def broken(records, path):
        raise RuntimeError("no matplotlib backend")

    monkeypatch.setattr(bench, "plot_bench", broken)
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    rec = {"layer": "vanilla", "shape_name": "cpu_smoke", "tokens_per_rank": 16, "world_size": 2, "ep": 2,
           "device_name": "cpu", "ms": 1.0}
    paths = bench.save_records([rec], str(tmp_path), None, plot=True)
    assert [Path(p).name for p in paths] == ["vanilla_cpu_smoke_t16_ws2_cpu.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vanilla_cpu_smoke_t16_ws2_cpu.json"]
    assert (f"warning: {tmp_path / 'bench.png'} not written (RuntimeError: no matplotlib backend); the run's other "
            "files are written without it") in capsys.readouterr().err


def test_plot_bench_draws_every_side_it_has(tmp_path):
    """Ours against the peer and a baseline at two sizes; a lone side says there is nothing to compare."""
    from recipes._plots import plot_bench

    base = dict(layer="semantic", peer="megatron MoELayer", baseline="vanilla", shape_name="qwen3_30b_a3b",
                device_name="NVIDIA H200", world_size=2, ep=2, dtype="bfloat16", mode="eager")
    recs = [dict(base, tokens_per_rank=t, ms=ms, peer_ms=p, ratio=ms / p, baseline_ms=b, vs_baseline=ms / b)
            for t, ms, p, b in ((4096, 2.7, 18.8, 2.9), (256, 2.6, 18.6, 2.5))]
    plot_bench(recs, tmp_path / "all.png")
    plot_bench([dict(base, tokens_per_rank=16, ms=1.9, peer_ms=None, ratio=None, baseline_ms=None,
                     vs_baseline=None)], tmp_path / "alone.png")
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in ("all.png", "alone.png"))


@pytest.mark.timeout(90)
def test_bench_cpu_smoke_writes_json(tmp_path):
    proc = run_bench(tmp_path, f"bench.save_to={tmp_path / 'saved'}")
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    files = sorted((tmp_path / "run").glob("vanilla_cpu_smoke_t*_ws2_*.json"))
    assert len(files) == 2, f"expected one JSON per tokens_per_rank (2), got {[f.name for f in files]}"
    saved = sorted(p.name for p in (tmp_path / "saved").glob("*.json"))
    assert saved == [f.name for f in files]
    assert (tmp_path / "saved" / ".moelayers-bench-records").is_file()  # the recipes refuse it as a run dir
    tokens = set()
    for f in files:
        rec = json.loads(f.read_text())
        missing = [k for k in KEYS if k not in rec]
        assert not missing, f"{f.name} lacks {missing}"
        assert rec["ms"] > 0
        assert rec["peer"] is None and rec["peer_ms"] is None and rec["ratio"] is None  # no megatron peer on CPU
        assert rec["world_size"] == 2 and rec["layer"] == "vanilla" and rec["dtype"] == "float32"
        assert rec["shape"] == {"H": 64, "E": 8, "K": 2, "F": 32}
        assert "bench=cpu_smoke" in rec["command"]
        check_provenance(rec["provenance"], {})
        assert_documented(rec, "bench.py")
        assert rec["check"]["reference"]["ok"]
        assert f.name == f"vanilla_cpu_smoke_t{rec['tokens_per_rank']}_ws2_{f.name.split('_ws2_')[1]}"
        tokens.add(rec["tokens_per_rank"])
    assert tokens == {16, 64}
    assert "ours ms" in proc.stdout  # the table


@pytest.mark.timeout(90)
def test_bench_router_dtype(tmp_path):
    """bench.router_dtype=fp32 reaches ours (and the peer): fp32 logits from bf16 weights, checked and recorded."""
    rec = bench_record(tmp_path, "vanilla_cpu_smoke_t16_ws2_*.json", "bench.dtype=bfloat16", "bench.router_dtype=fp32",
                       "bench.tokens_per_rank=[16]")
    assert rec["router_dtype"] == "float32" and rec["dtype"] == "bfloat16" and rec["check"]["reference"]["ok"]
    proc = run_bench(tmp_path, "bench.router_dtype=bf16", "hydra.run.dir=" + str(tmp_path / "bad"))
    assert proc.returncode != 0 and "bench.router_dtype='bf16'" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())  # nothing written


@pytest.mark.timeout(90)
def test_bench_refuses_large_shape_on_cpu(tmp_path):
    proc = run_bench(tmp_path, shape="qwen3_30b_a3b")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "without a CUDA device" in out and "bench=cpu_smoke" in out
    assert not list((tmp_path / "run").glob("*.json"))


def test_the_cpu_size_limit_is_named():
    """bench.max_cpu_expert_params: a bad value named no key ("invalid literal for int()"), and a
    limit below the smoke shape told to run the smoke shape (found by a fuzzer of the command line)."""
    import torch
    from recipes.bench import check_shape_fits

    smoke = {"name": "cpu_smoke", "shape": {"num_experts": 8, "hidden_size": 64, "ffn_hidden_size": 32}}
    with pytest.raises(ValueError, match=r"bench\.max_cpu_expert_params must be an integer >= 0, got 'abc'"):
        check_shape_fits({**smoke, "max_cpu_expert_params": "abc"}, torch.device("cpu"))
    with pytest.raises(SystemExit, match=r"more than bench\.max_cpu_expert_params=10 allows .* Raise "
                                         r"bench\.max_cpu_expert_params \(bench\.allow_large_cpu=true forces it\)"):
        check_shape_fits({**smoke, "max_cpu_expert_params": 10}, torch.device("cpu"))
    check_shape_fits({**smoke, "max_cpu_expert_params": 10, "allow_large_cpu": True}, torch.device("cpu"))
    check_shape_fits(smoke, torch.device("cpu"))


@pytest.mark.timeout(120)
def test_bench_semantic_against_vanilla_in_one_run(tmp_path):
    """layer=semantic replays its scheduler's requests; VanillaMoE (round robin) is timed in the same run.

    The documented command (default sequence lengths, 512-1536 tokens): the synthetic trace must hold
    enough held-out requests for every rank. The baseline executes like ours (here without dedup)."""
    proc = run_bench(tmp_path, "router=replay", "layer=semantic", "bench.tokens_per_rank=[64]", "layer.kwargs.dedup=false")
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (f,) = (tmp_path / "run").glob("semantic_nodedup_cpu_smoke_t64_ws2_*.json")  # dedup off: a name of its own
    rec = json.loads(f.read_text())
    assert rec["layer"] == "semantic" and rec["baseline"] == "vanilla" and rec["router"] == "replay"
    assert rec["baseline_kwargs"] == {"dispatcher": "alltoall", "dedup": False}
    assert rec["trace"]["tokens_repeated"] is False
    assert rec["baseline_ms"] > 0 and rec["vs_baseline"] == pytest.approx(rec["ms"] / rec["baseline_ms"])
    assert rec["check"]["reference"]["ok"] and rec["check"]["baseline_reference"]["ok"]
    for side in ("layer_stats", "baseline_stats"):
        assert 0.0 <= rec[side]["lar"] <= 1.0 and rec[side]["bytes_sent"] > 0
    assert "vanilla ms" in proc.stdout and "LAR baseline" in proc.stdout
    # Both records recomputed from what the bench replays: the same synthetic trace and held-out
    # requests (recipes._bench_tools, sized as bench_worker sizes them: 4 x world x tokens, >= 8 x world
    # sequences), rank r's 64 tokens of the requests the semantic scheduler / round robin gives it;
    # experts on the plan's ranks for ours, linear (experts r*E/R.. on rank r) for vanilla.
    from types import SimpleNamespace

    import torch
    from hydra import compose, initialize_config_dir

    from recipes._bench_tools import Replay, semantic_schedules
    from recipes._common import to_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        d = to_dict(compose("bench", overrides=["bench=cpu_smoke", "parallel.world_size=2", "router=replay",
                                                "layer=semantic"]))
    world, tokens, experts = 2, 64, rec["shape"]["E"]
    pairs = world * tokens * rec["shape"]["K"]  # (token, expert) activations over both ranks
    replay = Replay(d["trace"], SimpleNamespace(num_experts=experts, top_k=rec["shape"]["K"]), d["seed"],
                    4 * world * tokens, min_sequences=8 * world)
    assert d["layer"]["plan_train_fraction"] is None  # the recipe's default then: 0.5
    plan, owners = semantic_schedules(replay, world, d["seed"], 0.5, None)
    remote = {}
    for side, owner, expert_rank in (("layer_stats", "semantic", plan.expert_rank[replay.layer]),
                                     ("baseline_stats", "round_robin", np.arange(experts) // (experts // world))):
        ids = [replay.ids_for(r, tokens, torch.device("cpu"), owners[owner]).numpy() for r in range(world)]
        where = [expert_rank[i] for i in ids]  # [tokens, K] rank of each activation, per replaying rank
        local = sum(int((w == r).sum()) for r, w in enumerate(where))
        assert rec[side]["lar"] == pytest.approx(local / pairs, abs=1e-12), side
        assert rec[side]["rank_loads"] == np.bincount(np.concatenate(where).ravel(), minlength=world).tolist(), side
        remote[side] = pairs - local
    # without dedup every remote activation is one row of the same size, on both sides
    ours, base = rec["layer_stats"]["bytes_sent"], rec["baseline_stats"]["bytes_sent"]
    assert ours * remote["baseline_stats"] == base * remote["layer_stats"]
    assert rec["layer_stats"]["lar"] > rec["baseline_stats"]["lar"]  # the point of the semantic schedule


@pytest.mark.timeout(90)
def test_bench_semantic_needs_replayed_routing(tmp_path):
    proc = run_bench(tmp_path, "layer=semantic")
    assert proc.returncode != 0 and "router=replay" in proc.stdout + proc.stderr
    assert not list((tmp_path / "run").glob("*.json"))


def test_time_forwards_interleaves_the_runs():
    """Ours and the baseline alternate call by call (after each one's warm-up), so both see the same conditions."""
    import torch

    from recipes._bench_tools import time_forwards

    calls = []
    times = time_forwards([lambda: calls.append("a"), lambda: calls.append("b")], torch.device("cpu"), 2, 3)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert [len(t) for t in times] == [3, 3] and all(v >= 0 for t in times for v in t)


@pytest.mark.parametrize("check_finite", [False, True])
def test_build_layer_gives_every_layer_the_same_nan_check(check_finite):
    """``bench.check_finite`` reaches layers whose constructor takes ``**kwargs`` (SemanticMoE) as well as
    VanillaMoE: with it dropped, SemanticMoE kept its default NaN check and was timed doing extra work."""
    import torch

    from moelayers import MoEConfig, ParallelGroups
    from moelayers.planning.semantic import plan_semantic
    from moelayers.trace import synthetic_trace
    from recipes.bench import build_layer

    config = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2, params_dtype=torch.float32)
    trace = synthetic_trace(num_sequences=8, num_layers=1, num_experts=8, top_k=2, vocab_size=64, seed=0,
                            seq_len=(16, 32))
    plan = plan_semantic(trace, 1, mode="dp", seed=0, progress=False)
    cpu, groups = torch.device("cpu"), ParallelGroups.single()
    semantic = build_layer({"name": "semantic", "cls": "moelayers.SemanticMoE", "kwargs": {"mode": "dp"}},
                           config, groups, cpu, 0, check_finite, plan=plan, plan_layer=0)
    vanilla = build_layer({"name": "vanilla"}, config, groups, cpu, 0, check_finite)
    assert semantic.router.check_finite is check_finite
    assert vanilla.router.check_finite is check_finite


@pytest.mark.timeout(120)
def test_bench_times_variability_without_moving_weights(tmp_path):
    """A layer that re-plans by itself (VariabilityAwareMoE) is timed with auto_replan off, and says so:
    with a window of 2 steps it would re-plan within the 2 warm-up + 5 timed forwards; none happens."""
    rec = bench_record(tmp_path, "variability_cpu_smoke_t16_ws2_*.json", "layer=variability", "bench.baseline=vanilla",
                       "bench.tokens_per_rank=[16]", "layer.kwargs.window=2")
    assert rec["notes"] == ["variability: auto_replan off while timing"]
    assert rec["replans"] == 0
    assert rec["baseline"] == "vanilla" and rec["baseline_kwargs"] == {"dispatcher": "alltoall", "dedup": True}


@pytest.mark.parametrize("value, plan_based, expected", [
    (False, True, None), ("false", True, None), ("off", True, None), ("no", False, None), ("none", True, None),
    (None, True, None), ("auto", True, "vanilla"), ("auto", False, None), ("vanilla", False, "vanilla"),
])
def test_resolve_baseline(value, plan_based, expected):
    """Hydra passes ``bench.baseline=false`` as the bool False: no baseline (it used to look up a layer 'False')."""
    from recipes.bench import resolve_baseline

    assert resolve_baseline(value, plan_based) == expected


@pytest.mark.parametrize("value", [True, "on", "yes"])
def test_resolve_baseline_refuses_true(value):
    from recipes.bench import resolve_baseline

    with pytest.raises(ValueError, match="bench.baseline=.* names no layer"):
        resolve_baseline(value, True)


def bench_config(*overrides: str) -> dict:
    """conf/bench.yaml composed with bench=cpu_smoke and ``overrides``, as main hands it to check_config."""
    from hydra import compose, initialize_config_dir

    from recipes._common import to_dict

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        d = to_dict(compose("bench", overrides=["bench=cpu_smoke", *overrides]))
    d["_router_name"] = d["router"]["name"]
    return d


def test_check_config_takes_one_size_and_refuses_bad_counts():
    """``bench.tokens_per_rank=16`` is one size (it was a TypeError inside every rank); iters, warmup and the
    sizes are checked before any rank starts (``iters=0`` ended in 'no median for empty data')."""
    from recipes.bench import check_config

    d = bench_config("bench.tokens_per_rank=16")
    check_config(d)
    assert d["bench"]["tokens_per_rank"] == [16]
    for override, match in [("bench.iters=0", r"bench\.iters must be an integer >= 1, got 0"),
                            ("bench.warmup=-1", r"bench\.warmup must be an integer >= 0, got -1"),
                            ("bench.iters=2.5", r"bench\.iters must be an integer >= 1, got 2\.5"),
                            ("bench.tokens_per_rank=[16,0]", r"bench\.tokens_per_rank must be an integer >= 1, got 0"),
                            ("bench.baseline=true", r"bench\.baseline=True names no layer"),
                            ("trace.seq_len=[64,32]", r"trace\.seq_len \[lo, hi\] needs lo <= hi")]:
        with pytest.raises(ValueError, match=match):
            check_config(bench_config("router=replay", override))


@pytest.mark.parametrize("seq_len", [64, [64, 64]])
def test_replay_takes_one_sequence_length(seq_len):
    """``trace.seq_len=64`` (fixed length, as plan.py reads it) replays like ``[64, 64]`` (it was a TypeError)."""
    import torch

    from moelayers import MoEConfig
    from recipes._bench_tools import Replay

    config = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2, params_dtype=torch.float32)
    replay = Replay({"seq_len": seq_len}, config, seed=0, need_tokens=256)
    assert (replay.trace.seq_lengths == 64).all() and replay.trace.num_tokens >= 256
    assert replay.ids_for(1, 16, torch.device("cpu")).shape == (16, 2)


def test_replay_names_its_synthetic_trace_and_can_fix_its_size():
    """The synthetic trace's routing depends on its number of sequences, which follows the largest
    size timed: the label names it, and trace.num_sequences fixes it (the same routing at t=16 whether
    or not t=4096 is timed too; before, both runs carried the same label and replayed other routing)."""
    import torch

    from moelayers import MoEConfig
    from recipes._bench_tools import Replay
    from recipes.bench import check_config

    config = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2, params_dtype=torch.float32)
    small, large = (Replay({}, config, seed=0, need_tokens=n) for n in (32, 32 * 1024))
    assert small.source != large.source and "num_sequences=2)" in small.source
    fixed = [Replay({"num_sequences": 12}, config, seed=0, need_tokens=n) for n in (32, 32 * 1024)]
    assert fixed[0].source == fixed[1].source and "num_sequences=12)" in fixed[0].source
    assert torch.equal(fixed[0].ids, fixed[1].ids)
    with pytest.raises(ValueError, match="trace.num_sequences must be an integer >= 8"):
        Replay({"num_sequences": 4}, config, seed=0, need_tokens=32, min_sequences=8)
    with pytest.raises(ValueError, match="trace.num_sequences sizes the synthetic trace"):
        check_config(bench_config("router=replay", "trace.path=x.npz", "trace.num_sequences=4"))
    with pytest.raises(ValueError, match="trace.num_sequences must be an integer >= 1"):
        check_config(bench_config("router=replay", "trace.num_sequences=0"))


def test_records_name_the_dispatcher(tmp_path):
    """An all-gather (or non-de-duplicated) run was recorded as 'eager (exact all-to-all-v)' under the
    default run's file name, so bench.save_to replaced the all-to-all record with it."""
    from types import SimpleNamespace

    from recipes.bench import _eager_mode, save_records

    modes = [_eager_mode(SimpleNamespace(dispatcher_name=d, dedup=dd))
             for d, dd in (("alltoall", True), ("allgather", True), ("alltoall", False))]
    assert modes == ["eager (exact all-to-all-v)", "eager (all-gather)", "eager (exact all-to-all-v, no de-duplication)"]
    rec = {"device_name": "cpu", "layer": "vanilla", "shape_name": "s", "tokens_per_rank": 16, "world_size": 2, "ep": 2}
    names = [Path(save_records([{**rec, "mode": m}], str(tmp_path), None)[0]).name for m in modes]
    assert names == ["vanilla_s_t16_ws2_cpu.json", "vanilla_allgather_s_t16_ws2_cpu.json",
                     "vanilla_nodedup_s_t16_ws2_cpu.json"]
    # another dtype, router dtype or replayed routing overwrote the default run's record too
    gpu = {**rec, "mode": modes[0], "backend": "nccl", "dtype": "bfloat16", "router": "learned", "router_dtype": None}
    variants = [gpu, {**gpu, "dtype": "float32"}, {**gpu, "router_dtype": "float32"}, {**gpu, "router": "replay"},
                {**rec, "mode": modes[0], "backend": "gloo", "dtype": "float32"}]
    names = [Path(save_records([r], str(tmp_path), None)[0]).name for r in variants]
    assert names == ["vanilla_s_t16_ws2_cpu.json", "vanilla_s_t16_ws2_float32_cpu.json",
                     "vanilla_s_t16_ws2_router-float32_cpu.json", "vanilla_s_t16_ws2_replay_cpu.json",
                     "vanilla_s_t16_ws2_cpu.json"]


def test_check_config_refuses_dtypes_and_checks_that_would_fail_in_the_ranks():
    """Found by a sweep: these failed inside every rank after the layers were built (or, for
    ref_rows=0, passed a correctness check of no rows)."""
    from recipes.bench import check_config

    for override, match in [("bench.dtype=fp32", r"bench\.dtype must be auto or one of"),
                            ("bench.router_dtype=float32", r"bench\.router_dtype='float32'"),
                            ("bench.check.ref_rows=0", r"bench\.check\.ref_rows must be an integer >= 1"),
                            ("bench.check.tol=abc", r"bench\.check\.tol must be null or a number >= 0")]:
        with pytest.raises(ValueError, match=match):
            check_config(bench_config(override))
    with pytest.raises(ValueError, match="narrower than bench.dtype=float64"):
        check_config(bench_config("bench.dtype=float64", "bench.router_dtype=fp32"))
    check_config(bench_config("bench.dtype=float32", "bench.router_dtype=fp64"))


@pytest.mark.timeout(90)
def test_bench_bad_iters_fails_before_the_ranks_start(tmp_path):
    proc = run_bench(tmp_path, "bench.iters=0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "bench.iters must be an integer >= 1, got 0" in out
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def _checked_layer(wrong_routing: bool = False):
    """A 1-process VanillaMoE on 300 tokens (fp32) and its weights; ``wrong_routing``: forced to
    each token's K lowest-scoring experts (a wrong router)."""
    import torch

    import moelayers as ml

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=8, top_k=2, init_std=0.3)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(3))
    if wrong_routing:
        layer.force_routing(torch.topk(-(x @ layer.router.weight.detach().t()), 2, dim=-1).indices)
    with torch.no_grad():
        y = layer(x)
    return layer, x, y, tuple(w.double() for w in layer.export_full_weights()), cfg


def test_reference_check_catches_a_wrong_router_and_nan_rows():
    """It compared ours with the dense reference on the experts ours chose (a wrong router passed)
    and on the first 256 rows only (NaN beyond them passed)."""
    import torch

    from recipes._bench_tools import check_against_reference

    cpu = torch.device("cpu")
    layer, x, y, weights, cfg = _checked_layer()
    assert check_against_reference(layer, x, y, weights, cfg, 256, cpu)["ok"]
    bad = check_against_reference(*_checked_layer(wrong_routing=True)[:4], cfg, 256, cpu)
    assert not bad["ok"] and bad["rows_other_experts"] == 256
    y_nan = y.clone()
    y_nan[280:] = float("nan")
    assert not check_against_reference(layer, x, y_nan, weights, cfg, 256, cpu)["ok"]


def test_peer_check_refuses_nan_and_a_far_off_row():
    import torch

    from recipes._bench_tools import check_against_peer

    cpu = torch.device("cpu")
    y_peer = torch.randn(1000, 8, generator=torch.Generator().manual_seed(0))
    assert check_against_peer(y_peer + 1e-4, y_peer, 2e-2, 1e-3, cpu)["ok"]
    far = y_peer.clone()
    far[7] += 1e6  # one row of 1000 off by anything used to pass as a "near-tie"
    nan = torch.full_like(y_peer, float("nan"))
    for ours, peer in ((far, y_peer), (nan, y_peer), (y_peer * 1e9, nan)):
        assert not check_against_peer(ours, peer, 2e-2, 1e-3, cpu)["ok"]
    near = y_peer.clone()
    near[7] += 3e-2 * y_peer.abs().max()  # one row a little over: still a near-tie
    assert check_against_peer(near, y_peer, 2e-2, 1e-3, cpu)["ok"]


def test_build_layer_uses_an_explicit_cls():
    """layer.cls=... used to be ignored when layer.name was a registered name."""
    import torch

    import moelayers as ml
    from recipes.bench import build_layer

    cfg = ml.MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2)
    layer = build_layer({"name": "vanilla", "cls": "moelayers.VariabilityAwareMoE", "kwargs": {}}, cfg,
                        ml.ParallelGroups.single(), torch.device("cpu"), 0, False)
    assert type(layer) is ml.VariabilityAwareMoE


@pytest.mark.timeout(90)
def test_bench_records_the_expert_parallel_size(tmp_path):
    """parallel.ep=1 at world 2 (each rank all experts, no exchange) was recorded, named and printed as the
    ep = world run (``..._ws2_<device>.json``, no ep anywhere): its much lower ms passed for the EP=2 figure."""
    proc = run_bench(tmp_path, "parallel.ep=1", "bench.tokens_per_rank=[16]")
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (f,) = (tmp_path / "run").glob("*.json")
    assert f.name.startswith("vanilla_cpu_smoke_t16_ws2_ep1_")
    rec = json.loads(f.read_text())
    assert rec["ep"] == 1 and rec["world_size"] == 2
    assert "world 2 (ep 1)" in proc.stdout


@pytest.mark.timeout(90)
def test_bench_flags_repeated_trace_tokens_per_size(tmp_path):
    """A 32-token trace replayed at 16 and 64 tokens/rank on 2 ranks: only t=64 wraps. tokens_repeated was
    one flag for the whole run (true in the t=16 record too) and nothing was printed."""
    from moelayers.trace import save_trace, synthetic_trace

    path = tmp_path / "tiny.npz"
    save_trace(synthetic_trace(2, 1, 8, 2, 500, seq_len=(16, 16), seed=0), path)
    proc = run_bench(tmp_path, "router=replay", f"trace.path={path}", "bench.iters=1", "bench.warmup=0")
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    repeated, noted = {}, {}
    for f in (tmp_path / "run").glob("*.json"):
        rec = json.loads(f.read_text())
        repeated[rec["tokens_per_rank"]] = rec["trace"]["tokens_repeated"]
        noted[rec["tokens_per_rank"]] = any("trace tokens repeat" in n for n in rec["notes"])
    assert repeated == {16: False, 64: True}
    assert noted == {16: False, 64: True}  # the t=64 note was in the t=16 record too
    assert "warning: tokens/rank=64: the trace holds fewer tokens" in proc.stderr  # (warnings on stderr)


@pytest.mark.parametrize("override, match", [
    ("+layer.kwargs.capacity=64", r"layer\.kwargs\.capacity=64: the bench sets capacity"),
    ("+layer.kwargs.cuda_graph=true", r"layer\.kwargs\.cuda_graph=True: the bench sets"),
    ("+layer.kwargs.beyond_capacity=exact", r"layer\.kwargs\.beyond_capacity='exact': the bench sets"),
    ("bench.peer=ture", r"bench\.peer must be auto, true \(required\) or false, got 'ture'"),
    ("bench.profile_tokens=0", r"bench\.profile_tokens must be an integer >= 1, got 0"),
    ("bench.profile_iters=0", r"bench\.profile_iters must be an integer >= 1, got 0"),
    ("+layer.kwargs.mode=tp", r"use layer\.kwargs\.mode=dp; mode=tp runs through forward_tp"),
    ("bench.baseline=bogus", r"bench\.baseline='bogus': no bogus\.yaml in .*conf/layer; one of \['semantic', 'vanilla', 'variability'\].*\(registered: \['vanilla'\]\)"),
    ("bench.baseline=semantic", r"bench\.baseline=semantic is built from a semantic plan"),
    ("parallel.ep=3", r"parallel\.ep=3 must divide the world size 2"),  # failed inside every rank
    # the layer's kwarg won in build_layer while the record and its name said bench.check_finite's
    ("+layer.kwargs.check_finite=true", r"layer\.kwargs\.check_finite=True differs from bench\.check_finite=False"),
    # the learned router ran and the record said trace: null
    ("trace.path=x.npz", r"trace\.path=x\.npz is read with router=replay only \(router=learned"),
    # Hydra's hint for variability=high; nothing was emulated and the record said nothing
    ("+variability=high", r"variability: bench\.py times the hardware as it is and emulates no GPU variability"),
    ("+emulation.mode=curve", r"emulation: bench\.py times the hardware"),
])
def test_check_config_refuses_settings_that_were_ignored_or_mislabelled(override, match):
    """layer.kwargs.capacity=64 padded every size to 64 tokens (t=16 timed 64 rows), left the baseline
    exact and was recorded as mode 'eager (exact all-to-all-v)'; a typo in bench.peer meant auto;
    profile_tokens=0 fell back to the largest size and profile_iters=0 printed an empty profile."""
    from recipes.bench import check_config

    with pytest.raises(ValueError, match=match):
        check_config(bench_config(override))


def test_replayed_trace_layer_is_an_integer_and_names_the_record(tmp_path):
    """trace.layer=1.7 replayed layer 1; records of another layer of the same trace had the same
    name, so bench.save_to replaced one with the other."""
    from recipes.bench import check_config, save_records

    with pytest.raises(ValueError, match=r"trace\.layer must be an integer >= 0, got 1\.7"):
        check_config(bench_config("router=replay", "trace.layer=1.7"))
    rec = {"device_name": "cpu", "layer": "vanilla", "shape_name": "s", "tokens_per_rank": 16, "world_size": 2, "ep": 2,
           "mode": "eager (exact all-to-all-v)", "router": "replay"}
    names = [Path(save_records([{**rec, "trace": {"path": "/t/e8.npz", "layer": layer}}], str(tmp_path), None)[0]).name
             for layer in (0, 2)]
    assert names[0] != names[1] and names[1].endswith("_layer2_cpu.json") and "_layer" not in names[0]


@pytest.mark.timeout(120)
def test_trace_settings_without_replay_are_refused_on_the_command_line(tmp_path):
    """trace.layer=2 (and the synthetic trace's settings) with the learned router were ignored silently."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "bench.py"), "trace.layer=2",
                           f"hydra.run.dir={tmp_path / 'out'}"], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0 and "trace.layer=2 is read with router=replay only" in proc.stderr, proc.stderr[-2000:]


def test_check_config_takes_a_layer_nan_check_that_agrees():
    from recipes.bench import check_config

    check_config(bench_config("+layer.kwargs.check_finite=true", "bench.check_finite=true"))
    check_config(bench_config("+layer.kwargs.check_finite=false"))


def test_a_baseline_named_by_its_layer_config():
    """bench.baseline=variability failed in every rank ('unknown layer', only vanilla was registered):
    a conf/layer name gives the baseline its class and kwargs, with ours' execution kwargs."""
    from recipes.bench import baseline_config, check_config

    check_config(bench_config("bench.baseline=variability"))
    base = baseline_config("variability", {"name": "vanilla", "kwargs": {"dispatcher": "allgather", "dedup": False}})
    assert base["cls"] == "moelayers.VariabilityAwareMoE" and base["kwargs"]["window"] == 16
    assert base["kwargs"]["dispatcher"] == "allgather" and base["kwargs"]["dedup"] is False
    assert baseline_config("vanilla", {"kwargs": {}}) == {"name": "vanilla", "kwargs": {}}


def test_check_config_refuses_a_plan_built_layer_below_the_world():
    """layer=semantic plans and schedules over the world: parallel.ep=2 at world 4 planned first, then failed
    inside every rank with 'the plan is for 4 ranks, the expert-parallel group has 2' (no setting named)."""
    from recipes.bench import check_config

    d = bench_config("router=replay", "layer=semantic", "parallel.world_size=4", "parallel.ep=2")
    with pytest.raises(ValueError, match=r"layer=semantic .*parallel\.ep must be null or the world size \(4\), got 2"):
        check_config(d)
    check_config(bench_config("router=replay", "layer=semantic", "parallel.world_size=4", "parallel.ep=4"))
    check_config(bench_config("parallel.world_size=4", "parallel.ep=2"))  # vanilla: any ep


def test_save_to_is_written_atomically(tmp_path, monkeypatch):
    """bench.save_to (e.g. docs/benchmarks) got a plain copy: cut short, it left half a JSON there."""
    import shutil

    from recipes.bench import save_records

    def cut_short(src, dst, *args, **kwargs):  # the disk fills up half way through the copy
        Path(dst).write_text(Path(src).read_text()[:10])
        raise OSError("No space left on device")

    monkeypatch.setattr(shutil, "copyfile", cut_short)
    rec = {"device_name": "cpu", "layer": "vanilla", "shape_name": "s", "tokens_per_rank": 16, "world_size": 2,
           "ep": 2, "mode": "eager", "ms": 1.0}
    try:
        save_records([rec], str(tmp_path / "run"), str(tmp_path / "saved"))
    except OSError:
        pass
    saved = tmp_path / "saved" / "vanilla_s_t16_ws2_cpu.json"
    assert not saved.exists() or json.loads(saved.read_text()) == rec  # all or nothing


def test_save_to_filling_up_names_the_records_left_to_copy(tmp_path, monkeypatch):
    """A full disk in bench.save_to after the first record: the folder is marked as a record store
    all the same, and the error says which records to copy from the run dir (all of them are there)."""
    import errno

    import recipes._bench_records as records

    real = records.write_json

    def full_disk(path, obj):
        if "saved" in str(path) and "t32" in str(path):
            raise OSError(errno.ENOSPC, f"{path}: cannot write (No space left on device)")
        return real(path, obj)

    monkeypatch.setattr(records, "write_json", full_disk)
    recs = [{"device_name": "cpu", "layer": "vanilla", "shape_name": "s", "tokens_per_rank": t, "world_size": 2,
             "ep": 2, "mode": "eager", "ms": 1.0} for t in (16, 32)]
    with pytest.raises(OSError, match=r"No space left on device\): bench.save_to=.*saved: 1 of 2 records copied; "
                                      r"every record is in the run dir .*run, the ones not copied: vanilla_s_t32_ws2_cpu.json"):
        records.save_records(recs, str(tmp_path / "run"), str(tmp_path / "saved"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "vanilla_s_t16_ws2_cpu.json", "vanilla_s_t32_ws2_cpu.json"]
    saved = sorted(p.name for p in (tmp_path / "saved").iterdir())
    assert saved == sorted([records.BENCH_STORE_MARK, "vanilla_s_t16_ws2_cpu.json"])


def test_save_to_keeps_a_record_of_other_settings_under_the_same_name(tmp_path, capsys):
    """Found by a sweep: a changed shape field (bench.shape.hidden_size=128), seed or
    bench.inference_mode left the file name alone, so bench.save_to replaced one configuration's
    record with another's. The record carries a digest of those settings; another digest keeps both."""
    from recipes.bench import SETTINGS_DIGEST_VERSION, save_records, settings_digest

    # a worker's record (resolved values) and the config it came from
    run = {"dtype": "float32", "ep": 2, "backend": "gloo", "warmup": 10, "iters": 50, "mode": "eager", "train": False,
           "layer": "vanilla", "layer_kwargs": {}, "baseline": None, "peer": None, "router": "replay",
           "trace": {"source": "synthetic_trace(seed=0, seq_len=(512, 1536), num_sequences=4)", "layer": 0,
                     "path": None}}
    base = settings_digest(run, bench_config())
    changed = []
    for key, value in (("seed", 3), ("bench.inference_mode", False), ("bench.shape.hidden_size", 128),
                       ("trace.vocab_size", 512)):
        e = bench_config()
        node = e
        *path, last = key.split(".")
        for k in path:
            node = node[k]
        node[last] = value
        changed.append(settings_digest(run, e))
    # the review's cases: a synthetic trace sized by the largest tokens_per_rank is another trace
    changed.append(settings_digest({**run, "trace": {**run["trace"], "source": run["trace"]["source"][:-2] + "2)"}},
                                   bench_config()))
    assert len({base, *changed}) == 6, (base, changed)
    untimed = bench_config("bench.dtype=float32", "parallel.ep=2", "bench.baseline=none")  # as resolved: the same
    untimed["bench"]["save_to"], untimed["bench"]["tokens_per_rank"] = "/elsewhere", [7]
    assert settings_digest(run, untimed) == base  # where it is saved and the sizes (in the name) are not settings
    files = [{**run, "trace": {"layer": 0, "path": p, "source": p}} for p in ("/x/t.npz", "/x/sub/../t.npz")]
    assert settings_digest(files[0], bench_config()) == settings_digest(files[1], bench_config())
    rec = {"device_name": "cpu", "layer": "vanilla", "shape_name": "s", "tokens_per_rank": 16, "world_size": 2,
           "ep": 2, "mode": "eager", "ms": 1.0, "shape": {"H": 64}, "settings_digest_version": SETTINGS_DIGEST_VERSION}
    saved = tmp_path / "saved"
    save_records([{**rec, "settings_digest": base}], str(tmp_path / "run"), str(saved))
    save_records([{**rec, "ms": 2.0, "settings_digest": base}], str(tmp_path / "run"), str(saved))  # same: replaced
    assert [json.loads(f.read_text())["ms"] for f in saved.glob("*.json")] == [2.0]
    save_records([{**rec, "ms": 3.0, "settings_digest": changed[0]}], str(tmp_path / "run"), str(saved))
    files = sorted(f.name for f in saved.glob("*.json"))
    assert files == ["vanilla_s_t16_ws2_cpu.json", f"vanilla_s_t16_ws2_cpu_cfg-{changed[0][:6]}.json"], files
    assert json.loads((saved / files[0]).read_text())["ms"] == 2.0  # kept
    assert "holds a record of other settings" in capsys.readouterr().out
    legacy = tmp_path / "legacy"  # a record from before digests: another shape or iters is another configuration
    save_records([{k: v for k, v in rec.items() if k != "settings_digest_version"}], str(tmp_path / "run"), str(legacy))
    save_records([{**rec, "shape": {"H": 128}, "settings_digest": base}], str(tmp_path / "run"), str(legacy))
    save_records([{**rec, "iters": 200, "settings_digest": changed[1]}], str(tmp_path / "run"), str(legacy))
    assert len(list(legacy.glob("*.json"))) == 3
    save_records([{**rec, "ms": 5.0, "settings_digest": base}], str(tmp_path / "run"), str(legacy))  # the same as it
    assert len(list(legacy.glob("*.json"))) == 3
    # a digest of an older scheme (a review found today's first records' digests unmatchable): compared as legacy
    older = tmp_path / "older"
    save_records([{**rec, "settings_digest": "e8e6485217a4", "settings_digest_version": None}], str(tmp_path / "run"),
                 str(older))
    save_records([{**rec, "ms": 6.0, "settings_digest": base}], str(tmp_path / "run"), str(older))
    assert [json.loads(f.read_text())["ms"] for f in older.glob("*.json")] == [6.0]


def test_a_reused_run_dir_keeps_only_this_runs_records(tmp_path, capsys):
    """Found by a sweep: bench into a reused hydra.run.dir left the earlier run's records (another
    tokens_per_rank) and profiler trace beside the new ones. Other files are left alone."""
    from recipes.bench import remove_earlier_outputs

    rec = {"device_name": "cpu", "tokens_per_rank": 16, "ms": 1.0}
    old = {"vanilla_s_t16_ws2_cpu.json": rec, "profile_vanilla_s_t16_rank0.json": {"traceEvents": []},
           "notes.json": {"mine": True}}
    for name, obj in old.items():
        (tmp_path / name).write_text(json.dumps(obj))
        os.utime(tmp_path / name, (1_000_000, 1_000_000))
    (tmp_path / "vanilla_s_t32_ws2_cpu.json").write_text(json.dumps(rec))  # this run's
    removed = remove_earlier_outputs(str(tmp_path), started=2_000_000)
    assert sorted(os.path.basename(p) for p in removed) == ["profile_vanilla_s_t16_rank0.json",
                                                             "vanilla_s_t16_ws2_cpu.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "vanilla_s_t32_ws2_cpu.json"]
    assert capsys.readouterr().out.count("an earlier run's output") == 2
    written = tmp_path / "vanilla_s_t64_ws2_cpu.json"  # this run's, stamped in the past (a clock skew)
    written.write_text(json.dumps(rec))
    os.utime(written, (1_000_000, 1_000_000))
    assert remove_earlier_outputs(str(tmp_path), started=2_000_000, written=[str(written)]) == []


def test_a_plan_file_leaves_out_the_sequences_it_was_trained_on(tmp_path):
    """Found by a sweep: with layer.plan_path every trace sequence was replayed, "whether the plan
    was trained on them is not known here", though the plan file records them (serve used that)."""
    from types import SimpleNamespace

    from moelayers.planning.semantic import plan_semantic
    from recipes._bench_tools import Replay, semantic_schedules

    shape = SimpleNamespace(num_experts=8, top_k=2)
    trace_cfg = {"synthetic": True, "seq_len": [16, 48], "num_sequences": 16, "vocab_size": 256}

    def replay():
        return Replay(dict(trace_cfg), shape, 0, 64, min_sequences=16)

    full = replay().trace
    train, held = full.split(0.25)
    plan_semantic(train, 2, mode="dp", seed=0, progress=False).save(tmp_path / "plan.npz")
    r, notes = replay(), []
    semantic_schedules(r, 2, 0, 0.5, str(tmp_path / "plan.npz"), notes)
    assert r.trace.num_sequences == held.num_sequences == 12
    assert (r.trace.sequence_digests() == held.sequence_digests()).all()
    assert notes == [f"4 of 16 trace sequences are left out: the plan {tmp_path / 'plan.npz'} was trained on them "
                     "(by content)"]


def test_a_trace_that_does_not_fit_the_shape_is_refused_before_the_ranks_start(tmp_path):
    """Found by a sweep: trace.layer past the trace's layers, or a trace of other experts or top-k,
    failed inside every rank (a traceback per rank); check_config says it now."""
    from moelayers.trace import RoutingTrace, save_trace
    from recipes.bench import check_config

    shape = bench_config()["bench"]["shape"]
    e, k = shape["num_experts"], shape["top_k"]
    rng = np.random.default_rng(0)

    def write(name, experts, top_k, layers=2):
        ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(20 * layers)]).reshape(20, layers, top_k)
        save_trace(RoutingTrace(ids.astype(np.int64), rng.integers(0, 100, size=20).astype(np.int64),
                                np.array([0, 10, 20]), experts, vocab_size=100), tmp_path / name)
        return tmp_path / name

    ok, other = write("ok.npz", e, k), write("other.npz", e * 2, k)
    check_config(bench_config("router=replay", f"trace.path={ok}", "trace.layer=1"))
    with pytest.raises(ValueError, match=r"trace\.layer=2 but trace\.path=.*ok\.npz has 2 layer\(s\)"):
        check_config(bench_config("router=replay", f"trace.path={ok}", "trace.layer=2"))
    with pytest.raises(ValueError, match=rf"other\.npz has E={2 * e}, K={k}; the benchmark shape has E={e}, K={k}"):
        check_config(bench_config("router=replay", f"trace.path={other}"))


def test_no_peer_when_ours_runs_below_the_world():
    """megatron's MoELayer spreads its experts over the whole world: with parallel.ep below it the two
    would time different layouts, so the peer is left out (auto) or refused (required), saying why."""
    import torch

    from recipes._bench_tools import build_peer

    cfg = pytest.importorskip("moelayers").MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    peer, name, note = build_peer(cfg, torch.float32, torch.device("cpu"), "auto", None, ep=2)  # world 1
    assert peer is None and name is None and "parallel.ep=2 of a world of 1" in note
    with pytest.raises(RuntimeError, match="bench.peer=true but ours runs at parallel.ep=2"):
        build_peer(cfg, torch.float32, torch.device("cpu"), "true", None, ep=2)
    assert "needs CUDA" in build_peer(cfg, torch.float32, torch.device("cpu"), "auto", None, ep=1)[2]


def test_record_names_tell_every_setting_that_changes_the_measurement(tmp_path):
    """Found by a sweep: replayed routing on a layer other than vanilla, a trace file, a plan file,
    the NaN check, the expert backend and the baseline left the file name alone, so bench.save_to
    replaced one configuration's record with another's."""
    from recipes.bench import save_records

    rec = {"device_name": "cpu", "shape_name": "s", "tokens_per_rank": 16, "world_size": 2, "ep": 2,
           "mode": "eager (exact all-to-all-v)", "backend": "gloo", "dtype": "float32", "router": "learned"}
    variants = [
        {**rec, "layer": "variability"},
        {**rec, "layer": "variability", "router": "replay"},
        {**rec, "layer": "vanilla", "router": "replay", "trace": {"path": "/x/my trace.npz"}},
        {**rec, "layer": "semantic", "router": "replay", "plan_based": True, "baseline": "vanilla"},
        {**rec, "layer": "semantic", "router": "replay", "plan_based": True, "baseline": "vanilla",
         "plan_path": "/x/plan_dp.npz"},
        {**rec, "layer": "semantic", "router": "replay", "plan_based": True, "baseline": None},
        {**rec, "layer": "vanilla", "check_finite": True},
        {**rec, "layer": "vanilla", "layer_kwargs": {"expert_backend": "loop"}},
        {**rec, "layer": "vanilla", "baseline": "variability"},
        {**rec, "layer": "vanilla", "train": True},
    ]
    names = [Path(save_records([r], str(tmp_path), None)[0]).name for r in variants]
    names = [re.sub(r"-[0-9a-f]{6}_", "-HASH_", n) for n in names]  # the file's path hash
    assert names == ["variability_s_t16_ws2_cpu.json", "variability_s_t16_ws2_replay_cpu.json",
                     "vanilla_s_t16_ws2_replay_trace-my-trace-HASH_cpu.json", "semantic_s_t16_ws2_cpu.json",
                     "semantic_s_t16_ws2_plan-plan_dp-HASH_cpu.json", "semantic_s_t16_ws2_vs-none_cpu.json",
                     "vanilla_s_t16_ws2_checkfinite_cpu.json", "vanilla_s_t16_ws2_loop_cpu.json",
                     "vanilla_s_t16_ws2_vs-variability_cpu.json", "vanilla_s_t16_ws2_train_cpu.json"]
    # two plans of one stem in other folders: two records
    two = [Path(save_records([{**variants[4], "plan_path": f"/{d}/plan_dp.npz"}], str(tmp_path), None)[0]).name
           for d in ("a", "b")]
    assert two[0] != two[1]


def test_check_config_checks_plan_files_save_to_and_sizes(tmp_path):
    """Found by a sweep: a tp plan was timed as dp without a word; a missing plan or trace file, a plan
    for other ranks, a bad plan_train_fraction failed inside every rank; bench.save_to naming a file
    failed after the run (losing records); a size given twice overwrote its own record."""
    from recipes.bench import check_config
    from tests.distributed.test_semantic import make_plan

    semantic = ("router=replay", "layer=semantic")
    for name, kwargs in (("tp", {"mode": "tp"}), ("r4", {"mode": "dp"}), ("ok", {"mode": "dp"})):
        make_plan(8, 4 if name == "r4" else 2, vocab=64, **kwargs).save(tmp_path / f"{name}.npz")
    check_config(bench_config(*semantic, f"layer.plan_path={tmp_path / 'ok.npz'}"))
    for override, exc, match in (
            (f"layer.plan_path={tmp_path / 'tp.npz'}", ValueError, r"tp\.npz: semantic plan field 'mode' is 'tp'"),
            (f"layer.plan_path={tmp_path / 'r4.npz'}", ValueError, r"r4\.npz.*'num_ranks' is 4"),
            (f"layer.plan_path={tmp_path / 'no.npz'}", FileNotFoundError, r"layer\.plan_path=.*no\.npz does not exist"),
            ("layer.plan_train_fraction=1.0", ValueError, r"layer\.plan_train_fraction must be null \(0\.5\) or a number"),
            (f"trace.path={tmp_path / 'no_trace.npz'}", FileNotFoundError, r"trace\.path=.*no_trace\.npz does not exist"),
            # a folder was said not to exist (found by a sweep)
            (f"trace.path={tmp_path}", IsADirectoryError, r"trace\.path=.* is a directory, not a routing trace file")):
        with pytest.raises(exc, match=match):
            check_config(bench_config(*semantic, override))
    with pytest.raises(ValueError, match="use router=replay"):
        check_config(bench_config("layer=semantic"))
    with pytest.raises(ValueError, match=r"layer\.placement_path=/x/a\.npz is read by recipes/serve\.py only"):
        check_config(bench_config("layer.placement_path=/x/a.npz"))  # it was ignored (found by a review)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"bench\.save_to=.*afile is a file"):
        check_config(bench_config(f"bench.save_to={tmp_path / 'afile'}"))
    with pytest.raises(ValueError, match=r"names a size twice"):
        check_config(bench_config("bench.tokens_per_rank=[7,7]"))



@pytest.mark.timeout(120)
def test_bench_train_times_training_steps(tmp_path):
    """bench.train=true: forward + backward of ours and the baseline, the input gradients checked
    against the dense reference before timing, records named ``_train``; the profile profiles
    training steps."""
    rec = bench_record(tmp_path, "semantic_*_train_*.json", "bench.train=true", "bench.tokens_per_rank=16",
                       "router=replay", "layer=semantic", "bench.profile=true", "bench.profile_iters=1")
    assert rec["train"] and rec["ms"] > 0 and rec["baseline_ms"] > 0
    for key in ("reference", "reference_grad", "baseline_reference_grad"):
        assert rec["check"][key]["ok"] and rec["check"][key]["rows"] > 0, key
    assert rec["check"]["reference_grad"]["max_abs_err"] <= rec["check"]["reference_grad"]["tol"]


def test_gradient_check_catches_a_wrong_backward():
    """A layer whose forward is right and whose input gradient is not fails the check."""
    import torch

    from recipes._bench_tools import check_grads_against_reference

    cpu = torch.device("cpu")
    layer, x, _, weights, cfg = _checked_layer()
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    good = check_grads_against_reference(layer, x, grad, weights, cfg, 256, cpu)
    assert good["ok"] and good["rows"] == 256 and good["max_abs_err"] < good["tol"]

    class WrongBackward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = layer

        @property
        def last_topk_ids(self):
            return self.inner.last_topk_ids

        def forward(self, v):
            return self.inner(v) + 1e-3 * (v - v.detach())  # the same output, a gradient off by 1e-3 * grad

    bad = check_grads_against_reference(WrongBackward(), x, grad, weights, cfg, 256, cpu)
    assert not bad["ok"] and bad["max_abs_err"] > bad["tol"]


def test_check_config_refuses_train_with_cuda_graphs():
    from recipes.bench import check_config

    d = {"bench": {"tokens_per_rank": [16], "warmup": 1, "iters": 1, "train": True, "cuda_graph": True,
                   "check": {}}, "layer": {"name": "vanilla", "kwargs": {}}}
    with pytest.raises(ValueError, match="bench.train=true .*cuda_graph"):
        check_config(d)


@pytest.mark.parametrize("override,match", [
    ("bench.shape.num_experts=7", r"bench\.shape\.num_experts=7 does not split over the 2 expert-parallel ranks"),
    ("bench.shape.score_fn=softmx", r"bench\.shape: MoEConfig\.score_fn must be one of"),
    ("layer.kwargs.dispatcher=all2all", r"layer=vanilla layer\.kwargs: dispatcher must be one of"),
])
def test_check_config_checks_the_shape_and_the_layer_settings(override, match):
    """These failed inside every spawned rank, as a traceback per rank naming neither key."""
    from recipes.bench import check_config

    d = bench_config(override, "parallel.world_size=2")
    with pytest.raises(ValueError, match=match):
        check_config(d)


def _warmups_per_size(rank, world, d):
    import recipes.bench as bench

    seen = []

    def timed(runs, device, warmup, iters):
        seen.append(warmup)
        return [[1.0] * iters for _ in runs]

    bench.time_forwards = timed
    bench.time_forward = lambda run, device, warmup, iters: timed([run], device, warmup, iters)[0]
    records = bench.bench_worker(rank, world, d)
    return [r["tokens_per_rank"] for r in records], seen


def test_the_first_size_timed_warms_up_longer():
    """A metrics audit found bench=cpu_smoke's first size 2-5x slower than the next (its two warm-up
    forwards absorbed the process's one-time costs: latency fell as tokens grew). The first size
    timed now warms up FIRST_SIZE_WARMUP more forwards; the others take bench.warmup."""
    from moelayers.testing import run_distributed
    from recipes.bench import FIRST_SIZE_WARMUP, check_config

    d = bench_config("parallel.world_size=1", "bench.tokens_per_rank=[16,8]", "plot=false")
    check_config(d)
    [(sizes, seen)] = run_distributed(_warmups_per_size, 1, d, timeout=120)
    assert sizes == [16, 8]
    assert seen == [d["bench"]["warmup"] + FIRST_SIZE_WARMUP, d["bench"]["warmup"]], seen


@pytest.mark.timeout(120)
def test_settings_a_fuzzer_found_ignored_are_refused(tmp_path):
    """Found by a fuzzer of the command line: each ran to the end with the setting read nowhere:
    bench.profile_* without bench.profile; trace.seq_len / trace.vocab_size beside trace.path;
    layer.plan_train_fraction beside layer.plan_path; bench.check.tol / strict without a peer."""
    from moelayers.trace import synthetic_trace, save_trace
    from tests.distributed.test_semantic import make_plan

    trace = tmp_path / "trace.npz"
    save_trace(synthetic_trace(32, 1, 8, 2, 256, seq_len=(16, 32), seed=0), trace)
    plan = tmp_path / "plan.npz"
    make_plan(8, 2, vocab=256, mode="dp").save(plan)
    for overrides, match in (
            (("bench.profile_rows=3",), r"bench.profile_rows=3 is read with bench.profile=true only"),
            (("router=replay", f"trace.path={trace}", "trace.seq_len=[4,8]"),
             r"trace.seq_len=\[4,8\] sizes the synthetic trace; with trace.path"),
            (("layer=semantic", "router=replay", f"layer.plan_path={plan}", "layer.plan_train_fraction=0.25"),
             r"layer.plan_train_fraction=0.25 splits the trace for a plan made by the run"),
            (("bench.check.tol=1e-30",), r"bench.check.tol=1e-30 is read by the check of ours against megatron")):
        proc = run_bench(tmp_path, "bench.tokens_per_rank=[16]", *overrides)
        assert proc.returncode != 0 and re.search(match, proc.stdout + proc.stderr), \
            (overrides, (proc.stdout + proc.stderr)[-2000:])


@pytest.mark.parametrize("overrides, swept, unread", [
    (["++bench.profile_rows=3"], {"bench.profile"}, []),  # -m bench.profile=true,false: the true job reads it
    (["++bench.profile_rows=3"], {"seed"}, ["++bench.profile_rows=3"]),  # no job of the sweep reads it
    (["bench.profile_rows=3"], {"bench.profile"}, ["bench.profile_rows=3"]),  # ++ marks a sweep's key
    (["bench.iters=3"], set(), []),
])
def test_unread_overrides_let_a_sweeps_plus_plus_through(monkeypatch, overrides, swept, unread):
    """The refusals of settings a run would not read (profile_*, check.*, trace.* beside a file, ...)
    let ++KEY through in a -m sweep over the setting that decides, as README says (a review)."""
    import recipes._common as common

    monkeypatch.setattr(common, "invocation", lambda: {"argv": [], "overrides": overrides})
    monkeypatch.setattr(common, "in_sweep", lambda key: key in swept)
    assert common.unread_overrides(["bench.profile_rows"], ["bench.profile"]) == unread
