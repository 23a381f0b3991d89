"""The workload of recipes/serve.py: the requests (synthetic, or replayed from a routing trace),
the attention-DP schedulers that deal them to the ranks, and the ``SemanticPlan`` that the
``semantic`` scheduler and ``layer=semantic`` share. Every rank builds the same requests from the
same seed and runs the same scheduler, then keeps the requests it is given."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from recipes._common import config_trace, import_object, int_setting, plan_fraction_setting


# ---------------------------------------------------------------------- requests
@dataclass
class Request:
    """One request; ``forced`` holds the recorded tokens fed in decode steps (replay)."""

    rid: int
    arrival: float
    prompt: list[int]
    output_len: int
    trace_seq: int | None = None
    forced: list[int] | None = None
    generated: int = 0
    next_input: int = -1
    token_times: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len


LENGTH_DISTS = ("uniform", "fixed", "lognormal")
LENGTH_KEYS = {"dist", "min", "max", "value", "median", "sigma"}  # every length spec key (each dist reads some)
LOGNORMAL_CLIP = (1, 1 << 20)  # lognormal lengths' default min and max


def sample_lengths(rng: np.random.Generator, spec: dict, n: int) -> np.ndarray:
    """``n`` lengths (>= 1) from ``{dist: uniform|fixed|lognormal, ...}`` (see :func:`check_length_spec`)."""
    kind = spec.get("dist", "uniform")
    if kind == "fixed":
        out = np.full(n, int(spec["value"]))
    elif kind == "uniform":
        out = rng.integers(int(spec["min"]), int(spec["max"]) + 1, size=n)
    elif kind == "lognormal":
        out = np.rint(float(spec["median"]) * np.exp(float(spec["sigma"]) * rng.standard_normal(n)))
        out = np.clip(out, int(spec.get("min", LOGNORMAL_CLIP[0])), int(spec.get("max", LOGNORMAL_CLIP[1])))
    else:
        raise ValueError(f"unknown length distribution {kind!r}: use one of {', '.join(LENGTH_DISTS)}")
    return np.maximum(out.astype(np.int64), 1)


def check_length_spec(spec, key: str) -> None:
    """A length spec of :func:`sample_lengths`: ``{dist: uniform, min, max}`` (ints, ``1 <= min <=
    max``), ``{dist: fixed, value}`` (an int >= 1) or ``{dist: lognormal, median, sigma, min, max}``
    (``median > 0``, ``sigma >= 0``, optional clip bounds as for uniform, default :data:`LOGNORMAL_CLIP`).

    Raises:
        ValueError: naming the config key (``key``, e.g. ``workload.prompt_len``).
    """
    if not isinstance(spec, dict):
        raise ValueError(f"{key} must be a dict {{dist: {'|'.join(LENGTH_DISTS)}, ...}}, got {spec!r}")
    kind = spec.get("dist", "uniform")
    if kind not in LENGTH_DISTS:
        raise ValueError(f"{key}.dist must be one of {', '.join(LENGTH_DISTS)}, got {kind!r}")
    unknown = sorted(set(spec) - LENGTH_KEYS)
    if unknown:  # a misspelt +workload.output_len.sigam=... would be ignored
        raise ValueError(f"unknown {key} key(s) {', '.join(unknown)}: a length spec has {', '.join(sorted(LENGTH_KEYS))}")
    if kind == "fixed":
        int_setting(spec.get("value"), f"{key}.value", 1)
        return
    if kind == "lognormal":
        median, sigma = spec.get("median"), spec.get("sigma")
        if not (_is_finite_number(median) and median > 0):
            raise ValueError(f"{key}.median must be a finite number > 0, got {median!r}")
        if not (_is_finite_number(sigma) and sigma >= 0):
            raise ValueError(f"{key}.sigma must be a finite number >= 0, got {sigma!r}")
        lo, hi = spec.get("min", LOGNORMAL_CLIP[0]), spec.get("max", LOGNORMAL_CLIP[1])
    else:
        lo, hi = spec.get("min"), spec.get("max")
    int_setting(lo, f"{key}.min", 1)
    int_setting(hi, f"{key}.max", 1)
    if lo > hi:
        raise ValueError(f"{key}.min={lo} is greater than {key}.max={hi}")


def _is_finite_number(value) -> bool:
    """An int or float (not a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def replay_sequences(cfg: dict, trace) -> tuple[list[int], list[str], int]:
    """The trace sequences the requests replay, notes about the ones left out, and how many empty
    sequences were skipped.

    Request ``i`` replays the ``i``-th non-empty sequence of ``request_offset .. request_offset +
    workload.num_requests - 1``: empty (zero-token) sequences are skipped (a request needs at least
    one prompt token), and a trace that ends early gives fewer requests; both are noted.

    Raises:
        ValueError: no request left (the offset is past the trace's end, or every sequence of the
            window is empty); the message names the trace and its sequence count.
    """
    n, offset = int(cfg["workload"]["num_requests"]), request_offset(cfg)
    num_seq, name = trace.num_sequences, _trace_name(cfg)
    if offset >= num_seq:
        raise ValueError(f"trace.request_offset={offset} leaves no request: {name} has {num_seq} sequence(s) "
                         f"(request i replays sequence request_offset + i)")
    window = range(offset, min(offset + n, num_seq))
    lengths = trace.seq_lengths
    seqs = [s for s in window if lengths[s] > 0]
    notes = []
    if len(window) < n:
        notes.append(f"{name} has {num_seq} sequence(s): trace.request_offset={offset} leaves {len(window)} of "
                     f"workload.num_requests={n} requests (sequences {offset}..{num_seq - 1})")
    if len(seqs) < len(window):
        empty = [s for s in window if lengths[s] == 0]
        shown = ", ".join(str(s) for s in empty[:10]) + (", ..." if len(empty) > 10 else "")
        notes.append(f"skipped {len(empty)} empty sequence(s) of {name} (no tokens to replay): {shown}")
    if not seqs:
        raise ValueError(f"no request left: sequences {window.start}..{window.stop - 1} of {name} "
                         f"({num_seq} sequence(s)) are all empty")
    return seqs, notes, len(window) - len(seqs)


def _trace_name(cfg: dict) -> str:
    path = (cfg.get("trace") or {}).get("path")
    return f"trace {path}" if path else "the synthetic trace"


DEFAULT_PROMPT_FRACTION = 0.5  # workload.prompt_fraction when absent


def make_requests(cfg: dict, vocab_size: int, trace=None) -> list[Request]:
    """The request list, identical on every rank (seeded by ``cfg['seed']``); with a trace, one
    request per sequence of :func:`replay_sequences`.

    Arrivals are Poisson at ``workload.rate`` requests per second; a null (or absent) rate makes
    every request arrive at t=0. Without a trace the lengths come from ``workload.prompt_len`` and
    ``workload.output_len``; with one, ``workload.prompt_fraction`` (default
    :data:`DEFAULT_PROMPT_FRACTION`) of each sequence is the prompt. :func:`check_config` checks them.
    """
    wl = cfg["workload"]
    rng = np.random.default_rng(cfg["seed"])
    n = int(wl["num_requests"])
    if trace is not None:
        seqs = replay_sequences(cfg, trace)[0]
        n = len(seqs)
    rate = wl.get("rate")
    gaps = rng.exponential(1.0 / float(rate), size=n) if rate is not None else np.zeros(n)
    arrivals = np.cumsum(gaps)
    if trace is None:
        plens = sample_lengths(rng, wl["prompt_len"], n)
        olens = sample_lengths(rng, wl["output_len"], n)
        return [Request(i, float(arrivals[i]), rng.integers(0, vocab_size, size=int(plens[i])).tolist(), int(olens[i]))
                for i in range(n)]
    frac = float(wl.get("prompt_fraction", DEFAULT_PROMPT_FRACTION))
    reqs = []
    for i, seq in enumerate(seqs):
        toks = trace.token_ids[trace.sequence_slice(seq)].tolist()
        p = min(len(toks), max(1, int(round(frac * len(toks)))))
        reqs.append(Request(i, float(arrivals[i]), toks[:p], len(toks) - p + 1, trace_seq=seq, forced=toks[p:]))
    return reqs


def request_offset(cfg: dict) -> int:
    """``trace.request_offset``: request ``i`` replays trace sequence ``offset + i`` (default 0). With
    a plan built on the trace's first half, an offset of half the sequences serves held-out requests."""
    return int((cfg.get("trace") or {}).get("request_offset") or 0)


# ---------------------------------------------------------------------- schedulers
def round_robin(requests: list[Request], world_size: int, cfg: dict) -> list[int]:
    """Request ``i`` goes to attention-DP rank ``i mod world_size``."""
    return [i % world_size for i in range(len(requests))]


def semantic(requests: list[Request], world_size: int, cfg: dict) -> list[int]:
    """Sem-MoE Algorithm 2 (:class:`moelayers.schedule.SemanticScheduler`): each request, in arrival
    order, to the unmasked rank its prompt's tokens vote for; every ``world_size`` requests cover all
    ranks, and a rank is closed to a request that would take it above 1.3x the mean prompt tokens
    (the total is known up front). Requests are taken one by one, as a live server takes them
    (``assign``, no look-ahead), so a long late request can still take a rank above the cap where no
    rank has room for it."""
    from moelayers.schedule import SemanticScheduler

    sched = SemanticScheduler(semantic_plan(cfg, world_size), num_ranks=world_size,
                              total_tokens=sum(len(r.prompt) for r in requests))
    return [sched.assign(r.prompt) for r in requests]


SCHEDULERS = {"round_robin": round_robin, "semantic": semantic}


def scheduler_name(spec) -> str:
    """``scheduler`` is a name or a dict with ``name`` (and e.g. ``plan_path``)."""
    if isinstance(spec, dict):
        if "name" not in spec:
            raise ValueError(f"scheduler={spec} needs a name, e.g. scheduler={{name:semantic,plan_path:FILE}}")
        return spec["name"]
    return spec


def get_scheduler(name):
    """A scheduler ``(requests, world_size, cfg) -> rank per request``: a registered name or ``module:function``."""
    name = scheduler_name(name)
    if name in SCHEDULERS:
        return SCHEDULERS[name]
    if ":" in name:
        fn = import_object(name, "scheduler", sep=":")
        if not callable(fn):
            raise ValueError(f"scheduler={name!r} is a {type(fn).__name__}, not a function (requests, world_size, "
                             "cfg) -> rank per request")
        try:
            inspect.signature(fn).bind(None, None, None)
        except TypeError as exc:  # (in every rank, the call's own TypeError named no setting)
            raise ValueError(f"scheduler={name!r} cannot be called as (requests, world_size, cfg) -> rank per "
                             f"request: {exc}") from None
        except ValueError:  # no signature to read (some builtins): the call will tell
            pass
        return fn
    raise ValueError(f"unknown scheduler {name!r}: one of {sorted(SCHEDULERS)} or 'module:function'")


def assign_requests(requests: list[Request], world_size: int, cfg: dict) -> list[int]:
    """The attention-DP rank of each request, from the scheduler ``cfg['scheduler']``, checked (a
    short list or a rank outside the world would silently drop requests).

    Returns:
        One rank per request, ints in ``[0, world_size)``.

    Raises:
        ValueError: the scheduler's output is not one int in ``[0, world_size)`` per request; the
            message names the scheduler.
    """
    name = scheduler_name(cfg["scheduler"])
    owner = get_scheduler(cfg["scheduler"])(requests, world_size, cfg)
    try:
        owner = list(owner)
    except TypeError:
        raise ValueError(f"scheduler {name!r} returned {owner!r}, not a list of ranks") from None
    if len(owner) != len(requests):
        raise ValueError(f"scheduler {name!r} returned {len(owner)} rank(s) for {len(requests)} request(s): "
                         f"it must return one rank per request")
    for i, rank in enumerate(owner):
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ValueError(f"scheduler {name!r} gave request {i} rank {rank!r}: a rank must be an int in "
                             f"[0, {world_size}) (the world size)")
    return [int(rank) for rank in owner]


# ---------------------------------------------------------------------- semantic plan
_PLANS: dict = {}


def semantic_plan_path(cfg: dict) -> str | None:
    """``scheduler.plan_path`` (dict form), else ``layer.plan_path``, else ``None``."""
    return _plan_setting(cfg, "plan_path")


def plan_train_fraction(cfg: dict) -> float:
    """``scheduler.plan_train_fraction`` (dict form), else ``layer.plan_train_fraction``, else 0.5.

    Raises:
        ValueError: not a number in (0, 1).
    """
    return plan_fraction_setting(_plan_setting(cfg, "plan_train_fraction"),
                                 "plan_train_fraction (layer.plan_train_fraction or scheduler.plan_train_fraction)")


def _plan_setting(cfg: dict, key: str):
    """``scheduler.KEY`` (dict form), else ``layer.KEY``; both set to different values is an error
    (one plan serves both, so one of them would be ignored)."""
    sched = cfg["scheduler"]
    value = sched.get(key) if isinstance(sched, dict) else None
    other = cfg["layer"].get(key)
    same = (os.path.realpath(str(value)) == os.path.realpath(str(other)) if key == "plan_path"
            else value == other)
    if value is not None and other is not None and not same:
        raise ValueError(f"scheduler.{key}={value} and layer.{key}={other} differ: the layer and the scheduler "
                         f"share one semantic plan, so give {key} once (either place)")
    return value if value is not None else other


def semantic_plan(cfg: dict, num_ranks: int, trace=None):
    """The ``SemanticPlan`` of ``layer=semantic`` / ``scheduler=semantic`` (built once per process):
    loaded from :func:`semantic_plan_path`, or planned (mode dp) on the replay trace's first
    ``layer.plan_train_fraction`` (default 0.5) of sequences."""
    from moelayers.planning.semantic import SemanticPlan, plan_semantic

    path = semantic_plan_path(cfg)
    source = None if path else json.dumps([cfg.get(k) for k in ("router", "trace", "workload", "model", "seed")]
                                          + [plan_train_fraction(cfg)], sort_keys=True, default=str)
    key = (path, source, num_ranks)
    if key not in _PLANS:
        if path:
            plan = SemanticPlan.load(path)
        else:
            trace = trace if trace is not None else load_replay_trace(cfg)
            if trace is None:
                raise ValueError("a semantic plan needs scheduler={name:semantic,plan_path:FILE}, layer.plan_path=FILE "
                                 "or router=replay (planned on the trace's first half)")
            train, _ = trace.split(plan_train_fraction(cfg))
            plan = plan_semantic(train, num_ranks, mode="dp", seed=int(cfg["seed"]), progress=False)
        _PLANS[key] = plan
    return _PLANS[key]


# ---------------------------------------------------------------------- replay trace
def load_replay_trace(cfg: dict):
    """The routing trace of ``router=replay`` (file or synthetic), else ``None``."""
    if cfg["router"]["name"] != "replay":
        return None
    tc, m = cfg["trace"], cfg["model"]
    num_seq = int(tc.get("num_sequences") or int(cfg["workload"]["num_requests"]) + request_offset(cfg))
    return config_trace(tc, num_sequences=num_seq, num_layers=m["num_layers"], num_experts=m["num_experts"],
                        top_k=m["top_k"], vocab_size=m["vocab_size"], seed=cfg["seed"], seq_len=[16, 48],
                        need="router=replay")


def in_sample_requests(cfg: dict, requests: list[Request], trace, layer_uses_plan: bool,
                       num_ranks: int | None = None) -> int | None:
    """How many requests replay a sequence the semantic plan trained on: planned from this trace,
    its first ``plan_train_fraction``; a plan file, the sequences it records
    (:meth:`SemanticPlan.trained_on`, by content; ``None``, unknown, for a file that does not
    record them). ``num_ranks``: the plan's, to find the plan file already loaded."""
    if trace is None or not (layer_uses_plan or scheduler_name(cfg["scheduler"]) == "semantic"):
        return 0
    if semantic_plan_path(cfg):
        mask = semantic_plan(cfg, num_ranks, trace).trained_on(trace)
        if mask is None:
            return None
        return sum(1 for r in requests if r.trace_seq is not None and bool(mask[r.trace_seq]))
    from moelayers.trace import train_sequences

    n_train = train_sequences(plan_train_fraction(cfg), trace.num_sequences)  # RoutingTrace.split's rule
    return sum(1 for r in requests if r.trace_seq is not None and r.trace_seq < n_train)


def requests_digest(requests: list[Request]) -> str:
    """SHA-1 of what defines the workload (id, arrival, prompt, output length, forced tokens and
    trace sequence of every request): equal digests = the same requests."""
    h = hashlib.sha1()
    for r in requests:
        h.update(json.dumps([r.rid, round(r.arrival, 9), r.prompt, r.output_len, r.forced, r.trace_seq]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------- checks
def check_workload(wl: dict) -> None:
    """The ``workload`` block: ``num_requests`` an int >= 1 (a run serves something), ``rate`` a
    finite number > 0 or null (every request at t=0), the length specs ``prompt_len`` and
    ``output_len`` (:func:`check_length_spec`) and ``prompt_fraction`` in ``(0, 1]`` (the share of a
    replayed sequence that is the prompt, at least one token); each whether or not this run uses it.

    Raises:
        ValueError: naming the config key.
    """
    int_setting(wl.get("num_requests"), "workload.num_requests", 1)
    rate = wl.get("rate")
    if rate is not None and not (_is_finite_number(rate) and rate > 0):
        raise ValueError(f"workload.rate must be a finite number > 0 (requests per second) or null (every request "
                         f"arrives at t=0), got {rate!r}")
    check_length_spec(wl.get("prompt_len"), "workload.prompt_len")
    check_length_spec(wl.get("output_len"), "workload.output_len")
    frac = wl.get("prompt_fraction", DEFAULT_PROMPT_FRACTION)
    if not (_is_finite_number(frac) and 0 < frac <= 1):
        raise ValueError(f"workload.prompt_fraction must be a number in (0, 1] (the share of each replayed sequence "
                         f"that is the prompt), got {frac!r}")
