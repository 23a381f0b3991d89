"""Token shuffle kernels of the attention-TP rebatch (Sem-MoE Algorithm 3).

Two kernels, each with its torch reference:

- ``shuffle_rows``: ``out[i] = x[index[i]]``, zeros where ``index[i] < 0``. With ``index = perm``
  it fills the reduce-scatter input buffer in the rebatched order (``-1`` = dummy padding row);
  with ``index = inverse`` it restores the original token order after the all-gather. A row
  past ``x`` (``index >= T``): the reference raises ``IndexError``; the Triton kernel, which checks
  nothing on the host (no sync), reads zeros and never reads outside ``x``.
- ``bucket_positions``: each token's position inside its bucket (tokens of the same predicted
  rank), ordered by confidence, highest first, ties by token index:
  ``pos[i] = #{j : pred[j] == pred[i] and (conf[j] > conf[i] or (conf[j] == conf[i] and j < i))}``.
  Confidences are compared as float32 (both implementations cast them), where the definition is a
  total order, so the Triton kernel (pairwise counts, no sort) and the reference (two stable sorts)
  agree bit for bit: the rebatch is identical on every rank.
"""

from __future__ import annotations

import torch

from moelayers.kernels import HAVE_TRITON, on_device_of, require_triton, use_triton

# Above this many tokens the O(T^2) pairwise kernel loses to a sort: the dispatcher uses the reference.
BUCKET_TRITON_MAX_TOKENS = 16384

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _shuffle_rows_kernel(x_ptr, index_ptr, out_ptr, H, T, stride_x, stride_o, BLOCK_H: tl.constexpr):
        # One program per (output row, block of H): copy the source row, or write zeros.
        i = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        src = tl.load(index_ptr + i).to(tl.int64)
        # scalar conditions become column bounds (a scalar & vector mask trips the interpreter)
        load_mask = offs < tl.where((src >= 0) & (src < T), H, 0)  # src >= T: zeros, never read past x
        src = tl.maximum(src, 0)  # keep the (masked-off) address in range
        row = tl.load(x_ptr + src * stride_x + offs, mask=load_mask, other=0.0)
        tl.store(out_ptr + i * stride_o + offs, row, mask=offs < H)

    @triton.jit
    def _bucket_positions_kernel(pred_ptr, conf_ptr, pos_ptr, T, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        # One program per block of tokens i; loop over all tokens j and count those ranked before i.
        offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_i = offs_i < T
        pred_i = tl.load(pred_ptr + offs_i, mask=mask_i, other=-3)
        conf_i = tl.load(conf_ptr + offs_i, mask=mask_i, other=0.0)
        acc = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, T, BLOCK_J):
            offs_j = j0 + tl.arange(0, BLOCK_J)
            mask_j = offs_j < T
            pred_j = tl.load(pred_ptr + offs_j, mask=mask_j, other=0)
            conf_j = tl.load(conf_ptr + offs_j, mask=mask_j, other=0.0)
            same = (pred_j[None, :] == pred_i[:, None]) & mask_j[None, :]  # lanes past T count for no bucket
            higher = conf_j[None, :] > conf_i[:, None]
            tie = (conf_j[None, :] == conf_i[:, None]) & (offs_j[None, :] < offs_i[:, None])
            acc += tl.sum((same & (higher | tie)).to(tl.int32), axis=1)
        tl.store(pos_ptr + offs_i, acc.to(tl.int64), mask=mask_i)


# ---------------------------------------------------------------------- shuffle_rows
def _check_shuffle(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or index.dim() != 1:
        raise ValueError(f"expected x [T, H] and index [N]; got {tuple(x.shape)} and {tuple(index.shape)}")
    if index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index must be int32 or int64, got {index.dtype}")
    if x.shape[0] == 0 and index.numel() and bool((index >= 0).any()):  # a sync, only when x has no rows
        raise IndexError(f"index holds row {int(index.max())} of x, which has no rows (only -1 can be asked)")
    if out is not None:
        if tuple(out.shape) != (index.shape[0], x.shape[1]):
            raise ValueError(f"out must be [{index.shape[0]}, {x.shape[1]}], got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"out dtype {out.dtype} differs from x dtype {x.dtype}")
        if out.shape[1] > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have unit stride along H, got strides {out.stride()}")


def shuffle_rows_reference(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch row gather: ``out[i] = x[index[i]]``, zeros where ``index[i] < 0``.

    Differentiable in ``x``. With ``out`` and no gradient wanted, writes into ``out`` and returns
    it; with a gradient it returns a fresh tensor and leaves ``out`` alone (use the return value).

    Args:
        x: ``[T, H]`` rows.
        index: ``[N]`` int32/int64 source row per output row, in ``[-1, T)`` (``-1`` = zeros).
        out: optional ``[N, H]`` destination (same dtype as ``x``, unit stride along H).

    Returns:
        ``[N, H]``.
    """
    _check_shuffle(x, index, out)
    t = x.shape[0]
    if t == 0:  # only -1 (zero rows) can be asked of no rows (_check_shuffle)
        padded = torch.nn.functional.pad(x, (0, 0, 0, 1))
        rows = padded.index_select(0, torch.where(index >= 0, index.to(torch.int64), t))
    else:  # an index >= T fails here (IndexError; a device assert on CUDA) instead of reading a zero row
        valid = (index >= 0)[:, None]
        rows = torch.where(valid, x.index_select(0, index.to(torch.int64).clamp(min=0)), x.new_zeros(()))
    if out is None or (torch.is_grad_enabled() and x.requires_grad):
        return rows
    out.copy_(rows)
    return out


def shuffle_rows_triton(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton row gather (inference only; same contract as :func:`shuffle_rows_reference`).

    Args:
        x: ``[T, H]`` float rows; index: ``[N]`` int32/int64 in ``[-1, T)``; out: optional ``[N, H]``.

    Returns:
        ``out`` (or a new ``[N, H]`` tensor).
    """
    require_triton()
    _check_shuffle(x, index, out)
    n, h = index.shape[0], x.shape[1]
    if out is None:
        out = x.new_empty(n, h)
    if n == 0 or h == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    index = index.contiguous()
    block_h = min(1024, triton.next_power_of_2(h))
    with on_device_of(x):
        _shuffle_rows_kernel[(n, triton.cdiv(h, block_h))](x, index, out, h, x.shape[0], x.stride(0), out.stride(0),
                                                          BLOCK_H=block_h)
    return out


def shuffle_rows(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = x[index[i]]`` (zeros where ``index[i] < 0``): :func:`shuffle_rows_triton` when
    :func:`moelayers.kernels.use_triton` allows it, else :func:`shuffle_rows_reference`."""
    if use_triton(x):
        return shuffle_rows_triton(x, index, out)
    return shuffle_rows_reference(x, index, out)


# ---------------------------------------------------------------------- bucket_positions
def _canonical(pred: torch.Tensor, conf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pred.dim() != 1 or conf.shape != pred.shape:
        raise ValueError(f"expected pred [T] and conf [T]; got {tuple(pred.shape)} and {tuple(conf.shape)}")
    if pred.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pred must be int32 or int64, got {pred.dtype}")
    if not conf.dtype.is_floating_point:
        raise TypeError(f"conf must be floating point, got {conf.dtype}")
    # NaN -> 0 and -0.0 -> +0.0: every comparison (and sort) then sees one total order
    return pred.to(torch.int64).contiguous(), (torch.nan_to_num(conf.float(), nan=0.0) + 0.0).contiguous()


def bucket_positions_reference(pred: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Position of each token among the tokens of its bucket, most confident first.

    Args:
        pred: ``[T]`` int bucket (predicted rank; any integer, e.g. ``-1`` for "no prediction").
        conf: ``[T]`` float confidence (NaN counts as 0).

    Returns:
        ``[T]`` int64: ``#{j : pred[j] == pred[i] and (conf[j] > conf[i] or (conf[j] == conf[i] and j < i))}``.
    """
    pred, conf = _canonical(pred, conf)
    t = pred.numel()
    if t == 0:
        return torch.zeros(0, dtype=torch.int64, device=pred.device)
    by_conf = torch.sort(conf, descending=True, stable=True).indices  # ties keep token order
    order = by_conf[torch.sort(pred[by_conf], stable=True).indices]  # by (pred, -conf, index)
    sorted_pred = pred[order]
    arange = torch.arange(t, device=pred.device)
    new_bucket = torch.ones(t, dtype=torch.bool, device=pred.device)
    new_bucket[1:] = sorted_pred[1:] != sorted_pred[:-1]
    start = torch.cummax(torch.where(new_bucket, arange, 0), 0).values
    pos = torch.empty_like(order)
    pos[order] = arange - start
    return pos


def bucket_positions_triton(pred: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Triton pairwise-count version of :func:`bucket_positions_reference` (``O(T^2)`` work, no sort)."""
    require_triton()
    pred, conf = _canonical(pred, conf)
    t = pred.numel()
    pos = torch.empty(t, dtype=torch.int64, device=pred.device)
    if t == 0:
        return pos
    block_i, block_j = 64, 64
    with on_device_of(pred):
        _bucket_positions_kernel[(triton.cdiv(t, block_i),)](pred, conf, pos, t, BLOCK_I=block_i, BLOCK_J=block_j)
    return pos


def bucket_positions(pred: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
    """Bucket positions (see :func:`bucket_positions_reference`): the Triton kernel on CUDA for up
    to ``BUCKET_TRITON_MAX_TOKENS`` tokens, else the sort-based reference. Both give the same result."""
    if use_triton(conf) and pred.numel() <= BUCKET_TRITON_MAX_TOKENS:
        return bucket_positions_triton(pred, conf)
    return bucket_positions_reference(pred, conf)
