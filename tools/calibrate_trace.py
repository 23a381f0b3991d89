"""Calibration numbers for ``moelayers.trace_synthetic`` from real routing counts.

Usage::

    python tools/calibrate_trace.py [--counts DIR]      # real statistics -> the TARGET_* / MIXTRAL_* constants
    python tools/calibrate_trace.py --compare           # + statistics of the current generator defaults
    python tools/calibrate_trace.py --fit [--rounds N]  # + fit the generator defaults (about 10 minutes)

``DIR`` defaults to ``../shared/traces/olmoe_mixtral_counts`` beside the repository. The files
hold aggregated counts of OLMoE-1B-7B and Mixtral-8x7B on five text domains (102 x 2048 tokens
each), layers 0, 7 and 15 (see their PROVENANCE.txt). Nothing is copied into the repository: the
printed numbers are written into ``moelayers/trace_synthetic.py`` by hand.

The synthetic side mimics the measurement: a 16-layer, 64-expert, top-8 trace with vocab 50,280
and 2 topics of 102 x 2048 tokens; per-topic statistics stand in for per-domain ones and the
cross-topic token-table recall for the cross-domain one. ``--fit`` solves the token law, then
refines the routing knobs starting from the current defaults (Broyden, common random numbers);
the committed defaults are the end point of a few such runs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moelayers import trace_synthetic as ts  # noqa: E402
from moelayers.trace import RoutingTrace  # noqa: E402

DEFAULT_COUNTS = REPO.parent / "shared" / "traces" / "olmoe_mixtral_counts"
FILES = {"olmoe": "olmoe_routing_counts_layers0_7_15.npz", "mixtral": "mistral_routing_counts_layers0_7_15.npz"}
DOMAIN_TOKENS = 102 * 2048  # tokens per domain in the real data
SYN_SHAPE = dict(num_layers=16, num_experts=64, top_k=8, vocab_size=50280)  # OLMoE-1B-7B


@dataclass
class Stats:
    """Per-domain statistics averaged over domains (layers 0/7/15, pairs (0,7)/(7,15))."""

    zipf_exponent: float = float("nan")
    top_token_share: float = float("nan")
    distinct_tokens: float = float("nan")
    pair_union_ratio: float = float("nan")  # distinct ids of two domains together / mean of one, mean over pairs
    token_recall: np.ndarray = field(default_factory=lambda: np.full(3, np.nan))
    frequent_recall: np.ndarray = field(default_factory=lambda: np.full(3, np.nan))
    cross_domain_recall: np.ndarray = field(default_factory=lambda: np.full(3, np.nan))
    crosslayer_nmi: np.ndarray = field(default_factory=lambda: np.full(2, np.nan))
    load_max_mean: np.ndarray = field(default_factory=lambda: np.full(3, np.nan))
    load_cv: np.ndarray = field(default_factory=lambda: np.full(3, np.nan))

    def show(self, name: str) -> None:
        print(f"[{name}]")
        for key, value in self.__dict__.items():
            print(f"  {key:22s} {np.round(value, 4)}")


def frequent_cross_recall(tables: list[np.ndarray], top_k: int, min_count: int = ts.FREQUENT_MIN_COUNT) -> float:
    """Mean over ordered domain pairs (a, b), a != b, of the recall on b of a's top-k table.

    Only tokens seen at least ``min_count`` times in both domains count. ``tables`` are
    ``[V, E]`` (token id, expert) counts over one shared token axis.
    """
    out = []
    for a, train in enumerate(tables):
        for b, test in enumerate(tables):
            if a == b:
                continue
            rows = (train.sum(1) >= min_count * top_k) & (test.sum(1) >= min_count * top_k)
            out.append(ts.cross_table_recall(train[rows], test[rows], top_k))
    return float(np.mean(out))


def domain_token_stats(tables: list[list[np.ndarray]], top_k: int) -> dict:
    """Token statistics from ``tables[domain][layer]`` = ``[V, E]`` (token id, expert) counts."""
    freq = [t[0].sum(1) // top_k for t in tables]  # occurrences per token id
    distinct = [int((f > 0).sum()) for f in freq]
    pair_union = [((fa > 0) | (fb > 0)).sum() / ((distinct[a] + distinct[b]) / 2)
                  for a, fa in enumerate(freq) for b, fb in enumerate(freq) if a < b]
    recall, frequent = np.zeros((len(tables), 3)), np.zeros((len(tables), 3))
    for d, layers in enumerate(tables):
        rows = freq[d] >= ts.FREQUENT_MIN_COUNT
        for slot, table in enumerate(layers):
            seen = table[freq[d] > 0]
            recall[d, slot] = ts.table_recall(seen, top_k)
            frequent[d, slot] = ts.table_recall(table[rows], top_k)
    return dict(
        zipf_exponent=float(np.mean([ts.rank_frequency_exponent(f[f > 0]) for f in freq])),
        top_token_share=float(np.mean([f.max() / f.sum() for f in freq])),
        distinct_tokens=float(np.mean(distinct)),
        pair_union_ratio=float(np.mean(pair_union)),
        token_recall=recall.mean(0),
        frequent_recall=frequent.mean(0),
        cross_domain_recall=np.array([frequent_cross_recall([t[s] for t in tables], top_k) for s in range(3)]),
    )


def real_stats(path: Path) -> Stats:
    """Statistics of one converted counts file (DESIGN §5 calibration data)."""
    d = np.load(path, allow_pickle=False)
    top_k, num_e = int(d["top_k"]), int(d["num_experts"])
    skew = np.array([[ts.load_skew(c) for c in dom] for dom in d["expert_counts"]])  # [domain, layer, 2]
    nmi = np.array([[ts.normalized_mutual_information(j) for j in dom] for dom in d["crosslayer_counts"]])
    dom, slot, exp_, tok, cnt = (d[f"eid2token_{k}"] for k in ("domain", "layer_slot", "expert", "token_id", "count"))
    vocab = int(tok.max()) + 1
    tables = []
    for di in np.flatnonzero(d["eid2token_available"]):
        per_layer = []
        for s in range(3):
            m = (dom == di) & (slot == s)
            flat = tok[m].astype(np.int64) * num_e + exp_[m]
            per_layer.append(np.bincount(flat, weights=cnt[m], minlength=vocab * num_e).astype(np.int64).reshape(vocab, num_e))
        tables.append(per_layer)
    return Stats(**domain_token_stats(tables, top_k), crosslayer_nmi=nmi.mean(0),
                 load_max_mean=skew[..., 0].mean(0), load_cv=skew[..., 1].mean(0))


def synthetic_stats(num_topics: int = 2, seed: int = 0, **knobs) -> Stats:
    """The same statistics on a synthetic OLMoE-shaped trace, one topic per 'domain'."""
    trace = ts.synthetic_trace(num_topics * 102, seq_len=2048, seed=seed, num_topics=num_topics, **SYN_SHAPE, **knobs)
    layers = ts.reference_layers(trace.num_layers)
    domains = [trace.select_sequences(np.arange(t, trace.num_sequences, num_topics)) for t in range(num_topics)]
    vocab, num_e = trace.vocab_size, trace.num_experts
    tables = []
    for sub in domains:
        per_layer = []
        for layer in layers:
            tokens, table = ts.token_expert_table(sub, layer)
            full = np.zeros((vocab, num_e), dtype=np.int64)
            full[tokens] = table
            per_layer.append(full)
        tables.append(per_layer)
    per = [ts.trace_statistics(RoutingTrace(sub.topk_ids[:, layers], sub.token_ids, sub.seq_offsets, num_e, vocab_size=vocab),
                               layer_pairs=[(0, 1), (1, 2)]) for sub in domains]
    return Stats(**domain_token_stats(tables, trace.top_k),
                 crosslayer_nmi=np.mean([p["crosslayer_nmi"] for p in per], axis=0),
                 load_max_mean=np.mean([p["load_max_mean"] for p in per], axis=0),
                 load_cv=np.mean([p["load_cv"] for p in per], axis=0))


# ---- fitting ------------------------------------------------------------------------------------
def _bisect(f, lo: float, hi: float, target: float, iters: int = 40) -> float:
    """x in [lo, hi] with f(x) ~ target, for f increasing."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def _expected_token_stats(exponent: float, offset: float, active: int) -> tuple[float, float, float]:
    """Expected (zipf fit, top share, distinct) of DOMAIN_TOKENS draws from the Zipf-Mandelbrot law."""
    pmf = (np.arange(1, active + 1) + offset) ** -exponent
    pmf /= pmf.sum()
    counts = DOMAIN_TOKENS * pmf
    distinct = float((-np.expm1(DOMAIN_TOKENS * np.log1p(-pmf))).sum())
    return ts.rank_frequency_exponent(counts), float(pmf[0]), distinct


def fit_token_law(target: Stats, vocab_size: int = SYN_SHAPE["vocab_size"]) -> dict:
    """Zipf exponent, offset and active vocabulary matching the real zipf fit, top share, distinct ids;
    then the topic jitter matching the pair-union ratio."""

    def active_for(exponent: float, offset: float) -> int:
        return round(_bisect(lambda a: _expected_token_stats(exponent, offset, round(a))[2], 1000, vocab_size, target.distinct_tokens, 20))

    def offset_for(exponent: float) -> float:  # top share falls with the offset
        return _bisect(lambda q: -_expected_token_stats(exponent, q, active_for(exponent, q))[1], 0.0, 50.0, -target.top_token_share, 14)

    def zipf_fit(exponent: float) -> float:  # on sampled counts, like the real measurement
        q = offset_for(exponent)
        tokens = ts._sample_tokens(np.random.default_rng(0), np.zeros(DOMAIN_TOKENS, dtype=np.int64), 1,
                                   vocab_size, exponent, q, active_for(exponent, q), 0.0)
        return ts.rank_frequency_exponent(np.unique(tokens, return_counts=True)[1])

    exponent = _bisect(zipf_fit, 0.8, 2.0, target.zipf_exponent, 14)
    offset = offset_for(exponent)
    active = active_for(exponent, offset)

    def union_ratio(jitter: float) -> float:
        rng = np.random.default_rng(0)
        topic = np.repeat(np.arange(2), DOMAIN_TOKENS)
        tokens = ts._sample_tokens(rng, topic, 2, vocab_size, exponent, offset, active, jitter)
        a, b = (np.unique(tokens[topic == t]).size for t in range(2))
        return np.unique(tokens).size / ((a + b) / 2)

    jitter = _bisect(union_ratio, 0.0, 10.0, target.pair_union_ratio, 20)
    return dict(zipf_exponent=round(exponent, 3), zipf_offset=round(offset, 2), active_vocab=int(active),
                topic_vocab_jitter=round(jitter, 2))


ROUTING_KNOBS = ("token_scale", "cluster_scale", "topic_scale", "expert_skew")  # 3 depths each
CARRY_MAX = 0.99


def _knobs_from(x: np.ndarray, knobs: dict) -> dict:
    """Unconstrained vector -> knobs: scales exp(x); carry CARRY_MAX * sigmoid(x), depth 0 = depth 7."""
    out = dict(knobs)
    for i, name in enumerate(ROUTING_KNOBS):
        out[name] = tuple(float(v) for v in np.round(np.exp(x[3 * i: 3 * i + 3]), 4))
    c0, c15 = CARRY_MAX / (1 + np.exp(-x[-2:]))
    out["crosslayer_carry"] = (round(float(c0), 4), round(float(c0), 4), round(float(c15), 4))
    return out


def _x_from(knobs: dict) -> np.ndarray:
    scales = [np.log(np.broadcast_to(knobs[name], 3)) for name in ROUTING_KNOBS]
    carry = np.broadcast_to(knobs["crosslayer_carry"], 3)[[1, 2]] / CARRY_MAX
    return np.concatenate(scales + [np.log(carry / (1 - carry))])


RECALL_WEIGHT = 3.0  # a recall error of 0.033 counts like a 10% error of a load or NMI statistic


def _residual(target: Stats, got: Stats) -> np.ndarray:
    """14 residuals: recall, cross-domain recall (3 each, times RECALL_WEIGHT), log load CV,
    log max/mean (3 each), log NMI (2)."""
    return np.concatenate([
        RECALL_WEIGHT * (got.token_recall - target.token_recall),
        RECALL_WEIGHT * (got.cross_domain_recall - target.cross_domain_recall),
        np.log(got.load_cv / target.load_cv),
        np.log(got.load_max_mean / target.load_max_mean),
        np.log(got.crosslayer_nmi / target.crosslayer_nmi),
    ])


def fit_routing(target: Stats, knobs: dict, rounds: int, step: float = 0.15) -> dict:
    """Broyden fit of the 14 routing knobs (token, cluster, topic scales and expert skew at depths
    0/7/15; cross-layer carry at depths 0 = 7 and 15) to the 14 residuals of :func:`_residual`.

    The Jacobian starts from forward differences (``step`` in the unconstrained coordinates),
    steps are damped to norm <= 1 and only accepted when they lower the squared residual. The
    shape knobs (``logit_tail``, ``context_tail``, ``num_clusters``, ``sequence_scale``) stay as
    given. Every evaluation uses the same seed (common random numbers).
    """
    x = _x_from(knobs)
    r = _residual(target, synthetic_stats(**_knobs_from(x, knobs)))
    print(f"start: loss {r @ r:.4f} residual {np.round(r, 3)}", flush=True)
    jac = np.empty((r.size, x.size))
    for j in range(x.size):
        dx = np.zeros_like(x)
        dx[j] = step
        jac[:, j] = (_residual(target, synthetic_stats(**_knobs_from(x + dx, knobs))) - r) / step
    print("jacobian done", flush=True)
    for it in range(rounds):
        dx = -np.linalg.lstsq(jac, r, rcond=1e-3)[0]
        dx *= min(1.0, 1.0 / np.linalg.norm(dx))
        r_new = _residual(target, synthetic_stats(**_knobs_from(x + dx, knobs)))
        jac += np.outer(r_new - r - jac @ dx, dx) / (dx @ dx)  # Broyden rank-1 update
        accepted = r_new @ r_new < r @ r
        if accepted:
            x, r = x + dx, r_new
        print(f"round {it}: loss {r_new @ r_new:.4f} {'accepted' if accepted else 'rejected'}; "
              f"residual {np.round(r_new, 3)}", flush=True)
        print("   knobs " + ", ".join(f"{n}={_knobs_from(x, knobs)[n]}" for n in ROUTING_KNOBS + ("crosslayer_carry",)), flush=True)
    return _knobs_from(x, knobs)


def current_knobs() -> dict:
    """The generator defaults now in ``moelayers/trace_synthetic.py``."""
    return dict(
        zipf_exponent=ts.ZIPF_EXPONENT, zipf_offset=ts.ZIPF_OFFSET, active_vocab=ts.ACTIVE_VOCAB,
        topic_vocab_jitter=ts.TOPIC_VOCAB_JITTER, expert_skew=ts.EXPERT_SKEW, token_scale=ts.TOKEN_SCALE,
        cluster_scale=ts.CLUSTER_SCALE, topic_scale=ts.TOPIC_SCALE, sequence_scale=ts.SEQUENCE_SCALE,
        crosslayer_carry=ts.CROSSLAYER_CARRY, logit_tail=ts.LOGIT_TAIL, context_tail=ts.CONTEXT_TAIL,
    )


def _fmt(value) -> str:
    if np.ndim(value) == 0:
        return f"{float(value):.4f}" if not float(value).is_integer() else str(int(value))
    return "(" + ", ".join(f"{float(v):.4f}" for v in value) + ")"


def constant_lines(real: dict[str, Stats], knobs: dict | None) -> list[str]:
    """The constants block of ``moelayers/trace_synthetic.py``, as `main` prints it (at the end of every run)."""
    o, m = real["olmoe"], real["mixtral"]
    lines = [f"TARGET_{name.upper()} = {_fmt(getattr(o, key))}" for name, key in (
        ("zipf_exponent", "zipf_exponent"), ("top_token_share", "top_token_share"),
        ("distinct_tokens", "distinct_tokens"), ("pair_union_ratio", "pair_union_ratio"),
        ("token_recall", "token_recall"), ("frequent_recall", "frequent_recall"),
        ("cross_domain_recall", "cross_domain_recall"), ("crosslayer_nmi", "crosslayer_nmi"),
        ("load_max_mean", "load_max_mean"), ("load_cv", "load_cv"))]
    lines[2] = f"TARGET_DISTINCT_TOKENS = {round(o.distinct_tokens)}"
    lines += [f"MIXTRAL_{key.upper()} = {_fmt(getattr(m, key))}" for key in (
        "token_recall", "frequent_recall", "cross_domain_recall", "crosslayer_nmi", "load_max_mean", "load_cv")]
    if knobs is not None:
        lines += [f"{name.upper()} = {_fmt(value)}" for name, value in knobs.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=Path, default=DEFAULT_COUNTS)
    parser.add_argument("--compare", action="store_true", help="also print the current generator's statistics")
    parser.add_argument("--fit", action="store_true", help="fit the generator defaults to the OLMoE statistics")
    parser.add_argument("--rounds", type=int, default=12, help="Broyden rounds of the routing fit (>= 0)")
    args = parser.parse_args()
    if args.rounds < 0:
        parser.error(f"--rounds must be >= 0, got {args.rounds}")
    if not args.counts.is_dir():
        parser.error(f"--counts {args.counts} is not a directory of routing counts (the real OLMoE/Mixtral counts)")
    real = {name: real_stats(args.counts / file) for name, file in FILES.items()}
    for name, stats in real.items():
        stats.show(f"real {name}")
    knobs = None
    if args.fit:
        knobs = current_knobs()
        knobs.update(fit_token_law(real["olmoe"]))
        print("token law:", {k: knobs[k] for k in ("zipf_exponent", "zipf_offset", "active_vocab", "topic_vocab_jitter")}, flush=True)
        knobs = fit_routing(real["olmoe"], knobs, args.rounds)
        synthetic_stats(**knobs).show("synthetic (fitted)")
    if args.compare:
        synthetic_stats(**current_knobs()).show("synthetic (current defaults)")
    print("\n# constants for moelayers/trace_synthetic.py")
    print("\n".join(constant_lines(real, knobs)))


if __name__ == "__main__":
    main()
