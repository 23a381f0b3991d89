"""Packed, differentiable collectives over rows.

Several per-row tensors (hidden states, routing weights, slot ids) travel as one byte payload:
each row is their bytes side by side, padded to 16 bytes. A forward makes one collective; the
all-to-all's backward one too, the all-gather's one reduce-scatter per floating field with a
gradient (integer fields carry none).
"""

from __future__ import annotations

import hashlib
import math

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moelayers.groups import collective_device

#: the flat collectives under their current names: torch >= 2.13 calls them ``*_single`` and warns on
#: the old names, which are all that torch 2.11 has (same signatures)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap alike)
_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)


def fingerprint(values: torch.Tensor, *, chunk: int = 1 << 21) -> torch.Tensor:
    """Order-sensitive exact fingerprints of the rows of an integer tensor: ``[N, M] -> [N]`` int64.

    Each value is mixed with its position (splitmix64's finaliser) and the row's mixes are summed,
    wrapping: equal rows give equal fingerprints on any device, while a changed or reordered value
    changes it (a plain or position-weighted sum misses swaps that cancel). The values are taken in
    blocks of about ``chunk`` (whole rows, or parts of one long row: the wrapping sums do not depend
    on the blocks), so the temporaries take a few int64 blocks, tens of MiB at the default, whatever
    the rows' length (it was about 400 MiB at 2^24 values with the rows whole, and more for longer
    rows: reviews of ``load_full_weights``' memory).
    """
    if not values.dim():
        v = values.reshape(1, 1)
    else:  # (reshape cannot infer -1 for zero rows)
        v = values.reshape(values.shape[0], math.prod(values.shape[1:]))
    n, m = v.shape
    out = torch.zeros(n, dtype=torch.int64, device=v.device)
    rows, cols = max(1, chunk // max(m, 1)), max(1, min(m, chunk))
    for lo in range(0, n, rows):
        for c0 in range(0, m, cols):
            pos = torch.arange(c0, min(m, c0 + cols), dtype=torch.int64, device=v.device) * _MIX[0]
            x = v[lo:lo + rows, c0:c0 + cols].to(torch.int64) + pos  # (a new tensor: the steps below work in place)
            for shift, mix in ((30, _MIX[1]), (27, _MIX[2])):
                x ^= x >> shift
                x *= mix
            x ^= x >> 31
            out[lo:lo + rows] += x.sum(-1)
    return out


ROW_ALIGN = 16  # packed rows are padded to a multiple of this many bytes


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one payload row: fields ``(width, dtype)`` laid out in order."""

    fields: tuple[tuple[int, torch.dtype], ...]

    @property
    def offsets(self) -> list[int]:
        """Byte offset of each field in a row (each aligned to its item size)."""
        offs, pos = [], 0
        for width, dtype in self.fields:
            size = dtype.itemsize
            pos = -(-pos // size) * size  # align each field to its item size
            offs.append(pos)
            pos += width * size
        return offs

    @property
    def row_bytes(self) -> int:
        """Bytes per row: the fields, padded to a multiple of ``ROW_ALIGN``."""
        (width, dtype), last = self.fields[-1], self.offsets[-1]
        end = last + width * dtype.itemsize
        return -(-end // ROW_ALIGN) * ROW_ALIGN

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """An uninitialised ``[rows, row_bytes]`` uint8 buffer."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed ``[rows, width]`` views of each field of a ``[rows, row_bytes]`` uint8 buffer."""
        out = []
        for (width, dtype), off in zip(self.fields, self.offsets):
            nbytes = width * dtype.itemsize
            out.append(buf[:, off : off + nbytes].view(dtype))
        return out

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One ``[rows, row_bytes]`` uint8 buffer holding ``tensors`` (``[rows, width]`` each, in
        the order and dtypes of :attr:`fields`) side by side."""
        rows = tensors[0].shape[0]
        buf = self.empty(rows, tensors[0].device)
        for view, t in zip(self.views(buf), tensors):
            view.copy_(t)
        return buf


def all_to_all_bytes(buf: torch.Tensor, out_rows: int, in_splits: list[int], out_splits: list[int], group) -> torch.Tensor:
    """All-to-all-v of a ``[rows, bytes]`` uint8 buffer (rows split by destination rank)."""
    out = buf.new_empty(out_rows, buf.shape[1])
    if group is None:
        out.copy_(buf)
        return out
    dist.all_to_all_single(out, buf, out_splits, in_splits, group=group)
    return out


class PackedAllToAll(torch.autograd.Function):
    """All-to-all-v of several row tensors packed into one payload; backward is the reverse
    exchange of the packed gradients of the floating fields, itself a ``PackedAllToAll`` (so
    second-order gradients, ``create_graph=True``, flow through it too)."""

    @staticmethod
    def forward(ctx, group, in_splits, out_splits, *tensors):
        layout = RowLayout(tuple((t.shape[1], t.dtype) for t in tensors))
        recv = all_to_all_bytes(layout.pack(list(tensors)), sum(out_splits), in_splits, out_splits, group)
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.layout = group, in_splits, out_splits, layout
        return _typed_outputs(ctx, layout, recv, tensors)

    @staticmethod
    def backward(ctx, *grads):
        layout = ctx.layout
        floats = [i for i, f in enumerate(ctx.float_fields) if f]
        rows = sum(ctx.out_splits)
        parts = [
            grads[i] if grads[i] is not None else torch.zeros(rows, layout.fields[i][0], dtype=layout.fields[i][1],
                                                               device=_device_of(grads))
            for i in floats
        ]
        # the reverse exchange, recorded by autograd when the backward itself is (create_graph=True)
        views = iter(PackedAllToAll.apply(ctx.group, ctx.out_splits, ctx.in_splits, *parts))
        result = [next(views) if f else None for f in ctx.float_fields]
        return (None, None, None, *result)


def packed_all_to_all(tensors: list[torch.Tensor], in_splits: list[int], out_splits: list[int], group) -> list[torch.Tensor]:
    """Differentiable all-to-all-v of row tensors (same number of rows), one payload exchange.

    Args:
        tensors: ``[N_send, w_i]`` each; rows ordered by destination rank.
        in_splits: rows sent to each rank; out_splits: rows received from each rank.

    Returns:
        ``[N_recv, w_i]`` each, ordered by source rank.
    """
    return list(PackedAllToAll.apply(group, list(in_splits), list(out_splits), *tensors))


class AllGatherRows(torch.autograd.Function):
    """All-gather of ``[N, w]`` rows (equal ``N`` on every rank); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        if group is None:
            return x.clone()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, ReduceScatterRows.apply(ctx.group, grad)


class ReduceScatterRows(torch.autograd.Function):
    """Sum ``[R * N, w]`` over ranks and keep this rank's ``[N, w]`` block; backward all-gathers."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        if group is None:
            return x.clone()
        size = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
        reduce_scatter_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, AllGatherRows.apply(ctx.group, grad)


class GatherRowsSplitGrad(AllGatherRows):
    """:class:`AllGatherRows` whose result is *replicated*: every rank goes on with the same
    gathered tensor and gets the same gradient of it, so the backward keeps this rank's block of
    the gradient (not the sum over ranks, the adjoint for a gradient that is a partial sum on each
    rank)."""

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:
            return None, grad
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return None, grad[rank * n:(rank + 1) * n]


class ReduceScatterRowsSplitGrad(ReduceScatterRows):
    """:class:`ReduceScatterRows` whose input gradient is *replicated*: the backward all-gathers
    with :class:`GatherRowsSplitGrad`, so every rank goes on with the same full gradient of its
    partial sum, and in a double backward (``create_graph=True``) each rank's cotangent of that
    gradient, the same full one on every rank, is not summed over the ranks again."""

    @staticmethod
    def backward(ctx, grad):
        return None, GatherRowsSplitGrad.apply(ctx.group, grad)


class _SumToReplicated(torch.autograd.Function):
    """All-reduce (sum) of partial gradients into the replicated one, as :class:`CopyToGroup`'s
    backward: its own backward, in a double backward, passes the cotangent through (it is the same
    full one on every rank: the adjoint of the sum hands every part the whole)."""

    @staticmethod
    def forward(ctx, group, x):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, grad


class CopyToGroup(torch.autograd.Function):
    """Identity forward of a tensor every rank of ``group`` holds alike; the backward sums the
    ranks' gradients (each rank used part of it, or used it in a partial computation: megatron's
    ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group is None:
            return None, grad
        return None, _SumToReplicated.apply(ctx.group, grad)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over ``group`` in the backward (see :class:`CopyToGroup`)."""
    if group is None or not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return CopyToGroup.apply(group, x)


def allreduce_partial_grads(module: torch.nn.Module, group) -> None:
    """Sum over ``group`` the gradients of ``module``'s parameters marked ``sequence_parallel``
    (used on one chunk of the tokens per rank, e.g. an attention-TP ``SemanticMoE``'s router and
    the norm before it), as megatron does for sequence-parallel parameters. Call on every rank
    after the backward; a no-op for ``group=None``.

    The ranks first agree, in one small all-reduce, on which such parameters hold gradients (names,
    shapes, dtypes): a parameter frozen on some ranks only would pair one rank's router gradient
    with another's norm gradient. The gradients are then summed in one all-reduce per dtype
    (flattened together; a model's routers and norms are many small tensors).

    Raises:
        ValueError: on every rank of ``group``, when the ranks differ in those gradients.
    """
    if group is None:
        return
    named = [(n, p) for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)]
    held = [(n, p.grad) for n, p in named if p.grad is not None]
    layout = repr([(n, tuple(g.shape), str(g.dtype)) for n, g in held]).encode()
    digest = int.from_bytes(hashlib.blake2b(layout, digest_size=8).digest(), "little") >> 2
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if int(both[0]) != -int(both[1]):
        raise ValueError(f"allreduce_partial_grads: the ranks hold gradients of different sequence-parallel "
                         f"parameters (this rank {dist.get_rank(group)}: {[n for n, _ in held]}; a parameter "
                         "frozen or unused on some ranks only): train them alike on every rank of the group")
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, g in held:  # (the same order on every rank: their names, shapes and dtypes agree)
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for grads in buckets.values():
        if len(grads) == 1 and grads[0].is_contiguous():
            dist.all_reduce(grads[0], group=group)
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view(g.shape))


def _typed_outputs(ctx, layout: RowLayout, buf: torch.Tensor, tensors) -> tuple[torch.Tensor, ...]:
    """The received fields as typed views; integer fields are marked non-differentiable."""
    ctx.float_fields = [t.dtype.is_floating_point for t in tensors]
    outs = layout.views(buf)
    for o, is_float in zip(outs, ctx.float_fields):
        if not is_float:
            ctx.mark_non_differentiable(o)
    return tuple(outs)


def _device_of(grads) -> torch.device:
    for g in grads:
        if g is not None:
            return g.device
    return torch.device("cpu")


class PackedAllGather(torch.autograd.Function):
    """All-gather of several row tensors packed into one payload (equal rows on every rank);
    backward reduce-scatters the gradient of each floating field."""

    @staticmethod
    def forward(ctx, group, *tensors):
        layout = RowLayout(tuple((t.shape[1], t.dtype) for t in tensors))
        buf = layout.pack(list(tensors))
        if group is None:
            out = buf
        else:
            out = buf.new_empty(dist.get_world_size(group) * buf.shape[0], buf.shape[1])
            all_gather_flat(out, buf, group=group)
        ctx.group = group
        return _typed_outputs(ctx, layout, out, tensors)

    @staticmethod
    def backward(ctx, *grads):
        result = []
        for g, is_float in zip(grads, ctx.float_fields):
            result.append(ReduceScatterRows.apply(ctx.group, g) if is_float and g is not None else None)
        return (None, *result)


def packed_all_gather(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Differentiable all-gather of row tensors ``[N, w_i]`` -> ``[R * N, w_i]``, one exchange."""
    return list(PackedAllGather.apply(group, *tensors))
