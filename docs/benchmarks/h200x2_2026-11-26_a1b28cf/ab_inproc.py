"""In-process interleaved A/B of the eager forward: eba7486's pre-sync ops (old) vs ce97918's (new).
torchrun --standalone --nproc_per_node=2 ab_inproc.py   (run from the new snapshot's root)"""
import os, time, statistics
import torch, torch.distributed as dist
import moelayers as ml
import moelayers.router as router_mod
import moelayers.layers.base as layer_base
from moelayers.dispatch import alltoall as a2a_mod
from moelayers.dispatch.base import Routes

NEW = dict(layout=a2a_mod.AllToAllDispatcher._layout, nonfinite=router_mod._any_nonfinite,
           routes=layer_base.routes_from_placement)


def old_layout(self, routes):  # eba7486's _layout + its header assembly in _exchange_counts
    t, k = routes.dest_rank.shape
    dev = routes.dest_rank.device
    per_rank = torch.zeros(t, self.num_ranks, dtype=torch.int64, device=dev)
    per_rank.scatter_add_(1, routes.dest_rank, self._ones.expand(t, k))
    send_pairs = per_rank.sum(0)
    hit = per_rank > 0
    running = torch.cumsum(hit, 0)
    send_rows = hit.sum(0)
    first_row = torch.cumsum(send_rows, 0) - send_rows
    dest_map = torch.where(hit, running - 1 + first_row, -1)
    nonfinite = routes.nonfinite
    flag = nonfinite.to(torch.int64).expand(self.num_ranks) if nonfinite is not None else torch.zeros_like(send_rows)
    digest = torch.full_like(send_rows, self.placement_digest)
    return dest_map, torch.stack([send_rows, send_pairs, flag, digest], 1)


def old_nonfinite(logits):
    return ~torch.isfinite(logits).all()


def old_routes(topk_ids, weights, placement, rank, policy):
    phys = placement.first_replica(topk_ids.device)[topk_ids]
    dest_rank = torch.div(phys, placement.slots_per_rank, rounding_mode="floor")
    return Routes(topk_ids, weights, dest_rank, phys - dest_rank * placement.slots_per_rank)


def use(variant):
    old = variant == "old"
    a2a_mod.AllToAllDispatcher._layout = old_layout if old else NEW["layout"]
    router_mod._any_nonfinite = old_nonfinite if old else NEW["nonfinite"]
    layer_base.routes_from_placement = old_routes if old else NEW["routes"]


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    h, f, e, k = 2048, 768, 128, 8
    cfg = ml.MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=k, params_dtype=torch.bfloat16)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world())
    layer.dispatcher._ones = torch.ones(1, dtype=torch.int64, device="cuda")
    for t in (256, 4096):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        ys = {}
        ev = {"old": [], "new": []}
        host = {"old": [], "new": []}
        with torch.inference_mode():
            for block in range(12):
                for variant in (("old", "new") if block % 2 == 0 else ("new", "old")):
                    use(variant)
                    for _ in range(3):
                        ys[variant] = layer(x)
                    torch.cuda.synchronize()
                    for _ in range(15):
                        dist.barrier()
                        torch.cuda.synchronize()
                        s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        layer(x)
                        en.record()
                        torch.cuda.synchronize()
                        ev[variant].append(s.elapsed_time(en))
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(15):
                        layer(x)
                    host[variant].append((time.perf_counter() - t0) / 15 * 1e3)
                    torch.cuda.synchronize()
        same = torch.equal(ys["old"], ys["new"])
        med = torch.tensor([statistics.median(ev["old"]), statistics.median(ev["new"]),
                            statistics.median(host["old"]), statistics.median(host["new"])], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        if rank == 0:
            o, n, ho, hn = med.tolist()
            print(f"t={t}: forward median old {o:.3f} ms, new {n:.3f} ms, new/old {n / o:.3f}; back-to-back host "
                  f"old {ho:.3f} ms, new {hn:.3f} ms, new/old {hn / ho:.3f}; outputs bitwise equal: {same} "
                  f"(180 forwards each, 12 interleaved blocks, max over ranks)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
