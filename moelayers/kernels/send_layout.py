"""Send layout: the rows of a de-duplicated all-to-all payload and the header the ranks exchange.

For ``dest_rank [T, K]`` (the rank of each (token, k); ``-1`` = padding, sent nowhere) over ``R``
ranks, a token goes once to every rank holding any of its experts, rows ordered by (rank, token):

- ``dest_map [T, R]``: the payload row of token ``t`` for rank ``r``, ``-1`` when it has no expert
  there;
- ``header [R, 4]`` int64, one line per destination rank: ``[rows, pairs, flag, digest]`` — the
  rows sent to it, the (token, k) activations they carry, this rank's routing flag
  (``Routes.nonfinite``, ``0`` when ``None``) and the placement digest. The all-to-all dispatcher
  exchanges these headers before the payload (its one host sync).

The Triton kernel does it in one launch where the torch reference takes a dozen ops: the eager
forward is host-bound at small batches (docs/benchmarks.md), and these ops stand between the
router and that sync. It is one program walking the tokens in blocks of ``8192 / R`` twice
(counts, then rows), so its device time grows with ``T × R``: :func:`send_layout` takes it up to
``T × R = 2^17`` (16 blocks a pass: 4,096 tokens at 32 ranks, 16,384 at 8) and the reference
beyond, where the batch is large enough for the host to matter less.
"""

from __future__ import annotations

import torch

from moelayers.kernels import HAVE_TRITON, on_device_of, require_triton, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _send_layout_kernel(
        rank_ptr, map_ptr, header_ptr, flag_ptr, digest, T, K, R,
        HAS_FLAG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        roffs = tl.arange(0, BLOCK_R)
        rmask = roffs < R
        rows = tl.zeros([BLOCK_R], dtype=tl.int64)
        pairs = tl.zeros([BLOCK_R], dtype=tl.int64)
        for start in range(0, T, BLOCK_T):  # pass 1: rows and pairs per rank
            toffs = start + tl.arange(0, BLOCK_T)
            per = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.int64)
            for k in range(K):
                r = tl.load(rank_ptr + toffs.to(tl.int64) * K + k, mask=toffs < T, other=-1)
                per += (r[:, None] == roffs[None, :]).to(tl.int64)
            pairs += tl.sum(per, axis=0)
            rows += tl.sum((per > 0).to(tl.int64), axis=0)
        running = tl.cumsum(rows, 0) - rows  # the first row of each rank, then its next free row
        for start in range(0, T, BLOCK_T):  # pass 2: each (token, rank) unit's row
            toffs = start + tl.arange(0, BLOCK_T)
            per = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.int64)
            for k in range(K):
                r = tl.load(rank_ptr + toffs.to(tl.int64) * K + k, mask=toffs < T, other=-1)
                per += (r[:, None] == roffs[None, :]).to(tl.int64)
            hit = (per > 0).to(tl.int64)
            row = tl.cumsum(hit, 0) - 1 + running[None, :]
            dst = map_ptr + toffs.to(tl.int64)[:, None] * R + roffs[None, :]
            tl.store(dst, tl.where(hit > 0, row, -1), mask=(toffs[:, None] < T) & rmask[None, :])
            running += tl.sum(hit, axis=0)
        if HAS_FLAG:
            flag = tl.load(flag_ptr).to(tl.int64) + tl.zeros([BLOCK_R], dtype=tl.int64)
        else:
            flag = tl.zeros([BLOCK_R], dtype=tl.int64)
        tl.store(header_ptr + roffs * 4, rows, mask=rmask)
        tl.store(header_ptr + roffs * 4 + 1, pairs, mask=rmask)
        tl.store(header_ptr + roffs * 4 + 2, flag, mask=rmask)
        tl.store(header_ptr + roffs * 4 + 3, tl.zeros([BLOCK_R], dtype=tl.int64) + digest, mask=rmask)


def _check(dest_rank: torch.Tensor, num_ranks: int, flag: torch.Tensor | None, digest: int) -> None:
    if dest_rank.dim() != 2:
        raise ValueError(f"dest_rank must be [T, K], got shape {tuple(dest_rank.shape)}")
    if dest_rank.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dest_rank must be int32 or int64, got {dest_rank.dtype}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if flag is not None and flag.numel() != 1:
        raise ValueError(f"flag must be a one-element tensor, got shape {tuple(flag.shape)}")
    if not 0 <= digest < 1 << 63:
        raise ValueError(f"digest must fit in a non-negative int64, got {digest}")


def send_layout_reference(
    dest_rank: torch.Tensor, num_ranks: int, flag: torch.Tensor | None = None, digest: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch send layout.

    Args:
        dest_rank: ``[T, K]`` int rank of each (token, k), ``-1`` for padding.
        num_ranks: ``R``.
        flag: optional one-element int or bool device tensor, copied into the header's column 2.
        digest: non-negative int64, the header's column 3.

    Returns:
        ``(dest_map [T, R] int64, header [R, 4] int64)`` (see the module docstring).
    """
    _check(dest_rank, num_ranks, flag, digest)
    t = dest_rank.shape[0]
    dev = dest_rank.device
    ranks = torch.arange(num_ranks, device=dev)
    per_rank = (dest_rank[:, :, None] == ranks).sum(1)  # [T, R] activations; -1 counts nowhere
    hit = per_rank > 0
    rows = hit.sum(0)
    first_row = torch.cumsum(rows, 0) - rows  # rows ordered by (rank, token)
    dest_map = torch.where(hit, torch.cumsum(hit, 0) - 1 + first_row, -1) if t else hit.to(torch.int64)
    flags = torch.zeros_like(rows) if flag is None else flag.reshape(()).to(torch.int64).expand(num_ranks)
    return dest_map, torch.stack([rows, per_rank.sum(0), flags, torch.full_like(rows, digest)], 1)


def send_layout_triton(
    dest_rank: torch.Tensor, num_ranks: int, flag: torch.Tensor | None = None, digest: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton send layout, one launch (same contract as :func:`send_layout_reference`)."""
    require_triton()
    _check(dest_rank, num_ranks, flag, digest)
    t, k = dest_rank.shape
    dest_rank = dest_rank.contiguous()
    dest_map = torch.empty(t, num_ranks, dtype=torch.int64, device=dest_rank.device)
    header = torch.empty(num_ranks, 4, dtype=torch.int64, device=dest_rank.device)
    block_r = triton.next_power_of_2(num_ranks)
    block_t = max(16, min(triton.next_power_of_2(max(t, 1)), 8192 // block_r))
    with on_device_of(dest_rank):
        _send_layout_kernel[(1,)](
            dest_rank, dest_map, header, dest_rank if flag is None else flag, digest, t, k, num_ranks,
            HAS_FLAG=flag is not None, BLOCK_T=block_t, BLOCK_R=block_r,
        )
    return dest_map, header


#: the largest ``T × R`` (``R`` rounded up to a power of two) that :func:`send_layout` gives the kernel
TRITON_MAX_UNITS = 1 << 17
#: and the most ranks (its tile is at least 16 tokens by the ranks; Triton allows 2^20 elements)
TRITON_MAX_RANKS = 1 << 12


def send_layout(
    dest_rank: torch.Tensor, num_ranks: int, flag: torch.Tensor | None = None, digest: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The send layout: the Triton kernel on CUDA up to ``TRITON_MAX_UNITS`` (token, rank) units
    and ``TRITON_MAX_RANKS`` ranks, else the torch reference."""
    units = dest_rank.shape[0] * (1 << max(num_ranks - 1, 0).bit_length())
    if use_triton(dest_rank) and units <= TRITON_MAX_UNITS and num_ranks <= TRITON_MAX_RANKS:
        return send_layout_triton(dest_rank, num_ranks, flag, digest)
    return send_layout_reference(dest_rank, num_ranks, flag, digest)
