"""Routing metrics: local activation rate, imbalance, bytes sent, expert loads.

Pure functions over tensors, and `MoEStats`, the record every layer leaves in ``last_stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moelayers.groups import collective_device


def local_activation_rate(token_rank: torch.Tensor, expert_rank_of_pair: torch.Tensor) -> float:
    """Fraction of (token, expert) activations served on the token's own rank.

    Args:
        token_rank: ``[T]`` rank that holds each token.
        expert_rank_of_pair: ``[T, K]`` rank that computes each activation.
    """
    if expert_rank_of_pair.numel() == 0:
        return 0.0
    return float((expert_rank_of_pair == token_rank[:, None]).double().mean())


def imbalance(loads: torch.Tensor | Sequence[float]) -> float:
    """``max / mean`` of per-rank loads (1.0 = perfectly balanced; 1.0 for all-zero loads)."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    mean = float(loads.mean()) if loads.numel() else 0.0
    return float(loads.max()) / mean if mean > 0 else 1.0


def rank_loads(expert_rank_of_pair: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``[R]`` (token, expert) activations computed by each rank."""
    return torch.bincount(expert_rank_of_pair.flatten().to(torch.int64), minlength=num_ranks)


@dataclass
class MoEStats:
    """What one forward did, seen from one rank (``reduce`` sums over ranks).

    Attributes:
        rank: this rank in the expert-parallel group.
        pairs_sent: ``[R]`` (token, expert) activations this rank sent to each rank (its own
            entry = activations served locally).
        rows_sent: ``[R]`` payload rows holding tokens for each rank (after de-duplication; in
            capacity mode the padding rows are sent too but not counted here). The all-gather
            dispatcher counts its rows on the wire instead: this rank's block padded to the largest
            rank's token count, the same ``t_max`` rows to every rank (also with no tokens here).
        bytes_sent: ``[R]`` payload bytes sent to each other rank (0 for itself; in capacity mode
            every row of the fixed buffer, ``capacity`` rows per rank; all-gather: the padded block).
        num_ranks_reduced: how many ranks' stats were summed into this record.
    """

    rank: int
    _pairs_sent: list[int] | torch.Tensor
    _rows_sent: list[int] | torch.Tensor
    _bytes_sent: list[int] | torch.Tensor
    num_ranks_reduced: int = 1
    _local_pairs: int | None = None
    _topk_ids: torch.Tensor | None = field(default=None, repr=False)
    _expert_loads: torch.Tensor | None = field(default=None, repr=False)
    _num_experts: int | None = field(default=None, repr=False)  # set by the layer: expert_loads on first read

    @classmethod
    def from_counts(cls, rank: int, pairs_sent: list[int], rows_sent: list[int], row_bytes: int,
                    topk_ids: torch.Tensor | None = None) -> "MoEStats":
        """One rank's record of one forward: ``pairs_sent`` / ``rows_sent`` ``[R]`` (token-expert
        pairs and payload rows sent to each rank, this rank's own included), ``row_bytes`` per
        row (rows kept on this rank cost no bytes), and optionally ``topk_ids [T, K]`` for the
        expert loads (:meth:`with_experts`)."""
        bytes_sent = [0 if r == rank else n * row_bytes for r, n in enumerate(rows_sent)]
        return cls(rank, list(pairs_sent), list(rows_sent), bytes_sent, 1, pairs_sent[rank], topk_ids)

    @classmethod
    def deferred(cls, rank: int, pairs_sent: torch.Tensor, rows_sent: torch.Tensor | list[int], bytes_sent: list[int],
                 topk_ids: torch.Tensor | None = None) -> "MoEStats":
        """Stats whose counts stay on the device until first read (no sync in the forward)."""
        return cls(rank, pairs_sent, rows_sent, list(bytes_sent), 1, None, topk_ids)

    def _host(self, name: str) -> list[int]:
        value = getattr(self, name)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
            setattr(self, name, value)
        return value

    @property
    def pairs_sent(self) -> list[int]:
        """``[R]`` (token, expert) activations sent to each rank (own entry = served locally)."""
        pairs = self._host("_pairs_sent")
        if self._local_pairs is None:
            self._local_pairs = pairs[self.rank]
        return pairs

    @property
    def rows_sent(self) -> list[int]:
        """``[R]`` payload rows holding tokens for each rank (after de-duplication)."""
        return self._host("_rows_sent")

    @property
    def bytes_sent(self) -> list[int]:
        """``[R]`` payload bytes sent to each other rank (0 for itself)."""
        return self._host("_bytes_sent")

    @property
    def lar(self) -> float:
        """Local activation rate: locally served activations over all activations."""
        total = sum(self.pairs_sent)
        return self._local_pairs / total if total else 0.0  # pairs_sent sets _local_pairs

    @property
    def rank_loads(self) -> list[int]:
        """Activations sent to each rank (after ``reduce``: received by each rank)."""
        return self.pairs_sent

    @property
    def imbalance(self) -> float:
        """``max / mean`` of ``rank_loads``."""
        return imbalance(self.rank_loads)

    @property
    def expert_loads(self) -> torch.Tensor:
        """``[E]`` activations per logical expert (computed on first read from the routing; a layer's
        ``last_stats`` knows its ``E``, other records need :meth:`with_experts`)."""
        loads = self._resolved_loads()
        if loads is None:
            if self._topk_ids is None:
                raise ValueError("this MoEStats holds no expert loads: it has no routing (a record built from "
                                 "counts, or reduced/merged from records of which one had no loads)")
            raise ValueError("expert loads need num_experts: use with_experts(num_experts)")
        return loads

    def _resolved_loads(self) -> torch.Tensor | None:
        """The expert loads, computed now when the record knows ``E`` (a layer's ``last_stats``),
        else ``None``: whether a record has loads never depends on what was read before."""
        if self._expert_loads is None and self._num_experts is not None:
            self.with_experts(self._num_experts)
        return self._expert_loads

    def with_experts(self, num_experts: int) -> "MoEStats":
        """Count the expert loads ``[E]`` from the recorded ``topk_ids`` (once; no-op without
        them) and return ``self``."""
        if self._topk_ids is not None and self._expert_loads is None:
            self._expert_loads = torch.bincount(self._topk_ids.flatten(), minlength=num_experts).cpu()
        return self

    def reduce(self, group=None) -> "MoEStats":
        """Sum over the ranks of ``group`` (a collective; ``None`` = this process alone): global
        LAR, activations received by each rank, total bytes, summed expert loads.

        Raises:
            ValueError: on every rank, when the ranks' records disagree in their number of ranks or
                of experts, or some hold expert loads and others not (nothing is summed then).
        """
        r = len(self.pairs_sent)
        loads = self._resolved_loads()
        loads = loads if loads is not None else torch.zeros(0, dtype=torch.int64)
        pairs = self.pairs_sent
        vec = torch.tensor(pairs + self.rows_sent + self.bytes_sent + [self._local_pairs or 0, self.num_ranks_reduced],
                           dtype=torch.int64)
        vec = torch.cat([vec, loads.to(torch.int64)])
        if group is not None:  # None: a group of one process, nothing to sum
            dev = collective_device(group)
            sizes = torch.tensor([r, loads.numel(), -r, -loads.numel()], dtype=torch.int64, device=dev)
            dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)  # max and -min of both sizes
            r_max, e_max, r_min, e_min = (v * sign for v, sign in zip(sizes.tolist(), (1, 1, -1, -1)))
            if (r_min, e_min) != (r_max, e_max):
                raise ValueError(f"MoEStats.reduce: the ranks' records differ (ranks {r_min}..{r_max}, expert loads "
                                 f"of {e_min}..{e_max} experts, 0 = none; this rank: {r}, {loads.numel()}); reduce "
                                 f"records of the same layer kind on every rank")
            vec = vec.to(dev)
            dist.all_reduce(vec, group=group)
            vec = vec.cpu()
        v = vec.tolist()
        out = MoEStats(self.rank, v[:r], v[r:2 * r], v[2 * r:3 * r], v[3 * r + 1], v[3 * r])
        if loads.numel():
            out._expert_loads = vec[3 * r + 2:]
        return out


def merge_stats(stats: list[MoEStats]) -> MoEStats:
    """Host-side sum of several records (e.g. over steps or layers). The sum has expert loads only
    when every record has them (a sum over some of them would undercount the others' activations)."""
    if not stats:
        raise ValueError("merge_stats needs at least one MoEStats")
    r = len(stats[0].pairs_sent)
    sizes = sorted({len(s.pairs_sent) for s in stats})
    if len(sizes) > 1:
        raise ValueError(f"merge_stats: the records are over different numbers of ranks {sizes}")
    resolved = [s._resolved_loads() for s in stats]
    experts = sorted({loads.numel() for loads in resolved if loads is not None})
    if len(experts) > 1:
        raise ValueError(f"merge_stats: the records' expert loads have different numbers of experts {experts}")

    def total(attr: str) -> list[int]:
        return [sum(getattr(s, attr)[i] for s in stats) for i in range(r)]

    pairs = total("pairs_sent")  # materialises each record's _local_pairs
    out = MoEStats(stats[0].rank, pairs, total("rows_sent"), total("bytes_sent"),
                   max(s.num_ranks_reduced for s in stats), sum(s._local_pairs or 0 for s in stats))
    loads = [loads for loads in resolved if loads is not None]
    if loads and len(loads) == len(stats):
        out._expert_loads = torch.stack(loads).sum(0)
    return out
