"""Quick latency probe of VanillaMoE on GPUs (torchrun). Prints per-size medians and a profile.

    torchrun --standalone --nproc_per_node=2 tools/quick_gpu_timing.py [--profile]
"""

import argparse
import os

import torch
import torch.distributed as dist

import moelayers as ml


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--shape", default="qwen3")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    h, f, e, k = (2048, 768, 128, 8) if args.shape == "qwen3" else (2048, 1408, 64, 6)
    cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k, params_dtype=torch.bfloat16)
    groups = ml.ParallelGroups.from_world()
    for variant in ("default", "nocheck"):
        layer = ml.VanillaMoE(cfg, groups, check_finite=(variant == "default"))
        for t in args.tokens:
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
            if rank == 0:
                print(f"{args.shape} {variant} tokens/rank={t}: {med.item():.3f} ms (median, max over ranks)", flush=True)
            if args.profile and variant == "default":
                from torch.profiler import ProfilerActivity, profile
                with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        layer(x)
                    torch.cuda.synchronize()
                if rank == 0:
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
