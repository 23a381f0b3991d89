"""Native Triton kernels on CUDA vs their torch references."""

import pytest
import torch

from moelayers.kernels import (
    HAVE_TRITON,
    permute,
    permute_reference,
    permute_triton,
    unpermute_combine,
    unpermute_combine_reference,
    unpermute_combine_triton,
    use_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAVE_TRITON, reason="needs triton"),
]

SHAPES = [(1, 8, 1), (37, 200, 3), (512, 1000, 8), (4096, 2048, 8), (16, 4096, 256)]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("T,H,J", SHAPES)
def test_permute_cuda(T, H, J, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T + H + J)
    n = T * J + 5
    dest = torch.randperm(n, device="cuda", generator=gen)[: T * J].view(T, J)
    dest[torch.rand(T, J, device="cuda", generator=gen) < 0.25] = -1
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    wide = torch.full((n, H + 16), float("nan"), device="cuda", dtype=dtype)
    ref_wide = wide.clone()
    assert use_triton(x)
    permute(x, dest.int(), wide[:, 8: 8 + H])
    permute_reference(x, dest, ref_wide[:, 8: 8 + H])
    assert torch.equal(wide.view(torch.uint8), ref_wide.view(torch.uint8))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("T,H,J", SHAPES)
def test_unpermute_combine_cuda(T, H, J, dtype):
    gen = torch.Generator(device="cuda").manual_seed(T * H + J)
    N = T * J
    src = torch.randn(N, H + 8, device="cuda", generator=gen).to(dtype)[:, :H]
    index = torch.randint(0, N, (T, J), device="cuda", generator=gen)
    index[torch.rand(T, J, device="cuda", generator=gen) < 0.25] = -1
    weight = torch.rand(T, J, device="cuda", generator=gen)
    for w in (None, weight):
        got = unpermute_combine(src, index, w)
        ref = unpermute_combine_reference(src, index, w)
        tol = 1e-4 if dtype == torch.float32 else 1.6e-2  # fp32 sums of up to 256 rows, any order
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    got32 = unpermute_combine_triton(src, index, weight, out_dtype=torch.float32)
    ref32 = unpermute_combine_reference(src, index, weight, out_dtype=torch.float32)
    torch.testing.assert_close(got32, ref32, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16))
@pytest.mark.parametrize("T,H,J", SHAPES)
def test_unpermute_combine_backward_cuda(T, H, J, dtype):
    """The Triton backward against the reference's autograd on CUDA: rows gathered once (the layers'
    case) get the same gradient bit for bit, the weight's gradient to float32 rounding; a combine
    that wants a gradient takes it, unless deterministic algorithms are on."""
    gen = torch.Generator(device="cuda").manual_seed(T * H + J + 1)
    n = T * J + 3
    index = torch.randperm(n, device="cuda", generator=gen)[: T * J].view(T, J)
    index[torch.rand(T, J, device="cuda", generator=gen) < 0.25] = -1
    src = torch.randn(n, H + 8, device="cuda", generator=gen).to(dtype)[:, :H]
    weight = torch.rand(T, J, device="cuda", generator=gen)
    grad = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    runs = []
    for fn in (unpermute_combine_reference, unpermute_combine):
        s, w = src.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(s, index, w)
        out.backward(grad)
        runs.append((out, s.grad, w.grad))
    assert "Triton" in type(runs[1][0].grad_fn).__name__
    tol = 1e-4 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=tol, atol=tol)
    assert torch.equal(runs[1][1], runs[0][1])
    torch.testing.assert_close(runs[1][2], runs[0][2], rtol=1e-4, atol=1e-4)
    torch.use_deterministic_algorithms(True)
    try:
        out = unpermute_combine(src.clone().requires_grad_(), index, weight)
        assert "Triton" not in type(out.grad_fn).__name__
    finally:
        torch.use_deterministic_algorithms(False)


def test_empty_and_all_invalid_cuda():
    x = torch.randn(0, 64, device="cuda")
    out = torch.zeros(4, 64, device="cuda")
    assert permute_triton(x, torch.empty(0, 2, dtype=torch.long, device="cuda"), out) is out
    y = unpermute_combine_triton(torch.empty(0, 64, device="cuda"), torch.full((3, 2), -1, device="cuda"), None)
    assert y.shape == (3, 64) and (y == 0).all()


@pytest.mark.parametrize("t,k,r", [(0, 2, 2), (1, 1, 1), (256, 8, 2), (4096, 8, 4), (4096, 6, 8), (1000, 8, 64)])
@pytest.mark.parametrize("flag", [None, "bool", "int"])
def test_send_layout_cuda(t, k, r, flag):
    from moelayers.kernels import send_layout, send_layout_reference, send_layout_triton
    from tests.unit.test_send_layout import _ranks

    dest_rank = _ranks(t, k, r, seed=t + r).cuda()
    f = {None: None, "bool": torch.tensor(True, device="cuda"), "int": torch.tensor(6, dtype=torch.int32, device="cuda")}[flag]
    digest = (1 << 62) - 7
    assert use_triton(dest_rank)
    got, want = send_layout_triton(dest_rank, r, f, digest), send_layout_reference(dest_rank, r, f, digest)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(send_layout(dest_rank.int(), r, f, digest), want))


def test_kernels_stay_in_bounds_cuda():
    from tests.kernel_bounds import check_kernels_stay_in_bounds

    check_kernels_stay_in_bounds(torch.device("cuda"))
    torch.cuda.synchronize()  # an illegal access would surface here
