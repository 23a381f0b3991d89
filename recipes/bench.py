#!/usr/bin/env python
"""Layer micro-benchmark: forward latency of a moelayers layer against megatron-core's
``MoELayer``, in the same run, on the same weights.

Every rank builds the same random weights (seeded, identical everywhere) and loads them into ours
(``layer=vanilla`` by default, looked up in :data:`LAYERS`) and into megatron-core's ``MoELayer``
(local spec, alltoall dispatcher, EP = world; the *peer*, GPU only). For each
``bench.tokens_per_rank`` value each rank draws its own random input (seeded by rank), then:

1. checks before timing: ours against the dense reference on the experts ours chose
   (:func:`moelayers.reference.moe_forward`, :func:`moelayers.testing.check_close`'s tolerance) and, with a peer, ours against
   the peer (max abs diff relative to max|peer|, over all ranks) with megatron's choice of experts
   (captured from its router) forced on ours — a router near-tie may break differently — so a wrong
   result is never timed; the agreement of the two routers is reported. Both routers score in
   ``bench.router_dtype`` (``null``: the input's dtype; ``fp32``: megatron's ``moe_router_dtype``);
2. times ``bench.warmup`` (20 more for the first size) + ``bench.iters`` forwards of each
   (inference mode): before each timed forward a device synchronize and a barrier, CUDA events
   around it (``perf_counter`` on CPU); the layer time is the median over iterations, maximised
   over ranks (the slowest rank sets it).
   Ours and the baseline (below) are timed interleaved, one forward each in turn, so that their
   ratio is not skewed by host jitter between two blocks of iterations; the peer is timed apart.

``router=replay`` forces ours' routing from a trace (``trace.path=FILE``; without a path a synthetic
trace shaped like the benchmark) through ``layer.force_routing``; the peer keeps its own router
(noted in the JSON). A plan-built layer (``layer=semantic``) needs ``router=replay``: it plans (dp
mode) on the trace's first half of sequences, or loads ``layer.plan_path``, and each rank replays the
held-out requests the semantic scheduler gives it; ``bench.baseline`` (``auto``: ``vanilla`` for such a
layer) is timed in the same run on the same held-out requests dealt round robin, with both layers'
LAR and dispatch bytes (the all-to-all's first half: ``MoEStats.bytes_sent``; serve.py's
``a2a_bytes`` adds the combine) in the JSON (``baseline``, ``baseline_ms``, ``vs_baseline``,
``baseline_stats``). The baseline executes like ours — the same dispatcher, dedup, NaN check and
expert backend (``recipes._common.EXECUTION_KWARGS``, recorded as ``baseline_kwargs``) and, with
``bench.cuda_graph=true``, the same capacity and CUDA graph — so that only the layer differs. A
layer that re-plans by itself (``auto_replan``) is timed with it off (the JSON's ``notes`` say so;
``replans`` counts its re-plans so far, whether or not they moved weights: 0 when none happened,
null for a layer that does not re-plan).
Rank 0 prints a table and writes one JSON per (shape, tokens/rank) into the run dir, with
the records all or nothing (an earlier run's ``bench.png`` removed with them), then ``bench.png`` (ms
against tokens per rank for ours, the peer and the baseline, and their ratios; ``plot=false``: none;
a plot that fails leaves the records and a warning); it copies the JSON (not the plot) into
``bench.save_to`` when set, named
``{layer}[_graph|_allgather|_nodedup]_{shape}_t{tokens}_ws{world}[_ep{ep}][_{dtype}][_router-{dtype}][_replay]``
``[_trace-{file}][_layer{L}][_plan-{file}][_checkfinite][_train][_{expert_backend}][_vs-{baseline}]_{device}.json``
(``_ep``: ``parallel.ep`` below the world size; ``_{dtype}``: another dtype than the device's default,
bf16 on CUDA and float32 on CPU; ``_router-``: ``bench.router_dtype``; ``_replay``: replayed routing
on a layer that is not plan-built (those always replay); ``_trace-``/``_plan-``: the stems of
``trace.path`` / ``layer.plan_path`` and a short hash of their absolute paths; ``_layer``: a
replayed trace layer other than 0 (``trace.layer``); ``_checkfinite``:
``bench.check_finite=true``; an expert backend other than ``auto``; ``_vs-``: a baseline other than
the layer's default, ``vanilla`` for a plan-built layer and none otherwise), so that no
configuration's record overwrites another's; settings that the name leaves out (a changed shape field,
``seed``, ``bench.inference_mode``, the layer's or the synthetic trace's settings) are in the record's
``settings_digest`` (as resolved: ``bench.dtype=auto`` and ``float32`` on CPU are one setting), and a
record in ``bench.save_to`` of another digest under the same name is kept:
the new one gets ``_cfg-`` and the digest's first 6 hex digits added (a note says so). ``bench.profile=true`` prints a torch.profiler table of
ours' top kernels at one size (and saves a chrome trace in the run dir).

``bench.train=true`` times a training step instead: forward and backward (``y.backward(g)`` with a
fixed random ``g``, gradients of the input and of every weight; gradients set to ``None`` before each
step, so none accumulates) of ours, the baseline and the peer in training mode, eager only. Before
timing it also checks the input gradient of ours against the peer's, with the peer's experts forced
on ours (the record's ``check.peer_grad``). Records are named with ``_train``.

Usage::

    python recipes/bench.py                                                   # 2 gloo processes, CPU (bench=cpu_smoke)
    python recipes/bench.py bench=cpu_smoke parallel.world_size=4 router=replay
    python recipes/bench.py bench=cpu_smoke router=replay layer=semantic        # vs VanillaMoE, same run
    torchrun --standalone --nproc_per_node=8 recipes/bench.py parallel=gpu bench=qwen3_30b_a3b \\
        bench.save_to=docs/benchmarks
    torchrun --standalone --nproc_per_node=8 recipes/bench.py bench=deepseek_v2_lite \\
        bench.tokens_per_rank=[4096] bench.profile=true
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import inspect
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this directory comes first on sys.path and recipes/profile.py would shadow the
# standard library's profile module: use the repository root instead (recipes is a package)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import hydra  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from recipes._common import (  # noqa: E402
    LAYER_FLAGS, absolute_path, check_input_file, check_layer_settings, device_for, flag, import_object, int_setting, launch, layer_objects,
    normalize_flags, overridden, plan_fraction_setting, provenance, refuse_empty_paths, refuse_unread_overrides, require_keys,
    resolve_backend, shared_execution_kwargs, shutdown, to_dict, unread_overrides,
)
from recipes._outputs import claim_run_dir, run_recipe, under_torchrun, warn  # noqa: E402
from recipes._bench_records import (  # noqa: E402
    SETTINGS_DIGEST_VERSION, order_record, print_results, remove_earlier_outputs, save_records, settings_digest,
)
from recipes._bench_tools import (  # noqa: E402
    megatron_version,
    build_peer,
    peer_forward,
    full_weights,
    rank_input,
    Replay,
    semantic_schedules,
    reduce_max,
    gather_scalar,
    time_forward,
    time_forwards,
    peer_forward_with_routing,
    layer_ids,
    peer_mode,
    routing_agreement,
    check_against_peer,
    check_against_reference,
    check_grads_against_peer,
    check_grads_against_reference,
    training_step,
    profile_ours,
    seq_len_bounds,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------- layer registry
def _construct(cls_path: str) -> Callable[..., torch.nn.Module]:
    """A builder ``(config, groups, *, device, seed, **kwargs) -> layer`` for a constructor path."""

    def build(config, groups, *, device, seed, plan=None, plan_layer=0, **kwargs):
        cls = _layer_class(cls_path)
        kwargs = {k: v for k, v in kwargs.items() if k not in _OPTIONAL_KWARGS or _accepts(cls, k)}
        if plan is not None:  # a plan-built layer (SemanticMoE): placement and tables from the plan
            return cls.from_plan(plan, plan_layer, config, groups, device=device, seed=seed, **kwargs)
        return cls(config, groups, device=device, seed=seed, **kwargs)

    return build


# kwargs the recipe adds itself; dropped when a layer's constructor does not take them
_OPTIONAL_KWARGS = ("check_finite",)

def _accepts(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` takes keyword ``name``: named in its signature, or passed on by ``**kwargs``
    (``SemanticMoE(**kwargs)`` hands ``check_finite`` to the base, so dropping it there would leave
    its NaN check on while the baseline's is off, and time the two layers unequally)."""
    params = inspect.signature(cls).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _layer_class(cls_path: str) -> type:
    return import_object(cls_path, "layer.cls")


def uses_plan(layer_cfg: dict) -> bool:
    """Whether the layer is built from a semantic plan (its class has ``from_plan``)."""
    return bool(layer_cfg.get("cls")) and hasattr(_layer_class(layer_cfg["cls"]), "from_plan")


#: name -> builder. A new layer plugs in with one entry; a layer config with ``cls: pkg.Module`` and
#: no entry here is built from that path.
LAYERS: dict[str, Callable[..., torch.nn.Module]] = {
    "vanilla": _construct("moelayers.VanillaMoE"),
}


def build_layer(layer_cfg: dict, config, groups, device: torch.device, seed: int, check_finite: bool, **extra):
    """Our layer from its config group (``cls`` when given, else the builder registered for ``name``;
    ``kwargs``); ``extra``: ``plan``, ``plan_layer``."""
    name = layer_cfg.get("name")
    # an explicit cls wins over the registered name (layer.cls=... on the command line used to be ignored)
    builder = _construct(layer_cfg["cls"]) if layer_cfg.get("cls") else LAYERS.get(name)
    if builder is None:
        raise ValueError(f"unknown layer {name!r}: registered {sorted(LAYERS)}, or give layer.cls")
    kwargs = layer_objects(layer_cfg.get("kwargs") or {})
    kwargs.setdefault("check_finite", check_finite)
    return builder(config, groups, device=device, seed=seed, **kwargs, **extra)


def baseline_config(name: str, ours: dict, root: dict | None = None) -> dict:
    """``bench.baseline``'s layer config: a registered name (:data:`LAYERS`), else ``conf/layer/NAME.yaml``
    (its ``cls`` and kwargs). It executes like ours (dispatcher, dedup, NaN check, expert backend):
    only the layer differs.

    Raises:
        ValueError: neither registered nor in ``conf/layer``, or a plan-built layer (a baseline is
            built without a plan).
    """
    if name in LAYERS:
        layer = {"name": name, "kwargs": {}}
    else:
        from recipes._serve_compare import baseline_layer

        try:
            layer = baseline_layer(name, os.path.join(os.path.dirname(_HERE), "conf"), key="bench.baseline", root=root)
        except FileNotFoundError as e:  # its message lists the conf/layer names
            raise ValueError(f"{e} (registered: {sorted(LAYERS)})") from None
        if uses_plan(layer):
            raise ValueError(f"bench.baseline={name} is built from a semantic plan, which a baseline does not get: "
                             "compare with a layer that needs none (e.g. bench.baseline=vanilla), or time it as ours")
    layer["kwargs"] = {**(layer.get("kwargs") or {}), **shared_execution_kwargs(ours)}
    return layer


def _graphed_config(layer_cfg: dict, tokens: int) -> dict:
    """``layer_cfg`` with ``capacity = tokens`` and ``cuda_graph = True``."""
    return {**layer_cfg, "kwargs": {**(layer_cfg.get("kwargs") or {}), "capacity": tokens, "cuda_graph": True}}


def resolve_router_dtype(b: dict) -> torch.dtype | None:
    """``bench.router_dtype``: ``null`` (the input's dtype) | ``fp32`` | ``fp64``, megatron's names."""
    from moelayers.config import ROUTER_DTYPES

    name = b.get("router_dtype")
    if name not in ROUTER_DTYPES:
        raise ValueError(f"bench.router_dtype={name!r}: one of {sorted(ROUTER_DTYPES, key=str)}")
    return ROUTER_DTYPES[name]


def resolve_baseline(want, plan_based: bool) -> str | None:
    """``bench.baseline``: a layer name; ``auto`` = ``vanilla`` for a plan-built layer (same run,
    round-robin requests), else none; off (``false``/``off``/``no``, ``none``/``null``) = none.

    Raises:
        ValueError: an on value (``true``/``on``/``yes``): it names no layer to compare with.
    """
    word = None if want is None else str(want).strip().lower()
    if word in (None, "none", "null"):
        return None
    if word == "auto":
        return "vanilla" if plan_based else None
    try:
        on = flag({"bench.baseline": want}, "bench.baseline", False)
    except ValueError:  # not an on/off value: a layer name
        return str(want)
    if on:
        raise ValueError(f"bench.baseline={want} names no layer: give one (e.g. bench.baseline=vanilla), "
                         "auto, or false for none")
    return None


def tokens_per_rank(b: dict) -> list[int]:
    """``bench.tokens_per_rank``: one size or a list of them, as a list of ints >= 1.

    Raises:
        ValueError: an empty list or a size that is not an integer >= 1, naming the key.
    """
    value = b.get("tokens_per_rank")
    sizes = list(value) if isinstance(value, (list, tuple)) else [value]
    if not sizes:
        raise ValueError("bench.tokens_per_rank must name at least one size")
    sizes = [int_setting(t, "bench.tokens_per_rank", 1) for t in sizes]
    if len(set(sizes)) != len(sizes):  # the second run of a size would overwrite the first one's record
        raise ValueError(f"bench.tokens_per_rank={sizes} names a size twice")
    return sizes


def moe_config(b: dict, dtype: torch.dtype):
    """The benchmarked layer's ``MoEConfig``: ``bench.shape`` in ``dtype``, logits in ``bench.router_dtype``."""
    from moelayers import MoEConfig

    shape = b["shape"]
    return MoEConfig(
        hidden_size=int(shape["hidden_size"]), ffn_hidden_size=int(shape["ffn_hidden_size"]),
        num_experts=int(shape["num_experts"]), top_k=int(shape["top_k"]),
        score_fn=shape.get("score_fn", "softmax"), norm_topk_prob=bool(shape.get("norm_topk_prob", True)),
        params_dtype=dtype, init_std=float(shape.get("init_std", 0.02)), router_dtype=resolve_router_dtype(b),
    )


def _check_shape_and_layer(d: dict, dtype: torch.dtype, world: int | None) -> None:
    """``bench.shape`` as a ``MoEConfig`` whose experts split over the expert-parallel ranks, and the
    layer's constructor settings (a one-process layer on the meta device; a plan-built layer's are
    checked with its plan, in the ranks)."""
    from moelayers import ParallelGroups

    try:
        config = moe_config(d["bench"], dtype)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"bench.shape: {exc}") from exc
    ep = (d.get("parallel") or {}).get("ep") or world
    if ep and config.num_experts % int(ep):
        raise ValueError(f"bench.shape.num_experts={config.num_experts} does not split over the {ep} expert-parallel "
                         "ranks (parallel.ep, default the world size)")
    layer = d.get("layer") or {}
    if uses_plan(layer) or not (layer.get("cls") or layer.get("name") in LAYERS):
        return
    check_layer_settings(lambda **kw: build_layer(dict(layer, kwargs=kw), config, ParallelGroups.single(),
                                                  torch.device("meta"), 0, bool(d["bench"].get("check_finite", False))),
                         layer.get("kwargs") or {}, f"layer={layer.get('name')} layer.kwargs",
                         import_object(layer["cls"], "layer.cls") if layer.get("cls") else None)


def check_config(d: dict) -> None:
    """Check the settings every rank reads, before any rank starts; ``bench.tokens_per_rank`` becomes a list.

    ``bench.tokens_per_rank`` (sizes >= 1), ``bench.warmup`` (>= 0), ``bench.iters`` (>= 1),
    ``bench.baseline`` (:func:`resolve_baseline`), ``bench.peer`` (:func:`recipes._bench_tools.peer_mode`),
    ``bench.profile_tokens`` (``null`` or >= 1), ``bench.profile_iters`` and ``bench.profile_rows`` (>= 1),
    no ``layer.kwargs.mode=tp``, no ``layer.kwargs.capacity`` / ``cuda_graph`` (``bench.cuda_graph`` sets them per size, for ours and
    the baseline alike), no ``layer.kwargs.check_finite`` other than ``bench.check_finite``, ``parallel.ep`` = the world for a plan-built layer and, with ``router=replay``,
    ``trace.seq_len`` (:func:`recipes._bench_tools.seq_len_bounds`) and ``trace.num_sequences`` (>= 1, not with
    ``trace.path``), and none of serve.py's emulation settings (``variability``, ``emulation``, ``curves``).

    Raises:
        ValueError: a bad value, naming its key.
    """
    emulated = [key for key in ("variability", "emulation", "curves") if key in d]
    if emulated:  # (Hydra's hint for `variability=high` is `+variability=high`, which then did nothing)
        raise ValueError(f"{', '.join(emulated)}: bench.py times the hardware as it is and emulates no GPU "
                         "variability; serve.py takes variability=... and emulation.* (VariabilityAwareMoE's "
                         "planner preset is layer.kwargs.variability, its own slowdown layer.kwargs.slowdown)")
    b = d["bench"]
    b["tokens_per_rank"] = tokens_per_rank(b)
    dtype, router_dtype = resolve_dtype(b.get("dtype"), torch.device("cpu")), resolve_router_dtype(b)
    if router_dtype is not None and b.get("dtype") not in (None, "auto") and router_dtype.itemsize < dtype.itemsize:
        raise ValueError(f"bench.router_dtype={b['router_dtype']} is narrower than bench.dtype={b['dtype']}: the logits "
                         f"would be {dtype} (ours) but {router_dtype} (megatron's); leave bench.router_dtype null")
    check = b.get("check") or {}
    int_setting(check.get("ref_rows", 1), "bench.check.ref_rows", 1)  # 0 rows checked nothing and passed
    try:
        tol_ok = check.get("tol") is None or float(check["tol"]) >= 0
    except (TypeError, ValueError):
        tol_ok = False
    if not tol_ok:
        raise ValueError(f"bench.check.tol must be null or a number >= 0, got {check.get('tol')!r}")
    int_setting(b.get("warmup"), "bench.warmup", 0)
    int_setting(b.get("iters"), "bench.iters", 1)
    base_name = resolve_baseline(b.get("baseline", "auto"), plan_based=True)  # auto: the one a plan-built layer gets
    if base_name is not None:
        baseline_config(base_name, (d.get("layer") or {}), d)
    peer_mode(b.get("peer", "auto"))
    if b.get("profile_tokens") is not None:
        int_setting(b["profile_tokens"], "bench.profile_tokens", 1)
    for key in ("profile_iters", "profile_rows"):
        if key in b:
            int_setting(b[key], f"bench.{key}", 1)
    if not b.get("profile"):
        unused = unread_overrides([f"bench.{k}" for k in ("profile_tokens", "profile_iters", "profile_rows")],
                                  ["bench.profile"])
        if unused:
            raise ValueError(f"{', '.join(unused)} is read with bench.profile=true only: add it, or drop it")
    layer_kwargs = (d.get("layer") or {}).get("kwargs") or {}
    if b.get("train") and b.get("cuda_graph"):
        raise ValueError("bench.train=true times forward + backward, which the CUDA-graph forward does not "
                         "replay: drop bench.cuda_graph")
    if layer_kwargs.get("mode") == "tp":  # forward_tp takes attention partials, a norm and a residual
        raise ValueError("bench.py times the layer's forward (attention data-parallel): use layer.kwargs.mode=dp; "
                         "mode=tp runs through forward_tp inside an attention-TP model")
    for key in ("capacity", "cuda_graph", "beyond_capacity"):
        # a fixed capacity pads every size to it (t=16 timed as 64 tokens), leaves the baseline exact
        # and was recorded as mode "eager (exact all-to-all-v)"; nothing is beyond capacity = tokens
        if layer_kwargs.get(key) is not None and layer_kwargs[key] not in (False, "raise"):
            raise ValueError(f"layer.kwargs.{key}={layer_kwargs[key]!r}: the bench sets capacity (= tokens/rank) "
                             "and cuda_graph itself, for ours and the baseline (no batch goes beyond the "
                             "capacity): use bench.cuda_graph=true (CUDA)")
    if "check_finite" in layer_kwargs and layer_kwargs["check_finite"] != bool(b.get("check_finite", False)):
        # build_layer lets the layer's kwargs win: the record and its name would say bench.check_finite's
        raise ValueError(f"layer.kwargs.check_finite={layer_kwargs['check_finite']!r} differs from "
                         f"bench.check_finite={b.get('check_finite', False)!r}: the bench sets the NaN check for ours "
                         "and the baseline alike and names the record by it: use bench.check_finite (true or "
                         "false: the bench times forwards one by one, so it offers no 'deferred')")
    ep = (d.get("parallel") or {}).get("ep")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (d.get("parallel") or {}).get("world_size")
    if ep is not None and world is not None and world % int_setting(ep, "parallel.ep", 1):
        raise ValueError(f"parallel.ep={ep} must divide the world size {world} (the expert-parallel groups split it)")
    if ep is not None and ep != world and uses_plan(d.get("layer") or {}):
        raise ValueError(f"layer={d['layer'].get('name')} plans and schedules over the whole world: parallel.ep "
                         f"must be null or the world size ({world}), got {ep}")
    save_to = d["bench"].get("save_to")
    if save_to and os.path.exists(save_to) and not os.path.isdir(save_to):
        raise ValueError(f"bench.save_to={save_to} is a file: it must be a directory (made when missing)")
    if (d.get("layer") or {}).get("placement_path"):  # (a sweep found it ignored here)
        raise ValueError(f"layer.placement_path={d['layer']['placement_path']} is read by recipes/serve.py only: "
                         "bench.py times the layer in its default placement; drop it")
    if uses_plan(d.get("layer") or {}):
        _check_plan_settings(d, world)
    _check_shape_and_layer(d, dtype, world)
    tc = d.get("trace") or {}
    if d.get("_router_name") != "replay":  # the model's own router: no trace setting would be read
        unused = ([f"trace.path={tc['path']}"] if tc.get("path") else []) + overridden(
            [f"trace.{k}" for k in ("layer", "synthetic", "vocab_size", "seq_len", "num_sequences")])
        if unused:
            raise ValueError(f"{', '.join(unused)} is read with router=replay only (router={d.get('_router_name')} "
                             "routes with the layer's own router): add router=replay, or drop it")
    if d.get("_router_name") == "replay":
        int_setting(tc.get("layer", 0), "trace.layer", 0)  # 1.7 was read as layer 1
        seq_len_bounds(tc.get("seq_len"))
        if tc.get("num_sequences") is not None:
            if tc.get("path"):
                raise ValueError("trace.num_sequences sizes the synthetic trace: it has no meaning with trace.path")
            int_setting(tc["num_sequences"], "trace.num_sequences", 1)
        if tc.get("path"):
            unused = unread_overrides(["trace.seq_len", "trace.vocab_size"], ["trace.path"])
            if unused:
                raise ValueError(f"{', '.join(unused)} sizes the synthetic trace; with trace.path the file's "
                                 "sequences are replayed as they are: drop it")
            check_input_file(tc["path"], "trace.path", "a routing trace file")
            _check_trace_fits(tc, d["bench"]["shape"])


def _check_trace_fits(tc: dict, shape: dict) -> None:
    """The trace file's experts and top-k are the shape's and it has layer ``trace.layer``: said here,
    before any rank starts (each rank would raise it, under a traceback per rank)."""
    from moelayers.trace import load_trace

    tr = load_trace(tc["path"])
    e, k = int(shape["num_experts"]), int(shape["top_k"])
    if tr.num_experts != e or tr.top_k != k:
        raise ValueError(f"trace.path={tc['path']} has E={tr.num_experts}, K={tr.top_k}; the benchmark shape has "
                         f"E={e}, K={k} (bench=NAME or bench.shape.num_experts / top_k)")
    if not 0 <= int(tc.get("layer", 0)) < tr.num_layers:
        raise ValueError(f"trace.layer={tc.get('layer', 0)} but trace.path={tc['path']} has {tr.num_layers} layer(s)")


def _check_plan_settings(d: dict, world: int | None) -> None:
    """A plan-built layer (``layer=semantic``): ``router=replay``, ``layer.plan_train_fraction`` in
    (0, 1) or null, and ``layer.plan_path``'s plan made for attention-DP (mode dp), the shape's
    experts and the world's ranks (the file named in every error)."""
    layer = d["layer"]
    if d.get("_router_name") != "replay":
        raise ValueError(f"layer={layer.get('name')} places experts from a semantic plan of real routing: "
                         "use router=replay (trace.path=FILE, or the synthetic trace)")
    plan_fraction_setting(layer.get("plan_train_fraction"), "layer.plan_train_fraction")
    path = layer.get("plan_path")
    if not path:
        return
    if layer.get("plan_train_fraction") is not None:
        raise ValueError(f"layer.plan_train_fraction={layer['plan_train_fraction']} splits the trace for a plan made "
                         f"by the run; with layer.plan_path={path} the plan file is used as it is (the sequences it "
                         "was trained on are left out by content): drop it")
    check_input_file(path, "layer.plan_path", "a semantic plan")
    from moelayers.planning.semantic import SemanticPlan

    plan = SemanticPlan.load(path)
    if plan.mode != "dp":
        raise ValueError(f"layer.plan_path={path}: semantic plan field 'mode' is {plan.mode!r}, but bench.py times "
                         "the attention-DP layer (mode dp); re-plan with recipes/plan.py planner=semantic mode=dp")
    try:
        plan.check_compatible(int(d["bench"]["shape"]["num_experts"]) if "shape" in d["bench"] else None, world)
    except ValueError as e:
        raise ValueError(f"layer.plan_path={path}: {e}" if str(path) not in str(e) else str(e)) from None


# ---------------------------------------------------------------------- the worker
@dataclasses.dataclass
class _Run:
    """What every tokens/rank size of one rank's run shares (built by :func:`_setup`)."""

    cfg: dict
    rank: int
    device: torch.device
    dtype: torch.dtype
    config: Any  # the layer's MoEConfig
    groups: Any  # its ParallelGroups
    weights: tuple | None  # (router, w13, w2) in logical order, identical on every rank
    replay: Replay | None  # router=replay: the trace ours' routing is forced from
    owners: dict  # scheduler name -> each held-out request's rank (plan-built layers)
    plan: Any
    notes: list[str]
    ours: torch.nn.Module
    base: torch.nn.Module | None  # the baseline layer (bench.baseline), timed with ours
    base_name: str | None
    base_cfg: dict | None
    peer: torch.nn.Module | None  # megatron-core's MoELayer
    peer_name: str | None
    peer_note: str | None
    tol: float  # ours against the peer, relative to max|peer|

    @property
    def b(self) -> dict:
        return self.cfg["bench"]

    @property
    def train(self) -> bool:
        return bool(self.b.get("train", False))

    @property
    def graph(self) -> bool:
        return bool(self.b.get("cuda_graph", False))

    def grad_ctx(self):
        return torch.inference_mode() if self.b.get("inference_mode", True) else torch.no_grad()

    def make(self, layer_cfg: dict, **extra) -> torch.nn.Module:
        """A layer built from ``layer_cfg`` with the run's weights, in eval mode."""
        layer = build_layer(layer_cfg, self.config, self.groups, self.device, int(self.cfg.get("seed", 0)),
                            bool(self.b.get("check_finite", False)), **extra)
        layer.load_full_weights(*self.weights)
        if getattr(layer, "auto_replan", False):  # moving weights inside the timed loop would time the move
            layer.auto_replan = False
            self.notes.append(f"{layer_cfg.get('name')}: auto_replan off while timing")
        return layer.eval()


#: more warm-up forwards for the first size timed. It absorbed the process's one-time costs (allocators,
#: thread pools, lazy initialisation): with ``bench=cpu_smoke``'s two warm-ups it took 2-5x its time
FIRST_SIZE_WARMUP = 20


def bench_worker(rank: int, world: int, cfg: dict) -> list[dict] | None:
    """Runs on every rank; rank 0 returns one record per tokens/rank value."""
    run = _setup(rank, world, cfg)
    tokens_list = tokens_per_rank(run.b)
    records = [_bench_size(run, tokens, first=i == 0) for i, tokens in enumerate(tokens_list)]
    run.weights = None  # free them before profiling (make() is not called after this)
    if run.b.get("profile", False):
        _profile(run, int(run.b.get("profile_tokens") or max(tokens_list)))
    if rank != 0:
        return None
    b, config = run.b, run.config
    common = {
        "device_name": device_name(run.device), "world_size": world, "ep": run.groups.ep_size,
        "layer": cfg["layer"]["name"], "shape_name": b["name"],
        "shape": {"H": config.hidden_size, "E": config.num_experts, "K": config.top_k, "F": config.ffn_hidden_size},
        "peer": run.peer_name, "peer_note": run.peer_note,
        "peer_experts": None if run.peer is None else type(getattr(run.peer, "experts", run.peer)).__name__,
        "dtype": str(run.dtype).replace("torch.", ""),
        "router_dtype": None if config.router_dtype is None else str(config.router_dtype).replace("torch.", ""),
        "warmup": int(b["warmup"]), "iters": int(b["iters"]), "router": cfg.get("_router_name", "learned"),
        "notes": list(dict.fromkeys(run.notes)),
        "backend": dist.get_backend() if dist.is_initialized() else "gloo", "torch": torch.__version__,
        "triton": triton_version(), "megatron_core": megatron_version(),
    }
    return [{**common, **{k: v for k, v in r.items() if k != "_size_notes"},
             "notes": list(dict.fromkeys(common["notes"] + r["_size_notes"]))} for r in records]


def _setup(rank: int, world: int, cfg: dict) -> _Run:
    """This rank's weights, replayed trace (and semantic plan), ours, the baseline and the peer."""
    from moelayers import ParallelGroups

    b = cfg["bench"]
    device = device_for(dist.get_backend() if dist.is_initialized() else "gloo")
    dtype = resolve_dtype(b.get("dtype", "auto"), device)
    check_shape_fits(b, device)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    config = moe_config(b, dtype)
    groups = ParallelGroups.from_world(ep=(cfg.get("parallel") or {}).get("ep"))
    weights = full_weights(config, seed, device, dtype)
    router = cfg.get("_router_name", "learned")
    replay, plan, owners, notes = None, None, {}, []
    if router == "replay":
        plan_based = uses_plan(cfg["layer"])
        # a plan trains on the first half; the scheduler's requests need not split the held-out
        # half evenly, so leave every rank twice its tokens and at least 4 held-out requests
        need = world * max(tokens_per_rank(b)) * (4 if plan_based else 1)
        replay = Replay(cfg.get("trace") or {}, config, seed, need, min_sequences=8 * world if plan_based else 2)
        if plan_based:
            frac = plan_fraction_setting(cfg["layer"].get("plan_train_fraction"), "layer.plan_train_fraction")
            plan, owners = semantic_schedules(replay, world, seed, frac, cfg["layer"].get("plan_path"), notes)
    elif router != "learned":
        raise ValueError(f"router must be learned or replay, got {router!r}")
    elif uses_plan(cfg["layer"]):
        raise ValueError(f"layer={cfg['layer']['name']} places experts from a semantic plan of real routing: "
                         "use router=replay (trace.path=FILE, or the synthetic trace)")
    if groups.ep_size != world:
        notes.append(f"parallel.ep={groups.ep_size} < world {world}: layer_stats and baseline_stats are of rank 0's "
                     "expert-parallel group")
    if bool(b.get("cuda_graph", False)) and (replay is not None or device.type != "cuda"):
        raise ValueError("bench.cuda_graph=true needs CUDA and the learned router (graphs take no forced routing)")
    tol = b["check"].get("tol")
    tol = float(tol) if tol is not None else (1e-4 if dtype in (torch.float32, torch.float64) else 2e-2)
    run = _Run(cfg=cfg, rank=rank, device=device, dtype=dtype, config=config, groups=groups, weights=weights,
               replay=replay, owners=owners, plan=plan, notes=notes, ours=None, base=None, base_name=None,
               base_cfg=None, peer=None, peer_name=None, peer_note=None, tol=tol)
    run.ours = run.make(cfg["layer"], **({} if plan is None else {"plan": plan, "plan_layer": replay.layer}))
    run.base_name = resolve_baseline(b.get("baseline", "auto"), plan is not None)
    run.base_cfg = None if run.base_name is None else copy.deepcopy(cfg["_baseline_layer"]) if (
        "_baseline_layer" in cfg and run.base_name not in LAYERS) else baseline_config(run.base_name, cfg["layer"])
    run.base = run.make(run.base_cfg) if run.base_cfg is not None else None
    run.peer, run.peer_name, run.peer_note = build_peer(config, dtype, device, b.get("peer", "auto"), weights,
                                                        groups.ep_size)
    if replay is not None:
        run.peer_note = "; ".join(filter(None, [run.peer_note, "routing replayed from a trace for ours only; the peer "
                                                "routed with its own learned router" if run.peer is not None else None]))
    return run


def _bench_size(run: _Run, tokens: int, first: bool = False) -> dict:
    """Check, then time, ours (the baseline and the peer) at ``tokens`` per rank: one record.
    ``first``: the first size timed, which warms up :data:`FIRST_SIZE_WARMUP` more forwards."""
    cfg, b, rank, device, config = run.cfg, run.b, run.rank, run.device, run.config
    ours, base, peer, replay, seed = run.ours, run.base, run.peer, run.replay, int(cfg.get("seed", 0))
    x = rank_input(tokens, config.hidden_size, seed, rank, device, run.dtype)
    if replay is not None:
        replay.repeated = False  # per size: a small size may fit the trace where a larger one wraps
    forced = replay.ids_for(rank, tokens, device, run.owners.get("semantic")) if replay is not None else None
    base_forced = replay.ids_for(rank, tokens, device, run.owners.get("round_robin")) if replay is not None else None
    repeated = replay is not None and bool(reduce_max([float(replay.repeated)], device)[0])  # every rank
    size_notes = []  # this size's record only
    if repeated:
        size_notes.append(f"tokens/rank={tokens}: the trace holds fewer tokens than the ranks replay, so "
                          "trace tokens repeat (trace.tokens_repeated)")
        if rank == 0:
            warn(size_notes[-1])
    timed, base_timed = ours, base
    if run.graph:  # fixed capacity = tokens per rank, whole forward replayed from a CUDA graph (both layers)
        timed = run.make(_graphed_config(cfg["layer"], tokens))
        base_timed = run.make(_graphed_config(run.base_cfg, tokens)) if base is not None else None

    def run_ours(x=x, forced=forced, timed=timed):
        if forced is not None:
            timed.force_routing(forced)
        return timed(x)

    def run_base(x=x, forced=base_forced, base_timed=base_timed):
        if forced is not None:
            base_timed.force_routing(forced)
        return base_timed(x)

    def run_peer(x=x):
        return peer_forward(peer, x)

    steps = (run_ours, run_base, run_peer)  # what is timed
    if run.train:  # forward + backward of the same input and output gradient, for each layer
        x_grad = x.detach().clone().requires_grad_()
        g = rank_input(tokens, config.hidden_size, seed + 1, rank, device, run.dtype)
        steps = tuple(training_step(lambda v, fn=fn: fn(x=v), x_grad, g, module)
                      for fn, module in zip(steps, (timed, base_timed, peer)))
    with run.grad_ctx():  # correctness before timing (a graph layer is checked on the experts the eager one chose)
        check, peer_ids = _check_size(run, tokens, x, run_ours, run_base, forced, base_forced)
    if run.train:  # the gradients too, in training mode, before timing
        for module in (timed, base_timed, peer):
            if module is not None:
                module.train()
        check_grads(check, run, x_grad, g, peer_ids, forced, base_forced)
    warmup, iters = int(b["warmup"]) + (FIRST_SIZE_WARMUP if first else 0), int(b["iters"])
    with torch.enable_grad() if run.train else run.grad_ctx():
        # ours and the baseline interleaved (their ratio is the point); the much slower peer on its own
        t_ours, t_base = (time_forwards(steps[:2], device, warmup, iters) if base is not None
                          else (time_forward(steps[0], device, warmup, iters), None))
        t_peer = time_forward(steps[2], device, warmup, iters) if peer is not None else None
    for module in (timed, base_timed, peer) if run.train else ():
        if module is not None:
            module.eval()
    med_ours = statistics.median(t_ours)
    med_peer = statistics.median(t_peer) if t_peer is not None else float("nan")
    ms, peer_ms = reduce_max([med_ours, med_peer if t_peer is not None else 0.0], device)
    stats = timed.last_stats.reduce(run.groups.ep) if getattr(timed, "last_stats", None) is not None else None
    base_ms = reduce_max([statistics.median(t_base)], device)[0] if base is not None else None
    base_stats = base_timed.last_stats.reduce(run.groups.ep) if base is not None else None
    if run.graph:
        timed.release_graphs()
        if base_timed is not None:
            base_timed.release_graphs()
    if rank == 0:
        ratio = f"{ms / peer_ms:.3f}" if peer is not None and peer_ms > 0 else "-"
        peer_s = f"{peer_ms:.3f}" if peer is not None else "-"
        print(f"timed t={tokens}: ours {ms:.3f} ms, peer {peer_s} ms, ratio {ratio}", flush=True)
        if base is not None:
            print(f"timed t={tokens}: baseline {run.base_name} {base_ms:.3f} ms (ours/baseline {ms / base_ms:.3f}); "
                  f"LAR ours {stats.lar:.3f} vs {base_stats.lar:.3f}, dispatch bytes ours "
                  f"{sum(stats.bytes_sent)} vs {sum(base_stats.bytes_sent)}", flush=True)
    return {
        "ms": ms, "peer_ms": peer_ms if peer is not None else None,
        "ms_per_rank": gather_scalar(med_ours, device),
        "peer_ms_per_rank": gather_scalar(med_peer, device) if peer is not None else None,
        "ms_min": reduce_max([min(t_ours)], device)[0],
        "tokens_per_rank": tokens, "check": check,
        "mode": f"cuda_graph (capacity={tokens})" if run.graph else _eager_mode(ours),
        "train": run.train,
        "layer_kwargs": (cfg["layer"].get("kwargs") or {}),
        "layer_stats": _stats_record(stats),
        "baseline": run.base_name, "baseline_kwargs": None if run.base_cfg is None else run.base_cfg["kwargs"],
        "baseline_ms": base_ms, "vs_baseline": ms / base_ms if base_ms else None,
        "baseline_stats": _stats_record(base_stats),
        "replans": getattr(ours, "num_replans", None),  # a self-re-planning layer's re-plans so far (0: none timed)
        "trace": None if replay is None else {"source": replay.source, "layer": replay.layer,
                                              "tokens_repeated": repeated, "path": cfg["trace"].get("path")},
        "check_finite": bool(b.get("check_finite", False)), "plan_based": run.plan is not None,
        "plan_path": cfg["layer"].get("plan_path") if run.plan is not None else None,
        "_size_notes": size_notes,
    }


def _check_size(run: _Run, tokens: int, x: torch.Tensor, run_ours, run_base, forced, base_forced):
    """Ours (and the baseline) against the dense reference on the experts they chose, and ours
    against the peer with the peer's experts forced; raises (the peer's check: unless
    ``bench.check.strict=false``) when one fails.

    Returns:
        ``(check, peer_ids)``: the record's ``check`` entries and the peer's expert ids (or ``None``).
    """
    b, rank, ours, base, peer = run.b, run.rank, run.ours, run.base, run.peer
    rows, max_bad = int(b["check"]["ref_rows"]), float(b["check"]["max_bad_rows_frac"])
    y = run_ours()
    if run.graph:
        ours(x)
        if base is not None:
            base(x)
    check = {"reference": check_against_reference(ours, x, y, run.weights, run.config, rows, run.device,
                                                   forced=forced, max_bad_frac=max_bad)}
    if not check["reference"]["ok"]:
        raise RuntimeError(f"{run.cfg['layer']['name']} does not match the dense reference at tokens/rank={tokens}: "
                           f"{check['reference']}")
    if base is not None:
        check["baseline_reference"] = check_against_reference(base, x, run_base(), run.weights, run.config, rows,
                                                              run.device, forced=base_forced, max_bad_frac=max_bad)
        if not check["baseline_reference"]["ok"]:
            raise RuntimeError(f"baseline {run.base_name} does not match the dense reference: "
                               f"{check['baseline_reference']}")
    if peer is None:
        if rank == 0:
            print(f"check t={tokens}: ours vs dense reference max abs err {check['reference']['max_abs_err']:.3e} "
                  f"(tol {check['reference']['tol']:.3e}); no peer", flush=True)
        return check, None
    # a few tokens have a near-tie of router logits that megatron's and our matmul break
    # differently. Check with megatron's choice forced on ours (same experts; weights still
    # from our router), and report the agreement.
    own_ids = None if forced is not None else layer_ids(ours)
    y_peer, peer_ids = peer_forward_with_routing(peer, x, run.config.top_k)
    ours.force_routing(peer_ids)
    c = check["peer"] = check_against_peer(ours(x), y_peer, run.tol, max_bad, run.device)
    c["router_agreement"] = None if own_ids is None else routing_agreement(own_ids, peer_ids, run.device)
    if rank == 0:
        agree = "" if c["router_agreement"] is None else \
            f"; our router picks the same experts as megatron's for {100 * c['router_agreement']:.1f}% of tokens"
        print(f"check t={tokens}: max|ours - peer| / max|peer| = {c['rel_max_abs_diff']:.3e} with the same "
              f"experts (tol {run.tol:g}; rows over tol: {c['rows_over_tol']}/{c['rows']}){agree}", flush=True)
    if not c["ok"]:
        _peer_disagrees(run, f"ours and the peer disagree at tokens/rank={tokens}: {c}")
    return check, peer_ids


def _peer_disagrees(run: _Run, msg: str) -> None:
    """Raise ``msg``, or with ``bench.check.strict=false`` warn (rank 0) and time anyway."""
    if run.b["check"].get("strict", True):
        raise RuntimeError(msg + " (bench.check.strict=false to time anyway)")
    if run.rank == 0:
        warn(msg)


def _profile(run: _Run, tokens: int) -> None:
    """``bench.profile``: torch.profiler's table of ours' top kernels at ``tokens`` per rank (rank
    0 prints it and saves a chrome trace in the run dir)."""
    cfg, b, rank, device, config, ours = run.cfg, run.b, run.rank, run.device, run.config, run.ours
    seed = int(cfg.get("seed", 0))
    x = rank_input(tokens, config.hidden_size, seed, rank, device, run.dtype)
    forced = run.replay.ids_for(rank, tokens, device, run.owners.get("semantic")) if run.replay is not None else None

    def run_prof(x=x):
        if forced is not None:
            ours.force_routing(forced)
        return ours(x)

    path = os.path.join(cfg["run_dir"], f"profile_{cfg['layer']['name']}_{b['name']}_t{tokens}_rank0.json")
    if run.train:
        x_grad = x.detach().clone().requires_grad_()
        ours.train()
        run_prof = training_step(run_prof, x_grad, rank_input(tokens, config.hidden_size, seed + 1, rank, device,
                                                              run.dtype), ours)
    with torch.enable_grad() if run.train else run.grad_ctx():
        table = profile_ours(run_prof, device, int(b.get("profile_iters", 5)), int(b.get("profile_rows", 25)),
                             rank, path)
    if rank == 0:
        print(f"\nprofile: {cfg['layer']['name']} {b['name']} tokens/rank={tokens}, {b.get('profile_iters', 5)} "
              f"{'eager ' if run.graph else ''}{'training steps' if run.train else 'forwards'} "
              f"(rank 0; chrome trace {path})\n{table}", flush=True)


def check_grads(check: dict, run: _Run, x: torch.Tensor, grad: torch.Tensor, peer_ids, forced, base_forced) -> None:
    """``bench.train``: the input gradients of ours and the baseline against the dense reference's
    (``check["reference_grad"]``, ``check["baseline_reference_grad"]``) and of ours against the
    peer's with the peer's experts forced (``check["peer_grad"]``), each raising (the peer's: unless
    ``bench.check.strict=false``) when it fails."""
    b, ours = run.b, run.ours
    rows = int(b["check"]["ref_rows"])
    for key, layer, ids in (("reference_grad", ours, forced), ("baseline_reference_grad", run.base, base_forced)):
        if layer is None:
            continue
        check[key] = check_grads_against_reference(layer, x, grad, run.weights, run.config, rows, run.device,
                                                   forced=ids)
        if not check[key]["ok"]:
            raise RuntimeError(f"the input gradient of {'ours' if layer is ours else 'the baseline'} does not "
                               f"match the dense reference's: {check[key]}")
    if run.peer is not None:
        check["peer_grad"] = c = check_grads_against_peer(ours, run.peer, x, grad, peer_ids, run.tol,
                                                          float(b["check"]["max_bad_rows_frac"]), run.device)
        if run.rank == 0:
            print(f"check grad: max|ours - peer| / max|peer| = {c['rel_max_abs_diff']:.3e} on the input gradient "
                  f"with the same experts (tol {run.tol:g}; rows over tol: {c['rows_over_tol']}/{c['rows']})",
                  flush=True)
        if not c["ok"]:
            _peer_disagrees(run, f"the input gradients of ours and the peer disagree: {c}")
    elif run.rank == 0:
        print(f"check grad: ours vs dense reference, input gradient max abs err "
              f"{check['reference_grad']['max_abs_err']:.3e} (tol {check['reference_grad']['tol']:.3e}); no peer",
              flush=True)


def _stats_record(stats) -> dict | None:
    """The JSON view of a reduced ``MoEStats`` (``None`` passes through)."""
    if stats is None:
        return None
    return {"lar": stats.lar, "imbalance": stats.imbalance, "rank_loads": stats.rank_loads,
            "bytes_sent": sum(stats.bytes_sent)}


# ---------------------------------------------------------------------- environment
def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"bench.dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def expert_params(shape: dict) -> int:
    return 3 * int(shape["num_experts"]) * int(shape["hidden_size"]) * int(shape["ffn_hidden_size"])


def check_shape_fits(b: dict, device: torch.device) -> None:
    """Refuse a large shape without CUDA (it would take minutes per forward and gigabytes per rank):
    more expert parameters than ``bench.max_cpu_expert_params``, unless ``bench.allow_large_cpu``."""
    limit = int_setting(b.get("max_cpu_expert_params", 50_000_000), "bench.max_cpu_expert_params", 0)
    n = expert_params(b["shape"])
    if device.type != "cuda" and n > limit and not b.get("allow_large_cpu", False):
        way_out = (f"Run the CPU smoke shape instead:\n    python recipes/bench.py bench=cpu_smoke\nor on GPUs: "
                   f"torchrun --standalone --nproc_per_node=N recipes/bench.py bench={b['name']} "
                   if b["name"] != "cpu_smoke" else "Raise bench.max_cpu_expert_params ")
        raise SystemExit(
            f"bench={b['name']} has {n / 1e6:.3g}M expert parameters, more than bench.max_cpu_expert_params="
            f"{limit} allows without a CUDA device (a large shape on CPU is not a useful benchmark). "
            f"{way_out}(bench.allow_large_cpu=true forces it)")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return str(getattr(triton, "__version__", "?"))


def command_line() -> str:
    """The command as typed: ``sys.argv`` quoted, with the ``torchrun`` prefix rebuilt from its env."""
    argv = shlex.join(sys.argv)
    if under_torchrun():
        nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
        prefix = "torchrun --standalone" if nnodes == 1 else f"torchrun --nnodes={nnodes}"
        return f"{prefix} --nproc_per_node={nproc} {argv}"
    return f"python {argv}"


def router_name(cfg: DictConfig) -> str:
    """``router`` group's name; if the group is absent, a ``router=X`` command-line override."""
    r = cfg.get("router")
    if r is not None:
        return str(r.get("name") if hasattr(r, "get") else r)
    try:
        from hydra.core.hydra_config import HydraConfig

        for o in HydraConfig.get().overrides.task:
            if o.startswith("router="):
                return o.split("=", 1)[1]
    except Exception:
        pass
    return "learned"


def _eager_mode(layer) -> str:
    """The record's ``mode`` of an eager run: the dispatcher that moved the tokens."""
    name, dedup = getattr(layer, "dispatcher_name", "alltoall"), getattr(layer, "dedup", True)
    if name == "allgather":
        return "eager (all-gather)"
    return "eager (exact all-to-all-v)" if dedup else "eager (exact all-to-all-v, no de-duplication)"


#: the config groups of conf/ this recipe reads (--help lists these)
CONFIG_GROUPS = ("parallel", "bench", "layer", "router")
#: config keys whose sub-keys the code reading them checks (refuse_unread_overrides lets them pass; check_config
#: refuses serve.py's emulation settings, saying why)
OPEN_KEYS = ("layer.kwargs", "variability", "emulation")
#: keys read with a default that no bench shape's yaml sets (moe_config), and layer.placement_path of some
#: layer options, which check_config refuses with its reason (serve.py reads it)
EXTRA_KEYS = ("bench.shape.init_std", "bench.shape.score_fn", "bench.shape.norm_topk_prob", "layer.placement_path")


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_unread_overrides("bench.py", "bench", CONFIG_GROUPS, OPEN_KEYS, EXTRA_KEYS, cfg=cfg)
    d = to_dict(cfg)
    require_keys(d, "bench.py", ("bench", "layer"))
    refuse_empty_paths(d)
    normalize_flags(d, ("plot", "trace.synthetic", "bench.inference_mode", "bench.check_finite", "bench.cuda_graph", "bench.train",
                        "bench.profile", "bench.allow_large_cpu", "bench.check.strict", *LAYER_FLAGS))
    b = d["bench"]
    d["_router_name"] = router_name(cfg)
    if d.get("trace", {}).get("path"):  # (before the checks: with hydra.job.chdir=true the cwd is the run dir)
        d["trace"]["path"] = absolute_path(d["trace"]["path"])
    if (d.get("layer") or {}).get("plan_path"):
        d["layer"]["plan_path"] = absolute_path(d["layer"]["plan_path"])
    check_config(d)
    named = resolve_baseline(b.get("baseline", "auto"), plan_based=False)
    if named is not None and named not in LAYERS:  # a layer option found here (a user's --config-dir too), where
        d["_baseline_layer"] = baseline_config(named, d["layer"], d)  # Hydra's search path is known, not in the ranks
    d["run_dir"] = claim_run_dir("bench.py")
    if b.get("save_to") and os.path.realpath(absolute_path(b["save_to"])) == os.path.realpath(d["run_dir"]):
        raise ValueError(f"bench.save_to={b['save_to']} is this run's dir (hydra.run.dir), whose earlier records each run "
                         "removes (a run dir holds one run's files): give bench.save_to a folder of its own, where "
                         "records of every configuration are kept")
    torchrun = under_torchrun()
    backend = resolve_backend((d.get("parallel") or {}).get("backend"), torchrun=torchrun)
    check_shape_fits(b, torch.device("cuda") if backend == "nccl" else torch.device("cpu"))
    if backend != "nccl" and b.get("cuda_graph"):  # here, not in every rank after the layers are built
        raise ValueError("bench.cuda_graph=true needs CUDA (parallel=gpu)")
    if backend != "nccl" and peer_mode(b.get("peer", "auto")) == "required":
        raise ValueError("bench.peer=true but megatron-core's MoELayer needs CUDA (parallel=gpu): no peer on CPU")
    if backend != "nccl" or peer_mode(b.get("peer", "auto")) == "off":
        unused = unread_overrides(["bench.check.tol", "bench.check.strict"], ["bench.peer", "parallel"])
        if unused:  # (the dense-reference check has check_close's tolerance and always stops the run)
            raise ValueError(f"{', '.join(unused)} is read by the check of ours against megatron-core's MoELayer "
                             f"(the peer), and this run has no peer ({'not parallel=gpu' if backend != 'nccl' else 'bench.peer=false'}): drop it")
    command = command_line()
    started = datetime.datetime.now().timestamp()
    records = launch(d, bench_worker)
    if not records:
        shutdown()
        return  # torchrun ranks other than 0
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    origin = provenance({"trace.path": (d.get("trace") or {}).get("path"),
                         "layer.plan_path": (d.get("layer") or {}).get("plan_path")})
    records = [order_record({**r, "seed": d.get("seed"), "settings_digest": settings_digest(r, d),
                             "settings_digest_version": SETTINGS_DIGEST_VERSION, "provenance": origin}, date, command)
               for r in records]
    save_to = absolute_path(b["save_to"]) if b.get("save_to") else None
    print_results(records)
    written = save_records(records, d["run_dir"], save_to, plot=d.get("plot", True))
    for p in written:
        print(f"wrote {p}")
    remove_earlier_outputs(d["run_dir"], started, written)
    shutdown()


if __name__ == "__main__":
    run_recipe(main)
