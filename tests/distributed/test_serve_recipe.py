"""recipes/serve.py end to end (2 gloo processes), and the tiny model's attention-DP + expert-parallel
step against a single process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import moelayers as ml
from moelayers.testing import run_distributed

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


def _serve(run_dir: Path, *overrides: str) -> dict:
    cmd = [sys.executable, str(SERVE), "parallel.world_size=2", f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"serve failed:\n{proc.stdout}\n{proc.stderr}"
    assert "throughput" in proc.stdout and "LAR" in proc.stdout  # the summary table
    assert (run_dir / "rank_load.png").stat().st_size > 1000
    res = json.loads((run_dir / "results.json").read_text())
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
    assert all(q["output_len"] > 0 and q["ttft_s"] >= 0 for q in res["requests"])
    assert res["output_tokens"] == sum(q["output_len"] for q in res["requests"])
    out = res["config"]["workload"]["output_len"]
    assert all(out["min"] <= q["output_len"] <= out["max"] for q in res["requests"])


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
