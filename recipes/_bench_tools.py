"""Helpers of recipes/bench.py: settings, the megatron-core peer, inputs, timing and correctness checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from recipes._common import int_setting
from recipes._outputs import warn

PEER_NAME = "megatron-core MoELayer {version} (local spec, alltoall)"


# ---------------------------------------------------------------------- settings
def seq_len_bounds(value: Any, default: tuple[int, int] = (512, 1536)) -> tuple[int, int]:
    """``trace.seq_len`` as ``(lo, hi)`` tokens per synthetic sequence: one int ``n`` is ``(n, n)``,
    ``[lo, hi]`` itself, ``None`` the default.

    Raises:
        ValueError: anything else, a length below 1 or ``hi < lo``, naming ``trace.seq_len``.
    """
    if value is None:
        return default
    pair = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(pair) != 2:
        raise ValueError(f"trace.seq_len must be an integer or [lo, hi], got {value!r}")
    lo, hi = (int_setting(v, "trace.seq_len", 1) for v in pair)
    if hi < lo:
        raise ValueError(f"trace.seq_len [lo, hi] needs lo <= hi, got {value!r}")
    return lo, hi


# ---------------------------------------------------------------------- peer (megatron-core)
def megatron_version() -> str | None:
    """Installed megatron-core version (from package metadata: importing it is slow and noisy)."""
    from importlib import metadata

    for dist_name in ("megatron-core", "megatron_core"):
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    try:
        import megatron.core as mc
    except Exception:
        return None
    return str(getattr(mc, "__version__", None) or getattr(getattr(mc, "package_info", None), "__version__", "?"))


def peer_mode(want: Any) -> str:
    """``bench.peer`` as ``'auto'`` | ``'required'`` (``true``/``on``/``required``/``1``) | ``'off'``
    (``false``/``off``/``none``/``0``).

    Raises:
        ValueError: any other value (a typo used to mean ``auto``), naming ``bench.peer``.
    """
    word = str(want).strip().lower()
    if word in ("false", "off", "none", "0"):
        return "off"
    if word in ("true", "on", "required", "1"):
        return "required"
    if word == "auto":
        return "auto"
    raise ValueError(f"bench.peer must be auto, true (required) or false, got {want!r}")


def build_peer(config, dtype: torch.dtype, device: torch.device, want: str, weights,
               ep: int | None = None) -> tuple[Any, str | None, str | None]:
    """megatron-core's ``MoELayer`` with ``weights`` loaded: ``(peer or None, peer name or None, note)``.

    ``want``: ``auto`` (no peer, with a note, when CUDA or megatron-core is missing, ours runs with
    an expert-parallel size ``ep`` below the world (the peer spreads its experts over the whole
    world: another layout) or the peer fails to build — a warning with the error is printed) |
    ``true`` (required: raise instead) | ``false`` (:func:`peer_mode`).
    """
    mode = peer_mode(want)
    if mode == "off":
        return None, None, "peer disabled (bench.peer=false)"
    required = mode == "required"
    reason, peer = None, None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep is not None and ep != world:
        reason = (f"ours runs at parallel.ep={ep} of a world of {world}, megatron-core's MoELayer here at "
                  f"EP = world: no peer (the two would time different layouts)")
    elif device.type != "cuda":
        reason = "megatron-core's MoELayer needs CUDA: no peer on CPU"
    elif megatron_version() is None:
        reason = "megatron-core is not installed: no peer"
    else:
        try:
            from moelayers.integrations.megatron import load_megatron_weights, megatron_moe_layer

            peer = megatron_moe_layer(config, dtype=dtype, device=device)
            load_megatron_weights(peer, *weights)
            peer.eval()
        except Exception as e:  # API drift, missing optional pieces: our numbers are still worth having
            if required:
                raise
            import traceback

            reason = f"megatron-core MoELayer failed to build: {type(e).__name__}: {e}"
            warn(f"(rank {dist.get_rank() if dist.is_initialized() else 0}) {reason}\n{traceback.format_exc()}")
            peer = None
    # every rank must agree (a peer on some ranks only would hang its collectives)
    have = gather_scalar(0.0 if peer is None else 1.0, device)
    if peer is not None and min(have) == 0.0:
        peer, reason = None, "megatron-core MoELayer failed to build on some rank(s)"
    if peer is None:
        if required:
            raise RuntimeError(f"bench.peer=true but {reason}")
        return None, None, reason
    return peer, PEER_NAME.format(version=megatron_version()), None


def peer_forward(peer, x: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``MoELayer`` takes ``[S, B, H]`` and returns ``(output, bias)``."""
    out = peer(x.view(x.shape[0], 1, x.shape[1]))
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(x.shape)


# ---------------------------------------------------------------------- helpers
def full_weights(config, seed: int, device: torch.device, dtype: torch.dtype):
    """Router ``[E, H]``, w13 ``[E, 2F, H]``, w2 ``[E, H, F]`` ~ N(0, init_std), identical on every rank
    (one generator on the compute device, seeded by ``seed``)."""
    e, h, f = config.num_experts, config.hidden_size, config.ffn_hidden_size
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + 17)
    out = []
    for shape in ((e, h), (e, 2 * f, h), (e, h, f)):
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, config.init_std, generator=gen)
        out.append(t.to(dtype))
    return tuple(out)


def rank_input(tokens: int, hidden: int, seed: int, rank: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + 7919 * (rank + 1) + tokens)
    return torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)


class Replay:
    """Routing replayed from a trace.

    By default rank ``r``'s ``T`` tokens are trace tokens ``r*T ...`` (wrapping). With ``owner``
    (``[S]`` rank of each sequence, from a request scheduler) rank ``r`` replays the tokens of its
    own sequences in file order (wrapping), as attention-DP serving would give them to it.

    Attributes:
        trace: the :class:`~moelayers.trace.RoutingTrace`; layer: the replayed MoE layer; source: its name.
        repeated: whether some :meth:`ids_for` call had to wrap (replay a trace token twice).
    """

    def __init__(self, trace_cfg: dict, config, seed: int, need_tokens: int, min_sequences: int = 2):
        from recipes._common import config_trace

        trace_cfg = {"synthetic": True, **trace_cfg}
        lo, hi = seq_len_bounds(trace_cfg.get("seq_len"))
        num_seq = max(min_sequences, -(-need_tokens // ((lo + hi) // 2)))
        if trace_cfg.get("num_sequences") is not None:  # the same synthetic routing whatever the sizes timed
            num_seq = int_setting(trace_cfg["num_sequences"], "trace.num_sequences", min_sequences)
        tr = config_trace(trace_cfg, num_sequences=num_seq, num_layers=1,
                          num_experts=config.num_experts, top_k=config.top_k,
                          vocab_size=trace_cfg.get("vocab_size", 4096), seed=seed, seq_len=(lo, hi),
                          need="router=replay")
        path = trace_cfg.get("path")
        # the synthetic routing depends on the number of sequences too (by default: from the largest size timed)
        self.source = (str(path) if path else
                       f"synthetic_trace(seed={seed}, seq_len=({lo}, {hi}), num_sequences={num_seq})")
        if tr.num_experts != config.num_experts or tr.top_k != config.top_k:
            raise ValueError(f"trace {self.source} has E={tr.num_experts}, K={tr.top_k}; the benchmark shape "
                             f"has E={config.num_experts}, K={config.top_k}")
        layer = int_setting(trace_cfg.get("layer", 0), "trace.layer", 0)
        if not 0 <= layer < tr.num_layers:
            raise ValueError(f"trace.layer={layer} but the trace has {tr.num_layers} layer(s)")
        self.trace, self.layer = tr, layer
        self.ids = torch.from_numpy(np.ascontiguousarray(tr.topk_ids[:, layer, :]).astype(np.int64))
        self.repeated = False  # set when a rank had fewer trace tokens than it replays (they wrap)

    def ids_for(self, rank: int, tokens: int, device: torch.device, owner: np.ndarray | None = None) -> torch.Tensor:
        """``[tokens, K]`` expert ids rank ``rank`` replays (its own sequences when ``owner`` is given)."""
        if owner is None:
            self.repeated |= (rank + 1) * tokens > self.ids.shape[0]
            idx = (torch.arange(tokens, dtype=torch.int64) + rank * tokens) % self.ids.shape[0]
        else:
            mine = np.flatnonzero(np.asarray(owner) == rank)
            if mine.size == 0:
                raise ValueError(f"the request schedule gives rank {rank} no sequence of {self.source}")
            off = self.trace.seq_offsets
            pool = np.concatenate([np.arange(off[s], off[s + 1]) for s in mine])
            self.repeated |= pool.size < tokens
            idx = torch.from_numpy(pool[np.arange(tokens) % pool.size])
        return self.ids[idx].to(device)


def semantic_schedules(replay: Replay, world: int, seed: int, train_fraction: float, plan_path: str | None,
                       notes: list[str] | None = None):
    """A dp-mode ``SemanticPlan`` and the request schedules of the replay trace's held-out sequences.

    The plan is loaded from ``plan_path`` or made (``plan_semantic``, mode ``dp``) on the first
    ``train_fraction`` of the sequences; the replay then keeps only the held-out rest, where the
    semantic scheduler (Sem-MoE Algorithm 2) and round robin assign requests. A plan file's held-out
    rest: the sequences it does not record as trained on (:meth:`SemanticPlan.trained_on`, by
    content); all of them where it records none (an older file) or every one was trained on,
    said in ``notes``.

    Returns:
        ``(plan, {"semantic": owner [S_held], "round_robin": owner [S_held]})``.
    """
    from moelayers.planning.semantic import SemanticPlan, plan_semantic
    from moelayers.schedule import SemanticScheduler

    tr = replay.trace
    if plan_path:
        plan = SemanticPlan.load(plan_path)
        if plan.mode != "dp":
            raise ValueError(f"{plan_path}: semantic plan field 'mode' is {plan.mode!r}; bench.py times the "
                             "attention-DP layer (mode dp)")
        held = tr
        trained = plan.trained_on(tr)
        say = (notes.append if notes is not None else lambda _: None)
        if trained is None:
            say(f"the plan {plan_path} does not record the sequences it was trained on (an older file): every "
                "sequence of the trace is replayed, some perhaps in-sample")
        elif trained.all():
            say(f"the plan {plan_path} was trained on every sequence of the trace: all are replayed (in-sample)")
        elif trained.any():
            held = tr.select_sequences(np.flatnonzero(~trained))
            say(f"{int(trained.sum())} of {tr.num_sequences} trace sequences are left out: the plan {plan_path} "
                "was trained on them (by content)")
    else:
        train, held = tr.split(train_fraction)
        plan = plan_semantic(train, world, mode="dp", seed=seed, progress=False)
    plan.check_compatible(tr.num_experts, world)
    if replay.layer >= plan.num_layers:
        raise ValueError(f"trace.layer={replay.layer} but the semantic plan has {plan.num_layers} layer(s)")
    sched = SemanticScheduler(plan, layer=replay.layer, num_ranks=world, total_tokens=held.num_tokens)
    owner = np.array([sched.assign(held.token_ids[held.sequence_slice(s)]) for s in range(held.num_sequences)])
    replay.trace = held
    replay.ids = torch.from_numpy(np.ascontiguousarray(held.topk_ids[:, replay.layer, :]).astype(np.int64))
    return plan, {"semantic": owner, "round_robin": np.arange(held.num_sequences) % world}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def reduce_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather_scalar(value: float, device: torch.device) -> list[float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    t = torch.zeros(world, dtype=torch.float64, device=device)
    t[dist.get_rank() if dist.is_initialized() else 0] = value
    if world > 1:
        dist.all_reduce(t)
    return t.tolist()


def time_forward(run: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-iteration milliseconds of ``run()`` on this rank (sync + barrier before each)."""
    return time_forwards([run], device, warmup, iters)[0]


def time_forwards(runs: list[Callable[[], Any]], device: torch.device, warmup: int, iters: int) -> list[list[float]]:
    """Per-iteration milliseconds of each of ``runs``, interleaved: iteration ``i`` times ``runs[0]``,
    then ``runs[1]``, ... (a device sync and a barrier before each call).

    Interleaving makes a ratio between the runs fair: host jitter, clocks and other load hit both
    alike, where timing one block after the other lets them drift apart between the blocks.

    Returns:
        ``[len(runs)][iters]`` milliseconds (CUDA events on GPU, ``perf_counter`` on CPU).
    """
    for run in runs:
        for _ in range(warmup):
            run()
    out: list[list[float]] = [[] for _ in runs]
    if device.type == "cuda":
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in runs]
                  for _ in range(iters)]
        for row in events:
            for run, (start, end) in zip(runs, row):
                _sync(device)
                _barrier(device)
                _sync(device)
                start.record()
                run()
                end.record()
        _sync(device)
        for row in events:
            for i, (start, end) in enumerate(row):
                out[i].append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            for i, run in enumerate(runs):
                _barrier(device)
                t0 = time.perf_counter()
                run()
                out[i].append((time.perf_counter() - t0) * 1e3)
    _barrier(device)
    return out


def peer_forward_with_routing(peer, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [T, H], experts [T, K])``: one forward of megatron-core's ``MoELayer`` and the experts its
    router picked (its ``routing_map``, captured by a forward hook on ``peer.router``)."""
    captured = []
    hook = peer.router.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        y = peer_forward(peer, x)
    finally:
        hook.remove()
    if not captured or not isinstance(captured[-1], tuple) or len(captured[-1]) < 2:
        raise RuntimeError("megatron's router returned no (probs, routing_map): cannot read its choice of experts")
    routing_map = captured[-1][1].reshape(x.shape[0], -1)
    if not bool((routing_map.sum(dim=-1) == top_k).all()):
        raise RuntimeError(f"megatron's routing_map does not hold {top_k} experts per token")
    return y, torch.topk(routing_map.float(), top_k, dim=-1).indices


def layer_ids(layer) -> torch.Tensor | None:
    ids = getattr(layer, "last_topk_ids", None)
    return None if ids is None else ids.clone()


def routing_agreement(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    """Fraction of tokens (over all ranks) whose expert *sets* agree."""
    same = (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)
    n = sum(gather_scalar(float(same.sum()), device))
    total = sum(gather_scalar(float(same.numel()), device))
    return n / total if total else 1.0


#: rows over the peer tolerance may be off by at most this many times it (router near-ties move a
#: token's weights a little; a wrong layer is off by whole expert outputs)
PEER_ROW_SLACK = 4.0


def check_against_peer(y: torch.Tensor, y_peer: torch.Tensor, tol: float, max_bad_frac: float,
                       device: torch.device) -> dict:
    """Max abs diff of ours vs the peer relative to max|peer| (over all ranks). Passes when every row
    is within ``tol``, or when at most ``max_bad_frac`` of the rows exceed it and none exceeds
    ``PEER_ROW_SLACK * tol``; a NaN/inf anywhere in either output fails."""
    finite = bool(torch.isfinite(y).all()) and bool(torch.isfinite(y_peer).all())
    finite = min(gather_scalar(1.0 if finite else 0.0, device)) > 0
    diff_rows = (y.float() - y_peer.float()).abs().amax(dim=-1) if y.numel() else y.new_zeros(0, dtype=torch.float32)
    max_diff = float(diff_rows.nan_to_num(nan=float("inf")).max()) if diff_rows.numel() else 0.0
    max_peer = float(y_peer.float().abs().nan_to_num(nan=float("inf")).max()) if y_peer.numel() else 0.0
    max_diff, max_peer = reduce_max([max_diff, max_peer], device)
    scale = max(max_peer, 1e-30)
    bad = float((~(diff_rows <= tol * scale)).sum()) if diff_rows.numel() else 0.0  # NaN rows count as bad
    bad_total = sum(gather_scalar(bad, device))
    rows_total = sum(gather_scalar(float(y.shape[0]), device))
    rel = max_diff / scale
    ok = finite and (rel <= tol or (bad_total <= max_bad_frac * rows_total and rel <= PEER_ROW_SLACK * tol))
    return {"rel_max_abs_diff": rel, "tol": tol, "rows_over_tol": int(bad_total), "rows": int(rows_total),
            "finite": finite, "ok": ok}


#: a row routed to an expert whose float64 logit lies more than this many machine epsilons (of the
#: layer's logits dtype) x max|logit| below the reference's k-th best is routed wrongly (a near-tie
#: flipped by low-precision logits stays well inside it; a wrong router is far outside)
ROUTING_SLACK_EPS = 16.0


def wrongly_routed(x: torch.Tensor, router_w: torch.Tensor, ids: torch.Tensor, config) -> torch.Tensor:
    """``[n]`` bool: rows whose experts ``ids [n, K]`` are not the float64 reference router's top-k,
    beyond a near-tie (:data:`ROUTING_SLACK_EPS`). Top-k by logits is top-k by score (softmax and
    sigmoid keep the order)."""
    logits = x.double() @ router_w.double().t()
    kth = logits.topk(config.top_k, dim=-1).values[:, -1]
    worst = logits.gather(1, ids.long().to(logits.device)).min(dim=-1).values
    slack = ROUTING_SLACK_EPS * torch.finfo(config.logits_dtype(x.dtype)).eps * logits.abs().amax(dim=-1)
    return (kth - worst) > slack


def check_against_reference(layer, x: torch.Tensor, y: torch.Tensor, weights, config, rows: int,
                            device: torch.device, *, forced: torch.Tensor | None = None,
                            max_bad_frac: float = 0.0) -> dict:
    """Ours against the dense reference (:func:`moelayers.testing.check_close`'s tolerance) on ``rows`` rows spread over the
    batch, on the experts ours chose; and those experts against the float64 reference router's
    (beyond near-ties, :func:`wrongly_routed`; ``forced`` routing: exactly the forced experts). A
    NaN/inf anywhere in ``y`` fails.

    Args:
        forced: the routing forced on the layer (replay), or ``None`` (its own router).
        max_bad_frac: share of checked rows that may be routed wrongly beyond a near-tie.
    """
    from moelayers.reference import moe_forward
    from moelayers.testing import max_error, tolerance

    t = x.shape[0]
    n = min(rows, t)
    idx = torch.linspace(0, t - 1, n, device=x.device).round().long() if n else torch.zeros(0, dtype=torch.long)
    ids = layer.last_topk_ids[idx]
    router_w, w13, w2 = weights
    ref64 = moe_forward(x[idx].double(), router_w, w13, w2, config, topk_ids=ids)
    ref_low = None if y.dtype in (torch.float32, torch.float64) else moe_forward(
        x[idx], router_w, w13, w2, config, topk_ids=ids)
    err = max_error(y[idx], ref64) if n else 0.0
    tol = tolerance(ref64.cpu(), None if ref_low is None else ref_low.cpu(), y.dtype) if n else 0.0
    if not n:
        other_experts = 0.0
    elif forced is not None:
        want = forced[idx].to(ids.device).sort(dim=-1).values
        other_experts = float((ids.sort(dim=-1).values != want).any(dim=-1).sum())
    else:
        other_experts = float(wrongly_routed(x[idx], router_w, ids, config).sum())
    finite = bool(torch.isfinite(y).all())
    ok = finite and err <= tol and other_experts <= (0 if forced is not None else max_bad_frac * n)
    ok_all = min(gather_scalar(1.0 if ok else 0.0, device)) > 0
    return {"max_abs_err": reduce_max([err], device)[0], "tol": tol, "rows": n, "finite": finite,
            "rows_other_experts": int(sum(gather_scalar(other_experts, device))), "ok": ok_all}


def training_step(run: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor, grad: torch.Tensor,
                  module: torch.nn.Module | None) -> Callable[[], None] | None:
    """``run(x)`` and its backward with output gradient ``grad``, the gradients of ``x`` and of
    ``module``'s parameters set to ``None`` first (none accumulates from step to step); ``None`` when
    ``module`` is (no such layer in this run)."""
    if module is None:
        return None
    params = [p for p in module.parameters() if p.requires_grad]

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        run(x).backward(grad)

    return step


def check_grads_against_reference(layer, x: torch.Tensor, grad: torch.Tensor, weights, config, rows: int,
                                  device: torch.device, forced: torch.Tensor | None = None) -> dict:
    """The input gradient of a training step of ``layer`` (output gradient ``grad``) against the
    dense reference's on ``rows`` rows spread over the batch, on the experts the layer chose (each
    row's gradient depends on that row alone), with :func:`moelayers.testing.check_close`'s tolerance."""
    from moelayers.reference import moe_forward
    from moelayers.testing import max_error, tolerance

    xg = x.detach().clone().requires_grad_()
    with torch.enable_grad():
        if forced is not None:
            layer.force_routing(forced)
        layer(xg).backward(grad)
    t = x.shape[0]
    n = min(rows, t)
    idx = torch.linspace(0, t - 1, n, device=x.device).round().long() if n else torch.zeros(0, dtype=torch.long)
    ids = layer.last_topk_ids[idx]
    refs = []
    for dtype in (torch.float64, None if x.dtype in (torch.float32, torch.float64) else x.dtype):
        if dtype is None:
            refs.append(None)
            continue
        xr = x[idx].detach().to(dtype).requires_grad_()
        with torch.enable_grad():
            moe_forward(xr, *(w.to(dtype) if dtype == torch.float64 else w for w in weights), config,
                        topk_ids=ids).backward(grad[idx].to(dtype))
        refs.append(xr.grad)
    got = xg.grad[idx]
    err = max_error(got, refs[0]) if n else 0.0
    tol = tolerance(refs[0].cpu(), None if refs[1] is None else refs[1].cpu(), x.dtype) if n else 0.0
    finite = bool(torch.isfinite(xg.grad).all())
    ok = min(gather_scalar(1.0 if finite and err <= tol else 0.0, device)) > 0
    return {"max_abs_err": reduce_max([err], device)[0], "tol": tol, "rows": n, "finite": finite, "ok": ok}


def check_grads_against_peer(layer, peer, x: torch.Tensor, grad: torch.Tensor, peer_ids: torch.Tensor, tol: float,
                             max_bad_frac: float, device: torch.device) -> dict:
    """The input gradients of a training step of ours (the peer's experts forced) and of the peer,
    output gradient ``grad``: :func:`check_against_peer` on them."""
    got = []
    for run in (lambda v: (layer.force_routing(peer_ids), layer(v))[1], lambda v: peer_forward(peer, v)):
        v = x.detach().clone().requires_grad_()
        with torch.enable_grad():
            run(v).backward(grad)
        got.append(v.grad)
    return check_against_peer(got[0], got[1], tol, max_bad_frac, device)


def profile_ours(run: Callable[[], Any], device: torch.device, iters: int, rows: int, rank: int,
                 out_path: str | None) -> str | None:
    """torch.profiler over ``iters`` forwards; rank 0 gets the table of top kernels/ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):
        run()
    _sync(device)
    _barrier(device)
    with profile(activities=acts, record_shapes=False) as prof:
        for _ in range(iters):
            run()
        _sync(device)
    _barrier(device)
    if rank != 0:
        return None
    if out_path:
        try:
            prof.export_chrome_trace(out_path)
        except Exception as e:  # a trace is a convenience; the table is the result
            print(f"note: could not write the chrome trace: {e}")
    sort_keys = ("self_cuda_time_total", "self_device_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    averages = prof.key_averages()
    for key in sort_keys:
        try:
            return averages.table(sort_by=key, row_limit=rows)
        except Exception:
            continue
    return averages.table(row_limit=rows)


