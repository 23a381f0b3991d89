"""Synthetic routing traces calibrated on real routers, and the statistics used to compare them.

The targets (``TARGET_*``, ``MIXTRAL_*``) and generator defaults below are the output of
``tools/calibrate_trace.py``, run on the aggregated OLMoE-1B-7B / Mixtral-8x7B routing counts in
``shared/traces/olmoe_mixtral_counts`` (allenai/OLMoE ``scripts/routing_output``, 102 x 2048-token
chunks per text domain, layers 0, 7 and 15). "Per domain" statistics are averaged over the
domains; a synthetic *topic* plays the role of a domain.

Generative model, per MoE layer ``l`` (``E`` experts, top-``K``):

* tokens: sequence ``s`` has topic ``s % num_topics``; its tokens are drawn i.i.d. from a
  Zipf-Mandelbrot law ``p(r) ~ (r + offset)^-exponent`` over ``active_vocab`` ranks; each topic
  maps ranks to token ids by its own jittered order of one global random ranking.
* experts: a popularity ``pi_l ~ LogNormal(0, expert_skew)``; every token id and every topic gets
  ``K`` "home" experts drawn by popularity with Dirichlet(``preference_alpha``) weights; every
  expert of layer ``l - 1`` gets ``K`` successor experts the same way.
* routing: a token's expert distribution is the mixture
  ``token_weight * home(token) + topic_weight * home(topic) + crosslayer_weight * mean_k succ(e_{l-1,k})
  + rest * pi_l`` (layer 0 gives the cross-layer share to ``pi_0``), and its ``K`` experts are drawn
  without replacement (exponential races), most likely first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moelayers.trace import RoutingTrace

__all__ = [
    "synthetic_trace", "trace_statistics", "token_expert_table", "table_recall", "cross_table_recall",
    "crosslayer_joint", "normalized_mutual_information", "rank_frequency_exponent", "load_skew",
    "default_layer_pairs",
]

# ---- calibration targets: real statistics (tools/calibrate_trace.py) ---------------------------
# OLMoE-1B-7B, 64 experts, top-8; mean over the 4 domains with eid2token (arxiv, book, github,
# wikipedia) resp. all 5 domains for expert_counts / crosslayer_counts. Layers 0, 7, 15 of 16.
TARGET_ZIPF_EXPONENT = 0.0  # token frequency rank exponent (LS fit over tokens seen >= 5 times)
TARGET_TOP_TOKEN_SHARE = 0.0  # share of the most frequent token
TARGET_DISTINCT_TOKENS = 0  # distinct token ids per 208,896-token domain
TARGET_TOKEN_RECALL = (0.0, 0.0, 0.0)  # in-sample token id -> top-k table recall, layers 0/7/15
TARGET_FREQUENT_RECALL = (0.0, 0.0, 0.0)  # same, tokens seen >= 100 times only
TARGET_CROSS_DOMAIN_RECALL = (0.0, 0.0, 0.0)  # frequent tokens, table from the other domains
TARGET_CROSSLAYER_NMI = (0.0, 0.0)  # rank-aligned NMI of experts, layer pairs (0, 7), (7, 15)
TARGET_LOAD_MAX_MEAN = (0.0, 0.0, 0.0)  # max / mean of expert_counts, layers 0/7/15
TARGET_LOAD_CV = (0.0, 0.0, 0.0)  # coefficient of variation of expert_counts, layers 0/7/15

# ---- generator defaults: fitted so that synthetic statistics match the targets ------------------
NUM_TOPICS = 4  # topics (~ text domains) per trace
ZIPF_EXPONENT = 1.119  # Zipf-Mandelbrot rank exponent of token frequencies
ZIPF_OFFSET = 2.85  # Zipf-Mandelbrot rank offset (flattens the head)
ACTIVE_VOCAB = 12986  # token ids a topic draws from (capped at vocab_size)
TOPIC_VOCAB_JITTER = 2.1  # std of the per-topic log-rank jitter
EXPERT_SKEW = 1.0  # sigma of the log-normal expert popularity
PREFERENCE_ALPHA = 0.5  # Dirichlet concentration of home-expert weights
TOKEN_WEIGHT = 0.5  # mixture share of the token's home experts
TOPIC_WEIGHT = 0.2  # mixture share of the topic's home experts
CROSSLAYER_WEIGHT = 0.2  # mixture share of the previous layer's successor experts

MAX_EXPERTS = 4096  # the sampler packs expert ids into the low 12 bits of float32 keys
FREQUENT_MIN_COUNT = 100  # "frequent token": seen at least this often
ZIPF_FIT_MIN_COUNT = 5  # the Zipf fit uses tokens seen at least this often
REFERENCE_DEPTHS = (0, 7, 15)  # layers of the 16-layer OLMoE the targets were measured at


# ---- statistics on counts (shared with tools/calibrate_trace.py) -------------------------------
def rank_frequency_exponent(counts: np.ndarray, min_count: int = ZIPF_FIT_MIN_COUNT) -> float:
    """Zipf exponent ``a`` of ``count(rank) ~ rank^-a``: least-squares fit in log-log space.

    Args:
        counts: ``[U]`` occurrences of each distinct token (any order).
        min_count: only ranks whose count is at least this enter the fit.

    Returns:
        ``a``, or ``nan`` when fewer than 10 tokens reach ``min_count``.
    """
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    c = c[c >= min_count]
    if c.size < 10:
        return float("nan")
    slope = np.polyfit(np.log(np.arange(1, c.size + 1)), np.log(c), 1)[0]
    return float(-slope)


def table_recall(table: np.ndarray, top_k: int) -> float:
    """In-sample recall of a token -> top-k expert table.

    Args:
        table: ``[U, E]`` counts of (token, expert) assignments.
        top_k: experts the table keeps per token.

    Returns:
        Share of all assignments that fall on their token's ``top_k`` most frequent experts.
    """
    top = -np.partition(-table, top_k - 1, axis=1)[:, :top_k]
    return float(top.sum() / table.sum())


def cross_table_recall(train: np.ndarray, test: np.ndarray, top_k: int) -> float:
    """Recall on ``test`` of the top-k table built from ``train`` (same token rows, ``[U, E]``)."""
    top = np.argpartition(-train, top_k - 1, axis=1)[:, :top_k]
    return float(np.take_along_axis(test, top, axis=1).sum() / test.sum())


def normalized_mutual_information(joint: np.ndarray) -> float:
    """NMI ``I(X; Y) / ((H(X) + H(Y)) / 2)`` of a ``[E, E]`` joint count table."""
    p = joint / joint.sum()

    def entropy(q: np.ndarray) -> float:
        q = q[q > 0]
        return float(-(q * np.log(q)).sum())

    hx, hy = entropy(p.sum(1)), entropy(p.sum(0))
    mutual = hx + hy - entropy(p.ravel())
    return mutual / ((hx + hy) / 2) if hx + hy > 0 else 0.0


def load_skew(counts: np.ndarray) -> tuple[float, float]:
    """``(max / mean, std / mean)`` of ``[E]`` expert loads."""
    c = np.asarray(counts, dtype=np.float64)
    return float(c.max() / c.mean()), float(c.std() / c.mean())


# ---- statistics on traces -----------------------------------------------------------------------
def token_expert_table(trace: RoutingTrace, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of (token id, expert) at one layer.

    Returns:
        ``tokens [U]`` sorted distinct token ids and ``table [U, E]`` int64 counts.
    """
    tokens, inv = np.unique(trace.token_ids, return_inverse=True)
    num_e = trace.num_experts
    flat = (inv[:, None] * num_e + trace.topk_ids[:, layer, :]).ravel()
    return tokens, np.bincount(flat, minlength=tokens.size * num_e).reshape(tokens.size, num_e)


def crosslayer_joint(trace: RoutingTrace, i: int, j: int) -> np.ndarray:
    """``[E, E]`` counts of (k-th expert at layer i, k-th expert at layer j) over tokens and k.

    Rank-aligned pairs, as in OLMoE's ``run_routing_analysis.py`` (``zip`` of the two top-k lists).
    """
    num_e = trace.num_experts
    flat = (trace.topk_ids[:, i, :].astype(np.int64) * num_e + trace.topk_ids[:, j, :]).ravel()
    return np.bincount(flat, minlength=num_e * num_e).reshape(num_e, num_e)


def default_layer_pairs(num_layers: int) -> list[tuple[int, int]]:
    """Pairs (first, middle), (middle, last) at the relative depths of OLMoE's (0, 7), (7, 15)."""
    last = num_layers - 1
    mid = round(REFERENCE_DEPTHS[1] / REFERENCE_DEPTHS[2] * last)
    return [(i, j) for i, j in ((0, mid), (mid, last)) if i < j]


def reference_layers(num_layers: int) -> list[int]:
    """The layers at the relative depths of OLMoE's 0, 7, 15 of 16."""
    last = num_layers - 1
    return sorted({round(d / REFERENCE_DEPTHS[2] * last) for d in REFERENCE_DEPTHS})


def trace_statistics(
    trace: RoutingTrace,
    *,
    layer_pairs: Sequence[tuple[int, int]] | None = None,
    frequent_min_count: int = FREQUENT_MIN_COUNT,
) -> dict:
    """The calibration statistics of a trace (comparable with the ``TARGET_*`` constants).

    Args:
        trace: any routing trace.
        layer_pairs: layer pairs for cross-layer NMI; default :func:`default_layer_pairs`.
        frequent_min_count: occurrences that make a token "frequent".

    Returns:
        dict with ``zipf_exponent`` (float), ``top_token_share`` (float), ``distinct_tokens``
        (int), ``token_topk_recall`` ``[L]``, ``frequent_token_recall`` ``[L]`` (``nan`` where no
        token is frequent), ``layer_pairs`` (list), ``crosslayer_nmi`` ``[P]``,
        ``load_max_mean`` ``[L]`` and ``load_cv`` ``[L]``.
    """
    tok_counts = np.unique(trace.token_ids, return_counts=True)[1]
    frequent = tok_counts >= frequent_min_count
    recall, frequent_recall = [], []
    for layer in range(trace.num_layers):
        table = token_expert_table(trace, layer)[1]
        recall.append(table_recall(table, trace.top_k))
        frequent_recall.append(table_recall(table[frequent], trace.top_k) if frequent.any() else float("nan"))
    pairs = default_layer_pairs(trace.num_layers) if layer_pairs is None else [tuple(p) for p in layer_pairs]
    skew = np.array([load_skew(c) for c in trace.expert_counts()])
    return {
        "zipf_exponent": rank_frequency_exponent(tok_counts),
        "top_token_share": float(tok_counts.max() / trace.num_tokens),
        "distinct_tokens": int(tok_counts.size),
        "token_topk_recall": np.array(recall),
        "frequent_token_recall": np.array(frequent_recall),
        "layer_pairs": pairs,
        "crosslayer_nmi": np.array([normalized_mutual_information(crosslayer_joint(trace, i, j)) for i, j in pairs]),
        "load_max_mean": skew[:, 0],
        "load_cv": skew[:, 1],
    }


# ---- generator ----------------------------------------------------------------------------------
def _race_topk(rng: np.random.Generator, weights: np.ndarray, k: int) -> np.ndarray:
    """Draw ``k`` distinct columns per row with probability ~ ``weights``, without replacement.

    Exponential races: the ``k`` smallest ``Exp(1) / w`` win, smallest (most likely) first. Keys
    are float32; the expert id is packed into their low mantissa bits so that one fast ``uint32``
    sort returns both (relative key precision ``2^-(23 - bits)``, ties go to the lower id).

    Args:
        weights: ``[N, E]`` float32, non-negative; broadcast ``[1, E]`` rows are allowed.

    Returns:
        ``[N, k]`` int64 column ids.
    """
    n, num_e = weights.shape
    keys = rng.random((n, num_e), dtype=np.float32)
    with np.errstate(divide="ignore"):
        np.log(keys, out=keys)  # u = 0 -> -inf: key inf, drawn last
        np.negative(keys, out=keys)
        np.divide(keys, weights, out=keys)  # weight 0 -> inf, after every positive weight
    bits = keys.view(np.uint32)
    shift = max(1, (num_e - 1).bit_length())
    bits &= np.uint32((0xFFFFFFFF << shift) & 0xFFFFFFFF)
    bits |= np.arange(num_e, dtype=np.uint32)
    bits.sort(axis=1)
    return (bits[:, :k] & np.uint32((1 << shift) - 1)).astype(np.int64)


def _by_probability(chosen: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order each row's chosen experts by probability, highest first, like a router's top-k.

    Args:
        chosen: ``[N, K]`` expert ids; probs: ``[N, E]`` float32 probabilities.

    Returns:
        ``[N, K]`` reordered ids and ``[N, K]`` their probabilities.
    """
    p = np.take_along_axis(probs, chosen, axis=1)
    k = chosen.shape[1]
    shift = max(1, (k - 1).bit_length())
    keys = ~p.view(np.uint32)  # positive float32 bits are monotone: inverted sorts descending
    keys &= np.uint32((0xFFFFFFFF << shift) & 0xFFFFFFFF)
    keys |= np.arange(k, dtype=np.uint32)
    keys.sort(axis=1)
    order = (keys & np.uint32((1 << shift) - 1)).astype(np.int64)
    return np.take_along_axis(chosen, order, axis=1), np.take_along_axis(p, order, axis=1)


def _home_sets(rng: np.random.Generator, n: int, popularity: np.ndarray, k: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """``n`` sets of ``k`` experts drawn by ``popularity [E]``, with Dirichlet(alpha) weights.

    Returns:
        ``experts [n, k]`` int64 and ``weights [n, k]`` float32 (rows sum to 1).
    """
    experts = _race_topk(rng, np.broadcast_to(popularity.astype(np.float32), (n, popularity.size)), k)
    w = rng.gamma(alpha, size=(n, k)) + 1e-12
    return experts, (w / w.sum(1, keepdims=True)).astype(np.float32)


def _sequence_lengths(rng: np.random.Generator, num_sequences: int, seq_len: int | tuple[int, int]) -> np.ndarray:
    if isinstance(seq_len, (int, np.integer)):
        lo = hi = int(seq_len)
    else:
        lo, hi = (int(v) for v in seq_len)
    if not 1 <= lo <= hi:
        raise ValueError(f"seq_len must be an int >= 1 or a (lo, hi) range with 1 <= lo <= hi, got {seq_len!r}")
    return rng.integers(lo, hi + 1, size=num_sequences, dtype=np.int64)


def _sample_tokens(
    rng: np.random.Generator, token_topic: np.ndarray, num_topics: int, vocab_size: int,
    exponent: float, offset: float, active_vocab: int, jitter: float,
) -> np.ndarray:
    """``[T]`` token ids: Zipf-Mandelbrot ranks mapped through each topic's ranking."""
    active = min(active_vocab, vocab_size)
    pmf = (np.arange(1, active + 1) + offset) ** -exponent
    cdf = np.cumsum(pmf / pmf.sum())
    global_order = rng.permutation(vocab_size)
    candidates = min(vocab_size, 4 * active)
    log_rank = np.log(np.arange(1, candidates + 1))
    topic_map = np.stack([
        global_order[np.argsort(log_rank + jitter * rng.standard_normal(candidates), kind="stable")[:active]]
        for _ in range(num_topics)
    ])
    ranks = np.minimum(np.searchsorted(cdf, rng.random(token_topic.size), side="right"), active - 1)
    return topic_map[token_topic, ranks]


def _depth_values(value: float | Sequence[float], num_layers: int, name: str) -> np.ndarray:
    """``[L]`` knob values: a scalar, or values at the relative depths of REFERENCE_DEPTHS."""
    if np.ndim(value) == 0:
        return np.full(num_layers, float(value))
    values = np.asarray(value, dtype=np.float64)
    if values.shape != (len(REFERENCE_DEPTHS),):
        raise ValueError(f"{name} must be a float or {len(REFERENCE_DEPTHS)} values at depths {REFERENCE_DEPTHS}/15, got {value!r}")
    depth = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.zeros(1)
    return np.interp(depth, np.asarray(REFERENCE_DEPTHS) / REFERENCE_DEPTHS[-1], values)


def _check_generator_args(num_sequences: int, num_layers: int, num_experts: int, top_k: int, vocab_size: int) -> None:
    for name, value in (("num_sequences", num_sequences), ("num_layers", num_layers),
                        ("num_experts", num_experts), ("top_k", top_k), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"synthetic_trace: {name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"synthetic_trace: top_k ({top_k}) must not exceed num_experts ({num_experts})")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"synthetic_trace: at most {MAX_EXPERTS} experts are supported, got {num_experts}")


def synthetic_trace(
    num_sequences: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    vocab_size: int,
    seq_len: int | tuple[int, int] = (256, 2048),
    seed: int = 0,
    *,
    num_topics: int = NUM_TOPICS,
    zipf_exponent: float = ZIPF_EXPONENT,
    zipf_offset: float = ZIPF_OFFSET,
    active_vocab: int = ACTIVE_VOCAB,
    topic_vocab_jitter: float = TOPIC_VOCAB_JITTER,
    expert_skew: float | Sequence[float] = EXPERT_SKEW,
    preference_alpha: float = PREFERENCE_ALPHA,
    token_weight: float | Sequence[float] = TOKEN_WEIGHT,
    topic_weight: float | Sequence[float] = TOPIC_WEIGHT,
    crosslayer_weight: float | Sequence[float] = CROSSLAYER_WEIGHT,
    with_weights: bool = False,
) -> RoutingTrace:
    """A synthetic routing trace calibrated on OLMoE (see the module docstring for the model).

    Deterministic for a ``seed``. Knobs given as 3 values apply at the relative depths of layers
    0, 7, 15 of 16 and are interpolated in between.

    Args:
        num_sequences: ``S``.
        num_layers: ``L`` MoE layers.
        num_experts: ``E`` experts per layer (at most ``MAX_EXPERTS``).
        top_k: ``K`` experts per token.
        vocab_size: token ids lie in ``[0, vocab_size)``.
        seq_len: tokens per sequence, fixed or uniform in ``[lo, hi]``.
        seed: seed of ``numpy.random.default_rng``.
        num_topics: sequence ``s`` has topic ``s % num_topics``.
        zipf_exponent, zipf_offset, active_vocab, topic_vocab_jitter: token frequency law.
        expert_skew: sigma of the log-normal expert popularity.
        preference_alpha: Dirichlet concentration of home-expert weights (small = few dominant).
        token_weight, topic_weight, crosslayer_weight: mixture shares (sum <= 1; the rest is
            expert popularity).
        with_weights: also return ``topk_weights``: the mixture probabilities of the chosen
            experts, renormalised over the ``K``.

    Returns:
        RoutingTrace with ``topk_ids [T, L, K]`` (int16, or int32 above 32767 experts), most
        likely expert first, and ``vocab_size`` set.
    """
    _check_generator_args(num_sequences, num_layers, num_experts, top_k, vocab_size)
    w_tok = _depth_values(token_weight, num_layers, "token_weight")
    w_topic = _depth_values(topic_weight, num_layers, "topic_weight")
    w_cross = _depth_values(crosslayer_weight, num_layers, "crosslayer_weight")
    skew = _depth_values(expert_skew, num_layers, "expert_skew")
    total = w_tok + w_topic + w_cross
    if (np.concatenate([w_tok, w_topic, w_cross]) < 0).any() or (total > 1 + 1e-9).any():
        raise ValueError(f"synthetic_trace: mixture weights must be >= 0 and sum to <= 1, got max sum {total.max():.3f}")
    if num_topics < 1 or preference_alpha <= 0 or (skew < 0).any():
        raise ValueError("synthetic_trace: num_topics must be >= 1, preference_alpha > 0 and expert_skew >= 0")

    rng = np.random.default_rng(seed)
    lengths = _sequence_lengths(rng, num_sequences, seq_len)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_topic = np.repeat(np.arange(num_sequences) % num_topics, lengths)
    token_ids = _sample_tokens(rng, token_topic, num_topics, vocab_size, zipf_exponent, zipf_offset, active_vocab, topic_vocab_jitter)
    _, token_row = np.unique(token_ids, return_inverse=True)

    num_t, num_e = token_ids.size, num_experts
    topk_ids = np.empty((num_t, num_layers, top_k), dtype=np.int16 if num_e <= np.iinfo(np.int16).max else np.int32)
    topk_weights = np.empty((num_t, num_layers, top_k), dtype=np.float32) if with_weights else None
    rows = np.arange(num_t)[:, None]
    chosen = None
    for layer in range(num_layers):
        pop = rng.lognormal(0.0, skew[layer], size=num_e)
        pop /= pop.sum()
        tok_home, tok_w = _home_sets(rng, int(token_row.max()) + 1, pop, top_k, preference_alpha)
        topic_home, topic_w = _home_sets(rng, num_topics, pop, top_k, preference_alpha)
        succ_home, succ_w = _home_sets(rng, num_e, pop, top_k, preference_alpha)

        probs = np.empty((num_t, num_e), dtype=np.float32)
        base = 1.0 - total[layer] + (w_cross[layer] if chosen is None else 0.0)
        if chosen is None:
            probs[:] = (base * pop).astype(np.float32)
        else:
            successor = np.zeros((num_e, num_e), dtype=np.float32)
            np.put_along_axis(successor, succ_home, succ_w * (w_cross[layer] / top_k), axis=1)
            multi_hot = np.zeros((num_t, num_e), dtype=np.float32)
            multi_hot[rows, chosen] = 1.0
            np.matmul(multi_hot, successor, out=probs)
            probs += (base * pop).astype(np.float32)
        probs[rows, tok_home[token_row]] += w_tok[layer] * tok_w[token_row]
        probs[rows, topic_home[token_topic]] += w_topic[layer] * topic_w[token_topic]

        chosen, p = _by_probability(_race_topk(rng, probs, top_k), probs)
        topk_ids[:, layer, :] = chosen
        if topk_weights is not None:
            topk_weights[:, layer, :] = p / p.sum(1, keepdims=True)
    return RoutingTrace(topk_ids, token_ids.astype(np.int64), offsets, num_e, topk_weights=topk_weights, vocab_size=vocab_size)
