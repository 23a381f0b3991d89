"""Synthetic routing traces calibrated on real routers, and the statistics used to compare them.

The targets (``TARGET_*``, ``MIXTRAL_*``) and generator defaults below are the output of
``tools/calibrate_trace.py``, run on the aggregated OLMoE-1B-7B / Mixtral-8x7B routing counts in
``shared/traces/olmoe_mixtral_counts`` (allenai/OLMoE ``scripts/routing_output``: 102 x 2048-token
chunks per text domain, layers 0, 7 and 15). "Per domain" statistics are averaged over the
domains; a synthetic *topic* plays the role of a domain.

Generative model. Tokens: sequence ``s`` has topic ``s % num_topics``; its token ids are drawn
i.i.d. from a Zipf-Mandelbrot law ``p(r) ~ (r + zipf_offset) ** -zipf_exponent`` over
``active_vocab`` ranks, which each topic maps to ids by its own jittered order of one global random
ranking. Every distinct token id belongs to one of ``num_clusters`` clusters. Routing: at layer ``l``
token ``t`` (id ``v``, cluster ``c``, topic ``p``, sequence ``s``) scores expert ``e`` with::

    y[t, l, e] = token_scale    * A_l[v, e]       # the token's own preference, same in every topic
               + cluster_scale  * C_l[(p, c), e]  # its cluster's preference within this topic
               + topic_scale    * B_l[p, e]       # the topic's hot experts
               + sequence_scale * Q_l[s, e]       # the sequence's own preference
               + bias_l[e]                        # expert popularity, N(0, expert_skew^2)
               + n[t, l, e]                       # context: everything else the router sees
    n[t, l, e] = crosslayer_carry * n[t, l-1, e] + sqrt(1 - crosslayer_carry^2) * Gumbel

and takes the top ``K``, highest first. The context noise ``n`` (a standard Gumbel at layer 0) is
carried from layer to layer, so the choice at layer ``l`` depends on the choice at ``l - 1``
beyond what token, cluster and topic explain. ``A`` and ``C`` are ``Exp(1) ** logit_tail`` (a
few strongly preferred experts), ``B`` and ``Q`` ``Exp(1) ** context_tail``, all scaled to unit
standard deviation. Each layer names its score columns by its own random permutation of the
expert ids, so carried column ``e`` is a different expert id at every layer.
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

# ---- calibration targets: real statistics (printed by tools/calibrate_trace.py) ----------------
# OLMoE-1B-7B (64 experts, top-8), layers 0/7/15 of 16. Mean over the 4 domains with eid2token
# (arxiv, book, github, wikipedia) for token statistics, over all 5 domains for expert_counts and
# crosslayer_counts. A "domain" is 102 x 2048 = 208,896 tokens.
TARGET_ZIPF_EXPONENT = 1.0988  # token frequency rank exponent (LS fit over tokens seen >= 5 times)
TARGET_TOP_TOKEN_SHARE = 0.0487  # share of the most frequent token id
TARGET_DISTINCT_TOKENS = 11537  # distinct token ids per domain
TARGET_PAIR_UNION_RATIO = 1.6725  # distinct ids of two domains together / mean of one (mean over pairs)
TARGET_TOKEN_RECALL = (0.5829, 0.7031, 0.7435)  # in-sample token id -> top-k table recall, layers 0/7/15
TARGET_FREQUENT_RECALL = (0.5290, 0.6738, 0.7213)  # same, tokens seen >= 100 times in the domain
TARGET_CROSS_DOMAIN_RECALL = (0.2885, 0.4093, 0.4060)  # frequent tokens, table of another domain
TARGET_CROSSLAYER_NMI = (0.0314, 0.0688)  # rank-aligned NMI of experts, layer pairs (0, 7), (7, 15)
TARGET_LOAD_MAX_MEAN = (5.1293, 5.1870, 4.4163)  # max / mean of expert_counts, layers 0/7/15
TARGET_LOAD_CV = (0.6790, 0.9781, 1.0059)  # std / mean of expert_counts, layers 0/7/15
# Mixtral-8x7B (8 experts, top-2), layers 0/7/15 of 32, all 5 domains: for reference only.
MIXTRAL_TOKEN_RECALL = (0.6227, 0.6132, 0.6555)
MIXTRAL_FREQUENT_RECALL = (0.6075, 0.5502, 0.6219)
MIXTRAL_CROSS_DOMAIN_RECALL = (0.5147, 0.3951, 0.4929)
MIXTRAL_CROSSLAYER_NMI = (0.0120, 0.0228)
MIXTRAL_LOAD_MAX_MEAN = (1.1964, 1.1339, 1.2217)
MIXTRAL_LOAD_CV = (0.1115, 0.0785, 0.1957)

# ---- generator defaults: fitted by ``tools/calibrate_trace.py --fit`` -------------------------
# The token law is solved for (TARGET_ZIPF_EXPONENT, TARGET_TOP_TOKEN_SHARE, TARGET_DISTINCT_TOKENS,
# TARGET_PAIR_UNION_RATIO); the routing knobs by a Broyden fit of 14 knobs to 14 residuals (recall,
# cross-domain recall, load CV and max/mean at layers 0/7/15, NMI of (0, 7) and (7, 15)) on a
# 16-layer, 64-expert, top-8, vocab-50,280 trace with 2 topics of 102 x 2048 tokens. Triples are
# values at layers 0/7/15 of 16 (relative depth 0, 7/15, 1), interpolated in between. The fit
# draws one trace, seed 0 (common random numbers). Its statistics (targets in brackets): recall
# 0.598/0.714/0.784 (0.583/0.703/0.744); cross-domain recall 0.283/0.377/0.374 (0.289/0.409/0.406);
# NMI 0.030/0.062 (0.031/0.069); load max/mean 5.13/5.26/5.47 (5.13/5.19/4.42); load CV
# 0.74/0.95/1.02 (0.68/0.98/1.01). Other seeds scatter widely around them (a helper's check of seeds
# 0-5, 2026-11-27: mean load max/mean 4.28/6.14/6.59, std about 0.8; load CV 0.66/1.14/1.18, std
# about 0.12; recall 0.589/0.726/0.804; cross-domain recall 0.305/0.436/0.444): one seed's draw
# is one sample of the skew, not its mean, which is why the yardsticks run several seeds.
NUM_TOPICS = 4  # topics (~ text domains) per trace; the real data has 4 domains with token data
ZIPF_EXPONENT = 1.151  # Zipf-Mandelbrot rank exponent of token frequencies
ZIPF_OFFSET = 3.3  # Zipf-Mandelbrot rank offset (flattens the head: top token ~4.8%)
ACTIVE_VOCAB = 13464  # token ids one topic draws from (capped at vocab_size)
TOPIC_VOCAB_JITTER = 2.08  # std of the per-topic log-rank jitter (vocabulary overlap of topics)
TOKEN_SCALE = (1.2789, 1.3600, 2.0319)  # std of the per-token logits (hold in every topic)
CLUSTER_SCALE = (1.3894, 2.7502, 4.4029)  # std of the per-(topic, token cluster) logits
TOPIC_SCALE = (0.5988, 0.0058, 0.0155)  # std of the per-topic logits (hot experts of a domain)
EXPERT_SKEW = (0.3715, 1.9111, 2.4742)  # std of the per-expert logit bias (load skew)
CROSSLAYER_CARRY = (0.8853, 0.8853, 0.9711)  # AR(1) coefficient of the context noise across layers
SEQUENCE_SCALE = 0.0  # std of per-sequence logits: not identifiable from aggregated counts, off
LOGIT_TAIL = 3.0  # token/cluster logits ~ Exp(1) ** 3: a few strongly preferred experts (chosen, not fitted)
CONTEXT_TAIL = 1.0  # topic/sequence logits ~ Exp(1) (chosen, not fitted)

MAX_EXPERTS = 4096  # the sampler packs expert ids into the low 12 bits of float32 keys
MAX_VOCAB_SIZE = 2**31  # the token sampler shuffles the whole vocabulary (8 bytes and one draw per id)
MAX_SCALE = 1e30  # scales and expert_skew above this could overflow the float32 scores (max ~3.4e38)
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
    """The calibration statistics of a trace (comparable with the ``TARGET_*`` constants on one
    topic of about 102 x 2048 tokens: the targets are per domain; a whole multi-topic trace has more
    distinct tokens and a lower NMI).

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
    bad = [p for p in pairs if len(p) != 2 or not all(isinstance(i, (int, np.integer)) and 0 <= i < trace.num_layers
                                                      for i in p)]
    if bad:  # (-1 was read as the last layer, 5 of 4 layers an IndexError in numpy)
        raise ValueError(f"trace_statistics: layer_pairs must be (i, j) layer indexes in [0, {trace.num_layers}), "
                         f"got {bad}")
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
def _gumbel(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Standard Gumbel noise ``-log(-log(u))``, float32, with ``u`` in the open interval (0, 1)."""
    g = rng.random(shape, dtype=np.float32)  # multiples of 2^-24 in [0, 1)
    np.maximum(g, np.float32(2.0**-25), out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    return g


def _topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Column ids of the ``k`` largest ``scores [N, E]`` per row, largest first.

    Uses ``max - score >= 0`` as float32 keys with the column id packed into their low mantissa
    bits, so one fast ``uint32`` sort returns both (relative precision ``2^-(23 - bits)``; ties
    go to the lower id).

    Returns:
        ``[N, k]`` int64.
    """
    num_e = scores.shape[1]
    keys = scores.max(axis=1, keepdims=True) - scores
    bits = keys.view(np.uint32)
    shift = max(1, (num_e - 1).bit_length())
    bits &= np.uint32((0xFFFFFFFF << shift) & 0xFFFFFFFF)
    bits |= np.arange(num_e, dtype=np.uint32)
    bits.sort(axis=1)
    return (bits[:, :k] & np.uint32((1 << shift) - 1)).astype(np.int64)


def _heavy_tailed(rng: np.random.Generator, shape: tuple[int, int], tail: float) -> np.ndarray:
    """``Exp(1) ** tail`` divided by its standard deviation, float32 (``tail = 1``: exponential).

    A larger ``tail`` makes a few entries per row dominate: a token prefers a few experts strongly.
    """
    x = rng.standard_exponential(size=shape, dtype=np.float32)
    np.maximum(x, np.float32(1e-30), out=x)
    np.log(x, out=x)
    x *= np.float32(tail)
    np.exp(x, out=x)
    x /= np.float32(math.sqrt(math.gamma(1 + 2 * tail) - math.gamma(1 + tail) ** 2))
    return x


def _layer_tables(
    rng: np.random.Generator, k: dict[str, float], num_u: int, num_topics: int, num_clusters: int,
    num_sequences: int, num_e: int, logit_tail: float, context_tail: float,
    pair_row: np.ndarray, pair_topic: np.ndarray, pair_context: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's random preferences.

    Returns:
        ``pair_logits [P, E]`` token + cluster + topic logits + expert bias for each occurring
        (token id, topic) pair, ``seq_logits [S, E]`` and ``labels [E]`` (the expert id of each
        score column).
    """
    tok_logits = _heavy_tailed(rng, (num_u, num_e), logit_tail)
    tok_logits *= np.float32(k["token_scale"])
    cluster_logits = _heavy_tailed(rng, (num_topics * num_clusters, num_e), logit_tail)
    cluster_logits *= np.float32(k["cluster_scale"])
    topic_logits = _heavy_tailed(rng, (num_topics, num_e), context_tail) * np.float32(k["topic_scale"])
    seq_logits = _heavy_tailed(rng, (num_sequences, num_e), context_tail) * np.float32(k["sequence_scale"])
    bias = rng.standard_normal(num_e).astype(np.float32) * np.float32(k["expert_skew"])
    labels = rng.permutation(num_e)
    pair_logits = np.take(tok_logits, pair_row, axis=0)
    pair_logits += np.take(cluster_logits, pair_context, axis=0)
    pair_logits += np.take(topic_logits + bias, pair_topic, axis=0)
    return pair_logits, seq_logits, labels


def _carry_context(rng: np.random.Generator, context: np.ndarray | None, carry: float, shape: tuple[int, int]) -> np.ndarray:
    """Next layer's context noise: ``carry * context + sqrt(1 - carry^2) * Gumbel`` (Gumbel at layer 0)."""
    fresh = _gumbel(rng, shape)
    if context is None:
        return fresh
    context *= np.float32(carry)
    fresh *= np.float32(math.sqrt(1.0 - carry * carry))
    context += fresh
    return context


def _is_int(value: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _seq_len_bounds(seq_len: int | tuple[int, int]) -> tuple[int, int]:
    """``(lo, hi)`` of ``seq_len``: an int ``n`` is ``(n, n)``; a pair (tuple, list or 1-D integer array)
    of ints is ``(lo, hi)``. Floats, bools, strings and other lengths are refused, not truncated."""
    if _is_int(seq_len):
        pair = [seq_len, seq_len]
    elif (isinstance(seq_len, Sequence) and not isinstance(seq_len, (str, bytes))) \
            or (isinstance(seq_len, np.ndarray) and seq_len.ndim == 1):
        pair = list(seq_len)
    else:
        pair = []
    if len(pair) != 2 or not all(_is_int(v) for v in pair) or not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"synthetic_trace: seq_len must be an int >= 1 or a (lo, hi) pair of ints with "
                         f"1 <= lo <= hi, got {seq_len!r}")
    return int(pair[0]), int(pair[1])


def _sequence_lengths(rng: np.random.Generator, num_sequences: int, lo: int, hi: int) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=num_sequences, dtype=np.int64)


def _make_rng(seed: int | None) -> np.random.Generator:
    """``numpy.random.default_rng(seed)``, refusing what it refuses (and bools) with an error naming ``seed``."""
    if isinstance(seed, (bool, np.bool_)):
        raise ValueError(f"synthetic_trace: seed must be a non-negative int or None, got {seed!r}")
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"synthetic_trace: seed must be a non-negative int or None (anything "
                         f"numpy.random.default_rng accepts), got {seed!r} ({exc})") from None


def _sample_tokens(
    rng: np.random.Generator, token_topic: np.ndarray, num_topics: int, vocab_size: int,
    exponent: float, offset: float, active_vocab: int, jitter: float,
) -> np.ndarray:
    """``[T]`` token ids: Zipf-Mandelbrot ranks mapped through each topic's ranking."""
    active = min(active_vocab, vocab_size)
    with np.errstate(over="ignore", under="ignore"):
        pmf = (np.arange(1, active + 1) + offset) ** -exponent
    if not (np.isfinite(pmf).all() and pmf.sum() > 0):
        raise ValueError(f"synthetic_trace: zipf_exponent={exponent!r} with zipf_offset={offset!r} over-/underflows "
                         f"the token frequency law over {active} ranks")
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
    """``[L]`` knob values: a scalar, or values at the relative depths of REFERENCE_DEPTHS.

    Raises:
        ValueError: ``value`` (or an entry of it) is not a finite real number (a string or a bool is
            not one), or a sequence of the wrong length; the message names the knob ``name``.
    """
    entries = [value] if np.ndim(value) == 0 else list(np.ravel(np.asarray(value, dtype=object)))
    for v in entries:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not np.isfinite(v):
            raise ValueError(f"synthetic_trace: {name} must be a finite number or {len(REFERENCE_DEPTHS)} of them, "
                             f"got {value!r}")
    if np.ndim(value) == 0:
        return np.full(num_layers, float(value))
    values = np.asarray(value, dtype=np.float64)
    if values.shape != (len(REFERENCE_DEPTHS),):
        raise ValueError(f"{name} must be a float or {len(REFERENCE_DEPTHS)} values at depths {REFERENCE_DEPTHS}/15, got {value!r}")
    depth = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.zeros(1)
    return np.interp(depth, np.asarray(REFERENCE_DEPTHS) / REFERENCE_DEPTHS[-1], values)


def _check_generator_args(num_sequences: int, num_layers: int, num_experts: int, top_k: int, vocab_size: int,
                          num_topics: int, num_clusters: int) -> None:
    for name, value in (("num_sequences", num_sequences), ("num_layers", num_layers), ("num_experts", num_experts),
                        ("top_k", top_k), ("vocab_size", vocab_size), ("num_topics", num_topics),
                        ("num_clusters", num_clusters)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"synthetic_trace: {name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"synthetic_trace: top_k ({top_k}) must not exceed num_experts ({num_experts})")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"synthetic_trace: num_experts must be <= {MAX_EXPERTS} (ids are packed into float32 sort keys), got {num_experts}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"synthetic_trace: vocab_size must be <= {MAX_VOCAB_SIZE} (2**31): the token sampler shuffles "
                         f"the whole vocabulary (8 bytes and one random draw per id), got {vocab_size}")


def _check_token_law(zipf_exponent: float, zipf_offset: float, active_vocab: int, topic_vocab_jitter: float) -> None:
    for name, value in (("zipf_exponent", zipf_exponent), ("zipf_offset", zipf_offset),
                        ("topic_vocab_jitter", topic_vocab_jitter)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(value):
            raise ValueError(f"synthetic_trace: {name} must be a finite number, got {value!r}")
    if zipf_exponent < 0:
        raise ValueError(f"synthetic_trace: zipf_exponent must be >= 0, got {zipf_exponent!r}")
    if zipf_offset <= -1:
        raise ValueError(f"synthetic_trace: zipf_offset must be > -1 (p(r) ~ (r + zipf_offset) ** -zipf_exponent "
                         f"for ranks r >= 1), got {zipf_offset!r}")
    if topic_vocab_jitter < 0:
        raise ValueError(f"synthetic_trace: topic_vocab_jitter must be >= 0, got {topic_vocab_jitter!r}")
    if isinstance(active_vocab, bool) or not isinstance(active_vocab, (int, np.integer)) or active_vocab < 1:
        raise ValueError(f"synthetic_trace: active_vocab must be a positive int, got {active_vocab!r}")


def _check_knobs(knobs: dict[str, np.ndarray], logit_tail: float, context_tail: float) -> None:
    for name, values in knobs.items():
        if not (np.isfinite(values).all() and (values >= 0).all()):
            raise ValueError(f"synthetic_trace: {name} must be finite and >= 0, got {values}")
        if (values > MAX_SCALE).any():  # finite in float64 but would overflow the float32 scores (NaN routing)
            raise ValueError(f"synthetic_trace: {name} must be <= {MAX_SCALE:g} (larger values overflow the float32 "
                             f"routing scores), got {values}")
    if (knobs["crosslayer_carry"] >= 1).any():
        raise ValueError(f"synthetic_trace: crosslayer_carry must be < 1, got {knobs['crosslayer_carry']}")
    for name, tail in (("logit_tail", logit_tail), ("context_tail", context_tail)):
        if isinstance(tail, (bool, np.bool_)) or not isinstance(tail, (int, float, np.integer, np.floating)) \
                or not 0.25 <= tail <= 4:
            raise ValueError(f"synthetic_trace: {name} must be a number in [0.25, 4], got {tail!r}")


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
    num_clusters: int | None = None,
    zipf_exponent: float = ZIPF_EXPONENT,
    zipf_offset: float = ZIPF_OFFSET,
    active_vocab: int = ACTIVE_VOCAB,
    topic_vocab_jitter: float = TOPIC_VOCAB_JITTER,
    token_scale: float | Sequence[float] = TOKEN_SCALE,
    cluster_scale: float | Sequence[float] = CLUSTER_SCALE,
    topic_scale: float | Sequence[float] = TOPIC_SCALE,
    sequence_scale: float | Sequence[float] = SEQUENCE_SCALE,
    expert_skew: float | Sequence[float] = EXPERT_SKEW,
    crosslayer_carry: float | Sequence[float] = CROSSLAYER_CARRY,
    logit_tail: float = LOGIT_TAIL,
    context_tail: float = CONTEXT_TAIL,
    with_weights: bool = False,
    progress: bool = False,
) -> RoutingTrace:
    """A synthetic routing trace calibrated on OLMoE (the model is in the module docstring).

    Deterministic for a ``seed``. Knobs given as 3 values apply at the relative depths of layers
    0, 7, 15 of 16 and are interpolated linearly in between; scales are relative to the context
    noise (a standard Gumbel). About 10 s for 200k tokens x 26 layers x 64 experts on one core.

    Args:
        num_sequences: ``S``.
        num_layers: ``L`` MoE layers.
        num_experts: ``E`` experts per layer (at most ``MAX_EXPERTS``).
        top_k: ``K`` experts per token.
        vocab_size: token ids lie in ``[0, vocab_size)`` (at most ``MAX_VOCAB_SIZE`` = 2**31: the
            token sampler shuffles the whole vocabulary).
        seq_len: tokens per sequence: an int ``n >= 1`` (fixed), or a ``(lo, hi)`` pair of ints (tuple,
            list or 1-D integer array) with ``1 <= lo <= hi``: uniform in ``[lo, hi]``.
        seed: seed of ``numpy.random.default_rng``: a non-negative int, or ``None`` for fresh entropy
            (anything else ``default_rng`` accepts works too).
        num_topics: sequence ``s`` has topic ``s % num_topics``.
        num_clusters: token clusters; default one per expert.
        zipf_exponent, zipf_offset, active_vocab, topic_vocab_jitter: the token frequency law.
        token_scale: std of the per-(token id, layer) logits, the same in every topic.
        cluster_scale: std of the per-(topic, token cluster, layer) logits.
        topic_scale: std of the per-(topic, layer) logits.
        sequence_scale: std of the per-(sequence, layer) logits.
        expert_skew: std of the per-expert logit bias (load skew).
        crosslayer_carry: AR(1) coefficient, in ``[0, 1)``, of the context noise from one layer
            to the next (column by column): the choice at ``l`` depends on the choice at ``l - 1``.
            The scales and ``expert_skew`` must be finite, ``>= 0`` and at most ``MAX_SCALE`` = 1e30
            (larger ones would overflow the float32 scores).
        logit_tail: token and cluster logits are ``Exp(1) ** logit_tail`` (scaled to unit std); a
            number in ``[0.25, 4]``.
        context_tail: topic and sequence logits are ``Exp(1) ** context_tail``; in ``[0.25, 4]``.
        with_weights: also return ``topk_weights``, the softmax of the chosen experts' scores
            over the ``K``.
        progress: a bar over the layers (minutes for a trace of a few million tokens of a
            DeepSeek-V3-sized model); the trace is the same either way.

    Returns:
        RoutingTrace with ``topk_ids [T, L, K]`` (int16: at most MAX_EXPERTS = 4096 experts), highest
        score first, and ``vocab_size`` set.
    """
    num_clusters = num_experts if num_clusters is None else num_clusters
    _check_generator_args(num_sequences, num_layers, num_experts, top_k, vocab_size, num_topics, num_clusters)
    knobs = {name: _depth_values(value, num_layers, name) for name, value in (
        ("token_scale", token_scale), ("cluster_scale", cluster_scale), ("topic_scale", topic_scale),
        ("sequence_scale", sequence_scale), ("expert_skew", expert_skew), ("crosslayer_carry", crosslayer_carry))}
    _check_knobs(knobs, logit_tail, context_tail)
    _check_token_law(zipf_exponent, zipf_offset, active_vocab, topic_vocab_jitter)
    lo, hi = _seq_len_bounds(seq_len)

    rng = _make_rng(seed)
    lengths = _sequence_lengths(rng, num_sequences, lo, hi)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    token_seq = np.repeat(np.arange(num_sequences), lengths)
    token_topic = token_seq % num_topics
    token_ids = _sample_tokens(rng, token_topic, num_topics, vocab_size, zipf_exponent, zipf_offset, active_vocab, topic_vocab_jitter)
    _, token_row = np.unique(token_ids, return_inverse=True)  # distinct token ids -> rows
    num_t, num_e, num_u = token_ids.size, num_experts, int(token_row.max()) + 1
    token_cluster = rng.integers(0, num_clusters, size=num_u)
    # token, cluster and topic logits are shared by all occurrences of a (token id, topic) pair
    pairs, token_pair = np.unique(token_row * num_topics + token_topic, return_inverse=True)
    pair_row, pair_topic = pairs // num_topics, pairs % num_topics
    pair_context = pair_topic * num_clusters + token_cluster[pair_row]  # (topic, cluster) row

    topk_ids = np.empty((num_t, num_layers, top_k), dtype=np.int16 if num_e <= np.iinfo(np.int16).max else np.int32)
    topk_weights = np.empty((num_t, num_layers, top_k), dtype=np.float32) if with_weights else None
    context = None  # [T, E] context noise, carried from layer to layer
    layers = range(num_layers)
    if progress:
        from moelayers._progress import progress_bar

        layers = progress_bar(layers, desc=f"synthetic trace ({num_t} tokens)", unit="layer")
    for layer in layers:
        k = {name: float(values[layer]) for name, values in knobs.items()}
        pair_logits, seq_logits, labels = _layer_tables(
            rng, k, num_u, num_topics, num_clusters, num_sequences, num_e, logit_tail, context_tail,
            pair_row, pair_topic, pair_context)
        context = _carry_context(rng, context, k["crosslayer_carry"], (num_t, num_e))
        scores = np.take(pair_logits, token_pair, axis=0)
        if k["sequence_scale"] > 0:
            scores += np.take(seq_logits, token_seq, axis=0)
        scores += context
        chosen = _topk_desc(scores, top_k)
        topk_ids[:, layer, :] = labels[chosen]
        if topk_weights is not None:
            w = np.take_along_axis(scores, chosen, axis=1)
            w = np.exp(w - w[:, :1])
            topk_weights[:, layer, :] = w / w.sum(axis=1, keepdims=True)
    return RoutingTrace(topk_ids, token_ids.astype(np.int64), offsets, num_e, topk_weights=topk_weights, vocab_size=vocab_size)
