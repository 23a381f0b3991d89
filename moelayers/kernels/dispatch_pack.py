"""Dispatch pack: fill a de-duplicated all-to-all payload in one pass.

For every (token ``t``, destination rank ``r``) with ``dest_map[t, r] = row >= 0``:

- ``x_out[row] = x[t]``;
- ``s_out[row, k] = dest_slot[t, k]`` if ``dest_rank[t, k] == r`` else ``-1``;
- ``w_out[row, k] = weights[t, k]`` if ``dest_rank[t, k] == r`` else ``0``.

The three outputs are typically typed views of one ``uint8`` payload buffer (see
``moelayers.dispatch.comm.RowLayout``), so one launch writes the whole send buffer: the token
rows and the routing metadata each destination rank needs.

A row past the outputs (``dest_map >= N``): the reference raises ``IndexError``; the Triton
kernel, which checks nothing on the host (no sync), skips it and never writes outside them.
"""

from __future__ import annotations

import torch

from moelayers.kernels import HAVE_TRITON, on_device_of, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _dispatch_pack_kernel(
        x_ptr, map_ptr, rank_ptr, slot_ptr, w_ptr, xo_ptr, so_ptr, wo_ptr,
        H, R, K, N, stride_x, stride_xo, stride_so, stride_wo,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # One program per (token, block of H): the row block is loaded once and stored to every
        # destination rank; the programs of the first H block also write the metadata.
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        row = tl.load(x_ptr + t * stride_x + offs, mask=offs < H)
        koffs = tl.arange(0, BLOCK_K)
        kmask = koffs < K
        ranks = tl.load(rank_ptr + t * K + koffs, mask=kmask, other=-1)
        slots = tl.load(slot_ptr + t * K + koffs, mask=kmask, other=-1)
        weights = tl.load(w_ptr + t * K + koffs, mask=kmask, other=0.0)
        for r in range(R):
            d = tl.load(map_ptr + t * R + r).to(tl.int64)
            # scalar conditions become column bounds (scalar & vector masks trip the interpreter);
            # a row past the outputs (d >= N) is skipped like d < 0
            ok = (d >= 0) & (d < N)
            row_mask = offs < tl.where(ok, H, 0)
            meta_mask = koffs < tl.where(ok & (hb == 0), K, 0)
            d = tl.maximum(d, 0)
            tl.store(xo_ptr + d * stride_xo + offs, row, mask=row_mask)
            mine = ranks == r
            tl.store(so_ptr + d * stride_so + koffs, tl.where(mine, slots, -1).to(tl.int32), mask=meta_mask)
            tl.store(wo_ptr + d * stride_wo + koffs, tl.where(mine, weights, 0.0).to(wo_ptr.dtype.element_ty),
                     mask=meta_mask)


def _check(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out) -> None:
    """Shapes, dtypes and the unit inner strides the kernel's row addressing assumes (a strided
    view would be written as if it were contiguous)."""
    if x.dim() != 2 or dest_map.dim() != 2 or dest_map.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [T, H] and dest_map [T, R], got {tuple(x.shape)}, {tuple(dest_map.shape)}")
    t, h = x.shape
    if dest_rank.dim() != 2 or dest_rank.shape[0] != t or dest_slot.shape != dest_rank.shape \
            or weights.shape != dest_rank.shape:
        raise ValueError(f"dest_rank, dest_slot and weights must be [T={t}, K], got {tuple(dest_rank.shape)}, "
                         f"{tuple(dest_slot.shape)}, {tuple(weights.shape)}")
    k = dest_rank.shape[1]
    if x_out.dim() != 2 or x_out.shape[1] != h or w_out.shape != (x_out.shape[0], k) or s_out.shape != w_out.shape:
        raise ValueError(f"expected x_out [N, H={h}], w_out and s_out [N, K={k}], got {tuple(x_out.shape)}, "
                         f"{tuple(w_out.shape)}, {tuple(s_out.shape)}")
    for name, a in (("dest_map", dest_map), ("dest_rank", dest_rank), ("dest_slot", dest_slot)):
        if a.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {a.dtype}")
    if x_out.dtype != x.dtype or s_out.dtype != torch.int32 or not w_out.dtype.is_floating_point:
        raise TypeError(f"x_out must be {x.dtype} (got {x_out.dtype}), s_out int32 (got {s_out.dtype}), w_out "
                        f"floating (got {w_out.dtype})")
    for name, a in (("x_out", x_out), ("w_out", w_out), ("s_out", s_out)):
        if a.shape[1] > 1 and a.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension, got strides {a.stride()}")


def dispatch_pack_reference(
    x: torch.Tensor, dest_map: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor,
    weights: torch.Tensor, x_out: torch.Tensor, w_out: torch.Tensor, s_out: torch.Tensor,
) -> None:
    """Pure-torch dispatch pack, in place (no autograd).

    Args:
        x: ``[T, H]`` tokens; dest_map: ``[T, R]`` payload row per (token, rank), ``-1`` = none.
        dest_rank, dest_slot: ``[T, K]`` destination of each (token, k); weights: ``[T, K]``.
        x_out: ``[N, H]``, w_out: ``[N, K]``, s_out: ``[N, K]`` int32 outputs (views allowed).

    Raises:
        ValueError, TypeError: as :func:`dispatch_pack_triton` (the same checks on every path).
    """
    _check(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out)
    tok, rank = (dest_map >= 0).nonzero(as_tuple=True)
    rows = dest_map[tok, rank]
    mine = dest_rank[tok] == rank[:, None]
    x_out[rows] = x[tok]
    s_out[rows] = torch.where(mine, dest_slot[tok], -1).to(s_out.dtype)
    w_out[rows] = torch.where(mine, weights[tok], 0).to(w_out.dtype)


def dispatch_pack_triton(
    x: torch.Tensor, dest_map: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor,
    weights: torch.Tensor, x_out: torch.Tensor, w_out: torch.Tensor, s_out: torch.Tensor,
) -> None:
    """Triton dispatch pack (same contract as :func:`dispatch_pack_reference`).

    Raises:
        ValueError, TypeError: shapes or dtypes off the contract, or an output whose last
            dimension is not contiguous.
    """
    require_triton()
    _check(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out)
    t, h = x.shape
    k = dest_rank.shape[1]
    if t == 0:
        return
    if h == 0 or k == 0:  # no row or no metadata to write: blocks of size 0 do not compile
        dispatch_pack_reference(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out)
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    dest_map, dest_rank, dest_slot, weights = (a.contiguous() for a in (dest_map, dest_rank, dest_slot, weights))
    block_h = min(1024, triton.next_power_of_2(h))
    grid = (t, triton.cdiv(h, block_h))
    with on_device_of(x):
        _dispatch_pack_kernel[grid](
            x, dest_map, dest_rank, dest_slot, weights, x_out, s_out, w_out,
            h, dest_map.shape[1], k, x_out.shape[0], x.stride(0), x_out.stride(0), s_out.stride(0), w_out.stride(0),
            BLOCK_H=block_h, BLOCK_K=triton.next_power_of_2(k),
        )


def dispatch_pack(
    x: torch.Tensor, dest_map: torch.Tensor, dest_rank: torch.Tensor, dest_slot: torch.Tensor,
    weights: torch.Tensor, x_out: torch.Tensor, w_out: torch.Tensor, s_out: torch.Tensor,
) -> None:
    """Fill the de-duplicated payload: the Triton kernel on CUDA, else the torch reference."""
    if use_triton(x):
        dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out)
    else:
        dispatch_pack_reference(x, dest_map, dest_rank, dest_slot, weights, x_out, w_out, s_out)
