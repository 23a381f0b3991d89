#!/usr/bin/env python
"""Record a routing trace from the tiny decoder (random weights) for the GEM yardstick.

The token ids and sequence boundaries come from a synthetic trace (its Zipf token law and topic
vocabularies); the routing is whatever the tiny model's routers choose for them, so the expert
loads follow a real forward pass (embeddings, attention mixing, residual stream) instead of the
synthetic routing model.

Usage::

    OMP_NUM_THREADS=1 python tools/record_tiny_trace.py --out /tmp/tiny_trace.npz [--sequences 100]
    OMP_NUM_THREADS=1 python tools/gem_yardstick.py --trace /tmp/tiny_trace.npz
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moelayers as ml  # noqa: E402
from _args import positive_int  # noqa: E402  (tools/ is the script's directory)
from moelayers.models.tiny import TinyConfig, TinyDecoder  # noqa: E402
from moelayers.trace import TraceRecorder, save_trace, synthetic_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sequences", type=positive_int, default=100)
    ap.add_argument("--layers", type=positive_int, default=26)
    ap.add_argument("--experts", type=positive_int, default=64)
    ap.add_argument("--top-k", type=positive_int, default=6)
    ap.add_argument("--vocab", type=positive_int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():  # before the recording (minutes), not after it
        raise SystemExit(f"--out {out}: {'a directory' if out.is_dir() else 'its directory does not exist'}")
    torch.set_num_threads(1)
    tokens = synthetic_trace(args.sequences, 1, 8, 2, args.vocab, seq_len=(256, 2048), seed=args.seed)
    cfg = TinyConfig(vocab_size=args.vocab, hidden_size=64, num_layers=args.layers, num_heads=4)
    moe = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=args.experts, top_k=args.top_k)
    model = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, ml.ParallelGroups.single(), seed=100 + i), seed=args.seed)
    t0 = time.perf_counter()
    with torch.no_grad(), TraceRecorder(model, vocab_size=args.vocab) as rec:
        for s in range(tokens.num_sequences):
            ids = torch.as_tensor(tokens.token_ids[tokens.sequence_slice(s)], dtype=torch.int64)
            rec.tag([s] * ids.numel())
            model(ids[None])
    save_trace(rec.result, args.out)
    print(f"{rec.result.num_tokens} tokens, {args.layers} layers: {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
