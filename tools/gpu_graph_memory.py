#!/usr/bin/env python
"""GPU memory of the CUDA graphs of ``capacity=(16, 32, ..., 8192), cuda_graph=True`` layers at the
Qwen3-30B-A3B layer shape (bf16, one GPU), with each graph in a pool of its own (as before pools
were shared), the graphs of a layer in one pool (the default) and every layer's in one pool
(:func:`moelayers.share_graph_pool`): the memory reserved by capturing every size of ``--layers``
layers, and whether the outputs agree bit for bit between the three.

Usage::

    python tools/gpu_graph_memory.py [--layers 4] [--out OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import moelayers as ml  # noqa: E402
from moelayers.layers import graphs  # noqa: E402

H, FF, E, K = 2048, 768, 128, 8
SIZES = tuple(16 << i for i in range(10))  # 16 .. 8192


def build(n: int) -> list:
    cfg = ml.MoEConfig(num_experts=E, top_k=K, hidden_size=H, ffn_hidden_size=FF, params_dtype=torch.bfloat16)
    return [ml.VanillaMoE(cfg, ml.ParallelGroups.single(), device="cuda", capacity=SIZES, cuda_graph=True,
                          seed=i).eval() for i in range(n)]


def run(mode: str, layers: list, xs: dict) -> tuple[dict, dict]:
    for layer in layers:
        layer.release_graphs()
        layer.graph_pool = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    real_init = graphs.GraphedForward.__init__
    if mode == "separate":  # each graph a pool of its own
        def init(self, *args, **kwargs):
            kwargs["pool"] = None
            real_init(self, *args, **kwargs)
        graphs.GraphedForward.__init__ = init
    elif mode == "shared":
        ml.share_graph_pool(torch.nn.ModuleList(layers))
    outs = {}
    try:
        with torch.no_grad():
            for size in SIZES:  # ascending, as a generate loop meets them (decode first, then larger prefills)
                h = xs[size]
                for i, layer in enumerate(layers):
                    h = layer(h)
                outs[size] = h
            torch.cuda.synchronize()
            after = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            for _ in range(50):  # a decode-like loop: 16 tokens through every layer
                h = xs[16]
                for layer in layers:
                    h = layer(h)
            torch.cuda.synchronize()
            step = (time.perf_counter() - t0) / 50
    finally:
        graphs.GraphedForward.__init__ = real_init
    return outs, {"reserved_mib": (after - before) / 2**20, "per_layer_mib": (after - before) / 2**20 / len(layers),
                  "ms_per_16_token_pass": 1e3 * step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    layers = build(args.layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = {s: torch.randn(s, H, device="cuda", generator=gen).to(torch.bfloat16) for s in SIZES}
    record, first = {"sizes": SIZES, "layers": args.layers, "device": torch.cuda.get_device_name()}, None
    for mode in ("per_layer", "separate", "shared", "per_layer"):
        outs, row = run(mode, layers, xs)
        if first is None:
            first = outs
        else:
            row["same_outputs_as_per_layer"] = all(torch.equal(outs[s], first[s]) for s in SIZES)
        record.setdefault(mode, []).append(row)
        print(mode, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
