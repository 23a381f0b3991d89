"""The fused dispatch-pack kernel (Triton under the interpreter on CPU) vs its torch reference."""

import importlib

import pytest
import torch

from moelayers.dispatch.comm import RowLayout
from moelayers.kernels import HAVE_TRITON, dispatch_pack_reference, dispatch_pack_triton


def _interpreted() -> bool:
    mod = importlib.import_module("moelayers.kernels.dispatch_pack")
    return type(mod._dispatch_pack_kernel).__name__ == "InterpretedFunction"


def _case(t, h, k, r, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    dest_rank = torch.randint(0, r, (t, k), generator=g)
    dest_slot = torch.randint(0, 5, (t, k), generator=g)
    weights = torch.rand(t, k, generator=g).to(dtype)
    hit = torch.zeros(t, r, dtype=torch.bool).scatter_(1, dest_rank, True) if t else torch.zeros(0, r, dtype=torch.bool)
    rows = hit.sum(0)
    dest_map = torch.where(hit, torch.cumsum(hit, 0) - 1 + (torch.cumsum(rows, 0) - rows), -1)
    return x, dest_map, dest_rank, dest_slot, weights, int(rows.sum())


@pytest.mark.skipif(not HAVE_TRITON or not _interpreted(), reason="triton missing or not interpreted")
@pytest.mark.parametrize("t,h,k,r", [(0, 8, 2, 2), (1, 8, 1, 1), (9, 40, 3, 4), (33, 130, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dispatch_pack_matches_reference(t, h, k, r, dtype):
    x, dest_map, dest_rank, dest_slot, weights, n = _case(t, h, k, r, dtype, seed=t * 7 + h)
    layout = RowLayout(((h, dtype), (k, dtype), (k, torch.int32)))
    bufs = [torch.full((n, layout.row_bytes), 0xAB, dtype=torch.uint8) for _ in range(2)]
    dispatch_pack_reference(x, dest_map, dest_rank, dest_slot, weights, *_views(layout, bufs[0]))
    dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, *_views(layout, bufs[1]))
    xv, wv, sv = layout.views(bufs[1])
    assert torch.equal(bufs[0], bufs[1])
    # every row written: each row's slots are -1 or a real slot, and its token row is some x row
    assert ((sv == -1) | (sv >= 0)).all() and (sv >= 0).any(1).all()
    for row in range(n):
        assert any(torch.equal(xv[row], x[i]) for i in range(t))


def _views(layout, buf):
    xv, wv, sv = layout.views(buf)
    return xv, wv, sv


@pytest.mark.skipif(not HAVE_TRITON or not _interpreted(), reason="triton missing or not interpreted")
def test_dispatch_pack_refuses_strided_or_misshapen_outputs():
    """The kernel addresses output rows as contiguous: a transposed view used to be filled wrongly
    without a word; now it is refused, as are shapes and dtypes off the contract."""
    x, dest_map, dest_rank, dest_slot, weights, n = _case(9, 40, 3, 4, torch.float32, 3)
    good = dict(x_out=torch.zeros(n, 40), w_out=torch.zeros(n, 3), s_out=torch.zeros(n, 3, dtype=torch.int32))
    bad = {"x_out": torch.zeros(40, n).t(), "w_out": torch.zeros(3, n).t(), "s_out": torch.zeros(3, n, dtype=torch.int32).t()}
    for name, view in bad.items():
        with pytest.raises(ValueError, match=f"{name} must have unit stride"):
            dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, **{**good, name: view})
    with pytest.raises(ValueError, match="w_out and s_out"):
        dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, **{**good, "w_out": torch.zeros(n, 2)})
    with pytest.raises(TypeError, match="s_out int32"):
        dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, **{**good, "s_out": torch.zeros(n, 3)})
    with pytest.raises(ValueError, match=r"must be \[T=9, K\]"):
        dispatch_pack_triton(x, dest_map, dest_rank[:4], dest_slot, weights, **good)


@pytest.mark.parametrize("fn", [dispatch_pack_reference, dispatch_pack_triton])
def test_both_paths_check_the_contract(fn):
    """The reference (every CPU forward) skipped the checks: a dest_map of 3 rows for 4 tokens packed
    part of the rows without a word, and bad dtypes failed deep in torch or not at all."""
    if fn is dispatch_pack_triton and (not HAVE_TRITON or not _interpreted()):
        pytest.skip("triton missing or not interpreted")
    x, dest_map, dest_rank, dest_slot, weights, n = _case(4, 8, 2, 3, torch.float32, 5)
    good = dict(x_out=torch.zeros(n, 8), w_out=torch.zeros(n, 2), s_out=torch.zeros(n, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected x \[T, H\] and dest_map \[T, R\]"):
        fn(x, dest_map[:3], dest_rank, dest_slot, weights, **good)
    with pytest.raises(TypeError, match="dest_rank must be int32 or int64"):
        fn(x, dest_map, dest_rank.float(), dest_slot, weights, **good)
    with pytest.raises(ValueError, match="x_out must have unit stride"):
        fn(x, dest_map, dest_rank, dest_slot, weights, **{**good, "x_out": torch.zeros(n, 16)[:, ::2]})


@pytest.mark.skipif(not HAVE_TRITON or not _interpreted(), reason="triton missing or not interpreted")
@pytest.mark.parametrize("h,k", [(0, 2), (4, 0)])
def test_dispatch_pack_kernel_takes_empty_rows_or_metadata(h, k):
    """Blocks of size 0 do not compile: H = 0 raised ZeroDivisionError, K = 0 a Triton error."""
    x, dest_map, dest_rank, dest_slot, weights, n = _case(5, max(h, 1), max(k, 1), 2, torch.float32, 1)
    x, dest_rank, dest_slot, weights = x[:, :h], dest_rank[:, :k], dest_slot[:, :k], weights[:, :k]
    outs = [(torch.full((n, h), 7.0), torch.full((n, k), 7.0), torch.full((n, k), 7, dtype=torch.int32)) for _ in range(2)]
    dispatch_pack_reference(x, dest_map, dest_rank, dest_slot, weights, *outs[0])
    dispatch_pack_triton(x, dest_map, dest_rank, dest_slot, weights, *outs[1])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # by hand: every used row holds its token's slots and weights for that rank (-1 / 0 elsewhere)
    want_s, want_w = torch.full((n, k), 7, dtype=torch.int32), torch.full((n, k), 7.0)
    want_x = torch.full((n, h), 7.0)
    for t in range(5):
        for r in range(2):
            row = int(dest_map[t, r])
            if row >= 0:
                want_x[row] = x[t]
                mine = dest_rank[t] == r
                want_s[row] = torch.where(mine, dest_slot[t], -1).to(torch.int32)
                want_w[row] = torch.where(mine, weights[t], 0.0)
    assert torch.equal(outs[1][0], want_x) and torch.equal(outs[1][1], want_w) and torch.equal(outs[1][2], want_s)


def test_packed_rows_are_padded_to_16_bytes():
    """Packed rows are a multiple of ROW_ALIGN = 16 bytes (the vectorised pack kernels and the combine's
    raw-row shortcut, which is taken only where H * itemsize is already a multiple of it, rely on it)."""
    from moelayers.dispatch.comm import ROW_ALIGN, RowLayout

    assert ROW_ALIGN == 16
    assert RowLayout(((3, torch.float64),)).row_bytes == 32  # 24 bytes of data
    assert RowLayout(((4, torch.float32), (2, torch.float32), (2, torch.int32))).row_bytes == 32
    assert RowLayout(((5, torch.bfloat16), (1, torch.int32))).row_bytes == 16
