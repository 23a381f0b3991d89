#!/usr/bin/env python
"""Solve time of ``plan_semantic`` at the issue's two speed limits (run with ``OMP_NUM_THREADS=1``).

* 26 layers x 64 experts x 20k vocabulary, top-6, at EP8 (limit 60 s);
* 48 layers x 128 experts x 150k vocabulary, top-8, at EP8 (limit 300 s).

Each trace is synthetic (``--sequences`` sequences of 64-512 tokens, half of them train); the tp
predictor's fits run on ``--threads`` threads (default: ``plan_semantic``'s, the usable CPUs, at
most 4).

Usage::

    OMP_NUM_THREADS=1 python tools/semantic_timing.py [--shapes small big] [--modes tp dp] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import positive_int  # noqa: E402  (tools/ is the script's directory)
from moelayers.planning.semantic_solvers import plan_semantic  # noqa: E402
from moelayers.trace import synthetic_trace  # noqa: E402

#: name -> (layers, experts, top-k, vocabulary, limit in seconds)
SHAPES = {"small": (26, 64, 6, 20_000, 60), "big": (48, 128, 8, 150_000, 300)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--modes", nargs="+", default=["tp", "dp"], choices=["tp", "dp"])
    ap.add_argument("--sequences", type=positive_int, default=1000)
    ap.add_argument("--threads", type=positive_int, default=None)
    args = ap.parse_args()
    if args.sequences < 2:
        ap.error(f"--sequences must be >= 2 (half of them train), got {args.sequences}")
    for name in args.shapes:
        layers, experts, top_k, vocab, limit = SHAPES[name]
        trace = synthetic_trace(args.sequences, layers, experts, top_k, vocab, seq_len=(64, 512), seed=1)
        train = trace.select_sequences(np.arange(trace.num_sequences // 2))
        for mode in args.modes:
            t0 = time.perf_counter()
            plan_semantic(train, 8, mode, seed=0, progress=False, threads=args.threads)
            sec = time.perf_counter() - t0
            print(f"{mode}: {layers} layers x {experts} experts x {vocab} vocabulary, EP8, "
                  f"{train.topk_ids.shape[0]} train tokens: {sec:.1f} s (limit {limit} s)", flush=True)


if __name__ == "__main__":
    main()
