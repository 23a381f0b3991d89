"""Helpers of ``recipes/plan.py``: even token spreads, the LAR metrics of an assignment, atomic outputs.

An *assignment* of held-out tokens is a placement ``expert_rank [L, E]`` plus ``token_rank [T, L]``
(the rank that processes token ``t`` at layer ``l``). Its metrics (:func:`lar_report`) are those of
:mod:`moelayers.planning.semantic_eval`, computed the same way for every planner:

* ``lar``: share of (token, layer, k) activations whose expert lives on the token's rank, averaged
  over layers (equals :func:`~moelayers.planning.semantic_eval.lar_from_assignment`);
* ``token_imbalance``: max / mean tokens per rank (mean over layers);
* ``expert_imbalance``: max / mean activations received per rank (mean over layers);
* ``a2a_bytes_ratio``: tokens sent to remote ranks, de-duplicated (a token goes once to each remote
  rank holding any of its experts), relative to the linear placement with the even token spread.

The *even spread* (:func:`even_token_rank`) is how tokens reach ranks without a semantic plan: in
``tp`` mode every batch of ``tokens_per_step`` tokens is cut into ``R`` chunks in file order; in ``dp``
mode requests go round robin in file order through the request scheduler with equal scores, so the
same ``max_ratio`` (1.3) × mean token cap holds.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moelayers.planning.semantic import rank_counts
from moelayers.planning.semantic_eval import linear_expert_rank, request_schedule, step_capacity

__all__ = ["DP_MAX_RATIO", "MODES", "even_token_rank", "assignment_metrics", "lar_report", "commit_files"]

DP_MAX_RATIO = 1.3  # no rank holds more than this × the mean tokens per rank in dp mode
MODES = ("tp", "dp")


def even_token_rank(trace, num_ranks: int, mode: str, tokens_per_step: int) -> np.ndarray:
    """Ranks of the tokens spread evenly, the same at every layer (no plan).

    Args:
        trace: held-out :class:`~moelayers.trace.RoutingTrace` with ``T`` tokens.
        num_ranks: ``R``.
        mode: ``'tp'`` (each batch of ``tokens_per_step`` cut into ``R`` chunks in file order, the last
            partial batch's chunks differing by at most one) or ``'dp'`` (requests round robin in file
            order, at most :data:`DP_MAX_RATIO` × the mean tokens per rank).
        tokens_per_step: batch size (tp; divisible by ``R``).

    Returns:
        ``[T]`` int64 rank per token.
    """
    if mode == "tp":
        step, cap = step_capacity(trace.num_tokens, tokens_per_step, num_ranks)
        starts = np.searchsorted(step, np.arange(cap.shape[0]))
        pos = np.arange(step.size) - starts[step]  # position within the batch
        return (pos[:, None] >= np.cumsum(cap, axis=1)[step]).sum(1).astype(np.int64)
    if mode != "dp":
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    lengths = trace.seq_lengths
    req = request_schedule(np.zeros((lengths.size, num_ranks)), lengths, num_ranks, max_ratio=DP_MAX_RATIO)
    return np.repeat(req, lengths).astype(np.int64)


def assignment_metrics(trace, expert_rank: np.ndarray, token_rank: np.ndarray, num_ranks: int) -> dict:
    """Per-layer local activations, loads and de-duplicated remote sends of an assignment.

    Args:
        trace: :class:`~moelayers.trace.RoutingTrace` with ``T`` tokens, ``L`` layers.
        expert_rank: ``[L, E]`` rank of each expert.
        token_rank: ``[T, L]`` rank of each token at each layer.
        num_ranks: ``R``.

    Returns:
        ``lar_per_layer [L]``, ``token_imbalance``, ``tokens_per_rank [R]`` (layer 0),
        ``expert_imbalance_per_layer [L]`` and ``remote_sends`` (int).
    """
    er, tr = np.asarray(expert_rank, dtype=np.int64), np.asarray(token_rank, dtype=np.int64)
    if er.shape != (trace.num_layers, trace.num_experts) or tr.shape != (trace.num_tokens, trace.num_layers):
        raise ValueError(f"expert_rank must be [L, E] = {[trace.num_layers, trace.num_experts]} and token_rank "
                         f"[T, L] = {[trace.num_tokens, trace.num_layers]}; got {list(er.shape)}, {list(tr.shape)}")
    lar, e_imb, t_imb, sends = [], [], [], 0
    rows = np.arange(trace.num_tokens)
    for layer in range(trace.num_layers):
        ranks = er[layer][trace.topk_ids[:, layer].astype(np.int64)]  # [T, K] rank of each activation
        lar.append(float((ranks == tr[:, layer, None]).mean()))
        got = np.bincount(ranks.ravel(), minlength=num_ranks)
        e_imb.append(float(got.max() / got.mean()))
        tokens = np.bincount(tr[:, layer], minlength=num_ranks)
        t_imb.append(float(tokens.max() / tokens.mean()))
        hit = rank_counts(trace.topk_ids[:, layer], er[layer], num_ranks) > 0
        sends += int(hit.sum() - hit[rows, tr[:, layer]].sum())
    return {"lar_per_layer": lar, "token_imbalance": float(np.mean(t_imb)),
            "tokens_per_rank": np.bincount(tr[:, 0], minlength=num_ranks).tolist(),
            "expert_imbalance_per_layer": e_imb, "remote_sends": sends}


def lar_report(trace, expert_rank: np.ndarray, token_rank: np.ndarray, linear_token_rank: np.ndarray,
               num_ranks: int) -> dict:
    """The LAR keys of ``report.json`` (see the module docstring).

    Args:
        trace: held-out trace (``T`` tokens, ``L`` layers, ``E`` experts).
        expert_rank: ``[L, E]`` the planner's placement.
        token_rank: ``[T, L]`` the planner's token ranks.
        linear_token_rank: ``[T]`` the even spread (:func:`even_token_rank`), used with the linear
            placement for ``lar_linear`` and the ``a2a_bytes_ratio`` reference.
        num_ranks: ``R``.
    """
    mine = assignment_metrics(trace, expert_rank, token_rank, num_ranks)
    lin_tr = np.repeat(np.asarray(linear_token_rank, dtype=np.int64)[:, None], trace.num_layers, axis=1)
    lin = assignment_metrics(trace, linear_expert_rank(trace.num_layers, trace.num_experts, num_ranks), lin_tr,
                             num_ranks)
    lar, lar_lin = float(np.mean(mine["lar_per_layer"])), float(np.mean(lin["lar_per_layer"]))
    return {
        "lar": lar, "lar_linear": lar_lin,
        "lar_per_layer": mine["lar_per_layer"], "lar_linear_per_layer": lin["lar_per_layer"],
        "token_imbalance": mine["token_imbalance"], "tokens_per_rank": mine["tokens_per_rank"],
        "expert_imbalance": float(np.mean(mine["expert_imbalance_per_layer"])),
        "expert_imbalance_max": float(np.max(mine["expert_imbalance_per_layer"])),
        "expert_imbalance_linear": float(np.mean(lin["expert_imbalance_per_layer"])),
        "a2a_bytes_ratio": mine["remote_sends"] / lin["remote_sends"] if lin["remote_sends"] else 1.0,
        "remote_ratio": (1 - lar) / (1 - lar_lin) if lar_lin < 1 else 1.0,
    }


def commit_files(out_dir: str | os.PathLike, writers: dict[str, Callable[[Path], None]]) -> list[Path]:
    """Write several files into ``out_dir`` all or nothing.

    Every writer first writes a temporary file in ``out_dir``; only when all succeeded are they moved
    to their names with ``os.replace``, in the given order (put the file that marks a finished run
    last). On failure the temporary files are removed and nothing is moved.

    Args:
        out_dir: destination folder (created if missing).
        writers: file name -> function writing that file's content to the path it is given.

    Returns:
        The final paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    tmps: dict[str, Path] = {}
    try:
        for name, write in writers.items():
            fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.", suffix=".tmp")
            os.close(fd)
            tmps[name] = Path(tmp)
            write(tmps[name])
            os.chmod(tmps[name], 0o666 & ~umask)  # the permissions of a plain open(), not mkstemp's 0600
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    for name, tmp in tmps.items():
        os.replace(tmp, out / name)
    return [out / name for name in tmps]
