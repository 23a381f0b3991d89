#!/usr/bin/env python
"""Where a one-rank eager ``VanillaMoE`` forward spends its host time: microseconds per forward in
each of the five steps (route, plan, flags, dispatch — its ``dense_pairs`` shown apart — experts,
combine) with ``check_finite`` True, False and ``'deferred'``, and the host cost of single torch
ops at the same shape. Inference at the Qwen3-30B-A3B layer shape (bf16, 128 experts, top-8).

Host time is what a call takes to return, the device left unsynchronised (synchronised every 50
calls, outside the timings), so on a GPU it is the launch-bound time of a small batch. Each step is
timed by a wrapper on the layer's instance (about half a microsecond each); the sum of the steps
and the whole call's time are both written. Compare runs of one process only: the device
machines' hosts differ by 20-30 % from run to run.

Usage::

    python tools/host_stages.py OUT.json [--tokens 16] [--device cuda] [--calls 400]
    python tools/host_stages.py OUT.json --device cpu --shape small --calls 20    # a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import positive_int  # noqa: E402

import moelayers as ml  # noqa: E402
import moelayers.dispatch.alltoall as alltoall  # noqa: E402

SHAPES = {"qwen3_30b_a3b": (2048, 768, 128, 8), "small": (64, 32, 16, 4)}  # H, F, E, K
STEPS = (("router", "forward", "route"), ("layer", "plan", "plan"), ("layer", "_routing_flags", "flags"),
         ("dispatcher", "dispatch", "dispatch"), ("experts", "forward", "experts"),
         ("dispatcher", "combine", "combine"))


def timed_calls(fn, calls: int, sync, warmup: int = 20) -> list[float]:
    """Seconds each of ``calls`` calls of ``fn`` took to return (synchronised every 50, untimed)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 50 == 49:
            sync()
    sync()
    return times


def step_times(layer, x, calls: int, sync) -> dict[str, float]:
    """Microseconds per forward in each step, by wrappers set on the layer's instances for the run."""
    spent: dict[str, float] = {}
    owners = {"router": layer.router, "layer": layer, "dispatcher": layer.dispatcher, "experts": layer.experts}
    patched = []

    def wrap(owner, attr, key, namespace=False):
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        if namespace:
            patched.append((owner, attr, fn))
        object.__setattr__(owner, attr, timed)  # (an instance attribute: the class is left alone)

    for owner, attr, key in STEPS:
        wrap(owners[owner], attr, key)
    wrap(alltoall, "dense_pairs", "dispatch: dense_pairs", namespace=True)
    try:
        timed_calls(lambda: layer(x), 20, sync, warmup=0)
        spent.clear()
        total = sum(timed_calls(lambda: layer(x), calls, sync, warmup=0))
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)
        for owner, attr, _ in STEPS:  # drop the instance attributes: the class's methods again
            vars(owners[owner]).pop(attr, None)
    out = {key: 1e6 * value / calls for key, value in spent.items()}
    out["whole call"] = 1e6 * total / calls
    return out


def op_times(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, calls: int, sync) -> dict[str, float]:
    """Median host microseconds of single torch ops on the forward's shapes."""
    t, e = x.shape[0], router_weight.shape[0]
    ids = torch.randint(0, e, (t, top_k), device=x.device)
    flat = ids.flatten()
    logits = F.linear(x, router_weight)
    w = torch.rand(t, top_k, device=x.device, dtype=x.dtype)
    table = torch.arange(e, device=x.device)
    ops = {
        "linear (router)": lambda: F.linear(x, router_weight),
        "softmax float32": lambda: torch.softmax(logits, -1, dtype=torch.float32),
        "topk": lambda: torch.topk(logits, top_k, -1),
        "argsort stable": lambda: torch.argsort(flat, stable=True),
        "index a table": lambda: table[ids],
        "index_select rows": lambda: x.index_select(0, flat // top_k),
        "cumsum int32": lambda: torch.cumsum(flat, 0, dtype=torch.int32),
        "floor_divide": lambda: flat // top_k,
        "zeros": lambda: torch.zeros(e, dtype=torch.int64, device=x.device),
        "mul": lambda: w * w,
        "sum": lambda: w.sum(),
        "view": lambda: flat.view(t, top_k),
        "Python call": lambda: None,
    }
    return {name: 1e6 * statistics.median(timed_calls(fn, calls, sync)) for name, fn in ops.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--tokens", type=positive_int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_30b_a3b")
    ap.add_argument("--calls", type=positive_int, default=400, help="timed forwards per setting")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (pass --device cpu for a smoke run)")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    h, f, e, k = SHAPES[args.shape]
    cfg = ml.MoEConfig(num_experts=e, top_k=k, hidden_size=h, ffn_hidden_size=f, params_dtype=torch.bfloat16)
    x = torch.randn(args.tokens, h, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    record = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": args.shape, "tokens": args.tokens, "calls": args.calls, "steps_us": {}}
    first = None
    for mode in (True, False, "deferred"):
        layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device=device, check_finite=mode).eval()
        if first is None:
            first = layer
        else:
            layer.load_state_dict(first.state_dict())
        with torch.inference_mode():
            y = layer(x)
            steps = step_times(layer, x, args.calls, sync)
            steps["whole call, unwrapped (median)"] = 1e6 * statistics.median(timed_calls(lambda: layer(x), args.calls, sync))
            assert torch.equal(layer(x), y), "the timing wrappers changed the output"
        record["steps_us"][f"check_finite={mode}"] = steps
        print(f"check_finite={mode}: " + ", ".join(f"{key} {value:.1f}" for key, value in steps.items()), flush=True)
    with torch.inference_mode():
        record["ops_us"] = op_times(x, first.router.weight.detach(), k, max(args.calls, 200), sync)
    print("ops: " + ", ".join(f"{key} {value:.1f}" for key, value in record["ops_us"].items()))
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
