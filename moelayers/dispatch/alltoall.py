"""`AllToAllDispatcher`: one all-to-all-v payload exchange per direction.

Each payload row carries a token's hidden state together with its routing metadata for the
destination rank (local slots and weights), so the only other exchange is the small one of split
sizes. With de-duplication a token goes to each destination rank once, however many of its
experts live there; the rank sums its expert outputs before the return trip.

Send side, for ``T`` tokens and units ``U`` per token (``U = R`` ranks with de-duplication, else
``U = K`` experts), each unit carrying ``J`` (slot, weight) entries (``J = K``, else ``1``)::

    dest_map [T, U]   row of each unit in the send buffer, -1 when unused, rows sorted by rank
    send     [N, H | J weights | J slots]  ->  all-to-all-v  ->  recv [M, ...]
    recv side: pairs sorted by slot -> experts -> weighted sum per row [M, H]
    return   [M, H]  ->  all-to-all-v  ->  [N, H]  ->  sum over units -> y [T, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moelayers.dispatch.base import LocalPairs, Received, Routes, combine_pairs, local_pairs
from moelayers.dispatch.comm import RowLayout, all_to_all_bytes, packed_all_to_all
from moelayers.kernels import permute, permute_reference, unpermute_combine
from moelayers.metrics import MoEStats


@dataclass
class _State:
    dest_map: torch.Tensor  # [T, U]
    in_splits: list[int]
    out_splits: list[int]
    recv_weights: torch.Tensor  # [M, J]
    pairs: LocalPairs
    dtype: torch.dtype


class AllToAllDispatcher:
    """Expert-parallel dispatch over ``group`` with all-to-all-v.

    Args:
        group: expert-parallel process group (``None`` for a single process).
        num_ranks: size of ``group``; rank: this rank in it.
        num_slots: physical slots per rank ``S``.
        dedup: send a token once per destination rank (default) instead of once per expert.
    """

    def __init__(self, group, num_ranks: int, rank: int, num_slots: int, *, dedup: bool = True):
        self.group, self.num_ranks, self.rank, self.num_slots = group, num_ranks, rank, num_slots
        self.dedup = dedup
        self.last_stats: MoEStats | None = None

    # ------------------------------------------------------------------ step 3
    def dispatch(self, x: torch.Tensor, routes: Routes) -> Received:
        t, k = routes.dest_rank.shape
        r = self.num_ranks
        dev = x.device
        if self.dedup:
            hit = torch.zeros(t, r, dtype=torch.bool, device=dev)
            hit.scatter_(1, routes.dest_rank, True)
            # rows ordered by (rank, token): running count over the rank-major flattening
            pos = torch.cumsum(hit.t().flatten().to(torch.int64), 0).view(r, t).t() - 1
            dest_map = torch.where(hit, pos, -1)
            send_rows = hit.sum(0)
            ranks = torch.arange(r, device=dev)
            mine = routes.dest_rank[:, None, :] == ranks[None, :, None]  # [T, R, K]
            unit_slots = torch.where(mine, routes.dest_slot[:, None, :], -1)
            unit_weights = torch.where(mine, routes.weights[:, None, :], 0)
        else:
            flat = routes.dest_rank.flatten()
            order = torch.argsort(flat, stable=True)
            pos = torch.empty_like(order)
            pos[order] = torch.arange(order.numel(), device=dev)
            dest_map = pos.view(t, k)
            send_rows = None  # one row per (token, expert): the pair counts below
            unit_slots = routes.dest_slot[..., None]
            unit_weights = routes.weights[..., None]
        send_pairs = torch.zeros(r, dtype=torch.int64, device=dev)
        send_pairs.scatter_add_(0, routes.dest_rank.flatten(), torch.ones_like(routes.dest_rank.flatten()))
        if send_rows is None:
            send_rows = send_pairs

        # the one small exchange: rows and pairs per destination, then one host sync
        counts = torch.stack([send_rows, send_pairs], 1)  # [R, 2]
        recv_counts = torch.empty_like(counts)
        if self.group is None:
            recv_counts.copy_(counts)
        else:
            dist.all_to_all_single(recv_counts, counts, group=self.group)
        host = torch.cat([counts, recv_counts], 1).tolist()
        in_splits = [row[0] for row in host]
        out_splits = [row[2] for row in host]
        recv_pairs = sum(row[3] for row in host)

        # row metadata: (slot, weight) entries of each unit, gathered into send order
        j = unit_slots.shape[-1]
        n_send = sum(in_splits)
        # invert dest_map without a sync: unused units write to a dummy row n_send
        target = torch.where(dest_map >= 0, dest_map, n_send).flatten()
        unit_of_row = torch.empty(n_send + 1, dtype=torch.int64, device=dev)
        unit_of_row.scatter_(0, target, torch.arange(target.numel(), device=dev))
        unit_of_row = unit_of_row[:n_send]
        row_slots = unit_slots.reshape(-1, j)[unit_of_row].to(torch.int32)
        row_weights = unit_weights.reshape(-1, j)[unit_of_row]

        layout = RowLayout(((x.shape[1], x.dtype), (j, row_weights.dtype), (j, torch.int32)))
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or row_weights.requires_grad)
        if not needs_grad:
            # inference: gather tokens straight into the payload
            buf = layout.empty(n_send, dev)
            xv, wv, sv = layout.views(buf)
            permute(x, dest_map, xv)
            wv.copy_(row_weights)
            sv.copy_(row_slots)
            recv = all_to_all_bytes(buf, sum(out_splits), in_splits, out_splits, self.group)
            recv_x, recv_w, recv_s = layout.views(recv)
        else:
            rows = permute_reference(x, dest_map, x.new_empty(n_send, x.shape[1]))
            recv_x, recv_w, recv_s = packed_all_to_all([rows, row_weights, row_slots], in_splits, out_splits, self.group)

        pairs = local_pairs(recv_s, self.num_slots, recv_pairs)
        expert_input = recv_x.index_select(0, pairs.pair_row)
        self.last_stats = MoEStats.from_counts(
            rank=self.rank,
            pairs_sent=[row[1] for row in host],
            rows_sent=in_splits,
            row_bytes=layout.row_bytes,
            topk_ids=routes.topk_ids,
        )
        state = _State(dest_map, in_splits, out_splits, recv_w, pairs, x.dtype)
        return Received(expert_input, pairs.slot_counts, state)

    # ------------------------------------------------------------------ step 5
    def combine(self, expert_output: torch.Tensor, received: Received) -> torch.Tensor:
        st: _State = received.state
        row_out = combine_pairs(expert_output, st.pairs, st.recv_weights, st.dtype)
        if torch.is_grad_enabled() and row_out.requires_grad:
            (back,) = packed_all_to_all([row_out], st.out_splits, st.in_splits, self.group)
        else:  # inference: exchange the rows' bytes as they are, no packing copy
            raw = all_to_all_bytes(row_out.contiguous().view(torch.uint8), sum(st.in_splits), st.out_splits, st.in_splits, self.group)
            back = raw.view(st.dtype)
        return unpermute_combine(back, st.dest_map, None, out_dtype=st.dtype)
