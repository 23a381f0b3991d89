#!/usr/bin/env python
"""Held-out yardstick for GEM placement: how well do placements fitted on train steps generalise?

For each routing trace (a file, or synthetic *regimes* of different load skew, topic drift and
sequence length) and each setting (EP4 ``high``, EP4 ``low``, EP8 ``high`` by default), the first
half of the sequences trains and the second half is held out, as in ``recipes/plan.py``. Every
layer is planned with

* ``linear`` and ``eplb`` (fitted on the train steps): the references;
* ``plain``: ``plan_gem(method="plain")`` fitted on the train steps (the paper's algorithm);
* ``robust``: ``plan_gem(method="robust")`` fitted on the train steps;
* ``oracle``: ``plan_gem(method="plain")`` fitted on the *held-out* steps themselves (an
  in-sample upper reference that no planner seeing only train steps can be expected to reach);

and scored on the held-out steps. The table reports ``vs_linear`` / ``vs_eplb``: relative score
reductions (0.061 = 6.1 % below), summed over layers, plus ``capture`` = the method's gain vs EPLB
as a share of the oracle's, and planning seconds.

The regimes (26 layers, 64 experts, top-6, see ``REGIMES``) vary the load skew (``olmoe``: the
generator's OLMoE calibration, max/mean ~ 5; ``flat*``: ``expert_skew = 0.3``, max/mean ~ 1.8, as
a load-balanced router), how bursty steps are (topic and per-sequence preferences), sequence
length (``*_short``: 32-256 tokens, ``flat_long``: 2k-8k), trace length (``flat_mixed_small``: 12
train steps), repetitive sequences (``flat_spiky``) and drift between the halves (``flat_trend``,
``*_drift``). ``flat_mixed`` is the closest stand-in for the DeepSeek-V2-Lite traces: its plain
and oracle numbers are near the real ones (EP4 high: plain ~6.1 % / 4.9 %, oracle ~8.4 % / 7.2 %).

Usage::

    OMP_NUM_THREADS=1 python tools/gem_yardstick.py                         # all synthetic regimes
    OMP_NUM_THREADS=1 python tools/gem_yardstick.py --regimes flat --layers 8
    OMP_NUM_THREADS=1 python tools/gem_yardstick.py --trace trace.npz --settings ep4-high ep8-high
    OMP_NUM_THREADS=1 python tools/gem_yardstick.py --regimes flat_mixed --seeds 0 1 2  # averaged over seeds
    OMP_NUM_THREADS=1 python tools/gem_yardstick.py --regimes flat --opt scenarios=256    # robust options

Synthetic traces are cached under ``--cache`` (default ``/tmp/gem_yardstick``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moelayers.planning.eplb import plan_eplb  # noqa: E402
from moelayers.planning.gem import LatencyCurves, plan_gem, plan_linear, score_layers  # noqa: E402
from moelayers.planning.steps import MIN_STEPS, trace_step_loads  # noqa: E402
from moelayers.trace import RoutingTrace, load_trace, synthetic_trace  # noqa: E402
from _args import nonnegative_int, positive_int  # noqa: E402  (tools/ is the script's directory)
from _trace_cache import cached_trace  # noqa: E402

SETTINGS = {"ep4-high": (4, "high"), "ep4-low": (4, "low"), "ep8-high": (8, "high"),
            "ep8-low": (8, "low"), "ep4-moderate": (4, "moderate")}
METHODS = ("plain", "robust", "oracle")
#: the regimes' trace shape: layers, experts, top-k, vocabulary
SHAPE = (26, 64, 6, 32000)

# name -> (synthetic_trace keyword arguments, sequence order):
# "split"  file order (topics interleave: sequence s has topic s % num_topics);
# "trend"  sequences sorted by topic + noise: the topic mix drifts along the file and the held-out
#          half is closest to the end of the train half;
# "spiky"  file order, and 8 % of the sequences made repetitive (see with_repetitive_sequences);
# "drift"  topics 0-1 only in the train half, 6-7 only in the held-out half (2-5 shared): the
#          held-out steps come partly from topics never seen in training.
REGIMES: dict[str, tuple[dict, str]] = {
    "olmoe": (dict(num_sequences=100), "split"),                                  # defaults: max/mean ~ 5
    "flat": (dict(num_sequences=100, expert_skew=0.3), "split"),                  # balanced-router loads
    "flat_short": (dict(num_sequences=800, seq_len=(32, 256), expert_skew=0.3), "split"),
    "flat_drift": (dict(num_sequences=192, num_topics=8, expert_skew=0.3), "drift"),
    "flat_bursty": (dict(num_sequences=100, expert_skew=0.3, topic_scale=1.0, sequence_scale=0.7), "split"),
    "flat_mixed": (dict(num_sequences=100, expert_skew=0.3, topic_scale=0.4, sequence_scale=0.35), "split"),
    "flat_long": (dict(num_sequences=32, seq_len=(2048, 8192), expert_skew=0.3, topic_scale=0.4, sequence_scale=0.35),
                  "split"),
    "flat_trend": (dict(num_sequences=120, expert_skew=0.3, topic_scale=0.4, sequence_scale=0.35), "trend"),
    "flat_spiky": (dict(num_sequences=100, expert_skew=0.3, topic_scale=0.4, sequence_scale=0.35), "spiky"),
    "flat_mixed_small": (dict(num_sequences=40, expert_skew=0.3, topic_scale=0.4, sequence_scale=0.35), "split"),
    "olmoe_short": (dict(num_sequences=800, seq_len=(32, 256)), "split"),
    "mid_drift": (dict(num_sequences=192, num_topics=8, expert_skew=1.0, seq_len=(64, 1024)), "drift"),
}


def with_repetitive_sequences(trace: RoutingTrace, rng: np.random.Generator, share: float = 0.08,
                               stick: float = 0.7) -> RoutingTrace:
    """A ``share`` of the sequences made repetitive (like a repeated token or a long list): in each
    layer, each of their tokens takes one fixed random top-k set (chosen per sequence and layer)
    with probability ``stick`` instead of its own routing. Their steps burst on a few experts that
    other sequences do not share."""
    ids = trace.topk_ids.copy()
    num_l, k = ids.shape[1], ids.shape[2]
    for s in np.flatnonzero(rng.random(trace.num_sequences) < share):
        sl = trace.sequence_slice(int(s))
        for layer in range(num_l):
            fixed = rng.choice(trace.num_experts, size=k, replace=False)
            hit = rng.random(sl.stop - sl.start) < stick
            ids[sl.start:sl.stop, layer][hit] = fixed
    return RoutingTrace(ids, trace.token_ids, trace.seq_offsets, trace.num_experts, vocab_size=trace.vocab_size)


def regime_trace(name: str, cache: Path, seed: int = 0) -> tuple[RoutingTrace, RoutingTrace]:
    """``(train, held_out)`` traces of a synthetic regime (26 layers, 64 experts, top-6)."""
    kwargs, order = REGIMES[name]

    def make() -> RoutingTrace:
        kw = dict(kwargs)
        return synthetic_trace(kw.pop("num_sequences"), *SHAPE, seed=seed, **kw)

    trace = cached_trace(cache, f"{name}_s{seed}", {"regime": kwargs, "seed": seed, "shape": SHAPE}, make)
    if order == "spiky":
        trace = with_repetitive_sequences(trace, np.random.default_rng(seed + 1000))
    if order in ("split", "spiky"):
        return trace.split(0.5)
    if order == "trend":  # the topic mix drifts along the file: sort by topic + noise
        topic = np.arange(trace.num_sequences) % kwargs.get("num_topics", 4)
        key = topic + 1.5 * np.random.default_rng(seed).standard_normal(topic.size)
        return trace.select_sequences(np.argsort(key, kind="stable")).split(0.5)
    topic = np.arange(trace.num_sequences) % kwargs["num_topics"]
    shared = np.flatnonzero((topic >= 2) & (topic <= 5))
    train = np.concatenate([np.flatnonzero(topic <= 1), shared[::2]])
    held = np.concatenate([np.flatnonzero(topic >= 6), shared[1::2]])
    rng = np.random.default_rng(seed)
    return trace.select_sequences(rng.permutation(train)), trace.select_sequences(rng.permutation(held))


def plan_layers(method: str, fit: np.ndarray, curves: LatencyCurves, options: dict,
                seed: int) -> tuple[np.ndarray, float]:
    """Plan every layer of ``fit [L, steps, E]``; returns ``(expert_rank [L, E], seconds)``."""
    num_r = curves.num_ranks
    t0 = time.perf_counter()
    if method == "linear":
        out = [plan_linear(fit.shape[2], num_r) for _ in range(fit.shape[0])]
    elif method == "eplb":
        out = [plan_eplb(x, num_r) for x in fit]
    else:
        gem_method = "plain" if method == "oracle" else method
        opts = options if method == "robust" else {}
        out = [plan_gem(x, curves, seed=seed, method=gem_method, **opts) for x in fit]
    return np.stack(out).astype(np.int64), time.perf_counter() - t0


def evaluate_setting(train: np.ndarray, held: np.ndarray, num_ranks: int, variability: str,
                     methods: tuple[str, ...], options: dict, seed: int = 0) -> dict:
    """Held-out reductions of every method for one setting.

    Args:
        train: ``[L, steps, E]`` train-step loads.
        held: ``[L, steps', E]`` held-out step loads.
        num_ranks: ``R``.
        variability: curve preset.
        methods: subset of ``plain``, ``robust``, ``oracle``.
        options: keyword options for ``plan_gem(method="robust")``.

    Returns:
        ``{method: {"vs_linear", "vs_eplb", "seconds", "train_vs_linear"}}`` (plus ``oracle``'s).
    """
    curves = LatencyCurves.preset(variability, num_ranks)
    plans, secs = {}, {}
    for m in ("linear", "eplb", *methods):
        plans[m], secs[m] = plan_layers(m, held if m == "oracle" else train, curves, options, seed)
    held_score = {m: float(score_layers(er, held, curves).sum()) for m, er in plans.items()}
    train_score = {m: float(score_layers(er, train, curves).sum()) for m, er in plans.items()}
    out = {}
    for m in methods:
        out[m] = {"vs_linear": 1 - held_score[m] / held_score["linear"],
                  "vs_eplb": 1 - held_score[m] / held_score["eplb"],
                  "train_vs_linear": 1 - train_score[m] / train_score["linear"],
                  "seconds": secs[m]}
    if "oracle" in methods and "robust" in methods and out["oracle"]["vs_eplb"] > 0:
        out["robust"]["capture"] = out["robust"]["vs_eplb"] / out["oracle"]["vs_eplb"]
    if "oracle" in methods and "plain" in methods and out["oracle"]["vs_eplb"] > 0:
        out["plain"]["capture"] = out["plain"]["vs_eplb"] / out["oracle"]["vs_eplb"]
    return out


#: the robust search's options (``moelayers.planning.gem_search.search``) that ``--opt`` may set
OPTIONS = ("noise", "min_gain", "scenarios", "restarts")


def _parse_options(items: list[str]) -> dict:
    opts = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in OPTIONS:
            raise SystemExit(f"--opt {item!r}: unknown option {key!r}; the robust search takes {', '.join(OPTIONS)}")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def _print_rows(setting: str, res: dict) -> None:
    for m, r in res.items():
        cap = f"{r['capture']:.2f}" if "capture" in r else ""
        print(f"{setting:<10} {m:<7} {100 * r['vs_linear']:8.2f}% {100 * r['vs_eplb']:7.2f}% "
              f"{100 * r['train_vs_linear']:11.2f}% {cap:>8} {r['seconds']:8.2f}", flush=True)


def _mean_results(runs: list[dict]) -> dict:
    """Average ``{method: {key: value}}`` over runs (seeds); a key that some runs lack (``capture``)
    is averaged over the runs that have it."""
    keys = {m: dict.fromkeys(k for run in runs for k in run[m]) for m in runs[0]}
    return {m: {k: float(np.mean([run[m][k] for run in runs if k in run[m]])) for k in keys[m]} for m in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", help="routing trace npz (instead of the synthetic regimes)")
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--settings", nargs="+", default=["ep4-high", "ep4-low", "ep8-high"], choices=list(SETTINGS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--layers", type=nonnegative_int, default=0, help="plan only this many evenly spaced layers (0: all)")
    ap.add_argument("--tokens-per-step", type=positive_int, default=2048)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="synthetic trace seeds (results averaged)")
    ap.add_argument("--cache", default="/tmp/gem_yardstick")
    ap.add_argument("--opt", nargs="*", default=[],
                    help=f"robust search options key=value (JSON values); keys: {', '.join(OPTIONS)}")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.trace and not Path(args.trace).is_file():
        ap.error(f"--trace {args.trace} does not exist")
    if args.trace and any(a == "--seeds" or a.startswith("--seeds=") for a in sys.argv[1:]):
        ap.error("--seeds draws synthetic traces; with --trace the one trace is evaluated once")
    options = _parse_options(args.opt)

    names = [Path(args.trace).name] if args.trace else args.regimes
    seeds = [0] if args.trace else args.seeds
    results = {}
    for name in names:
        runs = {setting: [] for setting in args.settings}
        for seed in seeds:
            if args.trace:
                train_t, held_t = load_trace(args.trace).split(0.5)
            else:
                train_t, held_t = regime_trace(name, Path(args.cache), seed)
            train = trace_step_loads(train_t, args.tokens_per_step)
            held = trace_step_loads(held_t, args.tokens_per_step)
            if args.layers:
                pick = np.unique(np.linspace(0, train.shape[0] - 1, args.layers).round().astype(int))
                train, held = train[pick], held[pick]
            loads = train.sum(axis=1)
            skew = float((loads.max(axis=1) / loads.mean(axis=1)).mean())
            if min(train.shape[1], held.shape[1]) < MIN_STEPS:
                print(f"warning: {train.shape[1]} train and {held.shape[1]} held-out steps of {args.tokens_per_step} "
                      f"tokens (fewer than plan.py's minimum of {MIN_STEPS}): these figures rest on too few steps")
            print(f"\n== {name} (seed {seed}): train {train.shape[1]} steps, held-out {held.shape[1]} steps, "
                  f"{train.shape[0]} layers, load max/mean {skew:.2f}")
            print(f"{'setting':<10} {'method':<7} {'vs_linear':>9} {'vs_eplb':>8} {'train_vs_lin':>12} "
                  f"{'capture':>8} {'seconds':>8}")
            for setting in args.settings:
                num_r, var = SETTINGS[setting]
                runs[setting].append(evaluate_setting(train, held, num_r, var, tuple(args.methods), options))
                _print_rows(setting, runs[setting][-1])
        results[name] = {setting: _mean_results(r) for setting, r in runs.items()}
        if len(seeds) > 1:
            print(f"\n== {name}: mean over seeds {seeds}")
            for setting, res in results[name].items():
                _print_rows(setting, res)
    if args.json:
        Path(args.json).write_text(json.dumps({"options": options, "seeds": seeds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
