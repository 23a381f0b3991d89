#!/usr/bin/env python
"""Offline expert placement from a routing trace, evaluated on held-out sequences.

The trace's first ``floor(trace.train_fraction * S)`` sequences train the planner, the rest are
held out (:func:`moelayers.trace.train_sequences`: the floor forgives float rounding, so
``0.29 * 100`` trains 29). ``planner=linear|eplb|gem|semantic`` plans every layer on the train part:

* ``linear``: experts ``r*E/R .. (r+1)*E/R - 1`` on rank ``r``;
* ``eplb``: DeepSeek's EPLB balanced packing by mean load (:mod:`moelayers.planning.eplb`, no replicas);
* ``gem``: GEM, per-rank latency curves (``variability=high|moderate|low|none`` synthetic presets or
  ``curves.path=FILE`` measured by ``recipes/profile.py``);
* ``semantic``: Sem-MoE co-clustering of experts and tokens (:func:`moelayers.planning.semantic_solvers.plan_semantic`,
  ``planner.solver=alternating|cem``, ``planner.theta`` and the knobs of ``conf/planner/semantic.yaml``),
  or an existing plan file (``plan.path=FILE``, checked against the trace and ``parallel.ep``).

Every run reports, on the held-out part, for the configured ``mode``:

* the **local activation rate** (LAR) of the chosen planner's assignment. ``mode=tp`` (attention-TP):
  held-out tokens in file order in batches of ``trace.tokens_per_step``, every rank receives exactly
  ``tokens_per_step / ep`` tokens of each batch (the last, partial batch: counts differ by at most
  one); the semantic planner picks a token's rank at layer ``l`` from its token id and the experts of
  layers before ``l`` (:func:`moelayers.planning.semantic_eval.evaluate_tp`), the other planners cut
  each batch into ``ep`` chunks in file order. ``mode=dp`` (attention-DP): a sequence is one request
  and keeps one rank for all layers; the semantic planner's request scheduler (Algorithm 2) picks it
  from the request's token ids, requests in file order, every ``ep`` consecutive requests of a mask
  cycle on ``ep`` different ranks (``planner.dp_schedule=greedy``, the default: each request in turn
  takes its best unmasked rank; ``joint``: the requests of a cycle get their ranks together, the
  largest total vote, as ``SemanticScheduler.assign_batch`` does for a batch known up front), the
  other planners go round robin (a rank the 1.3× cap closes to a request is skipped: the schedule
  of no votes); no rank holds more than 1.3 × the mean tokens (:mod:`recipes._plan_tools`) where the held-out requests
  allow it (``max_ratio_exceeded`` in the report, and a warning, where they do not);
* GEM's **step-latency scores** of the linear, EPLB and GEM placements (and the chosen one) on the
  same held-out steps (seconds summed over steps and layers; :func:`moelayers.planning.gem.evaluate`).

Writes into the Hydra run dir (``hydra.run.dir=...``), only after everything succeeded (temporary
files moved into place, ``report.json`` last):

* ``report.json`` (every key, with units: docs/outputs.md): ``planner``, ``ep``, ``mode``, ``predictor`` (the semantic planner in tp mode: the
  token predictor that ran, ``alg3`` for a plan with Algorithm 3 tables only; else null), ``lar``, ``lar_linear`` (linear placement, tokens
  spread evenly), ``token_imbalance`` (max/mean tokens per rank, mean over layers; dp: ``max_ratio_exceeded`` when
  above 1.3), ``expert_imbalance`` (max/mean
  activations received per rank, mean over layers; ``expert_imbalance_max`` the worst layer's,
  ``expert_imbalance_linear`` linear's), ``a2a_bytes_ratio`` (de-duplicated all-to-all
  sends relative to linear), ``remote_ratio`` (remote activations relative to linear, without
  de-duplication: ``(1 - lar) / (1 - lar_linear)``), ``tokens_per_rank`` (held-out tokens of each
  rank at layer 0: in tp mode a token's rank may change from layer to layer), ``solve_seconds`` (the chosen planner, all layers; 0 for a loaded plan), ``in_sample_sequences``
  (semantic: held-out sequences the plan was trained on, by content, with a warning when any; null
  for another planner, or a plan file that does not record its training sequences), per-layer LARs,
  ``warnings`` (also printed); GEM's scores, for every planner: ``score`` (chosen planner), ``score_linear``, ``score_eplb``, ``score_gem``
  (``score_semantic``), ``gem_vs_linear`` / ``gem_vs_eplb`` (relative reductions of the GEM score:
  0.08 = 8 % lower), ``vs_linear`` / ``vs_eplb`` (the same for the chosen planner), ``train_score*``,
  ``per_layer`` scores; the resolved ``config`` and ``command`` (``argv``, Hydra ``overrides``;
  the run dir gets no ``.hydra/`` and no log file, and a failed run writes nothing there) and
  ``provenance`` (versions, commit, date, host, the input files with their sha256);
* ``assignment.npz`` (compressed): ``expert_rank [L, E]`` int64 (the chosen placement; for
  linear/eplb/gem this is the placement file: ``ExpertPlacement.from_expert_rank(expert_rank[l],
  num_ranks=ep)`` per layer), ``expert_rank_<planner> [L, E]`` for every placement the report scores
  (``linear``, ``eplb``, ``gem`` and ``semantic`` when planned),
  ``token_rank [T_heldout, L]`` int64 (the rank that processes each held-out token at each layer),
  ``token_rank_linear [T_heldout]`` int64 (the even spread that ``lar_linear`` pairs with the linear
  placement, at every layer),
  ``seq_offsets [S_heldout+1]`` of the held-out part, ``num_ranks``, ``tokens_per_step``,
  ``train_fraction``, ``mode``;
* ``plan.npz`` (``planner=semantic``): the :class:`~moelayers.planning.semantic.SemanticPlan`
  (``SemanticPlan.load``; read by ``SemanticMoE.from_plan``, ``recipes/serve.py layer.plan_path=FILE``
  and ``plan.path=FILE``);
* ``curves.npz``: the latency curves used (:meth:`LatencyCurves.load` reads it; from ``curves.path``,
  its ``rows`` and ``latency_s`` only: the profile's other fields stay in its own file);
* ``plan.png`` (``plot=false``: none): per layer, the held-out LAR of the chosen planner against
  linear, and every planned placement's held-out GEM score relative to linear.

Anyone can recompute the report::

    train, held_out = load_trace(TRACE).split(train_fraction)
    a = np.load("assignment.npz")
    lar_from_assignment(held_out, a["expert_rank"], a["token_rank"])          # report["lar"]
    lar_from_assignment(held_out, a["expert_rank_linear"],                    # report["lar_linear"]
                        np.repeat(a["token_rank_linear"][:, None], held_out.num_layers, axis=1))
    evaluate(held_out, a["expert_rank"], LatencyCurves.load("curves.npz"), tokens_per_step)   # report["score"]
    evaluate(held_out, a["expert_rank_eplb"], ...)                                      # report["score_eplb"]

(``lar_from_assignment`` from :mod:`moelayers.planning.semantic_eval`, ``evaluate`` from
:mod:`moelayers.planning.gem`.) Planning is deterministic for a ``seed``.

Usage::

    python recipes/plan.py                                   # synthetic trace, GEM, EP4, variability=high, mode=tp
    python recipes/plan.py planner=semantic parallel.ep=8 mode=tp trace.path=trace.npz trace.train_fraction=0.5
    python recipes/plan.py planner=semantic planner.solver=cem planner.theta=0.2 parallel.ep=4 mode=dp trace.path=trace.npz
    python recipes/plan.py planner=semantic plan.path=plan.npz parallel.ep=8 trace.path=trace.npz   # evaluate a plan file
    python recipes/plan.py planner=gem parallel.ep=4 variability=high trace.path=trace.npz
    python recipes/plan.py planner=eplb parallel.ep=8 trace.path=trace.npz hydra.run.dir=/tmp/plan
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this directory comes first on sys.path and recipes/profile.py would shadow the
# standard library's profile module: use the repository root instead (recipes is a package)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from moelayers.planning.semantic_eval import PREDICTORS  # noqa: E402
from moelayers.planning.steps import MIN_STEPS  # noqa: E402
from recipes._common import (  # noqa: E402
    absolute_path, config_trace, flag, in_sweep, int_setting, invocation, merge_curves_path, normalize_flags, overridden, print_table,
    provenance,
    refuse_empty_paths, refuse_unread_overrides, require_keys, to_dict,
)
from recipes._outputs import claim_run_dir, commit_files, run_recipe, warn, write_json  # noqa: E402
from recipes._plots import plot_plan  # noqa: E402
from recipes._plan_tools import ASSIGNMENT_FORMAT, DP_MAX_RATIO, MODES, even_token_rank, lar_report  # noqa: E402

SYNTHETIC_KEYS = ("synthetic", "num_sequences", "num_layers", "num_experts", "top_k", "vocab_size", "seq_len")
OUTPUTS = ("assignment.npz", "curves.npz", "plan.png", "plan.npz", "report.json")  # every file a run may write
BASELINES = ("linear", "eplb", "gem")  # always planned: GEM's scores compare against them
PLANNERS = (*BASELINES, "semantic")
DP_SCHEDULES = ("joint", "greedy")  # planner.dp_schedule: how the request scheduler takes a mask cycle


# ------------------------------------------------------------------------------------ inputs
def check_config(d: dict) -> tuple[str, int, str, int, float]:
    """``(planner, ep, mode, tokens_per_step, train_fraction)`` from the config, or ``ValueError`` naming the key."""
    name, mode = str(d["planner"]["name"]), str(d.get("mode", "tp"))
    if name not in PLANNERS:
        raise ValueError(f"planner must be one of {list(PLANNERS)}, got {name!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    ep = int_setting(d["parallel"]["ep"], "parallel.ep", 1)
    tc = d["trace"]
    tps, frac = int_setting(tc.get("tokens_per_step", 2048), "trace.tokens_per_step", 1), tc.get("train_fraction", 0.5)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
        raise ValueError(f"trace.train_fraction must be a number in (0, 1), got {frac!r}")
    problems = []  # every one of them in one message (the second came after the synthetic trace was drawn)
    if mode == "tp" and tps % ep:
        problems.append(f"trace.tokens_per_step ({tps}) must be divisible by parallel.ep ({ep}) in mode=tp: "
                        f"every rank receives tokens_per_step / ep tokens of each batch (e.g. "
                        f"trace.tokens_per_step={tps - tps % ep or ep})")
    experts = tc.get("num_experts")
    if not tc.get("path") and isinstance(experts, int) and not isinstance(experts, bool) and experts > 0 and experts % ep:
        problems.append(f"trace.num_experts ({experts}) of the synthetic trace must be divisible by parallel.ep ({ep}) "
                        f"(e.g. trace.num_experts={experts - experts % ep or ep})")
    if problems:
        raise ValueError("; ".join(problems))
    if tc.get("path"):
        shaped = overridden([f"trace.{k}" for k in SYNTHETIC_KEYS])
        if shaped:
            raise ValueError(f"{', '.join(shaped)} shape(s) the synthetic trace; with trace.path={tc['path']} the file's "
                             "trace is planned (drop them, or drop trace.path to plan a synthetic trace)")
    path = (d.get("plan") or {}).get("path")
    if path and name != "semantic":
        raise ValueError(f"plan.path is a semantic plan file: it needs planner=semantic, got planner={name}")
    if name == "semantic" and not path:
        semantic_settings(d["planner"])  # a bad solver setting fails here, before the trace is read
    if name == "semantic":
        dp_schedule(d["planner"])
        predictor = d["planner"].get("predictor", "combined")
        if predictor not in PREDICTORS:  # checked here, not after the solve
            raise ValueError(f"planner.predictor must be one of {list(PREDICTORS)}, got {predictor!r}")
        ignored = ignored_semantic_settings(d["planner"], mode, bool(path))
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: this run would ignore them; drop them (++KEY=VALUE passes in a -m "
                             "sweep over the setting in brackets, whose other jobs read it)")
    int_setting(d.get("seed", 0), "seed", 0)
    if name == "gem":
        gem_settings(d["planner"])
    return name, ep, mode, tps, frac


# planner.<key> of planner=semantic that only some runs read (the others are refused when set on the command line)
TP_ONLY = ("history", "sample", "smoothing", "predictor_sample", "threads", "predictor")  # the tp predictor and its fit
DP_ONLY = ("max_requests", "dp_schedule")  # the request clustering and the dp evaluation
SOLVE_ONLY = ("solver", "theta", "history", "sample", "beta", "rho", "slack", "smoothing", "max_requests",
              "predictor_sample", "threads", "embeddings")  # read by the solve, not by a plan.path run


def ignored_semantic_settings(planner: dict, mode: str, from_file: bool) -> list[str]:
    """The command-line overrides of ``planner=semantic`` settings that this run would not read, each
    with the reason: a tp-only setting in ``mode=dp`` and the other way round, ``planner.rho`` without
    ``planner.solver=cem``, and the solver's settings with ``plan.path`` (the file's plan is evaluated).
    A ``++KEY`` passes in a ``-m`` sweep over each setting that makes this job ignore it (``-m
    mode=tp,dp ++planner.history=4``: the tp job reads it), as ``++KEY`` of another option does."""
    why: dict[str, str] = {}
    deciders: dict[str, set[str]] = {}

    def ignored(key: str, reason: str, decider: str) -> None:
        why.setdefault(key, reason)
        deciders.setdefault(key, set()).add(decider)

    for key in (TP_ONLY if mode == "dp" else DP_ONLY):
        ignored(key, f"mode={mode}", "mode")
    if planner.get("solver", "alternating") != "cem":
        ignored("rho", "planner.solver is not cem", "planner.solver")
    if from_file:
        for key in SOLVE_ONLY:
            ignored(key, "plan.path: the file's plan is evaluated, not solved", "plan.path")
    out = []
    for override in overridden([f"planner.{key}" for key in why]):
        key = override.split("=", 1)[0].lstrip("+~").split(".")[1]  # planner.<key>[.sub]=value
        if override.startswith("++") and all(in_sweep(k) for k in deciders[key]):
            continue  # (another job of the sweep reads it)
        out.append(f"{override} ({why[key]})")
    return out


def gem_settings(planner: dict) -> tuple[int, str]:
    """``(planner.restarts, planner.method)`` of ``planner=gem``, or ``ValueError`` naming the key."""
    from moelayers.planning.gem_search import METHODS

    method = planner.get("method", "robust")
    if method not in METHODS:
        raise ValueError(f"planner.method must be one of {list(METHODS)}, got {method!r}")
    return int_setting(planner.get("restarts", 8), "planner.restarts", 1), method


def dp_schedule(planner: dict) -> str:
    """``planner.dp_schedule``: ``greedy`` (one by one in file order, Algorithm 2 as published: a
    request's rank depends on the requests before it only) or ``joint`` (each mask cycle's requests
    assigned together, for batches known up front); ``ValueError`` naming the key otherwise."""
    value = planner.get("dp_schedule", "greedy")
    if value not in DP_SCHEDULES:
        raise ValueError(f"planner.dp_schedule must be one of {list(DP_SCHEDULES)}, got {value!r}")
    return value


def semantic_settings(planner: dict) -> dict:
    """The ``plan_semantic`` settings the ``planner`` block sets (``conf/planner/semantic.yaml``), checked.

    The values are passed as they are, not cast: ``planner.sample=2.7`` is refused, not planned with 2.

    Raises:
        ValueError: a setting out of range or of the wrong type, naming ``planner.<setting>``
            (:func:`moelayers.planning.semantic_solvers.check_settings`).
    """
    from moelayers.planning.semantic_solvers import SETTINGS, check_settings

    settings = {k: planner[k] for k in SETTINGS if planner.get(k) is not None}
    check_settings(settings, prefix="planner.")
    return settings


def load_plan_trace(d: dict):
    """The routing trace: ``trace.path``, else a synthetic one of the configured shape."""
    tc = d["trace"]
    return config_trace(tc, num_sequences=tc.get("num_sequences", 0), num_layers=tc.get("num_layers", 0),
                        num_experts=tc.get("num_experts", 0), top_k=tc.get("top_k", 0),
                        vocab_size=tc.get("vocab_size", 0), seed=d["seed"], seq_len=[256, 2048], need="plan.py")


def trace_name(d: dict) -> str:
    """The trace in messages: its file, or ``synthetic trace``."""
    return str(d["trace"].get("path") or "synthetic trace")


def load_curves(d: dict, num_ranks: int):
    """Latency curves: ``curves.path`` if set, else the ``variability`` preset; checked for ``num_ranks``."""
    from moelayers.planning.gem import LatencyCurves

    path = (d.get("curves") or {}).get("path")
    curves = LatencyCurves.load(path) if path else LatencyCurves.preset(str(d["variability"]["name"]), num_ranks)
    curves.check_ranks(num_ranks)
    return curves, (f"file:{path}" if path else str(d["variability"]["name"]))


def load_embeddings(path: str | None, vocab_size: int) -> np.ndarray | None:
    """``planner.embeddings``: optional ``[V, D]`` float npy of token embeddings (unseen tokens borrow a neighbour's row)."""
    if not path:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: planner.embeddings file not found")
    try:
        emb = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: planner.embeddings is not a readable .npy array ({exc})") from exc
    if not isinstance(emb, np.ndarray):  # an .npz archive
        raise ValueError(f"{path}: planner.embeddings must be a .npy array [V={vocab_size}, D], not an .npz archive")
    if emb.ndim != 2 or emb.shape[0] != vocab_size or emb.dtype.kind != "f":
        raise ValueError(f"{path}: planner.embeddings must be a float [V={vocab_size}, D] array, "
                         f"got {emb.dtype} {list(emb.shape)}")
    bad = np.flatnonzero(~np.isfinite(emb).all(axis=1))
    if bad.size:
        raise ValueError(f"{path}: planner.embeddings has NaN/inf values in {bad.size} row(s) (token ids "
                         f"{bad[:5].tolist()}{' ...' if bad.size > 5 else ''}): give those rows finite values, or drop "
                         "planner.embeddings (unseen tokens then lean on the layer's overall distribution)")
    return emb


def load_semantic_plan(path: str, trace, held_out, ep: int, mode: str, trace_source: str):
    """``plan.path``: a :class:`SemanticPlan` file, checked against the trace, ``parallel.ep`` and ``mode``."""
    from moelayers.planning.semantic import SemanticPlan

    plan = SemanticPlan.load(path)
    plan.check_compatible(trace.num_experts, ep, trace.num_layers)
    if plan.mode != mode:
        raise ValueError(f"{path}: semantic plan field 'mode' is {plan.mode!r}, but mode={mode}; "
                         f"re-plan with mode={mode} or run with mode={plan.mode}")
    top = int(held_out.token_ids.max())
    if top >= plan.vocab_size:
        raise ValueError(f"{trace_source}: field 'token_ids' has token id {top}, outside [0, vocab_size="
                         f"{plan.vocab_size}) of the semantic plan {path}; re-plan on this vocabulary")
    return plan


# ------------------------------------------------------------------------------------ planning
def plan_layer(name: str, loads, curves, num_ranks: int, d: dict):
    """``expert_rank [E]`` of one layer from its train loads ``[steps, E]`` (baseline planners)."""
    from moelayers.planning.eplb import plan_eplb
    from moelayers.planning.gem import plan_gem, plan_linear

    if name == "linear":
        return plan_linear(loads.shape[1], num_ranks)
    if name == "eplb":
        return plan_eplb(loads, num_ranks)
    restarts, method = gem_settings(d["planner"] if d["planner"]["name"] == "gem" else {})
    return plan_gem(loads, curves, restarts=restarts, seed=int_setting(d["seed"], "seed", 0), method=method)


def plan_all(name: str, train_loads, curves, num_ranks: int, d: dict, *, bar: bool,
             baseline: bool = False) -> tuple[np.ndarray, float]:
    """Plan every layer: ``train_loads [L, steps, E]`` -> (``expert_rank [L, E]``, seconds)."""
    layers = range(train_loads.shape[0])
    if bar:
        from moelayers._progress import progress_bar

        desc = f"plan {name} ep{num_ranks}" + (" (baseline)" if baseline else "")
        layers = progress_bar(layers, desc=desc, unit="layer")
    t0 = time.perf_counter()
    out = np.stack([plan_layer(name, train_loads[i], curves, num_ranks, d) for i in layers]).astype(np.int64)
    return out, time.perf_counter() - t0


def read_inputs(d: dict, name: str, plan_source: str) -> dict:
    """``{setting: path}`` of the files this run read (for its provenance): the trace and curves
    files, and the semantic planner's plan file or, when it solved, its embeddings."""
    semantic = name == "semantic"
    return {"trace.path": d["trace"].get("path"), "curves.path": (d.get("curves") or {}).get("path"),
            "plan.path": plan_source if semantic and plan_source != "solved" else None,
            "planner.embeddings": (d.get("planner") or {}).get("embeddings") if semantic and plan_source == "solved"
            else None}


def plan_semantic_from_config(d: dict, trace, train, held_out, ep: int, mode: str, *, bar: bool):
    """``(SemanticPlan, seconds, source)``: ``plan.path`` if set (0 s), else ``plan_semantic`` on ``train``."""
    from moelayers.planning.semantic_solvers import plan_semantic

    path = (d.get("plan") or {}).get("path")
    if path:
        return load_semantic_plan(path, trace, held_out, ep, mode, trace_name(d)), 0.0, path
    p = d["planner"]
    emb = load_embeddings(p.get("embeddings"), train.vocab_size)
    t0 = time.perf_counter()
    plan = plan_semantic(train, ep, mode, seed=int(d["seed"]), progress=bar, embeddings=emb, **semantic_settings(p))
    return plan, time.perf_counter() - t0, "solved"


def assign_tokens(plan, held_out, ep: int, mode: str, tps: int, d: dict, *, bar: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(token_rank [T, L], even [T])``: the chosen planner's token ranks and the even spread.

    With a semantic ``plan`` the ranks come from its online predictor (tp) or request scheduler (dp),
    else every layer uses the even spread.
    """
    from moelayers.planning.semantic_eval import assign_dp, assign_tp

    even = even_token_rank(held_out, ep, mode, tps)
    if plan is None:
        return np.repeat(even[:, None], held_out.num_layers, axis=1), even
    if mode == "tp":
        token_rank = assign_tp(plan, held_out, tps, predictor=str(d["planner"].get("predictor", "combined")),
                               progress=bar)
    else:
        token_rank = assign_dp(plan, held_out, max_ratio=DP_MAX_RATIO, joint=dp_schedule(d["planner"]) == "joint")
    return np.asarray(token_rank, dtype=np.int64), even


def gem_scores(plans: dict[str, np.ndarray], name: str, train_loads, test_loads, curves) -> dict:
    """GEM step-latency scores of every placement in ``plans`` (``{planner: expert_rank [L, E]}``)."""
    from moelayers.planning.gem import score_layers

    def reduction(a: float, b: float) -> float:
        return 1.0 - a / b if b > 0 else 0.0

    per_layer = {p: score_layers(er, test_loads, curves) for p, er in plans.items()}
    held = {p: float(v.sum()) for p, v in per_layer.items()}
    train = {p: float(score_layers(er, train_loads, curves).sum()) for p, er in plans.items()}
    return {
        "score": held[name], **{f"score_{p}": v for p, v in held.items()},
        "gem_vs_linear": reduction(held["gem"], held["linear"]), "gem_vs_eplb": reduction(held["gem"], held["eplb"]),
        "vs_linear": reduction(held[name], held["linear"]), "vs_eplb": reduction(held[name], held["eplb"]),
        "train_score": train[name], **{f"train_score_{p}": v for p, v in train.items()},
        "train_gem_vs_linear": reduction(train["gem"], train["linear"]),
        "per_layer": {p: v.tolist() for p, v in per_layer.items()},
    }




def max_rank_rows(plans: dict[str, np.ndarray], parts: tuple, num_ranks: int) -> int:
    """The most rows any rank computes in any step of ``parts`` (``[L, steps, E]`` loads) under any of
    the placements ``plans`` (``{planner: expert_rank [L, E]}``): where the curves are read."""
    from moelayers.planning.steps import rank_rows

    return max((int(rank_rows(er[layer], loads[layer], num_ranks).max()) for er in plans.values()
                for loads in parts if loads.shape[1] for layer in range(er.shape[0])), default=0)


def run_warnings(report: dict) -> list[str]:
    """What the report's reader must know: too few steps for the step scores (GEM plans from the
    train steps and is scored on the held-out ones), or a dp schedule that broke the token cap."""
    out = []
    steps = {"train": report["train_steps"], "held-out": report["held_out_steps"]}
    few = {part: n for part, n in steps.items() if n < MIN_STEPS}
    if few:
        parts = " and ".join(f"{n} {part}" for part, n in few.items())
        out.append(f"only {parts} step(s) of trace.tokens_per_step={report['tokens_per_step']} tokens (fewer than "
                   f"{MIN_STEPS}): the step scores (score*, gem_vs_*) and GEM's plan rest on too few steps to "
                   f"generalise; use a longer trace or a smaller trace.tokens_per_step")
    if report["curves_sampled_up_to"] is not None and report["max_rank_rows"] > report["curves_sampled_up_to"]:
        out.append(f"a rank computes up to {report['max_rank_rows']} rows in a step, beyond the latency curves' last "
                   f"sample ({report['curves_sampled_up_to']} rows): the scores there extrapolate the curves (the "
                   f"slope of their upper half, of the whole curve where that half is flat); profile up to that many rows (recipes/profile.py profile.max_rows=...) or use a smaller "
                   f"trace.tokens_per_step")
    if report.get("planner") == "semantic" and report.get("in_sample_sequences") is None:
        out.append(f"the plan file {report['plan']} does not record the sequences it was planned on (written by an "
                   "older moelayers): whether the held-out sequences were among them is unknown, so the LAR may be "
                   "in-sample; re-plan to get a plan file that records them")
    elif report.get("in_sample_sequences") and report.get("plan") == "solved":
        out.append(f"{report['in_sample_sequences']} of {report['held_out_sequences']} held-out sequences repeat a "
                   f"training sequence (the same tokens and routing, e.g. repeated prompts): the LAR counts them as "
                   f"held out")
    elif report.get("in_sample_sequences"):
        out.append(f"{report['in_sample_sequences']} of {report['held_out_sequences']} held-out sequences are ones the "
                   f"semantic plan was trained on: the LAR is partly in-sample, not a held-out figure (plan the "
                   f"file on this trace's train part, trace.train_fraction={report['train_fraction']}, or evaluate "
                   f"on another trace)")
    if report["max_ratio_exceeded"]:
        out.append(f"a rank holds more than {DP_MAX_RATIO} x the mean held-out tokens (token imbalance "
                   f"{report['token_imbalance']:.3f}): no schedule of these requests in file order stays within it")
    return out


# ------------------------------------------------------------------------------------ the run
def run(d: dict) -> dict:
    """Plan, evaluate, then write report.json / assignment.npz / curves.npz (/ plan.npz) into ``d['run_dir']``."""
    from moelayers.planning.steps import trace_step_loads

    name, ep, mode, tps, frac = check_config(d)
    tc = d["trace"]
    trace = load_plan_trace(d)
    if trace.num_experts % ep:
        raise ValueError(f"{trace_name(d)}: field 'num_experts' ({trace.num_experts}) must be divisible by "
                         f"parallel.ep ({ep})")
    if name == "semantic" and not (d.get("plan") or {}).get("path"):  # before the curves, the split and the baselines
        from moelayers.planning.semantic_solvers import check_vocab_size

        check_vocab_size(trace, ep, mode, trace_name(d))
    curves, variability = load_curves(d, ep)
    try:
        train, held_out = trace.split(frac)
    except ValueError as exc:  # (a synthetic trace has no file name: say which trace, and which setting)
        raise ValueError(f"trace.train_fraction={frac}: {str(exc).replace('<memory>', trace_name(d))}") from None
    train_loads, test_loads = trace_step_loads(train, tps), trace_step_loads(held_out, tps)

    bar = d.get("progress", True)
    plans, solve, semantic, plan_source = {}, 0.0, None, "solved"
    if name == "semantic":  # the chosen planner first (timed, with the bar)
        semantic, solve, plan_source = plan_semantic_from_config(d, trace, train, held_out, ep, mode, bar=bar)
    for planner in sorted(BASELINES, key=lambda p: p != name):
        # a bar for the chosen planner and for GEM's baseline, which takes seconds per layer too
        plans[planner], seconds = plan_all(planner, train_loads, curves, ep, d, bar=bar and planner in (name, "gem"),
                                           baseline=planner != name)
        solve = seconds if planner == name else solve
    if semantic is not None:
        plans["semantic"] = semantic.expert_rank
    token_rank, even = assign_tokens(semantic, held_out, ep, mode, tps, d, bar=bar)
    in_sample = None if semantic is None else semantic.trained_on(held_out)

    report = {
        "planner": name, "ep": ep, "mode": mode,
        # the token predictor that ran (tp): a plan with Algorithm 3 tables only runs alg3 whatever is asked
        "predictor": (None if semantic is None or mode != "tp" else
                      "alg3" if semantic.token_logq is None else str(d["planner"].get("predictor", "combined"))),
        **lar_report(held_out, plans[name], token_rank, even, ep),
        "solve_seconds": solve, "variability": variability,
        **gem_scores(plans, name, train_loads, test_loads, curves),
        "gem_method": str(d["planner"].get("method", "robust")) if name == "gem" else "robust",
        "plan": plan_source if name == "semantic" else None,
        # held-out sequences the semantic plan was trained on (by content; null: the plan file does not say)
        "in_sample_sequences": None if in_sample is None else int(in_sample.sum()),
        "dp_schedule": dp_schedule(d["planner"]) if name == "semantic" and mode == "dp" else None,
        "num_layers": trace.num_layers, "num_experts": trace.num_experts, "top_k": trace.top_k,
        "vocab_size": trace.vocab_size, "held_out_tokens": held_out.num_tokens,
        "held_out_sequences": held_out.num_sequences, "train_steps": int(train_loads.shape[1]),
        "held_out_steps": int(test_loads.shape[1]), "tokens_per_step": tps, "train_fraction": frac,
        "seed": int(d["seed"]), "trace": tc.get("path") or "synthetic",
        "config": recorded_config(d),
        "command": invocation(),  # argv and Hydra overrides (the run dir holds no .hydra/)
        # versions, commit, date, host, input files with their sha256 (each read by now: a missing one failed)
        "provenance": provenance(read_inputs(d, name, plan_source)),
    }
    report["max_ratio_exceeded"] = mode == "dp" and max(report["tokens_per_rank"]) > DP_MAX_RATIO * (
        sum(report["tokens_per_rank"]) / ep) + 1e-9
    report["max_rank_rows"] = max_rank_rows(plans, (train_loads, test_loads), ep)
    report["curves_sampled_up_to"] = curves.sampled_up_to
    report["warnings"] = run_warnings(report)
    for warning in report["warnings"]:
        warn(warning)
    write_outputs(d["run_dir"], report, plans, name, token_rank, even, held_out, curves, semantic,
                  plot=flag(d, "plot", True))
    return report


def recorded_config(d: dict) -> dict:
    """The resolved config for the report, without the synthetic trace's shape when a trace file was
    planned (its shape is the report's ``num_layers``, ``num_experts``, ...)."""
    out = {k: v for k, v in d.items() if k != "run_dir"}
    if d["trace"].get("path"):
        out["trace"] = {k: v for k, v in d["trace"].items() if k not in SYNTHETIC_KEYS}
    return out


def write_outputs(out_dir: str, report: dict, plans: dict, name: str, token_rank: np.ndarray, even: np.ndarray,
                  held_out, curves, semantic, plot: bool = True) -> None:
    """All files of a run, all or nothing (``report.json`` last). ``plans``: ``{planner: expert_rank [L, E]}``,
    ``name`` the chosen one (``expert_rank`` in ``assignment.npz``; every one as ``expert_rank_<planner>``)."""
    every = {f"expert_rank_{p}": np.asarray(er, dtype=np.int64) for p, er in plans.items()}

    def assignment(path: Path) -> None:
        with open(path, "wb") as f:  # compressed: token_rank is T x L and mostly repeats
            np.savez_compressed(f, expert_rank=np.asarray(plans[name], dtype=np.int64), **every, token_rank=token_rank,
                     token_rank_linear=np.asarray(even, dtype=np.int64), seq_offsets=held_out.seq_offsets, num_ranks=np.int64(report["ep"]),
                     tokens_per_step=np.int64(report["tokens_per_step"]),
                     train_fraction=np.float64(report["train_fraction"]), mode=np.str_(report["mode"]),
                     format_version=np.int64(ASSIGNMENT_FORMAT))

    writers = {"assignment.npz": assignment, "curves.npz": curves.save}
    if plot:
        writers["plan.png"] = lambda path: plot_plan(report, path)
    if semantic is not None:
        writers["plan.npz"] = semantic.save
    writers["report.json"] = lambda path: write_json(path, report)
    commit_files(out_dir, writers, stale=OUTPUTS, optional=("plan.png",))


#: the config groups of conf/ this recipe reads (--help lists these)
CONFIG_GROUPS = ("planner", "variability")
#: config keys whose sub-keys the code reading them checks (refuse_unread_overrides lets them pass)
OPEN_KEYS = ("variability",)


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refuse_unread_overrides("plan.py", "plan", CONFIG_GROUPS, OPEN_KEYS, cfg=cfg)
    d = to_dict(cfg)
    require_keys(d, "plan.py", ("parallel", "planner", "seed", "trace"))
    refuse_empty_paths(d)
    normalize_flags(d, ("progress", "plot", "trace.synthetic"))
    merge_curves_path(d)  # variability.curves.path (serve.py's spelling) means curves.path here
    for key in ("trace", "curves", "plan"):
        if (d.get(key) or {}).get("path"):
            d[key]["path"] = absolute_path(d[key]["path"])
    if (d.get("planner") or {}).get("embeddings"):
        d["planner"]["embeddings"] = absolute_path(d["planner"]["embeddings"])
    d["run_dir"] = claim_run_dir("plan.py")
    rep = run(d)
    name = rep["planner"]
    # where another planner was chosen, the GEM planner's placement is scored too: a reference
    # (the "vs" rows are the report's relative reductions of the score, 1 - ours / theirs; the a2a row a ratio)
    gem = [] if name == "gem" else [("score gem, reference (s)", rep["score_gem"]),
                                    ("gem score reduction vs linear, reference", rep["gem_vs_linear"]),
                                    ("gem score reduction vs eplb, reference", rep["gem_vs_eplb"])]
    scores = [(f"score {name} (s)", rep["score"])] + [(f"score {p} (s)", rep[f"score_{p}"])
                                                      for p in ("linear", "eplb") if p != name]
    reductions = [(f"{name} score reduction vs {p}", rep[f"vs_{p}"]) for p in ("linear", "eplb") if p != name]
    print_table([("planner", name), ("ep", rep["ep"]), ("mode", rep["mode"]),
                 ("held-out tokens", rep["held_out_tokens"]), ("lar", rep["lar"]), ("lar linear", rep["lar_linear"]),
                 ("token imbalance", rep["token_imbalance"]), ("expert imbalance", rep["expert_imbalance"]),
                 ("a2a bytes / linear's", rep["a2a_bytes_ratio"]), *scores, *reductions, *gem,
                 ("solve seconds", rep["solve_seconds"])],
                title=f"plan: planner={rep['planner']} ep={rep['ep']} mode={rep['mode']} variability={rep['variability']}")
    print(f"report: {os.path.join(d['run_dir'], 'report.json')}")


if __name__ == "__main__":
    run_recipe(main)
