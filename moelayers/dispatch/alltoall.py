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

from moelayers._compile import cached_tensor
from moelayers.dispatch.base import (LocalPairs, Received, Routes, check_routes, combine_pairs, dense_pairs, local_pairs,
                                     partial_sum_dtype)
from moelayers.dispatch.flags import (
    HEADER_DIGEST, HEADER_FLAGS, HEADER_PAIRS, HEADER_ROWS, check_exchanged, payload_digest, payload_dtypes,
    raise_if_flagged,
)
from moelayers.dispatch.comm import ROW_ALIGN, RowLayout, all_to_all_bytes, packed_all_to_all
from moelayers.kernels import dispatch_pack, send_layout, unpermute_combine
from moelayers.metrics import MoEStats


@dataclass
class _State:
    dest_map: torch.Tensor  # [T, U]
    rows_sent: list[int]  # payload rows this rank sent to each rank
    rows_received: list[int]  # and received from each
    recv_weights: torch.Tensor  # [M, J]
    pairs: LocalPairs
    dtype: torch.dtype


@dataclass
class _Alone:
    """``combine``'s state after :meth:`AllToAllDispatcher._dispatch_alone`."""

    pairs: LocalPairs
    weights: torch.Tensor  # [T, K]
    dtype: torch.dtype


class AllToAllDispatcher:
    """Expert-parallel dispatch over ``group`` with all-to-all-v.

    Args:
        group: expert-parallel process group (``None`` for a single process).
        num_ranks: size of ``group``; rank: this rank in it.
        num_slots: physical slots per rank ``S``.
        dedup: send a token once per destination rank (default) instead of once per expert.
        capacity: fixed-size mode (like DeepEP's low-latency mode). Every rank passes exactly
            ``capacity`` tokens (the layer pads; padding tokens carry ``dest_rank == -1``) and sends
            ``capacity`` rows to every rank, unused rows flagged by slot ``-1``: no split sizes, no
            host sync, static shapes, so the whole forward can be captured in a CUDA graph. Costs
            bandwidth for rows a rank does not need. ``None`` (default): exact all-to-all-v.
        placement_digest: the layer's 62-bit digest of its placement
            (:meth:`~moelayers.placement.ExpertPlacement.digest`) and payload settings, sent with the
            split sizes (in capacity mode: with the flags of every row) so that ranks serving
            different placements or settings raise instead of mixing them.
    """

    def __init__(self, group, num_ranks: int, rank: int, num_slots: int, *, dedup: bool = True,
                 capacity: int | None = None, placement_digest: int = 0):
        if capacity is not None and (not dedup or capacity < 1):
            raise ValueError(f"capacity mode needs dedup=True and capacity >= 1, got dedup={dedup}, capacity={capacity}")
        self.group, self.num_ranks, self.rank, self.num_slots = group, num_ranks, rank, num_slots
        self.dedup, self.capacity = dedup, capacity
        self.placement_digest = int(placement_digest)  # exchanged with the counts: the ranks must agree
        self.last_stats: MoEStats | None = None
        # capacity mode: [R, 4] int32, every rank's header (its routing flag word, whether it had more tokens
        # than the capacity, its placement digest in two 31-bit halves), read after the forward
        self.header: torch.Tensor | None = None
        self.payload: tuple = ()  # the last forward's payload_dtypes (named when the ranks' digests differ)
        self.fixed_counts: torch.Tensor | None = None  # capacity mode: [2, R] activations and rows sent per rank
        self.fixed_bytes: list[int] | None = None  # capacity mode: bytes sent to each rank

    # ------------------------------------------------------------------ step 3
    def dispatch(self, x: torch.Tensor, routes: Routes) -> Received:
        """Step 3: send each token's rows to the ranks in ``routes`` (one all-to-all-v; in capacity
        mode, a fixed-size all-to-all), a collective over ``group``. Alone (one rank, with
        de-duplication) nothing is packed or exchanged: the pairs come straight from the tokens.

        Args:
            x: ``[T, H]`` this rank's tokens.
            routes: ``dest_rank`` / ``dest_slot`` ``[T, K]`` and ``weights [T, K]`` (:class:`Routes`).

        Returns:
            :class:`Received`: ``expert_input [P, H]``, one row per (token, local slot) pair that
            reached this rank, sorted by slot, and ``slot_counts [S]``.
        """
        routes = check_routes(routes, self.num_ranks, self.num_slots, padding=self.capacity is not None)
        if self.capacity is not None:
            return self._dispatch_fixed(x, routes)
        if self.num_ranks == 1 and self.dedup:  # (no group, or a group of one: an exchange with itself)
            return self._dispatch_alone(x, routes)
        return self._dispatch_exchange(x, routes)

    def _dispatch_exchange(self, x: torch.Tensor, routes: Routes) -> Received:
        """The all-to-all-v exchange (:meth:`dispatch` without capacity)."""
        self.payload = payload_dtypes(x, routes.weights.dtype)
        dest_map, header = self._layout(routes, payload_digest(self.placement_digest, self.payload))
        rows_sent, rows_received, pairs_sent, recv_pairs = self._exchange_counts(header)

        j = routes.dest_rank.shape[1] if self.dedup else 1
        layout = RowLayout(((x.shape[1], x.dtype), (j, routes.weights.dtype), (j, torch.int32)))
        n_send, n_recv = sum(rows_sent), sum(rows_received)
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or routes.weights.requires_grad)
        if self.dedup and not needs_grad:
            # de-duplicated, no autograd: one pass writes tokens and metadata straight into the payload
            buf = layout.empty(n_send, x.device)
            xv, wv, sv = layout.views(buf)
            dispatch_pack(x, dest_map, routes.dest_rank, routes.dest_slot, routes.weights, xv, wv, sv)
            recv_x, recv_w, recv_s = layout.views(all_to_all_bytes(buf, n_recv, rows_sent, rows_received, self.group))
        else:
            rows, row_w, row_s = self._rows(x, routes, dest_map, n_send)
            recv_x, recv_w, recv_s = packed_all_to_all([rows, row_w, row_s], rows_sent, rows_received, self.group)

        pairs = local_pairs(recv_s, self.num_slots, recv_pairs)
        self.last_stats = MoEStats.from_counts(self.rank, pairs_sent, rows_sent, layout.row_bytes, routes.topk_ids)
        state = _State(dest_map, rows_sent, rows_received, recv_w, pairs, x.dtype)
        return Received(recv_x.index_select(0, pairs.pair_row), pairs.slot_counts, state)

    def _dispatch_alone(self, x: torch.Tensor, routes: Routes) -> Received:
        """One rank (no group, or a group of one): no payload to pack, exchange or unpack (its
        launches were most of a small forward's host time on a GPU). The same pairs in the same
        order, the same flag checks and statistics, and the same outputs bit for bit as the
        exchange through a group of one (whose digests cannot differ and whose bytes sent are 0)."""
        self.payload = payload_dtypes(x, routes.weights.dtype)
        if routes.nonfinite is not None:
            raise_if_flagged([int(routes.nonfinite)])  # (the one host sync, as the header's)
        t, k = routes.dest_slot.shape
        pairs = dense_pairs(routes.dest_slot, self.num_slots)  # (every route is to this rank, in range)
        self.last_stats = MoEStats.from_counts(self.rank, [t * k], [t], 0, routes.topk_ids)
        state = _Alone(pairs, routes.weights, x.dtype)
        return Received(x.index_select(0, pairs.pair_row), pairs.slot_counts, state)

    def _dispatch_fixed(self, x: torch.Tensor, routes: Routes) -> Received:
        """Capacity mode: static shapes, no host sync (see the class docstring)."""
        c, r = self.capacity, self.num_ranks
        t, k = routes.dest_rank.shape
        if t != c:
            raise ValueError(f"capacity mode expects exactly {c} tokens (pad them), got {t}")
        if torch.is_grad_enabled() and (x.requires_grad or routes.weights.requires_grad):
            raise ValueError("capacity mode is inference-only: run it under torch.no_grad()/inference_mode(), "
                             "or build the layer without capacity for training")
        dev = x.device
        ranks = torch.arange(r, device=dev)
        per_rank = (routes.dest_rank[:, :, None] == ranks).sum(1)  # [T, R] activations; -1 = padding
        dest_map = _fixed_rows(c, r, dev)  # row r*C + t holds token t for rank r
        no = torch.zeros((), dtype=torch.bool, device=dev)
        self.payload = payload_dtypes(x, routes.weights.dtype)
        flags = torch.cat([torch.stack([no if routes.nonfinite is None else routes.nonfinite,
                                        no if routes.overflow is None else routes.overflow]).to(torch.int32),
                           self._digest_halves(dev, payload_digest(self.placement_digest, self.payload))])
        layout = RowLayout(((x.shape[1], x.dtype), (k, routes.weights.dtype), (k, torch.int32), (4, torch.int32)))
        buf = layout.empty(r * c, dev)
        xv, wv, sv, fv = layout.views(buf)
        dispatch_pack(x, dest_map, routes.dest_rank, routes.dest_slot, routes.weights, xv, wv, sv)
        fv.copy_(flags.expand(r * c, 4))
        recv = all_to_all_bytes(buf, r * c, [c] * r, [c] * r, self.group)
        recv_x, recv_w, recv_s, recv_f = layout.views(recv)
        self.header = recv_f[::c]  # row r * C comes from rank r
        pairs = local_pairs(recv_s, self.num_slots, static=True)
        self.fixed_counts = torch.stack([per_rank.sum(0), (per_rank > 0).sum(0)])  # [2, R] on the device
        self.fixed_bytes = [0 if i == self.rank else c * layout.row_bytes for i in range(r)]
        self.last_stats = MoEStats.deferred(self.rank, self.fixed_counts[0], self.fixed_counts[1],
                                            self.fixed_bytes, routes.topk_ids)
        state = _State(dest_map, [c] * r, [c] * r, recv_w, pairs, x.dtype)
        return Received(recv_x.index_select(0, pairs.pair_row), pairs.slot_counts, state)

    @staticmethod
    def _digest_halves(device: torch.device, d: int) -> torch.Tensor:
        """``[2]`` int32: the digest's low and high 31 bits (a fill, so it can be captured)."""
        return torch.stack([torch.full((), d & _LOW31, dtype=torch.int32, device=device),
                            torch.full((), (d >> 31) & _LOW31, dtype=torch.int32, device=device)])

    def _layout(self, routes: Routes, digest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send-buffer row of every unit (``-1`` unused) and the ``[R, 4]`` header the ranks
        exchange: rows and activations per rank, the routing flag and the digest (placement,
        settings and payload dtypes: :func:`~moelayers.dispatch.flags.payload_digest`)."""
        dest_map, header = send_layout(routes.dest_rank, self.num_ranks, routes.nonfinite, digest)
        if self.dedup:
            return dest_map, header
        # one row per (token, k), ordered by rank: as many rows as activations
        t, k = routes.dest_rank.shape
        order = torch.argsort(routes.dest_rank.flatten(), stable=True)
        dest_map = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        header[:, HEADER_ROWS] = header[:, HEADER_PAIRS]
        return dest_map.view(t, k), header

    def _exchange_counts(self, header: torch.Tensor):
        """The one small exchange and the one host sync: every rank's header (split sizes,
        activation counts, routing flag word and digest: the ``HEADER_*`` columns), so that every
        rank raises together on bad routing or mixed placements, and none hangs. Returns the split
        sizes sent and received, the pairs sent per rank and the pairs received in all."""
        recv = torch.empty_like(header)
        if self.group is None:
            recv.copy_(header)
        else:
            dist.all_to_all_single(recv, header, group=self.group)
        host = torch.cat([header, recv], 1).tolist()  # (one host sync for both)
        sent, got = [row[:4] for row in host], [row[4:] for row in host]
        check_exchanged([row[HEADER_FLAGS] for row in got], [row[HEADER_DIGEST] for row in got], together=True)
        return ([row[HEADER_ROWS] for row in sent], [row[HEADER_ROWS] for row in got],
                [row[HEADER_PAIRS] for row in sent], sum(row[HEADER_PAIRS] for row in got))

    def _rows(self, x, routes: Routes, dest_map: torch.Tensor, n_send: int):
        """Differentiable payload rows: tokens, weights and int32 slots in send order."""
        t, k = routes.dest_rank.shape
        dev = x.device
        if self.dedup:
            mine = routes.dest_rank[:, None, :] == torch.arange(self.num_ranks, device=dev)[None, :, None]
            unit_slots = torch.where(mine, routes.dest_slot[:, None, :], -1)  # [T, R, K]
            unit_weights = torch.where(mine, routes.weights[:, None, :], 0)
        else:
            unit_slots, unit_weights = routes.dest_slot[..., None], routes.weights[..., None]
        j = unit_slots.shape[-1]
        # invert dest_map without a sync: unused units write to a dummy row n_send
        target = torch.where(dest_map >= 0, dest_map, n_send).flatten()
        unit_of_row = torch.empty(n_send + 1, dtype=torch.int64, device=dev)
        unit_of_row.scatter_(0, target, torch.arange(target.numel(), device=dev))
        unit_of_row = unit_of_row[:n_send]
        rows = x.index_select(0, unit_of_row // dest_map.shape[1])  # the token of each row: no sync, differentiable
        return rows, unit_weights.reshape(-1, j)[unit_of_row], unit_slots.reshape(-1, j)[unit_of_row].to(torch.int32)

    # ------------------------------------------------------------------ step 5
    def combine(self, expert_output: torch.Tensor, received: Received) -> torch.Tensor:
        """Step 5: weight ``expert_output [P, H]`` (rows as :meth:`dispatch` delivered them), sum
        each token's rows on the rank that computed them, send the partial sums back (the reverse
        all-to-all) and add them up: ``y [T, H] = sum_k w_k * expert_k(x)`` in the order of ``x``."""
        st = received.state
        if isinstance(st, _Alone):  # (one rounding into the layer's dtype, as the partial sums' return trip)
            return unpermute_combine(expert_output, st.pairs.index, st.weights, out_dtype=st.dtype,
                                     all_valid=True)  # (every (token, k) computed here: an inverse permutation)
        wire = partial_sum_dtype(st.dtype)  # the rows are partial sums over this rank's experts
        row_out = combine_pairs(expert_output, st.pairs, st.recv_weights, wire)
        # the rows' size on the wire must not depend on this rank's autograd state (a peer may record
        # a graph where this one does not): raw rows only where they are already the packed size
        packed_size = (row_out.shape[1] * row_out.element_size()) % ROW_ALIGN == 0
        if (torch.is_grad_enabled() and row_out.requires_grad) or not packed_size:
            # each rank sends the rows it received back where they came from
            (back,) = packed_all_to_all([row_out], st.rows_received, st.rows_sent, self.group)
        else:  # inference: exchange the rows' bytes as they are, no packing copy
            raw = all_to_all_bytes(row_out.contiguous().view(torch.uint8), sum(st.rows_sent),
                                   st.rows_received, st.rows_sent, self.group)
            back = raw.view(wire)
        return unpermute_combine(back, st.dest_map, None, out_dtype=st.dtype)


_LOW31 = (1 << 31) - 1
_FIXED_ROWS: dict[tuple, torch.Tensor] = {}


def _fixed_rows(capacity: int, num_ranks: int, device: torch.device) -> torch.Tensor:
    """``[C, R]`` map of capacity mode: token ``t`` for rank ``r`` is row ``r * C + t`` (cached)."""
    def make() -> torch.Tensor:
        return torch.arange(capacity, device=device)[:, None] + capacity * torch.arange(num_ranks, device=device)[None, :]

    return cached_tensor(_FIXED_ROWS, (capacity, num_ranks, device), make)

