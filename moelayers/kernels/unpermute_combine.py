"""Unpermute + combine: gather expert-output rows back to token order and sum them, weighted.

``out[t] = sum_{j : index[t, j] >= 0} weight[t, j] * src[index[t, j]]``, accumulated in float32
(float64 when ``src`` is float64) and cast once to ``out_dtype``. Tokens with no valid entry get
zeros. ``src`` may be a strided row view (e.g. a column slice of a packed receive buffer).

A row past ``src`` (``index >= N``): the reference raises ``IndexError``; the Triton kernels, which
check nothing on the host (no sync), read it as zeros (and give it no gradient) and never touch
memory outside ``src``. Rows of an empty ``src`` are refused on both paths (a sync, only then).

Three paths, one result: the reference (pure torch), the lean autograd path (the reference's
operations in chunks, saving only the inputs for the backward) and Triton (forward and backward
kernels, nothing ``[T, J, H]``-sized in memory).
"""

from __future__ import annotations

import torch

from moelayers._dtypes import to_dtype
from moelayers.kernels import HAVE_TRITON, on_device_of, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _unpermute_combine_kernel(
        src_ptr, idx_ptr, w_ptr, out_ptr, H, J, N, stride_s, stride_i, stride_w, stride_o,
        HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # One program per (token, block of H): J masked row loads, one accumulator, one store.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=ACC)
        for j in range(J):
            r = tl.load(idx_ptr + t * stride_i + j).to(tl.int64)
            valid = (r >= 0) & (r < N)  # r >= N: never read past src
            # Skip r < 0 by masking every column (a scalar & vector mask trips the interpreter).
            row_mask = offs < tl.where(valid, H, 0)
            r = tl.maximum(r, 0)  # keep the (masked-off) address in range
            v = tl.load(src_ptr + r * stride_s + offs, mask=row_mask, other=0.0).to(ACC)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + t * stride_w + j).to(ACC)
                v = v * tl.where(valid, w, 0.0)
            acc += v
        tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _unpermute_combine_backward_kernel(
        g_ptr, src_ptr, idx_ptr, w_ptr, gsrc_ptr, gw_ptr, H, J, N,
        stride_g, stride_s, stride_i, stride_w, stride_gs,
        HAS_WEIGHT: tl.constexpr, NEED_SRC: tl.constexpr, NEED_W: tl.constexpr, ACC: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program per token: for each of its J rows, add w * g into the row's gradient (atomics:
        # a row may be gathered twice) and dot(g, src row) into the weight's gradient.
        t = tl.program_id(0).to(tl.int64)
        for j in range(J):
            r = tl.load(idx_ptr + t * stride_i + j).to(tl.int64)
            valid = (r >= 0) & (r < N)
            r = tl.maximum(r, 0)
            width = tl.where(valid, H, 0)  # masks every column of an invalid entry
            if HAS_WEIGHT:
                w = tl.load(w_ptr + t * stride_w + j).to(ACC)
            else:
                w = 1.0
            dot = tl.zeros([BLOCK_H], dtype=ACC)
            for h in range(0, H, BLOCK_H):
                offs = h + tl.arange(0, BLOCK_H)
                row_mask = offs < width
                g = tl.load(g_ptr + t * stride_g + offs, mask=row_mask, other=0.0).to(ACC)
                if NEED_SRC:
                    tl.atomic_add(gsrc_ptr + r * stride_gs + offs, g * w, mask=row_mask, sem="relaxed")
                if NEED_W:
                    dot += g * tl.load(src_ptr + r * stride_s + offs, mask=row_mask, other=0.0).to(ACC)
            if NEED_W:
                tl.store(gw_ptr + t * J + j, tl.sum(dot, axis=0))


def _check(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None) -> None:
    if src.dim() != 2 or index.dim() != 2:
        raise ValueError(f"expected src [N, H], index [T, J]; got {tuple(src.shape)}, {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index must be int32 or int64, got {index.dtype}")
    if weight is not None and weight.shape != index.shape:
        raise ValueError(f"weight {tuple(weight.shape)} must match index {tuple(index.shape)}")
    if src.shape[1] > 1 and src.stride(1) != 1:
        raise ValueError(f"src must have unit stride along H, got strides {src.stride()}")
    if src.shape[0] == 0 and index.numel() and bool((index >= 0).any()):  # a sync, only when src has no rows
        raise IndexError(f"index holds row {int(index.max())} of src, which has no rows (only -1 can be asked)")


def _acc_dtype(src: torch.Tensor) -> torch.dtype:
    return torch.float64 if src.dtype == torch.float64 else torch.float32


def unpermute_combine_reference(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """Pure-torch unpermute + weighted combine; differentiable w.r.t. ``src`` and ``weight``.

    Args:
        src: ``[N, H]`` rows to gather (``stride(1) == 1``); ``N`` may be 0.
        index: ``[T, J]`` int32/int64 row of ``src`` per (token, j); ``< 0`` means none.
        weight: ``[T, J]`` combine weights, or None for all ones. Ignored where ``index < 0``.
        out_dtype: result dtype; default ``src.dtype``.
        all_valid: the caller knows every entry of ``index`` is a row of ``src`` (one rank's pairs:
            an inverse permutation). The masks are then skipped: they would keep every value as it is.

    Returns:
        ``[T, H]`` in ``out_dtype``; zeros for tokens with no valid index.
    """
    _check(src, index, weight)
    acc = _acc_dtype(src)
    H = src.shape[1]
    if src.shape[0] == 0:  # every index is -1 (_check); keep a (zero) row so indexing stays valid
        src = torch.cat([src, src.new_zeros(1, H)])
    index = to_dtype(index, torch.int64)
    if all_valid:
        rows = to_dtype(_gather(src, index), acc)  # [T, J, H]
        if weight is not None:
            rows = rows * to_dtype(weight, acc).unsqueeze(-1)
        return to_dtype(rows.sum(dim=1), out_dtype or src.dtype)
    valid = index >= 0  # [T, J]
    rows = to_dtype(_gather(src, index.clamp(min=0)), acc)  # [T, J, H]
    rows = torch.where(valid.unsqueeze(-1), rows, rows.new_zeros(()))
    if weight is not None:
        w = torch.where(valid, to_dtype(weight, acc), weight.new_zeros((), dtype=acc))
        rows = rows * w.unsqueeze(-1)
    out = rows.sum(dim=1)  # J = 0: zeros, still in the autograd graph of src and weight
    return to_dtype(out, out_dtype or src.dtype)


#: Batches whose ``[T, J, H]`` temporaries (in the accumulation dtype) take at most this take the
#: reference itself: what it saves for the backward is small, and its backward runs in C++ (small
#: batches are host-bound on GPUs).
_SMALL_BYTES = 32 << 20
#: Larger ones go through :class:`_UnpermuteCombine` in chunks of tokens whose temporaries take at
#: most this: one chunk up to 4,096 tokens of Qwen3-30B-A3B's layer (top-8, H = 2,048), as few kernels
#: as the reference (chunks of 32 MiB made a DeepSeek-V2-Lite training step at 4,096 tokens 20 % slower on H100).
_CHUNK_BYTES = 256 << 20


class _UnpermuteCombine(torch.autograd.Function):
    """:func:`unpermute_combine_reference`'s operations on chunks of tokens whose ``[c, J, H]``
    tensors in the accumulation dtype take at most ``_CHUNK_BYTES`` each (two or three live at once);
    it saves only its inputs for the backward (the reference saves ``[T, J, H]`` float32 rows)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
        acc = _acc_dtype(src)
        out = torch.empty(index.shape[0], src.shape[1], dtype=out_dtype, device=src.device)
        for tokens, rows, valid in _chunks(src, index):
            part = _gather(src, rows).to(acc)  # [c, J, H]
            if weight is not None:
                part = part * weight[tokens, :, None].to(acc)
            out[tokens] = torch.where(valid[..., None], part, 0.0).sum(dim=1)
        ctx.save_for_backward(src, index, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        src, index, weight = ctx.saved_tensors
        grad_src, grad_w = _combine_backward_lean(grad_out, src, index, weight, *ctx.needs_input_grad[0:3:2])
        return grad_src, None, grad_w, None


def _combine_backward_lean(grad_out, src, index, weight, need_src: bool, need_w: bool):
    """The reference's backward in chunks of tokens, in torch operations (differentiable: a double
    backward records it): ``(grad_src [N, H] in src.dtype or None, grad_weight [T, J] or None)``."""
    acc = _acc_dtype(src)
    g = grad_out.to(acc)
    # in src's dtype, as the reference's gather backward adds (each row gathered once gets one exact sum)
    grad_src = torch.zeros_like(src) if need_src else None
    grad_w = torch.empty(index.shape, dtype=acc, device=src.device) if need_w else None
    for tokens, rows, valid in _chunks(src, index):
        g_rows = g[tokens, None, :]  # [c, 1, H]
        if grad_src is not None:  # (invalid entries add exact zeros to row 0: no host sync for a mask)
            part = g_rows.expand(-1, index.shape[1], -1) if weight is None else (
                g_rows * weight[tokens, :, None].to(acc))
            part = torch.where(valid[..., None], part, 0.0).to(src.dtype)
            grad_src.index_add_(0, rows.flatten(), part.reshape(-1, src.shape[1]))  # as _gather's backward
        if grad_w is not None:
            grad_w[tokens] = torch.where(valid, (g_rows * _gather(src, rows).to(acc)).sum(-1), 0.0)
    return grad_src, None if grad_w is None else grad_w.to(weight.dtype)


def _gather(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``src[rows]`` (``rows`` any shape, int64, in range) through ``index_select``, whose backward
    adds with ``index_add_``. ``src[rows]``'s backward (``index_put_`` with accumulate) sorts the rows
    first: about 1 ms per call at 24k rows of 2,048 on an H100, 60 % of a DeepSeek-V2-Lite training
    step at 4,096 tokens per rank. ``index_add_`` adds with atomics: the same sums bit for bit where
    every row of ``src`` is gathered at most once (the layers' case: one row per (token, expert) or
    (token, rank); ``-1`` entries add exact zeros), and torch sorts as ``index_put_`` does under
    ``torch.use_deterministic_algorithms(True)``."""
    return src.index_select(0, rows.flatten()).view(*rows.shape, src.shape[1])


def _token_bytes(src: torch.Tensor, index: torch.Tensor) -> int:
    """Bytes of one token's ``[J, H]`` rows in the accumulation dtype."""
    return index.shape[1] * src.shape[1] * torch.finfo(_acc_dtype(src)).bits // 8


def _chunks(src: torch.Tensor, index: torch.Tensor):
    """Chunks of tokens whose ``[c, J, H]`` temporaries take at most ``_CHUNK_BYTES``: ``(tokens
    (a slice), rows [c, J] int64, valid [c, J] bool)``, ``-1`` entries pointing at row 0 (a row past
    ``src`` raises ``IndexError``, as in the reference)."""
    step = max(1, _CHUNK_BYTES // max(1, _token_bytes(src, index)))
    for start in range(0, index.shape[0], step):
        tokens = slice(start, start + step)
        column = index[tokens].long()
        yield tokens, column.clamp(min=0), column >= 0


def unpermute_combine_lean(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """:func:`unpermute_combine_reference` (same arguments, the same output bit for bit,
    differentiable w.r.t. ``src`` and ``weight``) that saves for the backward only its inputs, not
    the reference's ``[T, J, H]`` float32 rows, and works in chunks of tokens whose ``[c, J, H]``
    float32 tensors take at most 256 MiB each: the autograd path of :func:`unpermute_combine`.
    Batches whose ``[T, J, H]`` temporaries fit in 32 MiB take the reference itself (fewer host
    calls: small batches are host-bound on GPUs)."""
    if index.shape[0] * _token_bytes(src, index) <= _SMALL_BYTES:
        return unpermute_combine_reference(src, index, weight, out_dtype, all_valid=all_valid)
    _check(src, index, weight)
    if src.shape[0] == 0:  # every index is -1 (_check): zeros, still in the autograd graph of src and weight
        src = torch.cat([src, src.new_zeros(1, src.shape[1])])
    return _UnpermuteCombine.apply(src, index, weight, out_dtype or src.dtype)


def unpermute_combine_triton(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton unpermute + weighted combine (see :func:`unpermute_combine_reference`), differentiable
    w.r.t. ``src`` and ``weight`` through a Triton backward (a double backward, ``create_graph=True``,
    takes the torch operations of :func:`unpermute_combine_lean`'s instead).

    The backward adds each ``(token, j)``'s gradient row into ``src``'s with float32 (float64)
    atomics, so a row gathered twice gets an unordered sum (a row gathered once gets the reference's
    bits); the weight's gradient is a dot product per ``(token, j)`` in float32 (float64).

    Args:
        src: ``[N, H]`` float32/bfloat16/float16/float64 rows (``stride(1) == 1``).
        index: ``[T, J]`` int32/int64 rows of ``src``; ``< 0`` means none.
        weight: ``[T, J]`` combine weights, or None for all ones.
        out_dtype: result dtype; default ``src.dtype``.

    Returns:
        ``[T, H]`` new tensor in ``out_dtype``.
    """
    require_triton()
    _check(src, index, weight)
    out_dtype = out_dtype or src.dtype
    if _wants_grad(src, weight):
        return _TritonUnpermuteCombine.apply(src, index, weight, out_dtype)
    return _combine_forward_triton(src, index, weight, out_dtype)


def _wants_grad(src: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (src.requires_grad or (weight is not None and weight.requires_grad))


def _combine_forward_triton(src, index, weight, out_dtype) -> torch.Tensor:
    T, J = index.shape
    H = src.shape[1]
    out = torch.empty(T, H, dtype=out_dtype, device=src.device)
    if T == 0 or H == 0:
        return out
    if src.shape[0] == 0 or J == 0:  # every index is invalid
        return out.zero_()
    index = index.contiguous()
    weight = weight.contiguous() if weight is not None else None
    block_h = min(1024, triton.next_power_of_2(H))
    grid = (T, triton.cdiv(H, block_h))
    with on_device_of(src):
        _unpermute_combine_kernel[grid](
            src, index, weight if weight is not None else index, out, H, J, src.shape[0],
            src.stride(0), index.stride(0), J, out.stride(0),
            HAS_WEIGHT=weight is not None,
            ACC=tl.float64 if src.dtype == torch.float64 else tl.float32,
            BLOCK_H=block_h,
        )
    return out


def _combine_backward_triton(grad_out, src, index, weight, need_src: bool, need_w: bool):
    """``(grad_src [N, H] in src.dtype or None, grad_weight [T, J] in weight.dtype or None)``."""
    T, J = index.shape
    N, H = src.shape
    acc = _acc_dtype(src)
    grad_src = torch.zeros(N, H, dtype=acc, device=src.device) if need_src else None
    grad_w = torch.zeros(T, J, dtype=acc, device=src.device) if need_w else None
    if T and J and N and H:
        index = index.contiguous()
        weight = weight.contiguous() if weight is not None else None
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dummy = index  # stands in for a pointer the kernel never reads
        with on_device_of(src):
            _unpermute_combine_backward_kernel[(T,)](
                grad_out, src, index, weight if weight is not None else dummy,
                grad_src if need_src else dummy, grad_w if need_w else dummy, H, J, N,
                grad_out.stride(0), src.stride(0), index.stride(0), J, H,
                HAS_WEIGHT=weight is not None, NEED_SRC=need_src, NEED_W=need_w,
                ACC=tl.float64 if acc == torch.float64 else tl.float32,
                BLOCK_H=min(1024, triton.next_power_of_2(H)),
            )
    return (None if grad_src is None else grad_src.to(src.dtype),
            None if grad_w is None else grad_w.to(weight.dtype))


class _TritonUnpermuteCombine(torch.autograd.Function):
    """The Triton forward and backward kernels; saves only the inputs. A double backward
    (``create_graph=True``) takes the lean path's backward instead, which autograd records."""

    @staticmethod
    def forward(ctx, src, index, weight, out_dtype):
        ctx.save_for_backward(src, index, weight)
        return _combine_forward_triton(src, index, weight, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        src, index, weight = ctx.saved_tensors
        backward = _combine_backward_lean if torch.is_grad_enabled() else _combine_backward_triton
        grad_src, grad_w = backward(grad_out, src, index, weight, *ctx.needs_input_grad[0:3:2])
        return grad_src, None, grad_w, None


def unpermute_combine(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    *,
    all_valid: bool = False,
) -> torch.Tensor:
    """Gather ``src [N, H]`` rows by ``index [T, J]`` and sum them weighted into ``[T, H]``.

    Uses :func:`unpermute_combine_triton` (forward and backward kernels) when
    :func:`moelayers.kernels.use_triton` allows it for training too, except where a gradient is
    wanted under ``torch.use_deterministic_algorithms(True)`` (its backward adds with atomics); else
    :func:`unpermute_combine_lean` (the reference's sums with bounded temporaries). ``all_valid``:
    the caller knows ``index`` holds no ``-1``. The reference then skips its masks, with the same
    result.
    """
    if use_triton(src, differentiable=True) and not (_wants_grad(src, weight)
                                                     and torch.are_deterministic_algorithms_enabled()):
        return unpermute_combine_triton(src, index, weight, out_dtype)
    return unpermute_combine_lean(src, index, weight, out_dtype, all_valid=all_valid)
