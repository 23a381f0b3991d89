"""Attention-DP request scheduling (Sem-MoE Algorithm 2).

With attention data-parallel, a request lives on one rank for its whole life, and every MoE
activation of its tokens is local when the expert sits on that rank. The semantic scheduler sends a
request where its tokens' experts are, as predicted by the plan's token table, while keeping the
number of requests per rank balanced::

    score[r]  = sum over the request's tokens t with token_rank[t] == r of token_conf[t]
    rank      = argmax of score over the ranks not yet masked (ties: lowest rank)
    mask[rank] = True; all ranks masked -> clear the mask

so every mask cycle (``R`` consecutive requests from an empty mask) goes to ``R`` different ranks
(affinity with balanced load). :meth:`SemanticScheduler.assign` takes one request at a time, in the
paper's order; :meth:`SemanticScheduler.assign_batch` takes a batch of requests known together (a
batch of rollout prompts) and gives the requests of each mask cycle their ranks jointly, the
assignment with the largest total vote (less a token-balance term;
``moelayers.planning.semantic_eval.request_schedule(joint=True)``), so that the last request of a
cycle is not left with whatever rank its predecessors did not want (about +0.014 local activation
rate at EP4 on held-out synthetic traces, docs/planning.md).

Given the tokens it will schedule in all (``total_tokens``), it also closes a rank to a request that
would take it above ``max_ratio`` times the mean (1.3), as the held-out evaluation of
``recipes/plan.py mode=dp`` does (both run ``moelayers.planning.semantic_eval.schedule_requests``),
with one difference: the evaluation knows the lengths still to come and keeps room for them
(``request_schedule(lookahead=True)``); online they are unknown, so a long late request can take a
rank above the cap. ``request_schedule(..., lookahead=False)`` is a sequence of ``assign`` calls
exactly, and with ``joint=True`` ``assign_batch`` on all the requests at once.
Both schedulers share one interface: ``assign(token_ids) -> rank`` and ``assign_batch(requests) -> ranks``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from moelayers.planning.semantic_eval import schedule_requests


class RequestScheduler(Protocol):
    """Picks an attention-DP rank for each arriving request."""

    num_ranks: int

    def assign(self, token_ids: Any) -> int:
        """The rank for a request with these (prompt) token ids."""

    def assign_batch(self, requests: Sequence[Any]) -> list[int]:
        """The ranks for requests arriving together, in order."""


def _token_array(token_ids: Any) -> np.ndarray:
    """``[N]`` integer token ids of one request in their own dtype (``uint64`` ids above the int64
    range must not wrap), from ``[N]`` or a tokenizer's ``[1, N]``.

    Raises:
        ValueError: several rows (``[B, N]``: a batch of requests, which one request's votes would
            send to one rank; :meth:`SemanticScheduler.assign_batch` takes them).
        TypeError: ids that are not integers.
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    try:
        a = np.asarray(token_ids)
    except ValueError as e:  # a ragged list of lists: a tokenizer's unpadded batch
        raise ValueError(f"token_ids of one request must be [N] (or [1, N]), got a ragged sequence of sequences "
                         f"({e}): for a batch of requests call assign_batch(requests), each request its own "
                         "ids") from None
    while a.ndim > 1 and a.shape[0] == 1:
        a = a[0]
    if a.ndim > 1:
        raise ValueError(f"token_ids of one request must be [N] (or [1, N]), got shape {list(a.shape)}: for a "
                         f"batch of requests call assign_batch(requests), each request its own ids without padding")
    if a.size == 0:
        return a.reshape(0).astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {a.dtype}")
    return a.reshape(-1)


class RoundRobinScheduler:
    """Request ``i`` goes to rank ``i mod R`` (ignores the tokens).

    Args:
        num_ranks: attention-DP ranks ``R``.
    """

    def __init__(self, num_ranks: int):
        if isinstance(num_ranks, (bool, np.bool_)) or not isinstance(num_ranks, numbers.Integral) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        self.num_ranks = int(num_ranks)
        self._next = 0

    def assign(self, token_ids: Any = None) -> int:
        """The next rank in turn."""
        r = self._next
        self._next = (r + 1) % self.num_ranks
        return r

    def assign_batch(self, requests: Sequence[Any]) -> list[int]:
        """The next ``len(requests)`` ranks in turn."""
        return [self.assign() for _ in requests]

    def reset(self) -> None:
        """Start again from rank 0."""
        self._next = 0


class SemanticScheduler:
    """Affinity scheduling from a ``SemanticPlan``'s token table (Sem-MoE Algorithm 2).

    Args:
        plan: a ``SemanticPlan`` (or any object with ``token_rank [L, V]``, ``token_conf [L, V]`` and
            ``num_ranks``); a dp-mode plan's token table is the same at every layer.
        layer: which layer's token table votes (default 0).
        num_ranks: the attention-DP ranks; must equal ``plan.num_ranks`` if given.
        total_tokens: the tokens of all the requests to schedule (when known, e.g. a batch of
            rollouts): a rank is then closed to a request that would take it above
            ``max_ratio * total_tokens / R`` tokens. ``None``: no token cap (the mask alone balances);
            a server taking requests as they come leaves it ``None``, since the cap counts every token
            assigned since the scheduler was made (finished requests are never taken off).
        max_ratio: the cap's multiple of the mean tokens per rank.

    Attributes:
        loads: ``[R]`` requests assigned to each rank so far.
        token_loads: ``[R]`` tokens assigned to each rank so far.

    Raises:
        ValueError: ``layer`` out of range, tables of inconsistent shapes, a plan for another
            number of ranks, or a negative ``total_tokens`` / ``max_ratio`` below 1. :meth:`assign`
            and :meth:`scores`: a token id outside ``[0, vocab_size)`` of the plan.
    """

    def __init__(self, plan: Any, *, layer: int = 0, num_ranks: int | None = None, total_tokens: int | None = None,
                 max_ratio: float = 1.3):
        tr, tc = np.asarray(_numpy(plan.token_rank)), np.asarray(_numpy(plan.token_conf))
        if tr.ndim == 1:
            tr, tc = tr[None], tc[None]
        if tr.ndim != 2 or tc.shape != tr.shape:
            raise ValueError(f"plan.token_rank/token_conf must both be [L, V], "
                             f"got {list(tr.shape)} and {list(tc.shape)}")
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, numbers.Integral) or not 0 <= layer < tr.shape[0]:
            raise ValueError(f"layer {layer!r} is out of range for a plan of {tr.shape[0]} layers")
        layer = int(layer)
        self.num_ranks = int(plan.num_ranks)
        if num_ranks is not None and (isinstance(num_ranks, (bool, np.bool_))
                                      or not isinstance(num_ranks, numbers.Integral)):
            raise ValueError(f"num_ranks must be None or an int, got {num_ranks!r}")
        if num_ranks is not None and num_ranks != self.num_ranks:
            raise ValueError(f"the plan is for {self.num_ranks} ranks, the scheduler serves {num_ranks}")
        self.token_rank = tr[layer].astype(np.int64)
        self.token_conf = np.nan_to_num(tc[layer].astype(np.float64), nan=0.0)
        self.token_conf[(self.token_rank < 0) | (self.token_rank >= self.num_ranks)] = 0.0
        self.vocab_size = self.token_rank.shape[0]
        self.source = getattr(plan, "source", None)  # the plan's file, for errors
        if total_tokens is not None and (isinstance(total_tokens, (bool, np.bool_))
                                         or not isinstance(total_tokens, numbers.Real)
                                         or not math.isfinite(total_tokens) or int(total_tokens) != total_tokens
                                         or total_tokens < 0):  # inf and nan: this error, not int()'s
            raise ValueError(f"total_tokens must be None or an int >= 0, got {total_tokens!r}")
        if isinstance(max_ratio, bool) or not isinstance(max_ratio, numbers.Real) or not max_ratio >= 1.0:
            raise ValueError(f"max_ratio must be a number >= 1, got {max_ratio!r}")
        self.cap = np.inf if total_tokens is None else max_ratio * int(total_tokens) / self.num_ranks
        self.mask = np.zeros(self.num_ranks, dtype=bool)
        self.loads = np.zeros(self.num_ranks, dtype=np.int64)
        self.token_loads = np.zeros(self.num_ranks, dtype=np.int64)

    def scores(self, token_ids: Any) -> np.ndarray:
        """``[R]`` float64 confidence-weighted votes of the request's tokens (tokens the plan never
        saw, confidence 0: none).

        Raises:
            ValueError: a token id outside the plan's vocabulary ``[0, vocab_size)`` (not silently
                dropped: the plan was made for another vocabulary).
        """
        ids = _token_array(token_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            where = f"{self.source}: " if self.source else ""
            raise ValueError(f"{where}token id {bad} is outside the plan's vocabulary "
                             f"[0, vocab_size={self.vocab_size}): token ids must be >= 0 and < vocab_size; "
                             f"use a plan made for this vocabulary")
        ids = ids.astype(np.int64)  # in [0, vocab_size): no wrap-around
        conf = self.token_conf[ids]
        seen = conf > 0
        return np.bincount(self.token_rank[ids[seen]], weights=conf[seen], minlength=self.num_ranks).astype(np.float64)

    def assign(self, token_ids: Any, num_tokens: int | None = None) -> int:
        """The best unmasked rank for this request (within the token cap); masks it (and clears a
        full mask).

        Args:
            token_ids: the request's (prompt) token ids, ``[N]`` or ``[1, N]``, without padding (a pad
                id would vote like the others).
            num_tokens: the request's tokens for the cap (default: ``N``).
        """
        ids = _token_array(token_ids)
        if num_tokens is not None and (isinstance(num_tokens, (bool, np.bool_))
                                       or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0):
            raise ValueError(f"num_tokens must be None or an int >= 0, got {num_tokens!r}")  # -100 lifted the cap
        n = ids.size if num_tokens is None else int(num_tokens)
        return self._schedule(self.scores(ids)[None], np.array([n]), joint=False)[0]  # ties: lowest rank

    def assign_batch(self, requests: Sequence[Any], *, joint: bool = True) -> list[int]:
        """Ranks for requests known together (e.g. a batch of rollout prompts), in order.

        Args:
            requests: each request's (prompt) token ids, ``[N_i]``, without padding (the rows of a
                padded ``[B, N]`` batch would count the pad id's votes).
            joint: the requests of each mask cycle get their ranks together, the largest total vote
                (see the module docstring); ``False``: the same as :meth:`assign` on each in turn.

        Returns:
            The rank of each request.
        """
        single = next((i for i, q in enumerate(requests) if np.ndim(q) == 0), None)
        if single is not None:  # (one request's [N] ids given as the batch: N requests of one token each)
            raise ValueError(f"requests[{single}] is one token id, not a request's ids: assign_batch takes a "
                             "sequence of requests, each [N_i] ids; for one request call assign(token_ids)")
        ids = [_token_array(q) for q in requests]
        if not ids:
            return []
        scores = np.stack([self.scores(q) for q in ids])  # every id checked before anything is assigned
        return self._schedule(scores, np.array([q.size for q in ids], dtype=np.int64), joint=joint)

    def _schedule(self, scores: np.ndarray, lengths: np.ndarray, *, joint: bool) -> list[int]:
        ranks = schedule_requests(scores, lengths, self.token_loads, self.mask, self.cap, joint=joint)
        self.loads += np.bincount(ranks, minlength=self.num_ranks)
        return [int(r) for r in ranks]

    def reset(self) -> None:
        """Forget the mask and the loads."""
        self.mask[:] = False
        self.loads[:] = 0
        self.token_loads[:] = 0


def _numpy(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)
