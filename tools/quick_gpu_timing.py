"""Quick latency probe of VanillaMoE on GPUs (torchrun). Prints per-size medians and a profile.

    torchrun --standalone --nproc_per_node=2 tools/quick_gpu_timing.py [--profile]
    torchrun --standalone --nproc_per_node=2 tools/quick_gpu_timing.py --train   # forward + backward,
        the layers' combine (Triton forward and backward) against the lean autograd one and the
        reference's, alternating in one run
"""

import argparse
import os

import torch
import torch.distributed as dist

import moelayers as ml

SHAPES = {"qwen3": (2048, 768, 128, 8), "deepseek": (2048, 1408, 64, 6)}  # hidden, ffn, experts, top-k


def _host_overheads(rank):
    """Per-op host costs on this machine: tiny elementwise op, tiny all-to-all, device sync."""
    import time
    a = torch.ones(16, device="cuda")
    small = torch.ones(4, dtype=torch.int64, device="cuda")
    out = torch.empty_like(small)
    for name, fn in (("add", lambda: a.add(1)), ("a2a(4 ints)", lambda: dist.all_to_all_single(out, small)),
                     ("tolist sync", lambda: small.tolist())):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        if rank == 0:
            print(f"host cost {name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us", flush=True)


def _stage_times(layer, x, rank):
    """Host time spent in each of the five steps (perf_counter, no extra syncs)."""
    import time
    from collections import defaultdict
    acc = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            acc[name] += time.perf_counter() - t0
            return out
        return wrapper

    orig = (layer.router.forward, layer.plan, layer.dispatcher.dispatch, layer.experts.forward, layer.dispatcher.combine)
    layer.router.forward = timed("1 route", orig[0])
    layer.plan = timed("2 plan", orig[1])
    layer.dispatcher.dispatch = timed("3 dispatch (incl. sync wait)", orig[2])
    layer.experts.forward = timed("4 compute", orig[3])
    layer.dispatcher.combine = timed("5 combine", orig[4])
    n = 20
    with torch.inference_mode():
        for _ in range(n):
            layer(x)
        torch.cuda.synchronize()
    layer.router.forward, layer.plan, layer.dispatcher.dispatch, layer.experts.forward, layer.dispatcher.combine = orig
    del layer.plan
    if rank == 0:
        print("  host ms per step: " + ", ".join(f"{k}: {v / n * 1e3:.3f}" for k, v in sorted(acc.items())), flush=True)


def _train_times(cfg, groups, tokens, rank, rounds=4, steps=20):
    """Median forward + backward time and peak memory of a training step, with the combine the
    layers use (``unpermute_combine``: Triton forward and backward on CUDA), the lean autograd one
    and the reference's, alternating ``rounds`` times so that clock drift hits all alike."""
    from moelayers.dispatch import alltoall, base
    from moelayers.kernels import unpermute_combine_lean, unpermute_combine_reference
    combines = {"layers": base.unpermute_combine, "lean": unpermute_combine_lean,
                "reference": unpermute_combine_reference}
    layer = ml.VanillaMoE(cfg, groups)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times, peaks = {k: [] for k in combines}, {k: 0 for k in combines}
    for _ in range(rounds):
        for name, fn in combines.items():
            base.unpermute_combine = alltoall.unpermute_combine = fn
            for _ in range(3):
                layer(x).float().square().mean().backward()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            for _ in range(steps):
                dist.barrier()
                s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                layer(x).float().square().mean().backward()
                en.record()
                torch.cuda.synchronize()
                times[name].append(s.elapsed_time(en))
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    base.unpermute_combine = alltoall.unpermute_combine = combines["layers"]
    for name in combines:
        med = torch.tensor(sorted(times[name])[len(times[name]) // 2], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"train tokens/rank={tokens} combine={name}: {med.item():.3f} ms forward+backward (median, "
                  f"max over ranks), peak {peaks[name] / 2**20:.0f} MiB on rank 0", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table")
    ap.add_argument("--stages", action="store_true", help="time the forward's stages")
    ap.add_argument("--train", action="store_true",
                    help="time forward + backward instead: the layers' combine, the lean one, the reference's")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 4096], help="tokens per rank")
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES),
                    help="qwen3: Qwen3-30B-A3B's MoE layer; deepseek: DeepSeek-V2-Lite's")
    args = ap.parse_args()
    if min(args.tokens) < 1:
        ap.error(f"--tokens must be integers >= 1, got {args.tokens}")
    if not torch.cuda.is_available() or "RANK" not in os.environ:
        ap.error("needs CUDA GPUs, launched by torchrun (e.g. torchrun --standalone --nproc_per_node=2 "
                 "tools/quick_gpu_timing.py)")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    h, f, e, k = SHAPES[args.shape]
    cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k, params_dtype=torch.bfloat16)
    groups = ml.ParallelGroups.from_world()
    if args.train:
        for t in args.tokens:
            _train_times(cfg, groups, t, rank)
        dist.barrier()
        dist.destroy_process_group()
        return
    _host_overheads(rank)
    for variant in ("default", "graph"):
      for t in args.tokens:
            kw = dict(capacity=t, cuda_graph=True, check_finite=False) if variant == "graph" else {}
            layer = ml.VanillaMoE(cfg, groups, **kw)
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                for _ in range(10):
                    layer(x)
                torch.cuda.synchronize()
                times = []
                for _ in range(50):
                    dist.barrier()
                    torch.cuda.synchronize()
                    s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    layer(x)
                    en.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(en))
            med = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            import time
            with torch.inference_mode():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    layer(x)
                host = (time.perf_counter() - t0) / 20
                torch.cuda.synchronize()
            if rank == 0:
                print(f"{args.shape} {variant} tokens/rank={t}: {med.item():.3f} ms (median, max over ranks); "
                      f"back-to-back host time {host * 1e3:.3f} ms", flush=True)
            if variant == "default" and args.stages:
                _stage_times(layer, x, rank)
            if args.profile and variant == "default":
                from torch.profiler import ProfilerActivity, profile
                with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        layer(x)
                    torch.cuda.synchronize()
                if rank == 0:
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
            layer.release_graphs()  # a captured graph holds NCCL work: release it before the group goes
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
