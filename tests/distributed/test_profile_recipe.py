"""recipes/profile.py end to end on CPU (2 gloo processes, tiny shape): a loadable curves file."""

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


@pytest.mark.timeout(180)
def test_profile_writes_curves(tmp_path):
    """`python recipes/profile.py` with its defaults: the cpu_smoke shape on 2 gloo processes."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), f"hydra.run.dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out / "curves.npz", allow_pickle=False) as d:
        rows, lat = d["rows"], d["latency_s"]
        assert rows.tolist() == [1, 16, 32, 48, 64, *range(320, 2048, 256), 2048]
        assert lat.shape == (2, len(rows)) and (lat > 0).all()
        raw = d["latency_raw_s"]
        assert raw.shape == lat.shape and (raw > 0).all()
        # each rank's curve is the non-decreasing fit of its own measurements (rank by rank, same order)
        np.testing.assert_allclose(lat, _profile_module().monotone_fit(raw), rtol=1e-12, atol=0)
    from moelayers.planning.gem import LatencyCurves

    assert LatencyCurves.load(out / "curves.npz").num_ranks == 2  # what plan.py curves.path=... reads
    assert "largest max/min between CPU ranks" in proc.stdout  # (GPUs on GPUs)
    assert re.search(r"wrote \S+curves\.npz, \S+curves\.png\n", proc.stdout), proc.stdout[-1000:]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the picture of the curves
    # the outputs only (no .hydra/, no profile.log); curves.npz records the config and the command
    assert {p.name for p in out.iterdir()} == {"curves.npz", "curves.png"}
    with np.load(out / "curves.npz", allow_pickle=False) as d:
        rec = json.loads(str(d["config"]))
    assert rec["command"]["overrides"] == [] and rec["config"]["profile"]["name"] == "cpu_smoke"
    check_provenance(rec["provenance"], {})
    assert_documented(rec, "profile.py")
    assert rec["config"]["profile"]["tile"] == 16
    assert rec["measured"]["dtype"] == "float32" and rec["measured"]["seconds"] > 0  # CPU profiles in float32
    assert rec["measured"]["shape"]["E"] == rec["config"]["profile"]["shape"]["num_experts"]
    assert rec["measured"]["timing"] == ["perf_counter", "perf_counter"]  # how each rank was timed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, message", [
    (["profile.tile=0"], "bad sampling"),
    # was a curves file with one sample, which LatencyCurves.load (plan.py curves.path=...) refuses
    (["profile.tile=1", "profile.dense_until=1", "profile.max_rows=1"], "max_rows >= 2"),
    # was a ZeroDivisionError from the spawned ranks
    (["profile.shape.num_experts=0"], "profile.shape.num_experts must be an integer >= 1, got 0"),
    # was checked on the ranks only, naming neither setting
    (["parallel.world_size=3"], "profile.shape.num_experts=8 experts do not divide over 3 ranks (parallel.world_size"),
    # these ran: 1.9 ranks profiled 1, seed 1.5 seeded 1, while the config recorded 1.9 and 1.5
    (["parallel.world_size=1.9"], "parallel.world_size must be an integer >= 1, got 1.9"),
    (["seed=1.5"], "seed must be an integer >= 0, got 1.5"),
    (["progress=maybe"], "progress"),
    # profiled 4 ranks' curves silently: plan.py with parallel.ep=2 needs 2
    (["parallel.world_size=4", "parallel.ep=2"], "parallel.ep=2: profile.py times every rank of the world"),
])
def test_profile_bad_input_writes_nothing(tmp_path, overrides, message):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), "profile=cpu_smoke", *overrides,
                           f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0 and message in proc.stderr
    assert "distributed run failed" not in proc.stderr  # refused before any rank started
    assert not out.exists() or not list(out.iterdir())


def test_summarize_failing_plot_keeps_the_curves(tmp_path, monkeypatch, capsys):
    """A journey found a finished profile (minutes of GPU time) lost when the picture failed: the
    curves are written with a warning, an earlier run's curves.png removed; a failure of the curves
    themselves writes nothing."""
    mod = _profile_module()

    def boom(*args, **kwargs):
        raise RuntimeError("no matplotlib")

    monkeypatch.setattr(mod, "plot_curves", boom)
    (tmp_path / "curves.png").write_bytes(b"an earlier run's picture")
    res = {"rows": [1, 16], "latency_s": np.array([[1.0, 2.0]]), "device_names": ["cpu"], "seconds": 0.1}
    mod.summarize(res, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.npz"]  # no picture, no temporary file
    assert "curves.png not written (RuntimeError: no matplotlib)" in capsys.readouterr().err
    (tmp_path / "curves.png").write_bytes(b"an earlier run's picture")
    mod.summarize(res, str(tmp_path), plot=False)  # plot=false: no picture drawn, an earlier one removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.npz"] and "not written" not in capsys.readouterr().err
    monkeypatch.setattr(mod, "save_curves", boom)
    (tmp_path / "curves.npz").unlink()
    with pytest.raises(RuntimeError, match="no matplotlib"):
        mod.summarize(res, str(tmp_path))
    assert not list(tmp_path.iterdir())


def _profile_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_recipe", ROOT / "recipes" / "profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_monotone_fit():
    fit = _profile_module().monotone_fit
    # the H200 measurement of 2026-11-23 (us; 128 experts on one GPU): memory-bound at few rows per expert
    raw = np.array([[28.2, 463.5, 429.4, 443.0, 428.1, 435.9, 512.9]])
    got = fit(raw)
    assert (np.diff(got) >= 0).all() and got[0, 0] == 28.2 and got[0, -1] == 512.9
    assert got[0, 1:6] == pytest.approx(np.full(5, raw[0, 1:6].mean()))  # one pooled block, its mean
    assert got.sum() == pytest.approx(raw.sum())  # least squares under an order constraint keeps the mean
    mono = np.array([[1.0, 2.0, 2.0, 5.0], [3.0, 1.0, 4.0, 4.0]])
    np.testing.assert_array_equal(fit(mono)[0], mono[0])
    np.testing.assert_allclose(fit(mono)[1], [2.0, 2.0, 4.0, 4.0])


def test_summarize_writes_each_ranks_fit_and_measurements(tmp_path, capsys):
    """summarize() on made-up measurements that differ per rank: curves.npz holds every rank's own
    measurements (latency_raw_s) and their non-decreasing fit (latency_s), in rank order."""
    from moelayers.planning.gem import LatencyCurves

    raw = np.array([[1.0, 3.0, 2.0, 4.0],    # rank 0 dips at 32 rows: 3 and 2 pool to 2.5
                    [2.0, 2.5, 6.0, 5.0]])   # rank 1 dips at the end: 6 and 5 pool to 5.5
    res = {"rows": [1, 16, 32, 48], "latency_s": raw.copy(), "device_names": ["gpu-a", "gpu-b"], "seconds": 0.1}
    path = _profile_module().summarize(res, str(tmp_path))
    with np.load(path, allow_pickle=False) as d:
        np.testing.assert_array_equal(d["rows"], [1, 16, 32, 48])
        np.testing.assert_array_equal(d["latency_raw_s"], raw)
        np.testing.assert_allclose(d["latency_s"], [[1.0, 2.5, 2.5, 4.0], [2.0, 2.5, 5.5, 5.5]], rtol=1e-12)
        assert d["device_names"].tolist() == ["gpu-a", "gpu-b"]
    curves = LatencyCurves.load(path)
    assert curves.num_ranks == 2
    out = capsys.readouterr().out
    assert "4 of 8 samples smoothed" in out  # the two pooled pairs
    # the table shows the first and the last sample (it showed the 1-row sample alone when no other
    # sample fell on 128, 1024, 4096 or 16384 rows)
    table = [line.split()[0] for line in out.splitlines()[1:] if line.strip() and line.split()[0].isdigit()]
    assert table == ["1", "48"], out


def test_sample_rows():
    sample_rows = _profile_module().sample_rows

    assert sample_rows(128, 512, 1024, 3584) == [1, 128, 256, 384, 512, 1536, 2560, 3584]
    with pytest.raises(ValueError, match="bad sampling"):
        sample_rows(0, 512, 1024, 3000)
    with pytest.raises(ValueError, match="bad sampling"):
        sample_rows(128, 512, 1024, 64)  # max_rows below one tile


def test_sample_rows_cover_max_rows():
    """The last sample is max_rows itself (was the last grid point below it: profiling "up to 3000
    rows", as plan.py's warning suggests, gave curves that end at 2560)."""
    sample_rows = _profile_module().sample_rows

    assert sample_rows(128, 512, 1024, 3000) == [1, 128, 256, 384, 512, 1536, 2560, 3000]
    assert sample_rows(16, 64, 32, 100) == [1, 16, 32, 48, 64, 96, 100]  # max_rows not on the grid
    assert sample_rows(16, 100, 32, 40) == [1, 16, 32, 40]  # dense_until above max_rows
    assert sample_rows(1, 3, 5, 2) == [1, 2]  # tile 1: the smallest curve LatencyCurves accepts
    with pytest.raises(ValueError, match="max_rows >= 2"):
        sample_rows(1, 1, 1, 1)  # one sample: a curves file that LatencyCurves.load refuses
    # a typo's sample count is refused up front (was a list of 3e8 row counts: a MemoryError, or all the RAM)
    with pytest.raises(ValueError, match=r"would time 299999941 row counts \(at most 100000\).*profile\.sparse_step"):
        sample_rows(16, 64, 1, 300_000_000)


CPU_SMOKE = {"shape": {"hidden_size": 16, "ffn_hidden_size": 8, "num_experts": 4}, "tile": 16, "dense_until": 32,
             "sparse_step": 16, "max_rows": 48, "warmup": 0, "reps": 1}


@pytest.mark.parametrize("key, value, match", [
    ("reps", 0, r"profile\.reps must be an integer >= 1, got 0"),  # used to write all-NaN curves
    ("reps", 2.5, r"profile\.reps must be an integer >= 1"),
    ("warmup", -1, r"profile\.warmup must be an integer >= 0"),
    ("tile", 15.5, r"profile\.tile must be an integer, got 15\.5"),  # not silently 15
    # the shape was read with int(): 64.5 became 64 and 0 profiled an empty GEMM
    ("shape.hidden_size", 16.5, r"profile\.shape\.hidden_size must be an integer >= 1, got 16\.5"),
    ("shape.ffn_hidden_size", 0, r"profile\.shape\.ffn_hidden_size must be an integer >= 1, got 0"),
])
def test_check_profile_refuses_bad_settings(key, value, match):
    check_profile = _profile_module().check_profile

    assert check_profile(CPU_SMOKE) == [1, 16, 32, 48]
    if key.startswith("shape."):
        bad = {**CPU_SMOKE, "shape": {**CPU_SMOKE["shape"], key.split(".", 1)[1]: value}}
    else:
        bad = {**CPU_SMOKE, key: value}
    with pytest.raises(ValueError, match=match):
        check_profile(bad)


def test_a_gpu_shape_on_cpu_is_refused():
    """Found by a sweep: profile=qwen3_30b_a3b on CPU started a 45-point profile of several seconds a
    point (bench refuses such shapes): refused now, unless forced, or under NCCL."""
    check_fits = _profile_module().check_fits
    qwen = {"name": "qwen3_30b_a3b", "shape": {"hidden_size": 2048, "ffn_hidden_size": 768, "num_experts": 128}}
    with pytest.raises(SystemExit, match=r"302M expert parameters per rank and this run is not on GPUs \(backend gloo"):
        check_fits(qwen, 2, "gloo")
    check_fits(qwen, 2, "gloo", allow=True)
    check_fits(qwen, 2, "nccl")
    check_fits(CPU_SMOKE, 2, "gloo")


def test_profile_worker_refuses_nan_latency(monkeypatch):
    """A NaN timing (the median of no samples) is a failed timer, not a curve to write."""
    mod = _profile_module()
    monkeypatch.setattr(mod, "_time_rows", lambda *args, **kwargs: float("nan"))
    with pytest.raises(RuntimeError, match="not a positive number"):
        mod.profile_worker(0, 1, {"profile": CPU_SMOKE, "seed": 0})


def test_commit_files_refuses_a_folder_in_the_way_and_leaves_no_temporary_file(tmp_path):
    """A folder named like an output was found after curves.npz had been moved in, and the other
    temporary files stayed behind."""
    from recipes._outputs import commit_files

    (tmp_path / "curves.png").mkdir()
    writers = {"curves.npz": lambda p: p.write_bytes(b"npz"), "curves.png": lambda p: p.write_bytes(b"png")}
    with pytest.raises(IsADirectoryError, match="curves.png is a directory"):
        commit_files(tmp_path, writers)
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]

    import recipes._outputs as tools

    real = tools.os.replace
    calls = []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    (tmp_path / "curves.png").rmdir()
    tools.os.replace = fail_second
    try:
        with pytest.raises(OSError, match="No space left"):
            commit_files(tmp_path, writers)
    finally:
        tools.os.replace = real
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.npz"]  # no .tmp file left


@pytest.mark.timeout(180)
def test_profile_progress_false_draws_no_bar(tmp_path):
    """progress=false is read (a bad value fails in main) and rank 0 draws no tqdm bar."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "profile.py"), "progress=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profiling row counts" not in proc.stderr


@pytest.mark.parametrize("bad", [1.9, 0, "2x"])
def test_launch_refuses_a_world_size_that_is_not_a_positive_integer(bad, tmp_path):
    """launch() took parallel.world_size=1.9 as 1 (int()) and 0 reached run_distributed."""
    from recipes._common import launch

    def never(rank, world, cfg):  # pragma: no cover - must not be reached
        raise AssertionError("launched")

    with pytest.raises(ValueError, match=r"parallel\.world_size must be an integer >= 1, got " + re.escape(repr(bad))):
        launch({"parallel": {"world_size": bad}, "run_dir": str(tmp_path)}, never)
