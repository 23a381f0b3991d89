"""The developer tools refuse bad arguments with a usage error before any work (found by a sweep:
library tracebacks, some after building a trace)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from _args import nonnegative_int, positive_int  # noqa: E402


def test_int_types():
    assert positive_int("3") == 3 and nonnegative_int("0") == 0
    for fn, bad in ((positive_int, "0"), (positive_int, "x"), (nonnegative_int, "-1")):
        with pytest.raises(argparse.ArgumentTypeError, match="must be an integer >="):
            fn(bad)


@pytest.mark.parametrize("argv, message", [
    (["tools/gem_yardstick.py", "--layers", "-1"], "argument --layers: must be an integer >= 0"),
    (["tools/gem_timing.py", "--sequences", "1"], "--sequences must be >= 2"),
    (["tools/semantic_yardstick.py", "--plan-kw", '{"foo": 1}'], "plan_semantic takes no ['foo']"),
    (["tools/calibrate_trace.py", "--counts", "/no/such/dir"], "is not a directory of routing counts"),
    (["tools/hf_bench.py", "--new", "1"], "--new must be at least 2"),
    (["tools/hf_bench.py", "--smoke", "--prompt", "9", "3"], "MIN must not exceed MAX"),
    (["tools/host_stages.py", "out.json", "--calls", "0"], "argument --calls: must be an integer >= 1"),
])
def test_tools_refuse_bad_arguments(argv, message):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-1000:]


def test_hf_bench_smoke(tmp_path):
    """tools/hf_bench.py on CPU at a tiny shape: every variant runs and the record is written."""
    pytest.importorskip("transformers")
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["tools/hf_bench.py", "--smoke", "--layers", "1", "--batch", "3", "--new", "2", "--reps", "1",
            "--out", str(tmp_path)]
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "hf_bench.json").read_text())
    assert set(record["results"]) == {"hf", "moelayers", "moelayers_skip_padding", "moelayers_unchecked",
                                      "moelayers_deferred", "moelayers_graphs", "moelayers_graphs_unchecked",
                                      "moelayers_graphs_deferred"}
    for name in ("moelayers_skip_padding", "moelayers_deferred", "moelayers_graphs", "moelayers_graphs_deferred"):
        assert record["results"][name]["same_tokens_as_hf"] == 1.0, name


def test_host_stages_smoke(tmp_path):
    """tools/host_stages.py on CPU at a tiny shape: every step of every check_finite mode is timed."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = ["tools/host_stages.py", str(tmp_path / "stages.json"), "--device", "cpu", "--shape", "small", "--calls", "5"]
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "stages.json").read_text())
    assert set(record["steps_us"]) == {"check_finite=True", "check_finite=False", "check_finite=deferred"}
    for steps in record["steps_us"].values():
        assert {"route", "plan", "flags", "dispatch", "dispatch: dense_pairs", "experts", "combine"} <= set(steps)
        assert sum(steps[k] for k in ("route", "plan", "flags", "dispatch", "experts", "combine")) < steps["whole call"]
