#!/usr/bin/env python
"""A world-1 ``VanillaMoE`` forward on one GPU at the Qwen3-30B-A3B layer shape (bf16, inference)
against transformers' ``Qwen3MoeSparseMoeBlock`` (its ``grouped_mm`` experts, when transformers is
installed; given the layer's weights), the layer with ``capacity=(16, 128, 1024, 8192), cuda_graph=True``
(a graph per size), the eager layer with ``check_finite='deferred'`` and a minimal torch forward (route, sort, two ``torch._grouped_mm``, ``index_add_``):
milliseconds per forward (synchronised, median of 50) and CPU milliseconds per call (launch-bound
time), at 16 to 8,192 tokens, then a profile of three 16-token forwards.

Usage::

    python tools/gpu_layer_overhead.py OUT.json
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moelayers as ml  # noqa: E402

dev = "cuda"
H, FF, E, K = 2048, 768, 128, 8
cfg = ml.MoEConfig(num_experts=E, top_k=K, hidden_size=H, ffn_hidden_size=FF, params_dtype=torch.bfloat16)
layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device=dev).eval()
w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
rw = layer.router.weight.detach()
SIZES = (16, 128, 1024, 8192)
# the same layer with a CUDA graph per size (each forward replays the graph of the capacity it fits)
graphed = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device=dev, capacity=SIZES, cuda_graph=True).eval()
graphed.load_state_dict(layer.state_dict())
# the eager layer with check_finite='deferred' (its flag word read at its next forward: no host sync)
deferred = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device=dev, check_finite="deferred").eval()
deferred.load_state_dict(layer.state_dict())

def minimal(x):
    logits = x @ rw.t()
    p = torch.softmax(logits.float(), -1)
    w, ids = torch.topk(p, K, -1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, order // K)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, -1)
    o = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)
    o = o * w.flatten()[order, None]
    y = torch.zeros_like(x).index_add_(0, order // K, o)
    return y

hf = None
try:
    import transformers
    c = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K,
                                    norm_topk_prob=True)
    c._experts_implementation = "grouped_mm"
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    hf = Qwen3MoeSparseMoeBlock(c).to(dev, torch.bfloat16).eval()
    with torch.no_grad():  # the layer's weights (a block built alone is not initialised: one routing for all)
        hf.gate.weight.copy_(rw)
        hf.experts.gate_up_proj.copy_(w13)
        hf.experts.down_proj.copy_(w2)
except Exception as e:
    print("no hf block:", repr(e))

def t(fn, x, n=50):
    for _ in range(5): fn(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(x); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)

def cpu_only(fn, x, n=50):  # time to return (launch-bound CPU time), GPU not synced per call
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn(x)
    cpu = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return 1e3 * cpu

out = {}
with torch.inference_mode():
    for T in SIZES:
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        row = {"ours": t(layer, x), "ours_deferred": t(deferred, x), "ours_graphed": t(graphed, x),
               "minimal": t(minimal, x)}
        if hf is not None:
            row["hf"] = t(lambda z: hf(z[None]), x)
        row["ours_cpu_per_call"] = cpu_only(layer, x)
        row["ours_deferred_cpu_per_call"] = cpu_only(deferred, x)
        row["ours_graphed_cpu_per_call"] = cpu_only(graphed, x)
        row["minimal_cpu_per_call"] = cpu_only(minimal, x)
        row["minimal_vs_ours_maxdiff"] = float((minimal(x) - layer(x)).abs().max())
        row["graphed_vs_ours_maxdiff"] = float((graphed(x) - layer(x)).abs().max())
        row["deferred_vs_ours_maxdiff"] = float((deferred(x) - layer(x)).abs().max())
        if hf is not None:
            row["hf_vs_ours_maxdiff"] = float((hf(x[None])[0] - layer(x)).abs().max())
        out[T] = row
        print(T, {k: round(v, 3) for k, v in row.items()}, flush=True)
    from torch.profiler import profile, ProfilerActivity
    x = torch.randn(16, H, device=dev, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3): layer(x)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print("cuda kernels per forward:", len(kern) / 3)
    for name, fn in (("deferred", deferred), ("minimal", minimal)) + ((("hf", lambda z: hf(z[None])),) if hf else ()):
        with profile(activities=[ProfilerActivity.CUDA]) as p2:
            for _ in range(3): fn(x)
            torch.cuda.synchronize()
        print(f"{name}: cuda kernels and copies per forward:", len(p2.events()) / 3)
    import cProfile
    import pstats
    pr = cProfile.Profile()  # where the eager deferred layer's host time goes (Python functions)
    pr.enable()
    for _ in range(200): deferred(x)
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(40)
    deferred.check_pending()
json.dump(out, open(sys.argv[1], "w"), indent=1)
