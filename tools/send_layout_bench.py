#!/usr/bin/env python
"""``send_layout``'s Triton kernel (one program, two passes over the tokens) against its torch
reference on one GPU: microseconds per call (synchronised, median of 50) for 1 to 32 ranks and 16
to 16,384 tokens of top-8 routing, and whether both give the same layout.

Usage::

    python tools/send_layout_bench.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moelayers.kernels.send_layout import send_layout_reference, send_layout_triton  # noqa: E402

dev = "cuda"
K = 8
def t(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)
for R in (1, 2, 4, 8, 32):
    for T in (16, 128, 512, 1024, 2048, 4096, 8192, 16384):
        if T * (1 << max(R - 1, 0).bit_length()) > (1 << 17):
            continue
        r = torch.randint(0, R, (T, K), device=dev)
        a = send_layout_triton(r, R); b = send_layout_reference(r, R)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        print(f"R={R:3d} T={T:6d} triton {t(lambda: send_layout_triton(r, R)):8.1f} us  reference {t(lambda: send_layout_reference(r, R)):8.1f} us  same={same}", flush=True)
