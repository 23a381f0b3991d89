"""Triton kernels vs their torch references vs naive python loops (CPU, TRITON_INTERPRET=1)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / moelayers are imported

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moelayers.kernels import (  # noqa: E402
    HAVE_TRITON,
    permute,
    permute_reference,
    permute_triton,
    unpermute_combine,
    unpermute_combine_lean,
    unpermute_combine_reference,
    unpermute_combine_triton,
    use_triton,
)


def _interpreted() -> bool:
    # The interpreter is chosen when a kernel is decorated: if something imported the kernels before
    # TRITON_INTERPRET was set, they are native kernels and cannot run on CPU tensors.
    mod = importlib.import_module("moelayers.kernels.permute")
    return type(mod._permute_kernel).__name__ == "InterpretedFunction"


needs_triton = pytest.mark.skipif(
    not HAVE_TRITON or not _interpreted(), reason="triton missing or not in interpreter mode"
)

TS, HS, JS = (0, 1, 7, 64), (8, 96, 200), (1, 3, 8)
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _dest_map(T, J, extra, drop, gen, idx_dtype=torch.int64):
    """[T, J] distinct destination rows in [0, T*J + extra), with a fraction `drop` set to -1."""
    n = T * J + extra
    dest = torch.randperm(n, generator=gen)[: T * J].view(T, J)
    dest[torch.rand(T, J, generator=gen) < drop] = -1
    return dest.to(idx_dtype), n


def _naive_permute(x, dest, out):
    out = out.clone()
    for t in range(dest.shape[0]):
        for j in range(dest.shape[1]):
            if dest[t, j] >= 0:
                out[dest[t, j]] = x[t]
    return out


def _naive_combine(src, index, weight):
    T, J = index.shape
    out = torch.zeros(T, src.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(J):
            if index[t, j] >= 0:
                w = 1.0 if weight is None else float(weight[t, j])
                out[t] += w * src[index[t, j]].double()
    return out


def _bitwise_equal(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _packed_out(n, H, dtype, layout, gen):
    """A NaN-poisoned [n, H] `out` view, and its base buffer (whose other bytes must survive)."""
    if layout == "contiguous":
        base = torch.full((n, H), float("nan"), dtype=dtype)
        return base, base
    if layout == "column_slice":
        base = torch.full((n, H + 13), float("nan"), dtype=dtype)
        base[:, :5] = 7.0
        base[:, 5 + H:] = -3.0
        return base, base[:, 5: 5 + H]
    # uint8 buffer viewed as dtype: a 16-byte header column block, the payload, an 8-byte tail.
    es = torch.empty((), dtype=dtype).element_size()
    base = torch.randint(0, 256, (n, 16 + H * es + 8), dtype=torch.uint8, generator=gen)
    out = base[:, 16: 16 + H * es].view(dtype)
    out.fill_(float("nan"))
    return base, out


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("J", JS)
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("T", TS)
def test_permute_matches(T, H, J, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + J)
    layout = ("contiguous", "column_slice", "uint8_view")[(T + H + J) % 3]
    idx_dtype = torch.int32 if J == 3 else torch.int64
    x = torch.randn(T, H, generator=gen).to(dtype)
    dest, n = _dest_map(T, J, extra=3, drop=0.3, gen=gen, idx_dtype=idx_dtype)
    if T == 7:
        dest[2] = -1  # a token with no destination
    results = []
    for fn in (permute_triton, permute_reference):
        base, out = _packed_out(n, H, dtype, layout, torch.Generator().manual_seed(1))
        before = base.clone()
        assert fn(x, dest, out) is out
        results.append((base, out, before))
    (b_tri, o_tri, before), (b_ref, o_ref, _) = results
    expected = _naive_permute(x, dest, o_ref.new_full(o_ref.shape, float("nan")))
    assert _bitwise_equal(o_tri, expected) and _bitwise_equal(o_ref, expected)
    assert _bitwise_equal(b_tri, b_ref)  # bytes outside the view untouched, in both
    targeted = torch.zeros(n, dtype=torch.bool)
    targeted[dest[dest >= 0].long()] = True
    assert not o_tri[targeted].isnan().any()  # every targeted row written
    assert o_tri[~targeted].isnan().all()  # every other row left as it was
    outside = torch.ones_like(before, dtype=torch.bool)
    if layout == "column_slice":
        outside[:, 5: 5 + H] = False
    elif layout == "uint8_view":
        outside[:, 16: 16 + H * o_tri.element_size()] = False
    if layout != "contiguous":
        assert torch.equal(b_tri[outside], before[outside])


@needs_triton
@pytest.mark.parametrize("idx_dtype", (torch.int32, torch.int64))
def test_permute_all_invalid_and_wide_J(idx_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 40, generator=gen)
    out = torch.full((9, 40), 3.0)
    permute_triton(x, torch.full((5, 4), -1, dtype=idx_dtype), out)
    assert (out == 3.0).all()
    dest, n = _dest_map(3, 256, extra=0, drop=0.5, gen=gen, idx_dtype=idx_dtype)
    x = torch.randn(3, 40, generator=gen)
    blank = torch.zeros(n, 40)
    assert torch.equal(permute_triton(x, dest, blank.clone()), _naive_permute(x, dest, blank))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("J", JS)
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("T", TS)
def test_unpermute_combine_matches(T, H, J, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H * 10 + J + 1)
    N = max(T * J // 2, 1)
    wide = torch.randn(N, H + 9, generator=gen).to(dtype)
    src = wide[:, 4: 4 + H] if (T + J) % 2 else wide[:, :H].contiguous()
    index = torch.randint(0, N, (T, J), generator=gen)  # rows may repeat (replicated sources)
    index[torch.rand(T, J, generator=gen) < 0.3] = -1
    if T == 7:
        index[3] = -1  # a token with no source: zeros
    index = index.to(torch.int32 if J == 8 else torch.int64)
    weight = None if H == 96 else torch.rand(T, J, generator=gen)
    if weight is not None:
        weight[index < 0] = float("nan")  # ignored where the index is invalid
    expected = _naive_combine(src, index, weight)
    tri = unpermute_combine_triton(src, index, weight)
    ref = unpermute_combine_reference(src, index, weight)
    assert tri.dtype == ref.dtype == dtype and tri.shape == ref.shape == (T, H)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for got in (tri, ref):
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    if T == 7:
        assert (tri[3] == 0).all() and (ref[3] == 0).all()


@needs_triton
def test_unpermute_combine_out_dtype_and_empty_src():
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(6, 24, generator=gen).bfloat16()
    index = torch.tensor([[0, 5, -1], [2, 2, 1], [-1, -1, -1]])
    weight = torch.rand(3, 3, generator=gen)
    tri = unpermute_combine_triton(src, index, weight, out_dtype=torch.float32)
    ref = unpermute_combine_reference(src, index, weight, out_dtype=torch.float32)
    assert tri.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(tri.double(), _naive_combine(src, index, weight), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref, tri)
    # float32 partial sums back into a float16 layer's output (the combine of float16 layers)
    half = unpermute_combine_triton(src.float(), index, None, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, unpermute_combine_reference(src.float(), index, None, out_dtype=torch.float16))
    empty = torch.empty(0, 24)
    none = torch.full((4, 2), -1)
    for fn in (unpermute_combine_triton, unpermute_combine_reference):
        out = fn(empty, none, torch.rand(4, 2))
        assert out.shape == (4, 24) and (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_unpermute_combine_with_every_entry_valid_skips_the_masks_bit_for_bit(dtype):
    """``all_valid=True`` (one rank's pairs: the index an inverse permutation) takes the reference
    without its masks, on the host-bound path: the same sums bit for bit, and the same gradients."""
    from moelayers.kernels.unpermute_combine import unpermute_combine_reference

    g = torch.Generator().manual_seed(3)
    t, j, h = 7, 3, 16
    index = torch.randperm(t * j, generator=g).view(t, j).to(torch.int32)
    for weighted in (True, False):
        outs, grads = [], []
        for all_valid in (False, True):
            src = torch.randn(t * j, h, generator=torch.Generator().manual_seed(4)).to(dtype).requires_grad_()
            w = torch.rand(t, j, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_() if weighted else None
            y = unpermute_combine_reference(src, index, w, torch.float32, all_valid=all_valid)
            y.pow(2).sum().backward()
            outs.append(y)
            grads.append((src.grad, None if w is None else w.grad))
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(grads[0][0], grads[1][0]) and (not weighted or torch.equal(grads[0][1], grads[1][1]))


def test_unpermute_combine_without_entries_keeps_the_graph():
    """J = 0 returned fresh zeros, cut off from src and weight: backward raised "does not require grad"."""
    src = torch.randn(3, 4, requires_grad=True)
    weight = torch.rand(2, 0, requires_grad=True)
    out = unpermute_combine(src, torch.zeros(2, 0, dtype=torch.int64), weight)
    assert out.shape == (2, 4) and out.requires_grad
    out.sum().backward()
    assert (src.grad == 0).all()


def test_reference_gradcheck():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    dest = torch.tensor([[0, 6], [-1, -1], [2, -1], [5, 1]])
    out = torch.full((8, 5), 9.0, dtype=torch.float64)
    y = permute_reference(x, dest, out)
    assert y is not out and (out == 9.0).all()  # with grad: fresh tensor, `out` untouched
    assert torch.equal(y.detach(), _naive_permute(x.detach(), dest, out))
    assert torch.autograd.gradcheck(lambda x: permute_reference(x, dest, out), (x,))

    src = torch.randn(6, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    index = torch.tensor([[0, 5, -1], [2, 2, 1], [-1, -1, -1], [4, 3, 0]])
    weight = torch.rand(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s, w: unpermute_combine_reference(s, index, w), (src, weight))
    assert torch.autograd.gradcheck(lambda s: unpermute_combine_reference(s, index, None), (src,))


@pytest.mark.parametrize("chunk_bytes", [None, 1, 3 * 4 * 6 * 8, 1 << 30])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_unpermute_combine_lean_is_the_reference(dtype, chunk_bytes, monkeypatch):
    """The autograd path without the reference's [T, J, H] temporaries (float32, saved for the
    backward), as the reference itself (small), in chunks of one token, of three and in one: the same output bit for bit, the
    same gradients, NaN weights of invalid entries ignored, double backward, an empty src, rows past
    src refused."""
    import importlib
    module = importlib.import_module("moelayers.kernels.unpermute_combine")
    if chunk_bytes is not None:
        monkeypatch.setattr(module, "_SMALL_BYTES", 0)
        monkeypatch.setattr(module, "_CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(5)
    t, j, n, h = 9, 4, 11, 6
    index = torch.randint(0, n, (t, j), generator=gen)
    index[torch.rand(t, j, generator=gen) < 0.4] = -1
    index[2] = -1
    weight = torch.rand(t, j, generator=gen)
    weight[index < 0] = float("nan")
    src = torch.randn(n, h, generator=gen).to(dtype)
    src[index[index >= 0].min()] = float("inf")  # a valid row: inf in the output, as in the reference
    grad = torch.randn(t, h, generator=gen).to(dtype)
    results = []
    for fn in (unpermute_combine_reference, unpermute_combine_lean):
        s, w = src.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(s, index, w)
        out.backward(grad)
        results.append((out, s.grad, w.grad))
    assert torch.equal(results[0][0].nan_to_num(), results[1][0].nan_to_num())
    assert torch.equal(results[0][0].isnan(), results[1][0].isnan())
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for ref, lean in zip(*results):
        assert ref.dtype == lean.dtype
        torch.testing.assert_close(lean.double(), ref.double(), rtol=tol, atol=tol, equal_nan=True)
    assert (results[1][0][2] == 0).all() and not results[1][1].isnan().any()
    src[src.isinf()] = 0.0
    if dtype == torch.float64:
        s = src.clone().requires_grad_()
        w = weight.nan_to_num().double().requires_grad_()
        assert torch.autograd.gradcheck(lambda s, w: unpermute_combine_lean(s, index, w), (s, w))
        assert torch.autograd.gradgradcheck(lambda s, w: unpermute_combine_lean(s, index, w), (s, w))
        assert torch.autograd.gradcheck(lambda s: unpermute_combine_lean(s, index, None), (s,))
        out = unpermute_combine_lean(src.float(), index, None, out_dtype=torch.float16)
        assert out.dtype == torch.float16
        assert torch.equal(out, unpermute_combine_reference(src.float(), index, None, out_dtype=torch.float16))
    empty = torch.zeros(0, h, requires_grad=True)
    out = unpermute_combine_lean(empty, torch.full((3, 2), -1), torch.rand(3, 2))
    assert out.shape == (3, h) and (out == 0).all() and out.requires_grad
    with pytest.raises(IndexError):
        unpermute_combine_lean(src, torch.tensor([[n, -1]]), None)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("repeat", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_combine_triton_backward(dtype, repeat, weighted):
    """The Triton backward against the reference's autograd: rows gathered once get the reference's
    gradient bit for bit (float32 atomics into zeros, one cast), rows gathered twice the sum, NaN
    weights of invalid entries ignored, the weight's gradient to float32 rounding (another order of
    the dot product), a strided ``src``, either input alone requiring a gradient."""
    gen = torch.Generator().manual_seed(7 + repeat + 2 * weighted)
    t, j, n, h = 9, 4, 45, 1030  # two blocks of H (1024 columns each)
    if repeat:
        index = torch.randint(0, n, (t, j), generator=gen)
        index[0, :2] = 5  # one row twice
    else:
        index = torch.randperm(n, generator=gen)[: t * j].view(t, j)
    index[torch.rand(t, j, generator=gen) < 0.3] = -1
    index[3] = -1
    weight = torch.rand(t, j, generator=gen) if weighted else None
    if weighted:
        weight[index < 0] = float("nan")
    src = torch.randn(n, h + 6, generator=gen).to(dtype)[:, 3: 3 + h]
    grad = torch.randn(t, h, generator=gen).to(dtype)
    runs = []
    for fn in (unpermute_combine_reference, unpermute_combine_triton):
        s = src.clone().requires_grad_()
        w = weight.clone().requires_grad_() if weighted else None
        fn(s, index, w).backward(grad)
        runs.append((s.grad, None if w is None else w.grad))
    (ref_src, ref_w), (tri_src, tri_w) = runs
    assert tri_src.dtype == dtype and tri_src.shape == src.shape
    if repeat and dtype in (torch.bfloat16, torch.float16):  # the reference rounds each add to dtype
        torch.testing.assert_close(tri_src, ref_src, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(tri_src, ref_src)
    if weighted:
        assert tri_w.dtype == weight.dtype and not tri_w.isnan().any() and (tri_w[index < 0] == 0).all()
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(tri_w, ref_w, rtol=tol, atol=tol)
        w = weight.nan_to_num().requires_grad_()  # only the weight wants a gradient
        unpermute_combine_triton(src, index, w).backward(grad)
        torch.testing.assert_close(w.grad, ref_w.nan_to_num(), rtol=tol, atol=tol)


@needs_triton
def test_unpermute_combine_triton_backward_edges():
    """Rows past ``src`` get no gradient (the forward reads them as zeros); an empty ``src``,
    ``J = 0`` and ``T = 0`` give empty or zero gradients; a double backward (``create_graph=True``
    takes the lean path's torch operations) passes gradgradcheck."""
    src = torch.randn(4, 8, requires_grad=True)
    w = torch.rand(2, 2, requires_grad=True)
    out = unpermute_combine_triton(src, torch.tensor([[1, 4], [-1, 0]]), w)  # row 4 is past src
    out.sum().backward()
    assert torch.equal(out[0].detach(), w[0, 0].detach() * src[1].detach())
    assert w.grad[0, 1] == 0 and w.grad[1, 0] == 0 and (src.grad[2:] == 0).all()
    for s, i in ((torch.zeros(0, 8), torch.full((3, 2), -1)), (torch.randn(4, 8), torch.zeros(3, 0, dtype=torch.long)),
                 (torch.randn(4, 8), torch.zeros(0, 2, dtype=torch.long))):
        s.requires_grad_()
        weight = torch.rand(i.shape, requires_grad=True)
        out = unpermute_combine_triton(s, i, weight)
        assert out.shape == (i.shape[0], 8) and (out == 0).all()
        out.sum().backward()
        assert s.grad.shape == s.shape and (s.grad == 0).all() and weight.grad.shape == i.shape
    s = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[1, 4], [-1, 0]])
    assert torch.autograd.gradcheck(lambda s, w: unpermute_combine_triton(s, index, w), (s, w))
    assert torch.autograd.gradgradcheck(lambda s, w: unpermute_combine_triton(s, index, w), (s, w))


def test_unpermute_combine_takes_triton_for_training_unless_deterministic(monkeypatch):
    """Where Triton is allowed, a gradient-wanting combine takes the Triton Function, except under
    ``torch.use_deterministic_algorithms(True)`` (its backward adds with atomics): the lean path."""
    module = importlib.import_module("moelayers.kernels.unpermute_combine")
    taken = []
    monkeypatch.setattr(module, "use_triton", lambda t, differentiable=False: differentiable)
    monkeypatch.setattr(module, "unpermute_combine_triton", lambda *a: taken.append("triton"))
    monkeypatch.setattr(module, "unpermute_combine_lean", lambda *a, **kw: taken.append("lean"))
    src = torch.randn(3, 4, requires_grad=True)
    index = torch.tensor([[0, 1]])
    module.unpermute_combine(src, index, None)
    with torch.no_grad():
        module.unpermute_combine(src, index, None)
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        module.unpermute_combine(src, index, None)
        module.unpermute_combine(src.detach(), index, None)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert taken == ["triton", "triton", "lean", "triton"]


def test_use_triton_decision(monkeypatch):
    """The Triton path: CUDA tensors only, not with MOELAYERS_DISABLE_TRITON=1, not when a gradient is
    wanted, not without Triton (a stand-in with ``is_cuda`` decides on CPU too)."""
    import types

    import moelayers.kernels as kernels

    monkeypatch.setattr(kernels, "HAVE_TRITON", True)
    cuda = types.SimpleNamespace(is_cuda=True, requires_grad=False)
    assert kernels.use_triton(cuda)
    assert not kernels.use_triton(types.SimpleNamespace(is_cuda=False, requires_grad=False))
    assert not kernels.use_triton(types.SimpleNamespace(is_cuda=True, requires_grad=True))
    with torch.no_grad():  # no gradient wanted: an input that requires one may still take Triton
        assert kernels.use_triton(types.SimpleNamespace(is_cuda=True, requires_grad=True))
    assert kernels.use_triton(types.SimpleNamespace(is_cuda=True, requires_grad=True), differentiable=True)
    assert not kernels.use_triton(types.SimpleNamespace(is_cuda=False, requires_grad=True), differentiable=True)
    monkeypatch.setenv("MOELAYERS_DISABLE_TRITON", "0")
    assert kernels.use_triton(cuda)
    monkeypatch.setenv("MOELAYERS_DISABLE_TRITON", "1")
    assert not kernels.use_triton(cuda)
    monkeypatch.delenv("MOELAYERS_DISABLE_TRITON")
    monkeypatch.setattr(kernels, "HAVE_TRITON", False)
    assert not kernels.use_triton(cuda)


def test_dispatch_uses_reference_on_cpu():
    x = torch.randn(3, 8)
    assert not use_triton(x)
    dest = torch.tensor([[1], [-1], [0]])
    out = permute(x, dest, torch.zeros(2, 8))
    assert torch.equal(out, torch.stack([x[2], x[0]]))
    y = unpermute_combine(out, torch.tensor([[1], [-1], [0]]), None)
    assert torch.equal(y, torch.stack([x[0], torch.zeros(8), x[2]]))
    xg = x.clone().requires_grad_()
    assert permute(xg, dest, torch.zeros(2, 8)).requires_grad


@needs_triton
def test_triton_kernels_never_touch_memory_past_their_buffers():
    from tests.kernel_bounds import check_kernels_stay_in_bounds

    check_kernels_stay_in_bounds(torch.device("cpu"))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_unpermute_combine_refuses_rows_of_an_empty_src(impl):
    """Row 0 of an empty src read as zeros (the reference's padding row); index 1 raised."""
    if impl == "triton" and (not HAVE_TRITON or not _interpreted()):
        pytest.skip("triton missing or not in interpreter mode")
    fn = unpermute_combine_reference if impl == "reference" else unpermute_combine_triton
    with pytest.raises(IndexError, match="src, which has no rows"):
        fn(torch.zeros(0, 3), torch.tensor([[0, -1]]), None)
    assert fn(torch.zeros(0, 3), torch.tensor([[-1, -1]]), None).abs().sum() == 0  # only -1: zeros
