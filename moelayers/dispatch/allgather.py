"""`AllGatherDispatcher`: every rank sees every token, computes its own slots, reduce-scatters.

Simple and with no data-dependent split sizes; it moves ``R`` times the tokens, so it suits
small batches (decode) and small expert-parallel groups. Ranks may hold different token counts:
they are padded to the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moelayers.dispatch.base import LocalPairs, Received, Routes, check_routes, combine_pairs, local_pairs, partial_sum_dtype
from moelayers.dispatch.flags import HEADER_DIGEST, HEADER_FLAGS, HEADER_ROWS, check_exchanged, payload_digest, payload_dtypes
from moelayers.dispatch.comm import ReduceScatterRows, RowLayout, packed_all_gather
from moelayers.metrics import MoEStats


@dataclass
class _State:
    num_tokens: int
    weights: torch.Tensor  # [R * Tmax, K]
    pairs: LocalPairs
    dtype: torch.dtype


class AllGatherDispatcher:
    """Expert-parallel dispatch by all-gather and reduce-scatter.

    Args:
        group: expert-parallel process group (``None`` for a single process).
        num_ranks: size of ``group``; rank: this rank in it.
        num_slots: physical slots per rank ``S``.
        placement_digest: the layer's 62-bit digest of its placement and settings, exchanged with the
            token counts so that ranks serving different placements or settings raise instead of
            mixing them (as :class:`~moelayers.dispatch.AllToAllDispatcher`'s).
    """

    def __init__(self, group, num_ranks: int, rank: int, num_slots: int, *, placement_digest: int = 0):
        self.group, self.num_ranks, self.rank, self.num_slots = group, num_ranks, rank, num_slots
        self.placement_digest = int(placement_digest)  # exchanged with the sizes: the ranks must agree
        self.last_stats: MoEStats | None = None
        self.payload: tuple = ()  # the last forward's payload_dtypes (named when the ranks' digests differ)

    def dispatch(self, x: torch.Tensor, routes: Routes) -> Received:
        """Step 3: all-gather every rank's tokens, routes and weights over ``group`` (a collective)
        and keep the (token, local slot) pairs of this rank's experts.

        Args:
            x: ``[T, H]`` this rank's tokens.
            routes: ``dest_rank`` / ``dest_slot`` ``[T, K]`` and ``weights [T, K]`` (:class:`Routes`).

        Returns:
            :class:`Received`: ``expert_input [P, H]`` sorted by local slot, and ``slot_counts [S]``.
        """
        routes = check_routes(routes, self.num_ranks, self.num_slots)
        t, k = routes.dest_rank.shape
        dev = x.device
        self.payload = payload_dtypes(x, routes.weights.dtype)
        # every rank's (tokens, -, routing flags, digest), exchanged as the all-to-all dispatcher exchanges its
        # [R, 4] header (the same collective and columns): ranks built with the other dispatcher meet this
        # one in it and raise on the digests, where an all-gather against its all-to-all hung
        header = torch.zeros((self.num_ranks, 4), dtype=torch.int64, device=dev)  # fills: no host-to-device copy
        header[:, HEADER_ROWS] = t
        header[:, HEADER_DIGEST] = payload_digest(self.placement_digest, self.payload)
        if routes.nonfinite is not None:
            header[:, HEADER_FLAGS] = routes.nonfinite.to(torch.int64)
        if self.group is not None:
            recv = torch.empty_like(header)
            dist.all_to_all_single(recv, header, group=self.group)
            header = recv
        host = header.tolist()
        check_exchanged([row[HEADER_FLAGS] for row in host], [row[HEADER_DIGEST] for row in host], together=True)
        t_max = max(row[HEADER_ROWS] for row in host)
        pad = t_max - t
        phys = (routes.dest_rank * self.num_slots + routes.dest_slot).to(torch.int32)
        xs = torch.nn.functional.pad(x, (0, 0, 0, pad))
        ws = torch.nn.functional.pad(routes.weights, (0, 0, 0, pad))
        ps = torch.nn.functional.pad(phys, (0, 0, 0, pad), value=-1)
        all_x, all_w, all_p = packed_all_gather([xs, ws, ps], self.group)
        mine = (all_p >= 0) & (all_p // self.num_slots == self.rank)
        slots = torch.where(mine, all_p % self.num_slots, -1)
        pairs = local_pairs(slots, self.num_slots)
        pairs_sent = torch.zeros(self.num_ranks, dtype=torch.int64, device=dev)
        pairs_sent.scatter_add_(0, routes.dest_rank.flatten(), torch.ones_like(routes.dest_rank.flatten()))
        row_bytes = RowLayout(((x.shape[1], x.dtype), (k, ws.dtype), (k, torch.int32))).row_bytes
        # every rank gets this rank's block of t_max rows (t tokens, then padding), and the reduce-scatter
        # brings as many back: the rows on the wire, as MoEStats documents for this dispatcher
        bytes_sent = [0 if r == self.rank else t_max * row_bytes for r in range(self.num_ranks)]
        self.last_stats = MoEStats.deferred(self.rank, pairs_sent, [t_max] * self.num_ranks, bytes_sent,
                                            routes.topk_ids)  # pairs_sent read when asked: no sync here
        return Received(all_x.index_select(0, pairs.pair_row), pairs.slot_counts, _State(t, all_w, pairs, x.dtype))

    def combine(self, expert_output: torch.Tensor, received: Received) -> torch.Tensor:
        """Step 5: weight ``expert_output [P, H]`` into partial sums for every rank's tokens and
        reduce-scatter them: ``y [T, H] = sum_k w_k * expert_k(x)`` in the order of ``x``."""
        st: _State = received.state
        partial = combine_pairs(expert_output, st.pairs, st.weights, partial_sum_dtype(st.dtype))
        return ReduceScatterRows.apply(self.group, partial)[: st.num_tokens].to(st.dtype)
