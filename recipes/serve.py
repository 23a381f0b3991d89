#!/usr/bin/env python
"""Serving loop: Poisson arrivals, continuous batching, attention-DP + expert-parallel MoE.

Every rank builds the same :class:`moelayers.models.TinyDecoder` (attention weights identical,
experts spread over the ranks), generates the same request list (same seed) and keeps the requests
the scheduler gives it (requests, schedulers and the semantic plan: ``recipes/_serve_workload.py``).
Each step all ranks run the model together — a rank without work still calls the MoE layers with
zero tokens — and stop when an all-reduce says every rank is done. A rank admits waiting requests
in arrival order while its step stays within ``max_batch_size`` requests and ``max_tokens_per_step``
tokens (one per decode, whole prompts; by default the layer's ``capacity`` when set, the largest
of a list, unless ``beyond_capacity=exact``: see :func:`step_token_budget`); ``max_step_tokens`` in results.json is the most one rank ran.

Measured: per request TTFT (arrival to first token) and TPOT (mean gap between output tokens),
output throughput, LAR and imbalance of the MoE layers (summed over layers and steps, reduced over
ranks), activations received per rank per step (``rank_loads``, ``rank_load_per_step``; one entry
per world rank, also with ``parallel.ep`` below the world, where each rank computes its own EP
group's share; ``imbalance`` is their max/mean). A run that ``max_steps`` ends before every request
finished says so: ``truncated`` true, ``unserved_requests`` (arrived, no first token),
``unarrived_requests`` (due after the run ended) and a note; its TTFT figures count unserved
requests as infinite (``inf`` in the table, ``null`` in results.json), as they waited longer than
the run, and leave the unarrived ones out (:func:`latency_summary`). Rank 0 prints a summary table and writes
``results.json`` (with the resolved ``config`` and the ``command``: argv and Hydra overrides) and
``rank_load.png`` (with ``compare.layer``: also ``compare.png``) into the Hydra run dir, all or
nothing at its end, nothing else: no ``.hydra/``, no log file, and a run that fails on bad input
writes nothing there (:func:`check_config` checks the files it is given, plan, curves and trace,
against the run before any rank starts). While it runs, the run dir holds ``.moelayers-run.lock``
(``recipes/_outputs.py``: a second run into the same dir is refused); Ctrl-C ends the run with one
line and exit status 130.

``router=replay`` replays a routing trace (``trace.path=FILE``, or a synthetic one): each request
is one trace sequence, teacher-forced — its first ``workload.prompt_fraction`` (at least one token)
is the prompt, the rest is fed one token per decode step — and MoE layer ``i`` is forced to the
trace's layer ``i mod L``. A request of ``n`` tokens with a prompt of ``p`` emits ``n - p + 1``
output tokens (one from the prefill, one per decode step; the last is past the trace's end).
Requests replay sequences ``trace.request_offset ..`` (``workload.num_requests`` of them): empty
sequences are skipped and a trace that ends early gives fewer requests, both noted in results.json
(``notes``, ``skipped_empty_sequences``); an offset that leaves no request is an error.

Usage::

    python recipes/serve.py                                          # 2 gloo processes on CPU
    python recipes/serve.py parallel.world_size=4 workload.num_requests=16 hydra.run.dir=/tmp/x
    python recipes/serve.py router=replay trace.path=trace.npz
    python recipes/serve.py layer=semantic scheduler=semantic router=replay   # Sem-MoE, plan from the trace
    torchrun --nproc-per-node 8 recipes/serve.py parallel=gpu        # NCCL

Comparisons (``compare.layer=NAME``, ``recipes/_serve_compare.py``, docs/serve_compare.md): ours and the
baseline once per seed (``compare.seeds``, default 3) on the same requests and the same emulated
hardware, one results.json (our medians, ``baseline``, ``runs``, ``comparison``), compare.png::

    python recipes/serve.py layer=semantic scheduler=semantic router=replay trace.num_sequences=256 \\
        trace.request_offset=128 compare.layer=vanilla compare.scheduler=round_robin
    python recipes/serve.py layer=variability variability=high emulation.mode=curve emulation.time_scale=3000 \\
        router=replay workload.num_requests=1024 workload.rate=2000 max_batch_size=256 layer.kwargs.window=6 \\
        compare.layer=vanilla

All-to-all volume: ``a2a_bytes`` = ``a2a_dispatch_bytes`` (``bytes_sent``) + ``a2a_combine_bytes``, see
:func:`_gather_results`. In ``emulation.mode=curve``, ``emulated_expert_s`` is the expert time the
emulation imposed on the critical path (:func:`emulated_expert_time`).

``layer.placement_path=FILE`` starts a constructor-built layer (vanilla, variability) in the placements
of a ``recipes/plan.py`` ``assignment.npz`` (GEM, EPLB: MoE layer ``i`` in row ``i mod L`` of its
``expert_rank``) or an ``ExpertPlacement`` file (:func:`layer_placements`).

``scheduler`` is a name (``round_robin``, ``semantic``, ``module:function``) or a dict
``scheduler={name:semantic,plan_path:FILE}``. ``layer=semantic`` and ``scheduler=semantic`` share one
``SemanticPlan``: ``scheduler.plan_path``, else ``layer.plan_path`` (both, with different values, is an
error), else one planned (mode dp) on the replay trace's first half of sequences (``layer.plan_train_fraction``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections import deque

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

from recipes import _serve_compare as compare  # noqa: E402
from recipes._common import (  # noqa: E402
    LAYER_FLAGS, absolute_path, capacity_bound, check_input_file, check_layer_settings, device_for, import_object, in_sweep, int_setting, layer_objects,
    invocation, launch, merge_curves_path, normalize_flags, overridden, percentile, print_table, provenance,
    refuse_empty_paths, refuse_unread_overrides, require_keys, shutdown, to_dict, unread_overrides,
)
from recipes._outputs import claim_run_dir, commit_files, run_recipe, warn, write_json, writes_outputs  # noqa: E402
from recipes._bench_tools import seq_len_bounds  # noqa: E402
from recipes._plots import plot_rank_load  # noqa: E402
from recipes._serve_workload import (  # noqa: E402
    Request, assign_requests, check_workload, get_scheduler, in_sample_requests, load_replay_trace, make_requests,
    plan_train_fraction, replay_sequences, request_offset, requests_digest, scheduler_name, semantic_plan,
    semantic_plan_path,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------- model
def warm_up(model, device: torch.device) -> None:
    """One prefill and one decode through ``model`` (lazy init, allocator), not measured. The MoE
    layers record no loads meanwhile, so a load-planning layer (GEM) neither plans from the warm-up
    nor re-plans during it, however small its window."""
    from moelayers.models import StepRequest

    recording = [(m, m.record_loads) for m in model.moe_layers if hasattr(m, "record_loads")]
    for m, _ in recording:
        m.record_loads = False
    try:
        with torch.no_grad():
            ids = torch.arange(5, dtype=torch.int64, device=device) % model.cfg.vocab_size  # any vocabulary
            model.step([StepRequest("warmup", ids[:4])])
            model.step([StepRequest("warmup", ids[4:])])
            model.release("warmup")
    finally:
        for m, on in recording:
            m.record_loads = on


def fit_model_to_trace(model_cfg: dict, trace) -> tuple[dict, list[str]]:
    """Experts and top-k from the trace; vocabulary grown to cover the trace's ``vocab_size``; a note
    when the model's layers and the trace's differ (layer ``i`` replays trace layer ``i mod L``)."""
    m, notes = dict(model_cfg), []
    if trace is None:
        return m, notes
    for key, val in (("num_experts", trace.num_experts), ("top_k", trace.top_k)):
        if int(m[key]) != val:
            notes.append(f"model.{key} {m[key]} -> {val} (from the trace)")
            m[key] = val
    if int(m["vocab_size"]) < trace.vocab_size:
        notes.append(f"model.vocab_size {m['vocab_size']} -> {trace.vocab_size} (covers the trace)")
        m["vocab_size"] = trace.vocab_size
    if int(m["num_layers"]) != trace.num_layers:
        notes.append(f"model.num_layers {m['num_layers']} with a trace of {trace.num_layers} layer(s): MoE layer i "
                     f"replays trace layer i mod {trace.num_layers}")
    return m, notes


def build_model(m: dict, layer: dict, groups, device: torch.device, seed: int, plan=None):
    """TinyDecoder whose MoE slots are ``layer['cls'](MoEConfig, groups, **layer['kwargs'])`` (with
    ``layer['placement_path']``, MoE layer ``i`` in that file's placement ``i mod L``:
    :func:`layer_placements`), or ``layer['cls'].from_plan(plan, i mod plan layers, ...)`` with a
    plan (``SemanticMoE``)."""
    from moelayers.models import TinyConfig, TinyDecoder

    dtype = DTYPES[m.get("dtype", "float32")]
    moe_cfg = moe_config(m)
    cls = import_object(layer["cls"], "layer.cls")
    kwargs = layer_objects(layer.get("kwargs") or {})
    placements = (layer_placements(layer["placement_path"], moe_cfg.num_experts, groups.ep_size)
                  if layer.get("placement_path") else None)

    def factory(i: int):
        if plan is not None:
            return cls.from_plan(plan, i % len(plan.expert_rank), moe_cfg, groups, device=device, seed=seed * 1000 + i,
                                 **kwargs)
        if placements is not None:
            kwargs["placement"] = placements[i % len(placements)]
        return cls(moe_cfg, groups, device=device, seed=seed * 1000 + i, **kwargs)

    tcfg = TinyConfig(vocab_size=int(m["vocab_size"]), hidden_size=int(m["hidden_size"]),
                      num_layers=int(m["num_layers"]), num_heads=int(m["num_heads"]), dtype=dtype)
    return TinyDecoder(tcfg, factory, device=device, seed=seed).eval()


def layer_placements(path: str, num_experts: int, ep: int) -> list:
    """The placements ``layer.placement_path`` names: an ``assignment.npz`` of ``recipes/plan.py``
    (``expert_rank [L, E]``, the planner's placement of each layer: MoE layer ``i`` starts in row
    ``i mod L``) or a placement file (``ExpertPlacement.save``: every layer).

    Raises:
        FileNotFoundError: no such file.
        ValueError: neither kind of file (or both), or placements for other experts or another
            number of expert-parallel ranks (an assignment's ``num_ranks``, where it has one, must
            be ``ep``: a plan for fewer ranks leaves ranks without experts), naming the file.
    """
    from moelayers.files import check_format_version, read_npz
    from moelayers.placement import ExpertPlacement
    from recipes._plan_tools import ASSIGNMENT_FORMAT

    data = read_npz(path, "placement file or plan.py assignment.npz")
    if "phy2log" not in data:  # first (a newer one may name its entries otherwise); a placement's: ExpertPlacement.load
        check_format_version(data, path, "plan.py assignment.npz", ASSIGNMENT_FORMAT, ("assignment", "placement"))
    kinds = [key for key in ("phy2log", "expert_rank") if key in data]
    if len(kinds) != 1:
        raise ValueError(f"{path}: " + ("holds both a placement (phy2log) and an assignment (expert_rank): which to "
                                         "serve is not clear" if kinds else
                                         f"neither a placement file (phy2log, num_experts) nor a plan.py "
                                         f"assignment.npz (expert_rank), keys {sorted(data)}"))
    if kinds == ["phy2log"]:
        placements = [ExpertPlacement.load(path)]
    else:
        rows = data["expert_rank"]
        rows = rows[None] if rows.ndim == 1 else rows
        if rows.ndim != 2 or rows.dtype.kind not in "iu" or rows.shape[0] == 0:
            raise ValueError(f"{path}: expert_rank must be an integer [L, E] table, got {rows.dtype} {list(rows.shape)}")
        if rows.shape[1] != num_experts:
            raise ValueError(f"{path} places {rows.shape[1]} experts per layer, the model has {num_experts}")
        planned = int(data["num_ranks"]) if "num_ranks" in data and data["num_ranks"].size == 1 else None
        if rows.min() < 0:
            raise ValueError(f"{path}: expert_rank holds rank {int(rows.min())}: ranks are >= 0")
        if (planned or 0) > ep or rows.max() >= ep:
            raise ValueError(f"{path} was planned for {planned or int(rows.max()) + 1} expert-parallel ranks, "
                             f"{ep} here: plan with parallel.ep={ep}")
        if planned is not None and planned != ep:
            raise ValueError(f"{path} was planned for {planned} expert-parallel ranks, {ep} here: ranks "
                             f"{planned}..{ep - 1} would hold no expert; plan with parallel.ep={ep}")
        placements = [ExpertPlacement.from_expert_rank(row, num_ranks=ep) for row in rows]
    for p in placements:
        if p.num_experts != num_experts or p.num_ranks != ep:
            raise ValueError(f"{path}: a placement of {p.num_experts} experts over {p.num_ranks} ranks, the model has "
                             f"{num_experts} experts over {ep} expert-parallel ranks")
    return placements


# ---------------------------------------------------------------------- the loop
def serve_worker(rank: int, world: int, cfg: dict) -> dict | None:
    """One rank of the serving loop; rank 0 returns the results dict."""
    import moelayers as ml
    from moelayers.emulation import VariabilitySettings
    from moelayers.metrics import merge_stats
    from moelayers.models import StepRequest
    from moelayers.trace import train_sequences

    device = device_for(dist.get_backend())
    trace = load_replay_trace(cfg)
    mcfg, notes = fit_model_to_trace(cfg["model"], trace)
    groups = ml.ParallelGroups.from_world(ep=cfg["parallel"].get("ep"))
    var = VariabilitySettings.from_config(cfg)  # variability preset / curves and its emulation (any layer)
    layer_cfg = var.layer_config(cfg["layer"], groups.ep_size)
    plan = semantic_plan(cfg, groups.ep_size, trace) if uses_plan(layer_cfg) else None
    model = build_model(mcfg, layer_cfg, groups, device, int(cfg["seed"]), plan=plan)
    if layer_cfg.get("placement_path"):
        notes.append(f"the MoE layers start in the placements of {layer_cfg['placement_path']} (MoE layer i in "
                     f"its placement i mod L)")
    var.apply(model.moe_layers)  # hooks stay on the layers for the whole run
    requests = make_requests(cfg, int(mcfg["vocab_size"]), trace)
    skipped_empty = 0
    if trace is not None:
        _, replay_notes, skipped_empty = replay_sequences(cfg, trace)
        notes += replay_notes
    owner = assign_requests(requests, world, cfg)
    in_sample = in_sample_requests(cfg, requests, trace, plan is not None, groups.ep_size)
    if in_sample is None:
        notes.append(f"the semantic plan is read from {semantic_plan_path(cfg)}, which does not record the sequences "
                     f"it was planned on (an older file): whether requests replay them is unknown (in_sample_requests: "
                     f"null); recipes/plan.py plans on the first trace.train_fraction of the trace's sequences, so set "
                     f"trace.request_offset past them")
    elif in_sample and semantic_plan_path(cfg):
        notes.append(f"{in_sample} of {len(requests)} requests replay sequences the semantic plan "
                     f"{semantic_plan_path(cfg)} was trained on (by content): set trace.request_offset past them")
    elif in_sample:
        notes.append(f"{in_sample} of {len(requests)} requests replay sequences the semantic plan was trained on "
                     f"(trace.request_offset={request_offset(cfg)}; held-out from "
                     f"{train_sequences(plan_train_fraction(cfg), trace.num_sequences)})")
    mine = sorted((r for r, o in zip(requests, owner) if o == rank), key=lambda r: r.arrival)
    max_batch, max_tokens = int(cfg["max_batch_size"]), step_token_budget(cfg)
    layers, num_layers = model.moe_layers, len(model.moe_layers)

    def ids(tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.int64, device=device)

    def forced_for(batch: list[tuple[Request, list[int]]]):
        if trace is None:
            return None
        if not batch:  # forced too (no ids): every rank reads the forced-routing flags, in capacity mode as well
            return [torch.zeros(0, trace.top_k, dtype=torch.int64, device=device)] * num_layers
        rows = [trace.topk_ids[trace.sequence_slice(r.trace_seq)][pos] for r, pos in batch]  # [n, L, K] each
        topk = torch.from_numpy(np.concatenate(rows).astype(np.int64)).to(device)
        return [topk[:, i % trace.num_layers] for i in range(num_layers)]

    warm_up(model, device)
    dist.barrier()

    bar = None
    if rank == 0 and cfg.get("progress", True):
        from moelayers._progress import progress_bar
        nested = cfg.get("_run_label") is not None  # one run of a comparison: under the runs bar
        bar = progress_bar(total=len(requests), desc=cfg.get("_run_label") or f"serve {cfg['layer']['name']} x{world}",
                           unit="req", nested=nested)
    replans_seen = [getattr(m, "num_replans", 0) for m in model.moe_layers]
    replans = []
    pending, waiting, running = deque(mine), deque(), []
    acc, load_rows, combine_rows, max_step_tokens = None, [], 0, 0
    sizes_run: dict[str, int] = {}  # capacity mode: layer forwards per size they were padded to ("exact": beyond)
    finished, steps, out_tokens, prompt_tokens = 0, 0, 0, 0
    t0 = time.perf_counter()
    with torch.no_grad():
        while steps < int(cfg["max_steps"]):
            now = time.perf_counter() - t0
            while pending and pending[0].arrival <= now:
                waiting.append(pending.popleft())
            new, n_tok = [], len(running)  # tokens of the step: one per decode, whole prompts
            while waiting and len(running) + len(new) < max_batch and n_tok + len(waiting[0].prompt) <= max_tokens:
                n_tok += len(waiting[0].prompt)
                new.append(waiting.popleft())
            vec = torch.tensor([len(pending) + len(waiting) + len(running) + len(new), n_tok, finished],
                               dtype=torch.int64, device=device)
            dist.all_reduce(vec)
            remaining, global_tok, global_done = vec.tolist()
            if bar is not None and global_done > bar.n:  # (only when a request finished: a redraw is a log line)
                bar.update(global_done - bar.n)
            if remaining == 0:
                break
            if global_tok == 0:  # nobody has work yet: wait for arrivals
                time.sleep(min(max(pending[0].arrival - now, 0.0), 0.002) if pending else 0.001)
                continue
            batch = [(r, [len(r.prompt) + r.generated - 1]) for r in running]
            batch += [(r, list(range(len(r.prompt)))) for r in new]
            items = [StepRequest(r.rid, ids([r.next_input]) if r.generated else ids(r.prompt)) for r, _ in batch]
            logits = model.step(items, forced_topk=forced_for(batch))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter() - t0
            steps += 1
            prompt_tokens += sum(len(r.prompt) for r in new)
            max_step_tokens = max(max_step_tokens, n_tok)
            per_layer = [layer.last_stats for layer in layers]
            acc = merge_stats(per_layer if acc is None else [acc] + per_layer)
            combine_rows += sum(_combine_rows(layer, s) for layer, s in zip(layers, per_layer))
            for layer in layers:
                if getattr(layer, "capacity", None) is not None:
                    size = "exact" if layer.last_capacity is None else str(layer.last_capacity)
                    sizes_run[size] = sizes_run.get(size, 0) + 1
            load_rows.append([list(s.pairs_sent) for s in per_layer])  # [L, R] activations sent to each rank
            for i, m in enumerate(layers):
                if getattr(m, "num_replans", 0) != replans_seen[i]:
                    replans_seen[i] = m.num_replans
                    replans.append({"layer": i, "step": steps, "t_s": t, **(getattr(m, "last_replan", None) or {})})
            for r, _ in batch:
                r.token_times.append(t)
                r.generated += 1
                out_tokens += 1
                if r.forced is not None:
                    r.next_input = r.forced[r.generated - 1] if r.generated - 1 < len(r.forced) else -1
                else:
                    r.next_input = int(logits[r.rid].argmax())
                if r.done:
                    model.release(r.rid)
                    finished += 1
            running = [r for r, _ in batch if not r.done]
    ml.check_pending(model)  # layers with check_finite='deferred': the last step's flags (every rank alike)
    elapsed = time.perf_counter() - t0
    emulated = var.describe(groups.ep_size)
    notes += [emulated] if emulated else []
    if bar is not None:
        bar.update(len(requests) - bar.n)
        bar.close()
    counted = [(i, m.num_replans) for i, m in enumerate(layers) if hasattr(m, "num_replans")]
    res = _gather_results(cfg, rank, world, groups, requests, mine, acc, load_rows, steps, out_tokens,
                          prompt_tokens, elapsed, mcfg, notes, device, (replans, counted), combine_rows,
                          max_step_tokens, sizes_run)
    if res is not None:
        res["in_sample_requests"] = in_sample
        if trace is not None:
            res["skipped_empty_sequences"] = skipped_empty
    return res


def compare_worker(rank: int, world: int, cfg: dict) -> list[dict] | None:
    """Every run of a comparison (``cfg['_runs']``, see ``recipes._serve_compare``) in turn, in this
    one launch of the ranks; rank 0 returns every run's results (with ``side``)."""
    import gc

    runs, bar = cfg["_runs"], None
    if rank == 0 and cfg.get("progress", True):
        from moelayers._progress import progress_bar
        bar = progress_bar(total=len(runs), desc="compare", unit="run")
    out = []
    for run in runs:
        if bar is not None:
            bar.set_postfix_str(run["_run_label"], refresh=sys.stderr.isatty())  # into a log: with the bar's pacing
        res = serve_worker(rank, world, run)
        if res is not None:
            res["side"] = run["_side"]
            out.append(res)
        gc.collect()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out if rank == 0 else None



def _combine_rows(layer, stats) -> int:
    """Hidden-state rows one forward's combine sent to other ranks: one per remote dispatch row, or
    with ``capacity`` the whole fixed buffer (``C`` rows to every other rank, ``C`` the capacity
    the forward ran at, padding included, as ``bytes_sent`` counts the dispatch)."""
    cap = getattr(layer, "last_capacity", None)
    if cap is not None:
        return int(cap) * (len(stats.rows_sent) - 1)
    return sum(stats.rows_sent) - stats.rows_sent[stats.rank]


def _gather_results(cfg, rank, world, groups, requests, mine, acc, load_rows, steps, out_tokens, prompt_tokens,
                    elapsed, mcfg, notes, device, replanning=((), ()), combine_rows=0,
                    max_step_tokens=0, sizes_run: dict | None = None) -> dict | None:
    """Reduce the counters over ranks; rank 0 builds the results dict.

    ``replanning``: this rank's ``(replans, [(layer, count)])``. Every expert-parallel group re-plans
    from its own loads: ``replans`` and the notes hold those of every group (``ep_group``: the
    group's index, world ranks ``ep_group * ep .. + ep - 1``), each taken from the group's EP rank 0.

    All-to-all volume: ``a2a_dispatch_bytes`` (= ``bytes_sent``: de-duplicated payload rows to other
    ranks, hidden state + routing metadata, ``MoEStats.bytes_sent``) plus ``a2a_combine_bytes`` (one
    hidden-state row back per such row; with ``capacity`` the fixed buffers both ways, padding
    included: :func:`_combine_rows`) = ``a2a_bytes``, summed over ranks, MoE layers and steps.
    ``max_step_tokens``: the most tokens one rank ran in a step (max over ranks). ``sizes_run``:
    this rank's layer forwards per capacity they ran at (summed over ranks: ``capacity_forwards``).
    """
    from moelayers.dispatch.base import partial_sum_dtype
    from moelayers.metrics import MoEStats, imbalance

    world_group = dist.group.WORLD if world > 1 else None
    ep_size = groups.ep_size
    if acc is None:  # no step ran anywhere (no requests)
        acc = MoEStats(0, [0] * ep_size, [0] * ep_size, [0] * ep_size, 1, 0)
    remote_rows = sum(acc.rows_sent) - acc.rows_sent[acc.rank]  # rows this rank sent to other ranks
    total = acc.reduce(world_group)
    num_layers = len(load_rows[0]) if load_rows else 0
    loads = (torch.tensor(load_rows, dtype=torch.int64) if load_rows
             else torch.zeros(0, num_layers, ep_size, dtype=torch.int64))  # [steps, L, R]
    loads = loads.to(device)
    # the rows each rank of this rank's expert-parallel group computed ([steps, L, R]), gathered from
    # every rank of the world with its EP rank: the emulated time of one group is not that of the sum
    group_loads = loads.clone()
    if ep_size > 1:
        dist.all_reduce(group_loads, group=groups.ep)
    ep_ranks = [groups.ep_rank]
    counts = torch.tensor([out_tokens, prompt_tokens, remote_rows, combine_rows], dtype=torch.int64, device=device)
    t_end = torch.tensor([elapsed], dtype=torch.float64, device=device)
    most = torch.tensor([max_step_tokens], dtype=torch.int64, device=device)
    if world > 1:
        every = [torch.empty_like(group_loads) for _ in range(world)]
        dist.all_gather(every, group_loads)
        group_loads = torch.stack(every)
        ep_ranks = [None] * world
        dist.all_gather_object(ep_ranks, groups.ep_rank)
        dist.all_reduce(counts)
        dist.all_reduce(t_end, op=dist.ReduceOp.MAX)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    else:
        group_loads = group_loads[None]
    every_sizes = [sizes_run or {}]
    if world > 1:
        every_sizes = [None] * world
        dist.all_gather_object(every_sizes, sizes_run or {})
    capacity_forwards: dict[str, int] = {}
    for got in every_sizes:
        for size, n in got.items():
            capacity_forwards[size] = capacity_forwards.get(size, 0) + n
    # times: arrival_s, last_token_s, finish_s from the run's start; ttft_s from the request's arrival
    per_req = [{"id": r.rid, "rank": rank, "arrival_s": r.arrival, "prompt_len": len(r.prompt),
                "output_len": r.output_len, "generated_tokens": r.generated, "finished": r.done,
                "ttft_s": r.token_times[0] - r.arrival if r.token_times else float("nan"),
                "tpot_s": (r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                if len(r.token_times) > 1 else float("nan"),
                "last_token_s": r.token_times[-1] if r.token_times else float("nan"),
                "finish_s": r.token_times[-1] if r.token_times and r.done else float("nan")} for r in mine]
    mine_replans = replanning if groups.ep_rank == 0 else None  # one record per EP group
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, (per_req, mine_replans))
    else:
        gathered = [(per_req, mine_replans)]
    if rank != 0:
        return None
    reqs = sorted((q for part, _ in gathered for q in part), key=lambda q: q["id"])
    groups_replans = [(w // ep_size, rp) for w, (_, rp) in enumerate(gathered) if rp is not None]
    replans = sorted(({**r, "ep_group": g} for g, (rp, _) in groups_replans for r in rp),
                     key=lambda r: (r["step"], r["ep_group"], r["layer"]))
    several = len(groups_replans) > 1
    notes = notes + [("EP group {g}: " if several else "").format(g=g) + "re-plans per MoE layer: "
                     + ", ".join(f"layer {i}: {n}" for i, n in counted)
                     for g, (_, counted) in groups_replans if counted]  # one line per group, not per layer
    latency = latency_summary(reqs, float(t_end[0]))
    group_loads = group_loads.cpu()  # [W, steps, L, R]: each world rank's EP group, per EP rank
    coverage = curves_coverage(cfg, int(group_loads.max()) if group_loads.numel() else 0)
    notes = notes + coverage.pop("notes")
    if latency["truncated"]:
        unserved, unarrived = latency["unserved_requests"], latency["unarrived_requests"]
        notes = notes + [f"max_steps={cfg['max_steps']} ended the run with {len(reqs) - latency['finished_requests']} "
                         f"of {len(reqs)} request(s) unfinished" + (
                             f", {unserved} arrived without a first token (their TTFT counts as inf in the TTFT "
                             f"figures, null in results.json)" if unserved else "") + (
                             f", {unarrived} due after the run ended (left out of the TTFT figures)"
                             if unarrived else "")]
    # activations received per step, MoE layer and *world* rank (with parallel.ep < world the EP
    # groups are told apart: summing them by EP rank hid one group's hot spots behind another's)
    layer_loads = torch.stack([group_loads[w, :, :, ep_ranks[w]] for w in range(world)], dim=-1)  # [steps, L, W]
    loads = layer_loads.sum(1)  # [steps, W]
    rank_loads = [int(v) for v in layer_loads.sum((0, 1)).tolist()]
    step_imb = [imbalance(row) for row in loads.tolist() if sum(row) > 0]
    elapsed = float(t_end[0])
    out_total, prompt_total, remote_total, combine_total = (int(v) for v in counts.cpu().tolist())
    row_dtype = partial_sum_dtype(DTYPES[mcfg.get("dtype", "float32")])  # float16 layers send float32 subtotals
    combine_bytes = combine_total * int(mcfg["hidden_size"]) * row_dtype.itemsize
    echo = {k: v for k, v in cfg.items() if k != "run_dir" and not k.startswith("_")}
    return {
        "throughput_tok_s": out_total / elapsed if elapsed > 0 else 0.0,
        "total_tok_s": (out_total + prompt_total) / elapsed if elapsed > 0 else 0.0,
        **latency,
        "lar": total.lar, "imbalance": imbalance(rank_loads),
        "imbalance_step_mean": float(np.mean(step_imb)) if step_imb else 1.0,
        "rank_loads": rank_loads, "bytes_sent": sum(total.bytes_sent), "rows_sent": sum(total.rows_sent),
        "a2a_bytes": sum(total.bytes_sent) + combine_bytes, "a2a_dispatch_bytes": sum(total.bytes_sent),
        "a2a_combine_bytes": combine_bytes, "a2a_rows": remote_total,
        "world_size": world, "layer": layer_label(cfg["layer"]), "router": cfg["router"]["name"],
        "scheduler": cfg["scheduler"], "num_requests": len(reqs), "output_tokens": out_total,
        "prompt_tokens": prompt_total, "max_step_tokens": int(most[0]),
        "capacity_forwards": dict(sorted(capacity_forwards.items(),
                                         key=lambda kv: (kv[0] == "exact", 0 if kv[0] == "exact" else int(kv[0])))),
        "steps": steps, "elapsed_s": elapsed, "seed": cfg["seed"], "requests_digest": requests_digest(requests),
        "model": mcfg, "notes": notes, "config": echo, "replans": replans,
        "requests": reqs, "rank_load_per_step": loads.tolist(),
        **emulated_expert_time(cfg, group_loads, ep_ranks), **coverage, **placement_file_record(cfg["layer"]),
    }


def layer_label(layer_cfg: dict) -> str:
    """The layer's name in results and tables; with ``placement_path``, the file's name after it
    (``vanilla+assignment.npz``), so that a comparison against the plain layer tells them apart."""
    path = layer_cfg.get("placement_path")
    return f"{layer_cfg['name']}+{os.path.basename(path)}" if path else layer_cfg["name"]


def placement_file_record(layer_cfg: dict) -> dict:
    """``{"placement_file": {"path", "sha256"}}`` with ``layer.placement_path`` (the placements served,
    should the file be rewritten later), else nothing."""
    path = layer_cfg.get("placement_path")
    if not path:
        return {}
    with open(path, "rb") as f:
        return {"placement_file": {"path": path, "sha256": hashlib.sha256(f.read()).hexdigest()}}


def curves_coverage(cfg: dict, max_rank_rows: int) -> dict:
    """With profiled latency curves (``curves.path``: curve-mode emulation, GEM's re-plans), how far
    the run's loads went past their last sample, where they extrapolate (``plan.py`` warns alike).

    Args:
        cfg: the run's config; max_rank_rows: the most (token, expert) rows one rank computed in
            one MoE layer's step.

    Returns:
        ``{"notes": [...]}`` plus, with a curves file, ``curves_sampled_up_to`` and ``max_rank_rows``.
    """
    from moelayers.emulation import VariabilitySettings, load_curves

    var = VariabilitySettings.from_config(cfg)
    if not var.curves_path:
        return {"notes": []}
    up_to = load_curves(var.curves_path).sampled_up_to
    out = {"notes": [], "curves_sampled_up_to": up_to, "max_rank_rows": max_rank_rows}
    if up_to is not None and max_rank_rows > up_to:
        out["notes"].append(
            f"a rank computed up to {max_rank_rows} rows in one MoE layer's step, beyond the last sample of the "
            f"latency curves {var.curves_path} ({up_to} rows): the emulated times and GEM's plans there extrapolate "
            f"the curves; profile up to that many rows (recipes/profile.py profile.max_rows=...) or serve smaller "
            f"batches (max_batch_size, max_tokens_per_step)")
    return out


def latency_summary(reqs: list[dict], elapsed: float = math.inf) -> dict:
    """TTFT and TPOT figures of the per-request records (``arrival_s``, ``ttft_s``, ``tpot_s``,
    ``generated_tokens``, ``finished``), and whether the run ended before every request finished.

    A request that arrived but got no first token (``max_steps`` ended the run first) has no
    measured TTFT; it counts as ``inf`` (it waited longer than the run), so the TTFT figures never
    leave it out: a percentile that falls among such requests, and the mean, are ``inf``. A request
    due after the run's end (``arrival_s > elapsed``) never waited: it is left out of the TTFT
    figures and counted in ``unarrived_requests``. The TPOT figures cover the requests with at
    least two output tokens.

    Args:
        reqs: the per-request records.
        elapsed: the run's length in seconds (arrivals are measured from its start).

    Returns:
        ``ttft_p50_s``, ``ttft_p99_s``, ``ttft_mean_s``, ``tpot_mean_s``, ``tpot_p90_s``,
        ``finished_requests``, ``unserved_requests`` (arrived, no output token),
        ``unarrived_requests`` (due after the run ended) and ``truncated`` (some request unfinished).
    """
    arrived = [q for q in reqs if q["generated_tokens"] or q.get("arrival_s", 0.0) <= elapsed]
    ttft = [q["ttft_s"] if q["generated_tokens"] else math.inf for q in arrived]
    tpot = [q["tpot_s"] for q in reqs if not math.isnan(q["tpot_s"])]
    finished = sum(1 for q in reqs if q["finished"])
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else math.nan,
            "tpot_mean_s": float(np.mean(tpot)) if tpot else math.nan, "tpot_p90_s": percentile(tpot, 90),
            "finished_requests": finished, "unserved_requests": sum(1 for q in arrived if not q["generated_tokens"]),
            "unarrived_requests": len(reqs) - len(arrived), "truncated": finished < len(reqs)}


def emulated_expert_time(cfg: dict, group_loads: torch.Tensor, ep_ranks: list[int]) -> dict:
    """In ``emulation.mode=curve``, the expert time the emulation imposed, from the recorded loads.

    Each (step, layer) costs an expert-parallel group ``time_scale * max_r C_r(rows_r)`` over its
    ranks (the slowest holds the others in the combine all-to-all); a step of the world lasts as long
    as its slowest group (the ranks agree on every step). ``emulated_expert_s`` is the sum over steps
    of that maximum (the critical path of step 4, GEM's objective as served; with one group, the sum
    over steps and layers of the slowest rank), ``emulated_expert_rank_s [W]`` each rank's own padded
    time, in world rank order. Empty for other modes.

    Args:
        cfg: the run's config (``emulation``, ``variability``, ``curves``).
        group_loads: ``[W, steps, L, R]`` the rows of every rank of each world rank's EP group.
        ep_ranks: ``[W]`` each world rank's rank in its EP group (its curve).
    """
    from moelayers.emulation import VariabilitySettings

    var = VariabilitySettings.from_config(cfg)
    if var.mode != "curve" or group_loads.numel() == 0:
        return {}
    curves = var.curves(int(group_loads.shape[-1]))
    per_rank = var.time_scale * np.asarray(curves(group_loads.to(torch.float64).numpy()), dtype=np.float64)
    group_step = per_rank.max(-1).sum(-1)  # [W, steps]: a world rank's group, step by step
    own = per_rank[np.arange(len(ep_ranks)), ..., np.asarray(ep_ranks)]  # [W, steps, L]
    return {"emulated_expert_s": float(group_step.max(0).sum()),
            "emulated_expert_rank_s": own.sum((1, 2)).tolist()}


# ---------------------------------------------------------------------- output
def summarize(res: dict, out_dir: str) -> None:
    """Write results.json and rank_load.png into ``out_dir``, then print the summary table (the files
    first: output that cannot be shown must not cost the run's files)."""
    keys = ["throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p90_s",
            *(["emulated_expert_s"] if "emulated_expert_s" in res else []),  # curve mode: the expert time imposed
            "lar", "a2a_bytes", "imbalance", "imbalance_step_mean", "num_requests", "finished_requests",
            "unserved_requests", "unarrived_requests", "output_tokens", "steps", "elapsed_s"]
    rows = [(compare.METRIC_LABELS[key], res.get(key, 0) if key == "unarrived_requests" else res[key]) for key in keys]
    title = f"{res['layer']} ({res['router']}), world {res['world_size']}: received per step"
    writers = {"rank_load.png": lambda p: plot_rank_load(res["rank_load_per_step"], p, title)} \
        if res["config"].get("plot", True) else {}
    writers["results.json"] = lambda p: write_json(p, compare.as_written(res, res["config"]))  # last: a finished run
    # all or nothing (an interrupted run leaves an earlier run's files, never one of each)
    paths = commit_files(out_dir, writers, stale=compare.OUTPUTS, optional=("rank_load.png",))
    for note in res["notes"]:
        print(f"note: {note}")
    print_table(rows, title=f"serve: layer={res['layer']} router={res['router']} scheduler={res['scheduler']} "
                            f"world={res['world_size']}")
    print(f"results: {paths[-1]}")
    for png in paths[:-1]:
        print(f"plot: {png}")


def uses_plan(layer_cfg: dict) -> bool:
    """Whether the layer class is built from a semantic plan (has ``from_plan``)."""
    return hasattr(import_object(layer_cfg["cls"], "layer.cls"), "from_plan")


def serve_sizes(d: dict) -> tuple[int, int]:
    """``(world, ep)``: the ranks (torchrun's ``WORLD_SIZE``, else ``parallel.world_size``) and the
    expert-parallel size (``parallel.ep``, default the world), as ``ParallelGroups.from_world`` sees them."""
    from recipes._outputs import under_torchrun

    par = d.get("parallel") or {}
    world = (int(os.environ["WORLD_SIZE"]) if under_torchrun()
             else int_setting(par.get("world_size", 1), "parallel.world_size", 1))
    if par.get("ep") is None:
        return world, world
    ep = int_setting(par["ep"], "parallel.ep", 1)
    if world % ep:
        raise ValueError(f"parallel.ep={ep} must divide the world size {world} (the expert-parallel groups split it)")
    return world, ep


def run_origin(d: dict, baseline: dict | None = None) -> dict:
    """What started this run, for its results: ``command`` (argv and Hydra overrides: the run dir
    holds no ``.hydra/``) and ``provenance`` (versions, commit, date, host, and the input files it
    reads with their sha256: the trace, the semantic plan, the placements, the latency curves; a
    comparison's ``baseline`` run config adds its own, as ``baseline:KEY``, where they differ)."""
    from moelayers.emulation import VariabilitySettings

    def files(c: dict) -> dict:
        return {"trace.path": (c.get("trace") or {}).get("path"), _plan_path_key(c): semantic_plan_path(c),
                "layer.placement_path": (c.get("layer") or {}).get("placement_path"),
                "curves.path": VariabilitySettings.from_config(c).curves_path}

    inputs = files(d)
    for key, path in (files(baseline) if baseline else {}).items():
        if path and inputs.get(key) != path:
            inputs[f"baseline:{key}"] = path
    return {"command": invocation(), "provenance": provenance(inputs)}


def _plan_path_key(d: dict) -> str:
    sched = d["scheduler"]
    return "scheduler.plan_path" if isinstance(sched, dict) and sched.get("plan_path") else "layer.plan_path"


def check_plan_file(d: dict, path: str, trace) -> None:
    """The semantic plan file of ``layer=semantic`` / ``scheduler=semantic`` against this run: mode
    dp (attention-DP serving), the model's experts and the expert-parallel ranks (a plan layer), the
    world (the semantic scheduler) and a vocabulary covering the requests' token ids (the semantic
    scheduler). ``trace``: the replay trace file, or ``None``.

    Raises:
        ValueError: naming the file (and the config key that gave it).
    """
    from moelayers.planning.semantic import SemanticPlan

    key = f"{_plan_path_key(d)}={path}"
    plan = SemanticPlan.load(path)  # its errors name the file
    world, ep = serve_sizes(d)
    mcfg, _ = fit_model_to_trace(d["model"], trace)
    layer_uses_plan = uses_plan(d["layer"])
    sched_uses_plan = scheduler_name(d["scheduler"]) == "semantic"
    if plan.mode != "dp":
        raise ValueError(f"{key}: semantic plan field 'mode' is {plan.mode!r}, but serve.py runs attention "
                         f"data-parallel (mode dp); re-plan with recipes/plan.py planner=semantic mode=dp")
    try:
        if layer_uses_plan:
            # with a replay trace, model layer i takes plan layer i mod P and trace layer i mod L: P = L
            plan.check_compatible(int(mcfg["num_experts"]), ep, None if trace is None else trace.num_layers)
        if sched_uses_plan:
            plan.check_compatible(None, world)
    except ValueError as e:
        raise ValueError(f"{key}: {e}" if str(path) not in str(e) else str(e)) from None
    if sched_uses_plan:
        # the scheduler reads the prompts' token ids: trace tokens with a replay trace, else drawn
        # from the model's vocabulary
        vocab, what = ((trace.vocab_size, f"the replay trace {d['trace']['path']}") if trace is not None
                       else (int(mcfg["vocab_size"]), "the model (model.vocab_size)"))
        if plan.vocab_size < vocab:
            raise ValueError(f"{key}: semantic plan field 'vocab_size' is {plan.vocab_size}, smaller than the "
                             f"vocab_size {vocab} of {what}: token ids >= {plan.vocab_size} have no entry in the "
                             f"plan's token table; re-plan on a trace with this vocabulary")


def check_curves_file(d: dict) -> None:
    """``curves.path`` (or ``variability.curves.path``): the profiled latency curves must exist and
    be for the expert-parallel ranks, whether or not this run uses them (a wrong file is an error).

    Raises:
        FileNotFoundError / ValueError: naming the file.
    """
    from moelayers.emulation import VariabilitySettings
    from moelayers.planning.gem import LatencyCurves

    path = VariabilitySettings.from_config(d).curves_path
    if not path:
        return
    check_input_file(path, "curves.path", "the latency curves")
    _, ep = serve_sizes(d)
    try:
        LatencyCurves.load(path).check_ranks(ep)
    except ValueError as e:
        raise ValueError(f"curves.path={path}: {e}" if str(path) not in str(e) else str(e)) from None


def check_plan_split(d: dict) -> None:
    """A plan built on the replay trace's first part: ``plan_train_fraction`` must split it (checked
    here, not inside the ranks)."""
    frac = plan_train_fraction(d)
    trace = load_replay_trace(d)
    try:
        trace.split(frac)
    except ValueError as e:
        raise ValueError(f"the semantic plan is built on the replay trace's first {frac} of its sequences: {e}; "
                         f"replay a longer trace (trace.num_sequences / workload.num_requests) or set "
                         f"layer.plan_train_fraction") from None


def check_config(d: dict) -> None:
    """Fail fast in the launching process on config mistakes (before any rank starts)."""
    from moelayers.emulation import VariabilitySettings

    get_scheduler(d["scheduler"])
    check_scheduler_keys(d)
    compare = d.get("compare") or {}
    if not compare.get("layer"):  # the comparison's settings without a comparison
        unused = overridden([f"compare.{k}" for k in compare if k != "layer"])
        if unused:
            raise ValueError(f"{', '.join(unused)} is read with compare.layer=NAME only (the baseline to serve the "
                             "same requests with): add compare.layer, or drop it")
    world, ep = serve_sizes(d)
    int_setting(d.get("seed", 0), "seed", 0)
    if scheduler_name(d["scheduler"]) == "semantic" and ep != world:
        raise ValueError(f"scheduler=semantic sends each request to the rank that holds its tokens' experts, by a plan "
                         f"over every rank: parallel.ep must be null or the world size ({world}), got {ep}")
    plan_path = None
    schedulers = [d["scheduler"], *([compare["scheduler"]] if compare.get("layer") and compare.get("scheduler") else [])]
    # (the command line's settings: checked on the whole config, not again on the baseline's run of a comparison)
    if "_side" not in d and not (uses_plan(d["layer"]) or any(scheduler_name(s) == "semantic" for s in schedulers)):
        # a layer without from_plan beside schedulers without a plan (++KEY in a -m sweep: set for its other jobs)
        unused = [o for o in overridden(EXTRA_KEYS[:2]) if not (o.startswith("++") and in_sweep("layer"))]
        if unused:
            raise ValueError(f"{', '.join(unused)}: a semantic plan is read with layer=semantic or scheduler=semantic "
                             f"only, and this run has layer={d['layer']['name']}, scheduler="
                             f"{scheduler_name(d['scheduler'])}: choose one of them, or drop it")
    if scheduler_name(d["scheduler"]) == "semantic" or uses_plan(d["layer"]):
        plan_path = semantic_plan_path(d)
        if plan_path:
            check_input_file(plan_path, _plan_path_key(d), "a semantic plan (recipes/plan.py's plan file)")
            sched = d["scheduler"] if isinstance(d["scheduler"], dict) else {}
            unused = unread_overrides(["layer.plan_train_fraction"], ["layer.plan_path", "scheduler"]) + (
                [f"scheduler.plan_train_fraction={sched['plan_train_fraction']}"]
                if sched.get("plan_train_fraction") is not None else [])
            if unused and "_side" not in d:
                raise ValueError(f"{', '.join(unused)} splits the replay trace for a plan made by the run; with "
                                 f"{_plan_path_key(d)}={plan_path} the plan file is served as it is (it records the "
                                 f"sequences it was trained on): drop it")
        if not plan_path and d["router"]["name"] != "replay":
            raise ValueError("layer=semantic / scheduler=semantic need a plan: layer.plan_path=FILE, "
                             "scheduler={name:semantic,plan_path:FILE}, or router=replay (planned on the trace)")
        if not plan_path:
            check_plan_split(d)
    if (d["layer"].get("kwargs") or {}).get("mode") == "tp":
        raise ValueError("serve.py runs attention data-parallel: use the layer's mode=dp (layer.kwargs.mode=dp)")
    check_curves_file(d)
    var = VariabilitySettings.from_config(d)
    var.layer_config(d["layer"], ep)  # its keys; a second slowdown of the layer
    check_emulation_read(d, var, ep)
    router = d["router"]["name"]
    if router not in ("learned", "replay"):
        raise ValueError(f"router must be learned or replay, got {router!r}")
    if d["model"].get("dtype", "float32") not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {d['model']['dtype']!r}")
    int_setting(d.get("max_batch_size"), "max_batch_size", 1)
    int_setting(d.get("max_steps"), "max_steps", 1)  # a run of zero steps serves nothing
    check_workload(d["workload"])
    trace = None
    if router != "replay":
        unused = [f"trace.{key}={d['trace'][key]}" for key in ("path", "request_offset") if d["trace"].get(key)]
        unused += unread_overrides(["trace.num_sequences", "trace.seq_len", "trace.synthetic", "workload.prompt_fraction"],
                                   ["router"])
        if unused:
            raise ValueError(f"{', '.join(unused)} is read with router=replay only (router={router} routes with "
                             f"the model's own router and draws the requests from workload.prompt_len / "
                             f"output_len): add router=replay, or drop it")
    else:  # the requests are the trace's sequences, cut by workload.prompt_fraction
        unused = overridden(["workload.prompt_len", "workload.output_len"])
        if unused:
            raise ValueError(f"{', '.join(unused)} is read with router=learned only: router=replay serves the trace's "
                             "sequences, workload.prompt_fraction of each the prompt and the rest its output "
                             "(trace.seq_len sizes a synthetic trace's sequences)")
    if router == "replay":
        path = d["trace"].get("path")
        if path:
            check_input_file(path, "trace.path", "a routing trace file")
        if not path and not d["trace"].get("synthetic", False):
            raise ValueError("router=replay needs trace.path=FILE (or trace.synthetic=true)")
        offset, num_seq = d["trace"].get("request_offset") or 0, d["trace"].get("num_sequences")
        int_setting(offset, "trace.request_offset", 0)
        if num_seq is not None:
            int_setting(num_seq, "trace.num_sequences", 1)
            if path:
                raise ValueError(f"trace.num_sequences={num_seq} sizes the synthetic trace; with trace.path the file's "
                                 "sequences are replayed (workload.num_requests and trace.request_offset pick them)")
        if path and overridden(["trace.seq_len"]):
            raise ValueError(f"{overridden(['trace.seq_len'])[0]} sizes the synthetic trace's sequences; with trace.path "
                             "the file's sequences are replayed as they are")
        if not path and num_seq and int(num_seq) <= offset:
            raise ValueError(f"trace.request_offset={offset} leaves no sequence of trace.num_sequences={num_seq}")
        if not path:
            seq_len_bounds(d["trace"].get("seq_len"), (16, 48))
        if path:
            trace = _load_trace_file(path)
            replay_sequences(d, trace)  # no request left: an error naming the file
    experts = trace.num_experts if trace is not None else d["model"]["num_experts"]
    if experts % ep:
        source = f"trace.path={d['trace']['path']} has" if trace is not None else "model.num_experts:"
        default = " (parallel.ep defaults to parallel.world_size)" if d["parallel"].get("ep") is None else ""
        fits = sorted({n for n in (experts - experts % ep, experts + ep - experts % ep) if n > 0})
        whole = scheduler_name(d["scheduler"]) == "semantic" or uses_plan(d["layer"])  # (ep = the world there)
        hint = (f"model.num_experts={' or '.join(map(str, fits))}" if trace is None
                else f"a parallel.world_size that divides {experts}" if whole
                else f"a parallel.ep that divides {experts} and the world size {world}")  # (linear placements only)
        raise ValueError(f"{source} {experts} experts per layer, which do not split over parallel.ep={ep} ranks{default}: "
                         f"e.g. {hint}")
    if plan_path:
        check_plan_file(d, plan_path, trace)
    check_placement_file(d, experts, ep, trace)
    check_capacity(d, trace)
    check_model_and_layer(d)  # last: the checks above name their keys more precisely


def check_scheduler_keys(d: dict) -> None:
    """A dict ``scheduler`` of a built-in scheduler: keys it reads only (a ``module:function``
    scheduler gets the whole config and may read any), and the plan keys only where a semantic plan
    is read (``scheduler=semantic`` or a plan-built layer)."""
    from recipes._serve_workload import SCHEDULERS

    sched = d["scheduler"]
    if "_side" in d or not isinstance(sched, dict) or scheduler_name(sched) not in SCHEDULERS:
        return
    plan_keys = ("plan_path", "plan_train_fraction")
    unknown = sorted(set(sched) - {"name", *plan_keys})
    if unknown:
        raise ValueError(f"scheduler.{unknown[0]}={sched[unknown[0]]}: scheduler={scheduler_name(sched)} reads no key "
                         f"{unknown[0]} (its dict form takes name, plan_path, plan_train_fraction), so the run would "
                         "ignore it: drop it")
    unused = [f"scheduler.{k}={sched[k]}" for k in plan_keys if sched.get(k) is not None]
    compare = d.get("compare") or {}
    # a comparison's baseline reads them too: a semantic compare.scheduler takes ours' plan (pin_semantic_plan),
    # and without compare.scheduler the baseline serves with this dict (a plan-built compare.layer reads it)
    baseline_reads = bool(compare.get("layer")) and (compare.get("scheduler") is None
                                                     or scheduler_name(compare["scheduler"]) == "semantic")
    if unused and not (scheduler_name(sched) == "semantic" or uses_plan(d["layer"]) or baseline_reads):
        raise ValueError(f"{', '.join(unused)}: a semantic plan is read with layer=semantic or scheduler=semantic "
                         f"only, and this run has layer={d['layer'].get('name')}, scheduler={scheduler_name(sched)}: "
                         "choose one of them, or drop it")


def check_emulation_read(d: dict, var, ep: int) -> None:
    """Refuse emulation / variability settings that nothing of this run reads: ``emulation.wait``
    where no rank is slowed down (``emulation.mode=off``, or measured mode with a preset that slows
    no rank), and, for a layer that takes no ``variability`` (e.g. vanilla) and no comparison,
    a ``variability`` preset with ``emulation.mode=off`` or a curves file outside curve mode. Each
    is named with its own reason; a ``++KEY`` (or a ``variability`` option) passes in a ``-m`` sweep
    over a setting that decides whether it is read (``-m layer=vanilla,variability ++curves.path=F``:
    the variability job reads it)."""
    import inspect

    if "_side" in d or (d.get("compare") or {}).get("layer"):  # (the baseline's layer may read them)
        return
    layer = d["layer"].get("name")
    found = []  # (override, why nothing reads it, what to do, the settings that decide it)
    if not var.slows(ep):
        found += [(o, f"it picks how a slowed rank waits, and variability={var.name} with emulation.mode={var.mode} "
                      f"slows no rank", "set emulation.mode=curve or a variability that slows a rank (e.g. high), "
                      "or drop it", ("variability", "emulation.mode")) for o in overridden(["emulation.wait"])]
    try:  # (a class taking **kwargs may read it)
        params = inspect.signature(import_object(d["layer"]["cls"], "layer.cls")).parameters
        takes = "variability" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes = True
    if not takes:
        if var.mode == "off":
            found += [(o, f"layer={layer} takes no variability, and emulation.mode=off slows no rank with it",
                       "set emulation.mode=measured or curve, use layer=variability, or drop it", ("layer", "emulation.mode"))
                      for o in overridden(["variability"]) if o.split("=", 1)[0].lstrip("+~") == "variability"]
        if var.mode != "curve":
            found += [(o, f"layer={layer} plans with no latency curves, and emulation.mode={var.mode} does not read "
                          "them", "set emulation.mode=curve, use layer=variability, or drop it", ("layer", "emulation.mode"))
                      for o in overridden(["curves.path", "variability.curves"])]
    # (in a sweep over what decides it another job reads it: ++KEY, or a variability option, which takes no ++)
    found = [f for f in found if not ((f[0].startswith("++") or f[0].split("=", 1)[0] == "variability")
                                      and any(in_sweep(k) for k in f[3]))]
    if found:
        raise ValueError("; ".join(f"{o}: nothing in this run reads it ({why}): {todo}" for o, why, todo, _ in found))


def check_model_and_layer(d: dict) -> None:
    """The model's configs (``model.*``) and the layer's constructor settings (``layer.kwargs``),
    checked by building one layer on the meta device here (a plan-built layer's settings are
    checked with its plan, in the ranks)."""
    import moelayers as ml

    from moelayers.models import TinyConfig

    m = d["model"]
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "num_experts", "top_k"):
        if key in m:  # (named here: int() below would say only "invalid literal")
            int_setting(m[key], f"model.{key}", 1)
    try:
        moe_cfg = moe_config(m)
        TinyConfig(vocab_size=int(m["vocab_size"]), hidden_size=int(m["hidden_size"]), num_layers=int(m["num_layers"]),
                   num_heads=int(m["num_heads"]), dtype=moe_cfg.params_dtype)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"model: {exc}") from exc
    if uses_plan(d["layer"]):
        return
    cls = import_object(d["layer"]["cls"], "layer.cls")
    check_layer_settings(lambda **kw: cls(moe_cfg, ml.ParallelGroups.single(), device=torch.device("meta"),
                                          **layer_objects(kw)),
                         d["layer"].get("kwargs") or {}, f"layer={d['layer'].get('name')} layer.kwargs", cls)


def moe_config(m: dict):
    """The MoE layers' ``MoEConfig`` from the ``model`` settings."""
    import moelayers as ml

    return ml.MoEConfig(hidden_size=int(m["hidden_size"]), ffn_hidden_size=int(m["ffn_hidden_size"]),
                        num_experts=int(m["num_experts"]), top_k=int(m["top_k"]),
                        score_fn=m.get("score_fn", "softmax"), params_dtype=DTYPES[m.get("dtype", "float32")])


def check_placement_file(d: dict, experts: int, ep: int, trace=None) -> None:
    """``layer.placement_path``: a file of placements for these experts and expert-parallel ranks
    (:func:`layer_placements`), for a layer built from its constructor (a plan-built one takes its
    placement from the plan), with one placement for every layer or one per layer: as many as the
    replayed trace has layers (MoE layer ``i`` replays trace layer ``i mod L``), else as the model.
    """
    path = d["layer"].get("placement_path")
    if not path:
        return
    if uses_plan(d["layer"]):
        raise ValueError(f"layer.placement_path={path}: layer={d['layer'].get('name')} takes its placement from its "
                         f"semantic plan (layer.plan_path); placement_path is for layers built by their constructor "
                         f"(vanilla, variability)")
    check_input_file(path, "layer.placement_path", "placements (plan.py's assignment.npz: name the file in its run dir)")
    n = len(layer_placements(path, experts, ep))
    layers, whose = (trace.num_layers, f"the trace {d['trace']['path']}") if trace is not None else (
        int(d["model"]["num_layers"]), "the model (model.num_layers)")
    if n not in (1, layers):
        raise ValueError(f"layer.placement_path={path} holds placements of {n} layers, {whose} has {layers}: a plan "
                         f"for another model? (one placement serves every layer)")


def step_token_budget(d: dict) -> float:
    """Most tokens a rank runs through the model in one step (a decode's one token, a prefill's
    whole prompt): ``max_tokens_per_step``, else the layer's ``capacity`` (the largest of a list:
    capacity mode refuses a step of more tokens per rank), else no bound (also with
    ``beyond_capacity=exact``, which runs such steps exact). Waiting requests are admitted in arrival
    order while the step's tokens stay within it; the decodes that follow fit by construction
    (one token per request, and every prompt has one at least)."""
    budget = d.get("max_tokens_per_step")
    if budget is None:
        budget = capacity_bound(d["layer"].get("kwargs"))
    return math.inf if budget is None else int(budget)


def check_capacity(d: dict, trace) -> None:
    """``max_tokens_per_step`` and ``+layer.kwargs.capacity=C`` (capacity mode: at most ``C``
    tokens per rank in a step, the largest of a list ``[C1, C2, ...]`` of sizes a step is padded
    to; the step budget by default; no bound with ``beyond_capacity=exact``): the longest prompt's
    prefill must fit
    the budget, or it could never be admitted, and the budget must fit the capacity, or the run
    fails inside the ranks at a large prefill.

    Raises:
        ValueError: either not an int >= 1, a budget above the capacity, or one below the longest
            prompt.
    """
    capacity = capacity_bound(d["layer"].get("kwargs"))
    budget = d.get("max_tokens_per_step")
    if budget is not None:
        budget = int_setting(budget, "max_tokens_per_step", 1)
        if capacity is not None and budget > capacity:
            raise ValueError(f"max_tokens_per_step={budget} is above layer.kwargs.capacity={capacity}: capacity mode "
                             f"refuses a step of more tokens per rank; set max_tokens_per_step <= {capacity} (or "
                             f"drop it: the capacity is the default budget)")
    if budget is None and capacity is None:
        return
    if trace is None and d["router"]["name"] == "replay":
        trace = load_replay_trace(d)  # the synthetic trace the ranks will replay
    vocab = fit_model_to_trace(d["model"], trace)[0]["vocab_size"]
    longest = max((len(r.prompt) for r in make_requests(d, int(vocab), trace)), default=0)
    name, value = ("max_tokens_per_step", budget) if budget is not None else ("layer.kwargs.capacity", capacity)
    if value < longest:
        given = (d["layer"].get("kwargs") or {}).get("capacity")
        shown = f"{list(given)} (largest {value})" if budget is None and isinstance(given, (list, tuple)) else value
        raise ValueError(f"{name}={shown} is below the longest prompt ({longest} tokens): a step prefills whole "
                         f"prompts, so that request could never be served; raise it to at least {longest} or "
                         f"shorten the prompts (workload.prompt_len, workload.prompt_fraction)")


def _load_trace_file(path: str):
    """``load_trace(path)``, once per file and process (check_config runs per side of a comparison)."""
    from moelayers.trace import load_trace

    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _TRACE_FILES:
        _TRACE_FILES.clear()
        _TRACE_FILES[key] = load_trace(path)
    return _TRACE_FILES[key]


_TRACE_FILES: dict = {}


#: the config groups of conf/ this recipe reads (--help lists these)
CONFIG_GROUPS = ("model", "layer", "parallel", "workload", "router", "variability")
#: config keys whose sub-keys the code reading them checks (refuse_unread_overrides lets them pass)
OPEN_KEYS = ("layer.kwargs", "scheduler", "workload.prompt_len", "workload.output_len", "variability", "emulation",
             "compare.layer.kwargs", "compare.scheduler")
#: the baseline of a comparison (compare.layer={name:...,cls:...,kwargs:{...}}) holds what layer does
MIRRORS = {"compare.layer": "layer"}
#: keys of some layer options that check_config refuses with its reason where the run would not read
#: them (a semantic scheduler reads plan_path with any layer; a plan-built layer has no placement_path)
EXTRA_KEYS = ("layer.plan_path", "layer.plan_train_fraction", "layer.placement_path")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_unread_overrides("serve.py", "config", CONFIG_GROUPS, OPEN_KEYS, EXTRA_KEYS, MIRRORS, cfg=cfg)
    d = to_dict(cfg)
    require_keys(d, "serve.py", ("layer", "max_batch_size", "max_steps", "model", "parallel", "router", "scheduler",
                                 "seed", "trace", "workload"))
    refuse_empty_paths(d)
    normalize_flags(d, ("progress", "plot", "per_request", "trace.synthetic", *LAYER_FLAGS))
    if merge_curves_path(d) and not isinstance(d.get("variability"), dict):  # curves.path: plan.py's spelling
        d["variability"] = {"name": d.get("variability") or "none", "curves": dict(d["curves"])}
    if d.get("trace", {}).get("path"):
        d["trace"]["path"] = absolute_path(d["trace"]["path"])
    baseline = (d.get("compare") or {}).get("layer")
    for holder in (d["layer"], d["scheduler"], baseline, (d.get("compare") or {}).get("scheduler")):  # (dicts too)
        for key in ("plan_path", "placement_path"):
            if isinstance(holder, dict) and holder.get(key):
                holder[key] = absolute_path(holder[key])
    var = d.get("variability")
    if isinstance(var, dict) and isinstance(var.get("curves"), dict) and var["curves"].get("path"):
        var["curves"]["path"] = d["curves"]["path"] = absolute_path(var["curves"]["path"])
    check_config(d)
    d["run_dir"] = claim_run_dir("serve.py")
    if compare.enabled(d):
        runs = compare.run_configs(d, os.path.join(os.path.dirname(_HERE), "conf"))
        for run in runs[:2]:  # ours and the baseline
            try:
                check_config(run)
            except (ValueError, FileNotFoundError) as e:
                if run["_side"] != "baseline":
                    raise
                raise type(e)(f"compare.layer / compare.scheduler (the baseline's side): {e}") from None
        warning = compare.seeds_warning(d)
        if warning:
            warn(warning)
        origin = run_origin(d, next(r for r in runs if r["_side"] == "baseline")) if writes_outputs() else {}
        t0 = time.perf_counter()
        res = launch(dict(d, _runs=runs), compare_worker)
        if res is not None:
            compare.summarize(res, d, d["run_dir"], time.perf_counter() - t0, origin=origin)
    else:
        origin = run_origin(d) if writes_outputs() else {}  # (the other torchrun ranks write nothing)
        res = launch(d, serve_worker)
        if res is not None:
            res.update(origin)
            summarize(res, d["run_dir"])
    shutdown()


if __name__ == "__main__":
    run_recipe(main)
