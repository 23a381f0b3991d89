"""Yardstick for the semantic planner: held-out LAR against a plain greedy co-clustering, over regimes.

The baseline ("plain per-layer greedy co-clustering with equal chunks") is deliberately simple and
lives here, not in the library: per layer, from the training trace's token→expert counts
``T [U, E]``, alternate

* tokens → the rank holding most of their profiled activations (no capacity), and
* experts → ranks greedily: (expert, rank) pairs by decreasing affinity (the activations of the
  tokens on that rank), each taken if the expert is free and the rank has a slot (``E / R`` each)
  and load room (``slack`` × mean),

from a linear start and a few seeded random ones (best in-sample local share kept), until stable.
Online, a token goes to its profiled rank (unseen tokens: the layer's busiest rank); in every batch
of ``tokens_per_step`` each rank takes exactly its share, most confident first, the overflow to
ranks with room (the library's ``evaluate_tp(predictor='alg3')`` with an empty n-gram does
exactly that).

Regimes are synthetic traces (``moelayers.trace.synthetic_trace`` with knobs turned one at a time,
26 layers x 64 experts x top-6, like DeepSeek-V2-Lite) and traces recorded from the random-weight
tiny decoder. Traces are generated once and cached (``--cache``); their sequences are shuffled
(seeded) before the 50/50 split.

Usage::

    OMP_NUM_THREADS=1 python tools/semantic_yardstick.py                   # every regime
    OMP_NUM_THREADS=1 python tools/semantic_yardstick.py --regimes default flat --cases tp4
    PYTHONPATH=/tmp/orig python tools/semantic_yardstick.py ...            # another moelayers tree
    python tools/semantic_yardstick.py --summarize before.jsonl after.jsonl  # markdown table
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import numpy as np

from moelayers.planning.semantic import SemanticPlan, build_token_table
from moelayers.planning.semantic_eval import evaluate, evaluate_tp
from moelayers.planning.semantic_solvers import plan_semantic
from moelayers.trace import RoutingTrace, synthetic_trace

from _trace_cache import cached_trace  # tools/ is the script's directory

LAYERS, EXPERTS, TOP_K, VOCAB = 26, 64, 6, 102400
REGIMES: dict[str, dict] = {
    "default": {},
    "token+": dict(token_scale=(1.9, 2.0, 3.0), cluster_scale=(2.1, 4.1, 6.6)),  # stronger token determinism
    "token-": dict(token_scale=(0.8, 0.8, 1.2), cluster_scale=(0.8, 1.6, 2.6)),  # weaker
    "carry97": dict(crosslayer_carry=0.97),  # strong cross-layer correlation
    "carry60": dict(crosslayer_carry=0.6),  # weak
    "flat": dict(expert_skew=0.3),  # load-balanced router (DeepSeek-V2-Lite-like loads)
    "short": dict(num_sequences=2400, seq_len=(32, 256)),  # short single-turn prompts
    "long": dict(num_sequences=200, seq_len=(512, 2048)),
    "dsv2": dict(num_sequences=2400, seq_len=(32, 256), expert_skew=0.3, crosslayer_carry=0.95),
    "tiny": dict(tiny=dict(init_std=0.5)),  # random tiny decoder: context mixing dominates, token ids weak
    "tiny-res": dict(tiny=dict(init_std=0.05, embed_std=1.0)),  # embedding-dominated residual stream
}
CASES = {"tp4": ("tp", 4, {}), "tp8": ("tp", 8, {}), "dp4": ("dp", 4, {}),
         "dp4-cap": ("dp", 4, {"mask": False}),  # dp scheduled by the 1.3 x mean cap alone (no rank mask)
         "dp4-joint": ("dp", 4, {"joint": True}),  # each mask cycle's requests assigned together
         "dp8-joint": ("dp", 8, {"joint": True})}


# ------------------------------------------------------------------------------------ traces
def make_trace(name: str, cache: Path) -> RoutingTrace:
    """The regime's trace, from ``cache`` or generated (and written there)."""
    def make() -> RoutingTrace:
        kw = dict(REGIMES[name])
        if "tiny" in kw:
            return tiny_model_trace(**kw["tiny"])
        num_s = kw.pop("num_sequences", 1000)
        seq_len = kw.pop("seq_len", (64, 512))
        return synthetic_trace(num_s, LAYERS, EXPERTS, TOP_K, VOCAB, seq_len=seq_len, seed=1, **kw)

    return cached_trace(cache, name, {"regime": REGIMES[name], "shape": (LAYERS, EXPERTS, TOP_K, VOCAB)}, make)


def tiny_model_trace(num_sequences: int = 600, seed: int = 0, *, init_std: float = 0.5,
                     embed_std: float | None = None) -> RoutingTrace:
    """Routing of the random-weight tiny decoder (26 MoE blocks, 64 experts, top-6) on Zipf token
    ids (the synthetic generator's token law, 32-256 tokens per prompt), one forward per prompt.

    ``init_std``: std of every weight (attention, experts, router, embedding); ``embed_std``: the
    embedding's instead (large against small layer outputs: the residual stream drifts slowly)."""
    import torch

    import moelayers as ml
    from moelayers.models import TinyConfig, TinyDecoder
    from moelayers.trace import TraceRecorder

    ids = synthetic_trace(num_sequences, 1, EXPERTS, TOP_K, 20000, seq_len=(32, 256), seed=seed)
    cfg = TinyConfig(vocab_size=20000, hidden_size=64, num_layers=LAYERS, num_heads=4, init_std=init_std)
    moe = ml.MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=EXPERTS, top_k=TOP_K, init_std=init_std)
    single = ml.ParallelGroups.single()
    model = TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, single, seed=100 + i), seed=seed)
    if embed_std is not None:
        with torch.no_grad():
            model.embed.weight.normal_(0.0, embed_std, generator=torch.Generator().manual_seed(seed))
    torch.set_num_threads(1)
    with torch.no_grad(), TraceRecorder(model, vocab_size=20000) as rec:
        for s in range(num_sequences):
            model(torch.as_tensor(ids.token_ids[ids.sequence_slice(s)])[None])
    return rec.result


# ------------------------------------------------------------------------------------ baseline
def _greedy_experts(aff: np.ndarray, load: np.ndarray, r: int, slack: float) -> np.ndarray:
    """Experts → ranks by decreasing ``aff [E, R]``: ``E / R`` slots and ``slack`` × mean load per rank."""
    num_e = aff.shape[0]
    per, cap = num_e // r, max(load.sum() / r * slack, load.max())
    er, cnt, rl = np.full(num_e, -1), np.zeros(r, int), np.zeros(r)
    for flat in np.argsort(-aff, axis=None, kind="stable"):
        e, c = divmod(int(flat), r)
        if er[e] < 0 and cnt[c] < per and rl[c] + load[e] <= cap:
            er[e], cnt[c], rl[c] = c, cnt[c] + 1, rl[c] + load[e]
    for e in np.flatnonzero(er < 0):  # nothing fits the load cap: the least loaded rank with a slot
        c = int(np.argmin(np.where(cnt < per, rl, np.inf)))
        er[e], cnt[c], rl[c] = c, cnt[c] + 1, rl[c] + load[e]
    return er


def plain_greedy_layer(counts: np.ndarray, r: int, rng: np.random.Generator, *, restarts: int = 3,
                       slack: float = 1.1, iters: int = 30) -> np.ndarray:
    """One layer's greedy co-clustering of ``counts [U, E]`` (profiled token→expert): ``expert_rank [E]``."""
    num_e = counts.shape[1]
    load = counts.sum(0).astype(np.float64)
    best, best_local = None, -1.0
    starts = [np.arange(num_e) // (num_e // r)] + [rng.permutation(np.arange(num_e) % r) for _ in range(restarts)]
    for er in starts:
        for _ in range(iters):
            tok = np.argmax(counts @ np.eye(r)[er], axis=1)
            aff = (np.eye(r)[tok].T @ counts).T  # [E, R]
            new = _greedy_experts(aff, load, r, slack)
            if (new == er).all():
                break
            er = new
        local = (counts @ np.eye(r)[er]).max(1).sum()
        if local > best_local:
            best, best_local = er, local
    return best


def plain_greedy_plan(train: RoutingTrace, r: int, seed: int = 0) -> SemanticPlan:
    """The baseline as a tp :class:`SemanticPlan` (token table only, empty n-gram)."""
    rng = np.random.default_rng(seed)
    num_l, v, num_e = train.num_layers, train.vocab_size, train.num_experts
    uniq, inv = np.unique(train.token_ids, return_inverse=True)
    er_all = np.empty((num_l, num_e), np.int64)
    token_rank = np.empty((num_l, v), np.int64)
    token_conf = np.zeros((num_l, v), np.float32)
    for l in range(num_l):
        table = build_token_table(inv, train.topk_ids[:, l], num_e, uniq.size)
        counts = table.dense().astype(np.float64)
        er = plain_greedy_layer(counts, r, rng)
        per_rank = counts @ np.eye(r)[er]
        er_all[l] = er
        token_rank[l] = int(np.argmax(np.bincount(er, weights=table.expert_load, minlength=r)))  # unseen
        token_rank[l, uniq] = np.argmax(per_rank, 1)
        token_conf[l, uniq] = per_rank.max(1) / per_rank.sum(1)
    zeros = np.zeros((num_l, r, r))
    return SemanticPlan(er_all, token_rank, token_conf, zeros.astype(np.int64), zeros.astype(np.float32), r, num_e, v,
                        "tp", solver="plain-greedy")


# ------------------------------------------------------------------------------------ runs
def run_case(train: RoutingTrace, held: RoutingTrace, mode: str, r: int, method: str, eval_kw: dict | None = None,
             **plan_kw) -> dict:
    """Plan on ``train`` with ``method`` ('ours' | 'greedy'), evaluate on ``held`` (``evaluate(**eval_kw)``):
    the report's numbers."""
    start = time.perf_counter()
    if method == "greedy":
        plan = plain_greedy_plan(train, r)
        solve = time.perf_counter() - start
        rep, _ = evaluate_tp(plan, held, predictor="alg3")
    else:
        plan = plan_semantic(train, r, mode, progress=False, **plan_kw)
        solve = time.perf_counter() - start
        rep, _ = evaluate(plan, held, **(eval_kw or {}))
    return {"lar": rep["lar"], "lar_linear": rep["lar_linear"], "expert_imbalance": rep["expert_imbalance"],
            "expert_imbalance_max": rep["expert_imbalance_max"], "token_imbalance": rep["token_imbalance"],
            "solve_seconds": solve}


def summarize(before: Path, after: Path) -> str:
    """Markdown table of two ``--json`` result files (before / after a change): per regime and case,
    the greedy baseline's LAR (from ``after``), ours before and after, the ratio after / greedy, and
    the expert imbalance (mean / max over layers) after."""
    rows: dict[tuple[str, str, str], dict] = {}
    for tag, path in (("before", before), ("after", after)):
        for line in path.read_text().splitlines():
            res = json.loads(line)
            rows[(res["regime"], res["case"], "greedy" if res["method"] == "greedy" else tag)] = res
    out = ["| regime | case | greedy | ours before | ours after | after / greedy | after eimb mean/max |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in REGIMES:
        for case in CASES:
            got = {m: rows.get((name, case, m)) for m in ("greedy", "before", "after")}
            if got["after"] is None:
                continue
            lar = {m: (f"{r['lar']:.3f}" if r else "-") for m, r in got.items()}
            ratio = f"{got['after']['lar'] / got['greedy']['lar']:.3f}" if got["greedy"] else "-"
            imb = f"{got['after']['expert_imbalance']:.2f}/{got['after']['expert_imbalance_max']:.2f}"
            out.append(f"| {name} | {case} | {lar['greedy']} | {lar['before']} | {lar['after']} | {ratio} | {imb} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--cases", nargs="+", default=["tp4", "tp8", "dp4"], choices=list(CASES))
    ap.add_argument("--methods", nargs="+", default=["greedy", "ours"], choices=["greedy", "ours"])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/sem_traces"))
    ap.add_argument("--plan-kw", default="{}", help="extra plan_semantic keywords, a JSON object")
    ap.add_argument("--json", type=Path, help="append one JSON line per result here")
    ap.add_argument("--summarize", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="print the markdown table of two --json files and exit")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(*args.summarize))
        return
    try:
        plan_kw = json.loads(args.plan_kw)
    except json.JSONDecodeError as e:
        ap.error(f"--plan-kw is not JSON: {e}")
    if not isinstance(plan_kw, dict):
        ap.error(f"--plan-kw must be a JSON object of plan_semantic keywords, got {args.plan_kw}")
    known = set(inspect.signature(plan_semantic).parameters) - {"train_trace", "ep", "mode", "progress"}
    if set(plan_kw) - known:  # before any trace is built
        ap.error(f"--plan-kw: plan_semantic takes no {sorted(set(plan_kw) - known)}; it takes {sorted(known)}")
    for name in args.regimes:
        trace = make_trace(name, args.cache)
        # the generator cycles topics (sequence s has topic s % 4): shuffle the order, as in a real
        # request log, so that Algorithm 2's rank mask cannot line up with the topics by accident
        trace = trace.select_sequences(np.random.default_rng(0).permutation(trace.num_sequences))
        train, held = trace.split(0.5)
        for case in args.cases:
            mode, r, eval_kw = CASES[case]
            for method in args.methods:
                if method == "greedy" and mode != "tp":
                    continue
                res = run_case(train, held, mode, r, method, eval_kw, **(plan_kw if method == "ours" else {}))
                res.update(regime=name, case=case, method=method, tokens=trace.num_tokens)
                print(f"{name:8s} {case} {method:6s} lar={res['lar']:.4f} (linear {res['lar_linear']:.3f}) "
                      f"eimb={res['expert_imbalance']:.3f}/{res['expert_imbalance_max']:.3f} "
                      f"timb={res['token_imbalance']:.3f} solve={res['solve_seconds']:.1f}s", flush=True)
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
