"""Host-overhead breakdown of eager VanillaMoE forwards (torchrun)."""
import os, sys, time, json
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
import moelayers as ml
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
from quick_gpu_timing import _stage_times
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
h, f, e, k = 2048, 768, 128, 8
cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k, params_dtype=torch.bfloat16)
groups = ml.ParallelGroups.from_world()
out = {}
for t in (256, 4096):
  for kw in ({}, {"check_finite": False}):
    layer = ml.VanillaMoE(cfg, groups, **kw)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(10): layer(x)
        torch.cuda.synchronize(); dist.barrier()
        t0 = time.perf_counter()
        for _ in range(50): layer(x)
        torch.cuda.synchronize()
        host = (time.perf_counter() - t0) / 50
    if rank == 0: print(f"t={t} {kw}: back-to-back {host*1e3:.3f} ms/forward", flush=True)
    _stage_times(layer, x, rank)
  from torch.profiler import ProfilerActivity, profile
  with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
      for _ in range(10): layer(x)
      torch.cuda.synchronize()
  if rank == 0:
      ka = prof.key_averages()
      print(ka.table(sort_by="self_cpu_time_total", row_limit=40), flush=True)
      print(ka.table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
      prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), f"trace_ws{dist.get_world_size()}_t{t}.json"))
dist.destroy_process_group()
