"""Permute: scatter token rows to their (expert, slot) destination rows.

For every ``(t, j)`` with ``dest_map[t, j] >= 0``: ``out[dest_map[t, j]] = x[t]``. A token may go to
up to ``J`` destinations (e.g. its top-k experts, or several destination ranks); negative entries
are skipped. Valid destination rows never collide, and rows of ``out`` no entry targets are left as
they are, so ``out`` can be a column slice of a wider packed send buffer (or a dtype view of a
``uint8`` buffer) that other fields are written into.

A row past ``out`` (``dest_map >= N``): the reference raises ``IndexError``; the Triton kernel,
which checks nothing on the host (no sync), skips it and never writes outside ``out``. The
dispatchers build in-range maps.
"""

from __future__ import annotations

import torch

from moelayers.kernels import HAVE_TRITON, on_device_of, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _permute_kernel(
        x_ptr, dest_ptr, out_ptr, H, J, N, stride_x, stride_d, stride_o, BLOCK_H: tl.constexpr
    ):
        # One program per (token, block of H): load the row block once, store it J times.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        row = tl.load(x_ptr + t * stride_x + offs, mask=mask)
        for j in range(J):
            d = tl.load(dest_ptr + t * stride_d + j).to(tl.int64)
            # Skip d < 0 (and d >= N: never past out) by masking every column (a scalar & vector
            # mask trips the interpreter).
            row_mask = offs < tl.where((d >= 0) & (d < N), H, 0)
            d = tl.maximum(d, 0)  # keep the (masked-off) address in range
            tl.store(out_ptr + d * stride_o + offs, row, mask=row_mask)


def _check(x: torch.Tensor, dest_map: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 2 or dest_map.dim() != 2 or out.dim() != 2:
        raise ValueError(
            f"expected x [T, H], dest_map [T, J], out [N, H]; got {tuple(x.shape)}, "
            f"{tuple(dest_map.shape)}, {tuple(out.shape)}"
        )
    if dest_map.shape[0] != x.shape[0] or out.shape[1] != x.shape[1]:
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, dest_map {tuple(dest_map.shape)}, out {tuple(out.shape)}"
        )
    if dest_map.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dest_map must be int32 or int64, got {dest_map.dtype}")
    if out.dtype != x.dtype:
        raise TypeError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit stride along H, got strides {out.stride()}")


def permute_reference(x: torch.Tensor, dest_map: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pure-torch permute.

    Without gradient (``x`` does not require grad, or grad mode is off) it writes into ``out`` in
    place and returns ``out``. When ``x`` (or ``out``) requires grad and grad mode is on, it does
    NOT touch ``out``: it returns a fresh ``[N, H]`` tensor (``out``'s values with the targeted rows
    replaced) built with out-of-place index ops, so gradients flow back to ``x``. Callers must use
    the return value.

    Args:
        x: ``[T, H]`` token rows.
        dest_map: ``[T, J]`` int32/int64 destination row per (token, j); ``< 0`` means skip.
        out: ``[N, H]`` destination, same dtype as ``x``; ``out.stride(1) == 1``, any row stride.

    Returns:
        ``[N, H]``: ``out`` itself (no grad) or a new tensor (grad).
    """
    _check(x, dest_map, out)
    valid = dest_map >= 0
    tok = valid.nonzero(as_tuple=True)[0]  # [M] source token per valid entry
    rows = dest_map[valid].long()  # [M] destination row per valid entry
    if torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
        return out.index_put((rows,), x.index_select(0, tok))
    out[rows] = x.index_select(0, tok)
    return out


def permute_triton(x: torch.Tensor, dest_map: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton permute, in place into ``out`` (inference only; see :func:`permute_reference`).

    Args:
        x: ``[T, H]`` float32/bfloat16/float16/float64 token rows.
        dest_map: ``[T, J]`` int32/int64 destination rows, ``< 0`` means skip (any ``J``: the kernel loops over it).
        out: ``[N, H]`` destination, same dtype as ``x``; ``out.stride(1) == 1``, any row stride.

    Returns:
        ``out``, with the targeted rows written.
    """
    require_triton()
    _check(x, dest_map, out)
    T, H = x.shape
    if T == 0 or H == 0 or dest_map.shape[1] == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    dest_map = dest_map.contiguous()
    block_h = min(1024, triton.next_power_of_2(H))
    grid = (T, triton.cdiv(H, block_h))
    with on_device_of(x):
        _permute_kernel[grid](
            x, dest_map, out, H, dest_map.shape[1], out.shape[0], x.stride(0), dest_map.stride(0), out.stride(0),
            BLOCK_H=block_h,
        )
    return out


def permute(x: torch.Tensor, dest_map: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Scatter ``x [T, H]`` rows to ``out [N, H]`` rows given by ``dest_map [T, J]``.

    Uses :func:`permute_triton` when :func:`moelayers.kernels.use_triton` allows it, else
    :func:`permute_reference`. Always use the return value (with grad it is a new tensor).
    """
    if use_triton(x) and not (torch.is_grad_enabled() and out.requires_grad):
        return permute_triton(x, dest_map, out)
    return permute_reference(x, dest_map, out)
