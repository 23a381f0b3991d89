#!/usr/bin/env python
"""Planning time of ``plan_gem`` for the two speed limits (run with ``OMP_NUM_THREADS=1``).

* the whole model: 26 layers x 64 experts at EP8 (``high`` curves), fitted on the train steps of a
  synthetic trace (``--sequences`` sequences, half of them train);
* one layer of 256 experts at EP8 with a 16-step window (the online case).

Usage::

    OMP_NUM_THREADS=1 python tools/gem_timing.py [--method robust] [--sequences 100]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import positive_int  # noqa: E402  (tools/ is the script's directory)
from moelayers.planning.gem import LatencyCurves, plan_gem  # noqa: E402
from moelayers.planning.steps import trace_step_loads  # noqa: E402
from moelayers.trace import synthetic_trace  # noqa: E402


def time_model(method: str, sequences: int, num_ranks: int = 8) -> tuple[float, int]:
    """Seconds to plan 26 layers x 64 experts; returns ``(seconds, train steps)``."""
    train, _ = synthetic_trace(sequences, 26, 64, 6, 32000, seed=0).split(0.5)
    loads = trace_step_loads(train, 2048)
    curves = LatencyCurves.preset("high", num_ranks)
    t0 = time.perf_counter()
    for layer in loads:
        plan_gem(layer, curves, method=method)
    return time.perf_counter() - t0, loads.shape[1]


def time_layer(method: str, num_experts: int = 256, num_ranks: int = 8, steps: int = 16) -> float:
    """Seconds to plan one layer of ``num_experts`` from a ``steps``-step window."""
    trace = synthetic_trace(2 * steps + 8, 1, num_experts, 8, 32000, seed=0, expert_skew=0.5)
    loads = trace_step_loads(trace, 2048)[0][:steps]
    if loads.shape[0] != steps:  # a window of fewer steps would be timed under this one's name
        raise RuntimeError(f"the synthetic trace has only {loads.shape[0]} full steps, {steps} asked")
    curves = LatencyCurves.preset("high", num_ranks)
    t0 = time.perf_counter()
    plan_gem(loads, curves, method=method)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="robust", choices=["plain", "robust"])
    ap.add_argument("--sequences", type=positive_int, nargs="+", default=[100])
    args = ap.parse_args()
    if min(args.sequences) < 2:
        ap.error(f"--sequences must be >= 2 (half of them train, half are held out), got {args.sequences}")
    for seqs in args.sequences:
        sec, steps = time_model(args.method, seqs)
        print(f"{args.method}: 26 layers x 64 experts, EP8, {steps} train steps: {sec:.2f} s (limit 30 s)")
    print(f"{args.method}: 1 layer x 256 experts, EP8, 16 steps: {time_layer(args.method):.2f} s (limit 10 s)")


if __name__ == "__main__":
    main()
