"""Per-GPU latency curves of the grouped experts (GEM), for ``recipes/plan.py curves.path=FILE``.

Every rank times its own grouped-expert computation (the experts of one rank at the chosen shape;
on GPUs, GPU time measured over CUDA-graph replays, free of host launch overhead, where the
experts can be captured: ``torch._grouped_mm``'s fast path, bf16 on sm90/sm100; otherwise eager
calls between CUDA events, their host syncs included — ``measured.timing`` says which, per rank)
for a range of row counts: densely at tile boundaries (``profile.tile`` rows, the grouped GEMM's M
tile) up to ``profile.dense_until``, then sparsely (every ``profile.sparse_step`` rows) up to
``profile.max_rows``, and at ``profile.max_rows`` itself; the planner interpolates linearly between
samples. Rank 0 gathers the curves and writes ``curves.npz`` (``rows [N]``, ``latency_s [R, N]`` —
the least-squares non-decreasing fit of the measurements, which ``LatencyCurves`` requires —,
``latency_raw_s [R, N]``, ``device_names``) atomically into the run dir with a picture of them
(``curves.png``: each rank's curve, and its latency relative to the fastest rank; written with
the curves, or left out with a warning when it cannot be drawn; ``plot=false``: none), and prints
the spread between the GPUs. ``curves.npz`` also
holds ``config``, a JSON string of ``{"config": the resolved config, "command": the command line,
"provenance": versions, commit, date and host, "measured": the dtype, the per-rank shape, the
seconds the profile took and each rank's timing method}`` (docs/outputs.md) (the run dir gets no
``.hydra/`` and no log file, and a run that fails writes nothing there).

    torchrun --standalone --nproc_per_node=2 recipes/profile.py parallel=gpu profile=qwen3_30b_a3b   # GPUs
    python recipes/profile.py                                   # 2 gloo processes, tiny shape (profile=cpu_smoke)
"""

from __future__ import annotations

import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this directory comes first on sys.path and recipes/profile.py would shadow the
# standard library's profile module: use the repository root instead (recipes is a package)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from recipes._common import (  # noqa: E402
    device_for, flag, int_setting, invocation, launch, provenance, refuse_empty_paths, refuse_unread_overrides, require_keys,
    resolve_backend, shutdown, to_dict,
)
from recipes._outputs import (  # noqa: E402
    claim_run_dir, commit_files, jsonable, run_recipe, under_torchrun, warn, writes_outputs,
)
from recipes._plots import plot_curves  # noqa: E402


MAX_SAMPLES = 100_000  # more row counts than this is a typo (its list alone could exhaust the memory)


def sample_rows(tile: int, dense_until: int, sparse_step: int, max_rows: int) -> list[int]:
    """Row counts to time: 1, every tile boundary up to ``dense_until``, then every ``sparse_step``,
    and ``max_rows`` itself (the last sample: the curves cover every row count asked for).

    Raises:
        ValueError: a bad setting (``max_rows < 2`` would give a one-sample curve, which
            ``LatencyCurves`` refuses), or more than :data:`MAX_SAMPLES` row counts.
    """
    if min(tile, sparse_step) < 1 or max_rows < 2 or dense_until < tile or max_rows < tile:
        raise ValueError(f"bad sampling: need profile.tile, sparse_step >= 1, max_rows >= 2 and dense_until, "
                         f"max_rows >= tile; got tile={tile}, dense_until={dense_until}, sparse_step={sparse_step}, "
                         f"max_rows={max_rows}")
    dense_top = min(dense_until, max_rows) // tile * tile
    n_sparse = (max_rows - dense_top) // sparse_step
    count = dense_top // tile + n_sparse + (tile > 1) + (dense_top + n_sparse * sparse_step < max_rows)  # len(result)
    if count > MAX_SAMPLES:
        raise ValueError(f"bad sampling: tile={tile}, dense_until={dense_until}, sparse_step={sparse_step}, "
                         f"max_rows={max_rows} would time {count} row counts (at most {MAX_SAMPLES}); raise "
                         f"profile.tile or profile.sparse_step, or lower profile.dense_until or profile.max_rows")
    rows = list(range(tile, dense_top + 1, tile))
    rows += list(range(dense_top + sparse_step, max_rows + 1, sparse_step))
    return sorted(set([1, *rows, max_rows]))


def check_profile(p: dict) -> list[int]:
    """The row counts to time (:func:`sample_rows`) from the ``profile`` block, its settings checked.

    ``tile``, ``dense_until``, ``sparse_step``, ``max_rows`` must be integers (their ranges:
    :func:`sample_rows`), ``warmup`` an integer >= 0, ``reps`` an integer >= 1 (with no timed call
    every latency would be NaN) and ``shape.hidden_size``, ``shape.ffn_hidden_size``,
    ``shape.num_experts`` integers >= 1.

    Raises:
        ValueError: a bad setting, naming it.
    """
    shape = p.get("shape") if isinstance(p.get("shape"), dict) else {}
    for key in ("hidden_size", "ffn_hidden_size", "num_experts"):
        int_setting(shape.get(key), f"profile.shape.{key}", 1)
    int_setting(p.get("warmup"), "profile.warmup", 0)
    int_setting(p.get("reps"), "profile.reps", 1)
    keys = ("tile", "dense_until", "sparse_step", "max_rows")
    return sample_rows(*(int_setting(p.get(k), f"profile.{k}") for k in keys))


def check_world(p: dict, world: int) -> None:
    """Raise ``ValueError`` unless ``profile.shape.num_experts`` divides over ``world`` ranks."""
    e = p["shape"]["num_experts"]
    if e % world:
        raise ValueError(f"profile.shape.num_experts={e} experts do not divide over {world} ranks (parallel.world_size "
                         f"or torchrun's --nproc_per_node); use a number of ranks that divides {e}")


#: expert parameters per rank above which a CPU run is refused (``profile.allow_large_cpu=true`` forces it)
MAX_CPU_EXPERT_PARAMS = 50_000_000


def check_fits(p: dict, world: int, backend: str, *, allow: bool = False) -> None:
    """Refuse a large shape without CUDA: each point would take seconds and the profile an hour,
    and CPU curves say nothing about GPUs.

    Raises:
        SystemExit: the shape's experts per rank hold more than :data:`MAX_CPU_EXPERT_PARAMS`
            parameters, the backend is not NCCL and not ``allow`` (``profile.allow_large_cpu``).
    """
    shape = p["shape"]
    n = 3 * (shape["num_experts"] // world) * shape["hidden_size"] * shape["ffn_hidden_size"]
    if backend != "nccl" and n > MAX_CPU_EXPERT_PARAMS and not allow:
        raise SystemExit(
            f"profile={p.get('name')} times {n / 1e6:.0f}M expert parameters per rank and this run is not on GPUs "
            f"(backend {backend}, not NCCL: CPU curves would take an hour and say nothing about GPUs). Profile the "
            f"CPU smoke shape instead:\n"
            f"    python recipes/profile.py profile=cpu_smoke\n"
            f"or on GPUs: torchrun --standalone --nproc_per_node=N recipes/profile.py parallel=gpu "
            f"profile={p.get('name')} (profile.allow_large_cpu=true forces it)")


def _time_rows(experts, x, counts, device, warmup: int, reps: int, inner: int = 10) -> float:
    """Median seconds of one grouped-expert call on ``x``.

    On CUDA, ``inner`` calls are captured in a CUDA graph and its replays timed with events, so the
    figure is GPU time, not the host's launch overhead (which a lone call would measure). Experts
    that read their slot counts on the host (the loop backend, or ``torch._grouped_mm`` off its fast
    path: another dtype, a GPU other than sm90/sm100) cannot be captured: their ``inner`` calls are
    timed eagerly between the same events, host syncs included, as they run when serving.
    """
    for _ in range(warmup):
        experts(x, counts)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            experts(x, counts)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))
    torch.cuda.synchronize(device)

    def calls():
        for _ in range(inner):
            experts(x, counts)

    graph = None
    if experts.sync_free(x):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
    run = graph.replay if graph is not None else calls
    run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    del graph, run
    return float(np.median(times))


def profile_worker(rank: int, world: int, cfg: dict) -> dict | None:
    from moelayers import GroupedExperts

    p, shape = cfg["profile"], cfg["profile"]["shape"]
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    device = device_for(backend)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h, f, e = int(shape["hidden_size"]), int(shape["ffn_hidden_size"]), int(shape["num_experts"])
    check_world(p, world)
    slots = e // world
    experts = GroupedExperts(slots, h, f, dtype=dtype, device=device)
    # the same weights and rows on every rank: the curves then differ only by the GPUs
    gen = torch.Generator(device=device).manual_seed(int_setting(cfg.get("seed", 0), "seed", 0))
    with torch.no_grad():
        experts.w13.normal_(0, 0.02, generator=gen)
        experts.w2.normal_(0, 0.02, generator=gen)
    rows = check_profile(p)
    x_all = torch.randn(rows[-1], h, dtype=dtype, device=device, generator=gen)
    reps, warmup = int(p["reps"]), int(p["warmup"])
    lat = []
    bar = None
    if rank == 0 and flag(cfg, "progress", True):
        from moelayers._progress import progress_bar
        bar = progress_bar(total=len(rows), desc="profiling row counts", unit="pt")
    t_start = time.perf_counter()
    with torch.inference_mode():
        for n in rows:
            # n rows spread evenly over this rank's experts (the grouped GEMM sees the same total)
            counts = torch.full((slots,), n // slots, dtype=torch.int64, device=device)
            counts[: n % slots] += 1
            lat.append(_time_rows(experts, x_all[:n], counts, device, warmup, reps))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    local = torch.tensor(lat, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(local) for _ in range(world)]
    if world > 1:
        dist.all_gather(everyone, local)
    else:
        everyone = [local]
    timing = ("perf_counter" if device.type != "cuda" else
              "cuda_graph" if experts.sync_free(x_all) else "cuda_events_eager")  # as _time_rows chose
    names = [None] * world
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if world > 1:
        dist.all_gather_object(names, (name, timing))
    else:
        names = [(name, timing)]
    names, timings = [n for n, _ in names], [t for _, t in names]
    if rank != 0:
        return None
    latency = torch.stack(everyone).cpu().numpy()
    if (~np.isfinite(latency) | (latency <= 0)).any():
        raise RuntimeError("a measured latency is not a positive number: the timer failed")
    return {"rows": rows, "latency_s": latency, "device_names": names, "seconds": time.perf_counter() - t_start,
            "shape": {"H": h, "F": f, "E": e, "slots_per_rank": slots}, "dtype": str(dtype), "timing": timings}


def monotone_fit(latency_s: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit of each rank's measured curve (pool adjacent violators).

    Timing noise, and kernels that run fewer rows per expert slower (a memory-bound grouped GEMM
    reads every active expert's weights), can make a measured curve dip; a planner needs
    ``C_r(n)`` non-decreasing, so each dip is replaced by the mean of the samples it spans.

    Args:
        latency_s: ``[R, N]`` measured seconds at increasing row counts.

    Returns:
        ``[R, N]`` non-decreasing in ``N``, equal to the input where it already was.
    """
    out = np.empty_like(np.asarray(latency_s, dtype=np.float64))
    for r, y in enumerate(np.asarray(latency_s, dtype=np.float64)):
        sums, counts = [], []
        for v in y:
            sums.append(v)
            counts.append(1)
            while len(sums) > 1 and sums[-2] / counts[-2] > sums[-1] / counts[-1]:
                last_sum, last_count = sums.pop(), counts.pop()
                sums[-1] += last_sum
                counts[-1] += last_count
        out[r] = np.repeat(np.asarray(sums) / np.asarray(counts), counts)
    return out


def save_curves(path: str, rows, latency_s: np.ndarray, device_names, raw_latency_s: np.ndarray | None = None,
                config: dict | None = None) -> None:
    """Write the curves file atomically (the format ``LatencyCurves.load`` reads; ``latency_raw_s``:
    the measurements before :func:`monotone_fit`; ``config``: stored as a JSON string)."""
    from moelayers.files import atomic_write
    from moelayers.planning.gem import FILE_FORMAT as CURVES_FORMAT

    extra = {} if raw_latency_s is None else {"latency_raw_s": np.asarray(raw_latency_s, dtype=np.float64)}
    if config is not None:
        extra["config"] = np.str_(json.dumps(jsonable(config), sort_keys=True))
    arrays = dict(rows=np.asarray(rows, dtype=np.int64), latency_s=np.asarray(latency_s, dtype=np.float64),
                  device_names=np.asarray(device_names, dtype=str), format_version=np.int64(CURVES_FORMAT), **extra)
    atomic_write(path, lambda fh: np.savez(fh, **arrays))


def summarize(res: dict, out_dir: str, config: dict | None = None, plot: bool = True) -> str:
    raw, rows = res["latency_s"], res["rows"]
    lat = monotone_fit(raw)
    path = os.path.join(out_dir, "curves.npz")
    writers = {"curves.npz": lambda tmp: save_curves(tmp, rows, lat, res["device_names"], raw, config=config)}
    if plot:
        writers["curves.png"] = lambda tmp: plot_curves(rows, lat, raw, res["device_names"], tmp)
    # together: never a new curves.npz beside an earlier run's curves.png; a plot that fails leaves the curves
    written = commit_files(out_dir, writers, stale=("curves.png",), optional=("curves.png",))
    picks = sorted({0, len(rows) - 1, *(i for i, n in enumerate(rows) if n in (128, 1024, 4096, 16384))})
    table = [("rows", *[f"rank {r}" for r in range(lat.shape[0])], "max/min")]
    for i in picks:
        col = lat[:, i]
        table.append((str(rows[i]), *[f"{v * 1e6:.1f} us" for v in col], f"{col.max() / col.min():.3f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    spread = float((lat.max(0) / lat.min(0)).max())
    dips = int((raw != lat).sum())
    print(f"profiled {len(rows)} row counts on {lat.shape[0]} rank(s) in {res['seconds']:.3g} s; "
          f"largest max/min between {'CPU ranks' if set(res['device_names']) == {'cpu'} else 'GPUs'} {spread:.3f} "
          f"(median {float(np.median(lat.max(0) / lat.min(0))):.3f}); {dips} of {raw.size} samples smoothed to a "
          f"non-decreasing curve; devices {res['device_names']}; wrote {', '.join(map(str, written))}")
    return path


#: the config groups of conf/ this recipe reads (--help lists these)
CONFIG_GROUPS = ("parallel", "profile")


@hydra.main(config_path="../conf", config_name="profile", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_unread_overrides("profile.py", "profile", CONFIG_GROUPS, cfg=cfg)
    d = to_dict(cfg)
    require_keys(d, "profile.py", ("profile",))
    refuse_empty_paths(d)
    d["run_dir"] = claim_run_dir("profile.py")
    check_profile(d["profile"])  # a bad setting fails here, before any rank starts
    int_setting(d.get("seed", 0), "seed", 0)
    flag(d, "progress", True)
    flag(d, "plot", True)
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (d.get("parallel") or {}).get("world_size", 1)
    check_world(d["profile"], int_setting(world, "parallel.world_size", 1))
    backend = resolve_backend((d.get("parallel") or {}).get("backend"), torchrun=under_torchrun())
    check_fits(d["profile"], world, backend, allow=flag(d["profile"], "allow_large_cpu", False))
    ep = (d.get("parallel") or {}).get("ep")
    if ep is not None and int_setting(ep, "parallel.ep", 1) != world:
        raise ValueError(f"parallel.ep={ep}: profile.py times every rank of the world, one curve each, and plan.py "
                         f"needs one curve per expert-parallel rank; run it with {ep} ranks (parallel.world_size or "
                         f"torchrun's --nproc_per_node) on the GPUs of that EP group, or leave parallel.ep unset")
    origin = provenance() if writes_outputs() else {}  # (the other torchrun ranks write nothing)
    res = launch(d, profile_worker)
    if res is not None:
        echo = {k: v for k, v in d.items() if k != "run_dir"}
        measured = {"dtype": res["dtype"].replace("torch.", ""), "shape": res["shape"], "seconds": res["seconds"],
                    "timing": res["timing"]}
        if len(set(res["timing"])) > 1:
            warn(f"the ranks were timed differently ({res['timing']}): eager timing includes host syncs that a CUDA "
                 "graph leaves out, so the spread between those GPUs is partly the method's")
        record = {"config": echo, "command": invocation(), "provenance": origin, "measured": measured}
        summarize(res, d["run_dir"], config=record, plot=flag(d, "plot", True))
    shutdown()


if __name__ == "__main__":
    run_recipe(main)
