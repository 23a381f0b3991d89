#!/usr/bin/env python
"""Offline expert placement from a routing trace, evaluated on held-out steps (DESIGN.md §6).

The trace's first ``floor(trace.train_fraction * S)`` sequences train the planner, the rest are
held out. Steps are ``trace.tokens_per_step`` consecutive tokens of each part in file order; the
rows of a rank in a step are the (token, expert) activations of its experts. Every layer is
planned on its own (tqdm bar over layers) with ``planner=linear|eplb|gem``; GEM uses the latency
curves of ``variability=high|moderate|low|none`` (synthetic) or ``curves.path=FILE`` (measured,
``recipes/profile.py``).

Writes into the Hydra run dir (``hydra.run.dir=...``):

* ``report.json``: ``score`` (the chosen planner's held-out score, seconds summed over steps and
  layers), ``score_linear``, ``score_eplb``, ``score_gem`` (held out, same curves),
  ``gem_vs_linear`` / ``gem_vs_eplb`` (relative reductions of the GEM score: 0.08 = 8 % lower),
  ``vs_linear`` / ``vs_eplb`` (the same for the chosen planner), the train-step scores
  (``train_score*``), ``solve_seconds`` (chosen planner, all layers), ``planner``, ``ep``,
  ``variability``, per-layer scores and the config;
* ``assignment.npz``: ``expert_rank [L, E]`` int64 (the placement), ``num_ranks``,
  ``tokens_per_step``, ``train_fraction``;
* ``curves.npz``: the latency curves used (:meth:`LatencyCurves.load` reads it).

Anyone can recompute ``score``::

    train, held_out = load_trace(TRACE).split(train_fraction)
    evaluate(held_out, np.load("assignment.npz")["expert_rank"], LatencyCurves.load("curves.npz"), tokens_per_step)

Usage::

    python recipes/plan.py                                   # synthetic trace, GEM, EP4, variability=high
    python recipes/plan.py planner=gem parallel.ep=4 variability=high trace.path=trace.npz
    python recipes/plan.py planner=eplb parallel.ep=8 trace.path=trace.npz hydra.run.dir=/tmp/plan
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from _common import print_table, run_dir, to_dict, write_json  # noqa: E402

PLANNERS = ("linear", "eplb", "gem")


def load_plan_trace(d: dict):
    """The routing trace: ``trace.path``, else a synthetic one of the configured shape."""
    from moelayers.trace import load_trace, synthetic_trace

    tc = d["trace"]
    if tc.get("path"):
        return load_trace(tc["path"])
    if not tc.get("synthetic", False):
        raise ValueError("plan.py needs trace.path=FILE (or trace.synthetic=true)")
    seq_len = tc.get("seq_len", [256, 2048])
    seq_len = tuple(int(v) for v in seq_len) if isinstance(seq_len, (list, tuple)) else int(seq_len)
    return synthetic_trace(int(tc["num_sequences"]), int(tc["num_layers"]), int(tc["num_experts"]), int(tc["top_k"]),
                           int(tc["vocab_size"]), seq_len=seq_len, seed=int(d["seed"]))


def load_curves(d: dict, num_ranks: int):
    """Latency curves: ``curves.path`` if set, else the ``variability`` preset; checked for ``num_ranks``."""
    from moelayers.planning.gem import LatencyCurves

    path = (d.get("curves") or {}).get("path")
    curves = LatencyCurves.load(path) if path else LatencyCurves.preset(str(d["variability"]["name"]), num_ranks)
    curves.check_ranks(num_ranks)
    return curves, (f"file:{path}" if path else str(d["variability"]["name"]))


def plan_layer(name: str, loads, curves, num_ranks: int, d: dict):
    """``expert_rank [E]`` of one layer from its train loads ``[steps, E]``."""
    from moelayers.planning.eplb import plan_eplb
    from moelayers.planning.gem import plan_gem, plan_linear

    if name == "linear":
        return plan_linear(loads.shape[1], num_ranks)
    if name == "eplb":
        return plan_eplb(loads, num_ranks)
    p = d["planner"] if d["planner"]["name"] == "gem" else {}
    return plan_gem(loads, curves, restarts=int(p.get("restarts", 8)), seed=int(d["seed"]),
                    method=str(p.get("method", "robust")))


def plan_all(name: str, train_loads, curves, num_ranks: int, d: dict, *, bar: bool) -> tuple[np.ndarray, float]:
    """Plan every layer: ``train_loads [L, steps, E]`` -> (``expert_rank [L, E]``, seconds)."""
    layers = range(train_loads.shape[0])
    if bar:
        from tqdm import tqdm

        layers = tqdm(layers, desc=f"plan {name} ep{num_ranks}", unit="layer", file=sys.stderr)
    t0 = time.perf_counter()
    out = np.stack([plan_layer(name, train_loads[i], curves, num_ranks, d) for i in layers]).astype(np.int64)
    return out, time.perf_counter() - t0


def run(d: dict) -> dict:
    """Plan, evaluate, write report.json / assignment.npz / curves.npz into ``d['run_dir']``."""
    from moelayers.planning.gem import score_layers
    from moelayers.planning.steps import trace_step_loads

    name = str(d["planner"]["name"])
    if name not in PLANNERS:
        raise ValueError(f"planner must be one of {list(PLANNERS)}, got {name!r}")
    ep = int(d["parallel"]["ep"])
    if ep < 1:
        raise ValueError(f"parallel.ep must be >= 1, got {ep}")
    tc = d["trace"]
    tps, frac = int(tc.get("tokens_per_step", 2048)), float(tc.get("train_fraction", 0.5))
    trace = load_plan_trace(d)
    if trace.num_experts % ep:
        raise ValueError(f"num_experts ({trace.num_experts}) must be divisible by parallel.ep ({ep})")
    curves, variability = load_curves(d, ep)
    train, held_out = trace.split(frac)
    train_loads, test_loads = trace_step_loads(train, tps), trace_step_loads(held_out, tps)

    bar = bool(d.get("progress", True))
    plans, solve = {}, 0.0
    for planner in (name, *[p for p in PLANNERS if p != name]):  # the chosen one first (and timed)
        plans[planner], seconds = plan_all(planner, train_loads, curves, ep, d, bar=bar and planner == name)
        solve = seconds if planner == name else solve
    per_layer = {p: score_layers(er, test_loads, curves) for p, er in plans.items()}
    held = {p: float(v.sum()) for p, v in per_layer.items()}
    train_scores = {p: float(score_layers(er, train_loads, curves).sum()) for p, er in plans.items()}

    out_dir = d["run_dir"]
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, "assignment.npz"), expert_rank=plans[name], num_ranks=np.int64(ep),
             tokens_per_step=np.int64(tps), train_fraction=np.float64(frac))
    curves.save(os.path.join(out_dir, "curves.npz"))

    def reduction(a: float, b: float) -> float:
        return 1.0 - a / b if b > 0 else 0.0

    report = {
        "planner": name, "ep": ep, "variability": variability,
        "score": held[name], "score_linear": held["linear"], "score_eplb": held["eplb"], "score_gem": held["gem"],
        "gem_vs_linear": reduction(held["gem"], held["linear"]), "gem_vs_eplb": reduction(held["gem"], held["eplb"]),
        "vs_linear": reduction(held[name], held["linear"]), "vs_eplb": reduction(held[name], held["eplb"]),
        "train_score": train_scores[name], "train_score_linear": train_scores["linear"],
        "train_score_eplb": train_scores["eplb"], "train_score_gem": train_scores["gem"],
        "train_gem_vs_linear": reduction(train_scores["gem"], train_scores["linear"]),
        "solve_seconds": solve,
        "gem_method": str(d["planner"].get("method", "robust")) if name == "gem" else "robust",
        "num_layers": trace.num_layers, "num_experts": trace.num_experts, "top_k": trace.top_k,
        "train_steps": int(train_loads.shape[1]), "held_out_steps": int(test_loads.shape[1]),
        "tokens_per_step": tps, "train_fraction": frac, "seed": int(d["seed"]),
        "trace": tc.get("path") or "synthetic",
        "per_layer": {p: v.tolist() for p, v in per_layer.items()},
        "config": {k: v for k, v in d.items() if k != "run_dir"},
    }
    write_json(os.path.join(out_dir, "report.json"), report)
    return report


@hydra.main(config_path="../conf", config_name="plan", version_base="1.3")
def main(cfg: DictConfig) -> None:
    d = to_dict(cfg)
    for key in ("trace", "curves"):
        if (d.get(key) or {}).get("path"):
            d[key]["path"] = hydra.utils.to_absolute_path(d[key]["path"])
    d["run_dir"] = run_dir()
    rep = run(d)
    print_table([("planner", rep["planner"]), ("ep", rep["ep"]), ("variability", rep["variability"]),
                 ("held-out steps", rep["held_out_steps"]), ("score (s)", rep["score"]),
                 ("score linear (s)", rep["score_linear"]), ("score eplb (s)", rep["score_eplb"]),
                 ("score gem (s)", rep["score_gem"]), ("gem vs linear", rep["gem_vs_linear"]),
                 ("gem vs eplb", rep["gem_vs_eplb"]), ("train: gem vs linear", rep["train_gem_vs_linear"]),
                 ("solve seconds", rep["solve_seconds"])],
                title=f"plan: planner={rep['planner']} ep={rep['ep']} variability={rep['variability']}")
    print(f"report: {os.path.join(d['run_dir'], 'report.json')}")


if __name__ == "__main__":
    main()
