"""Shuffle kernels (moelayers.kernels.shuffle): Triton under TRITON_INTERPRET=1 vs torch references
vs naive python loops."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton / moelayers are imported

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from moelayers.kernels import (  # noqa: E402
    HAVE_TRITON,
    bucket_positions,
    bucket_positions_reference,
    bucket_positions_triton,
    shuffle_rows,
    shuffle_rows_reference,
    shuffle_rows_triton,
)


def _interpreted() -> bool:
    mod = importlib.import_module("moelayers.kernels.shuffle")
    return type(mod._shuffle_rows_kernel).__name__ == "InterpretedFunction"


needs_triton = pytest.mark.skipif(not HAVE_TRITON or not _interpreted(),
                                  reason="triton missing or not in interpreter mode")


def _naive_shuffle(x, index):
    out = torch.zeros(index.numel(), x.shape[1], dtype=x.dtype)
    for i, s in enumerate(index.tolist()):
        if s >= 0:
            out[i] = x[s]
    return out


def _naive_positions(pred, conf):
    p, c = pred.tolist(), [0.0 if v != v else v for v in conf.tolist()]
    return torch.tensor([sum(1 for j in range(len(p)) if p[j] == p[i] and (c[j] > c[i] or (c[j] == c[i] and j < i)))
                         for i in range(len(p))], dtype=torch.int64)


def _bits(t):
    return t.contiguous().view(torch.uint8)


@needs_triton
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
@pytest.mark.parametrize("T,N,H", [(0, 3, 8), (1, 1, 8), (7, 9, 96), (33, 40, 200)])
def test_shuffle_rows_matches(T, N, H, dtype):
    gen = torch.Generator().manual_seed(T * 100 + N + H)
    x = torch.randn(T, H, generator=gen).to(dtype)
    index = torch.randint(-1, max(T, 1), (N,), generator=gen) if T else torch.full((N,), -1)
    index = index.to(torch.int32 if H == 96 else torch.int64)
    expected = _naive_shuffle(x, index)
    tri, ref = shuffle_rows_triton(x, index), shuffle_rows_reference(x, index)
    assert torch.equal(_bits(tri), _bits(expected)) and torch.equal(_bits(ref), _bits(expected))
    # into a column slice of a wider, NaN-poisoned buffer (the reduce-scatter input); NaN rows of x too
    if T:
        x[0] = float("nan")
        expected = _naive_shuffle(x, index)
    for fn in (shuffle_rows_triton, shuffle_rows_reference):
        wide = torch.full((N, H + 6), float("nan"), dtype=dtype)
        assert fn(x, index, wide[:, 3:3 + H]) is not None
        assert torch.equal(_bits(wide[:, 3:3 + H]), _bits(expected))
        assert wide[:, :3].isnan().all() and wide[:, 3 + H:].isnan().all()


@needs_triton
@pytest.mark.parametrize("T", (0, 1, 5, 64, 65, 150))
def test_bucket_positions_matches(T):
    gen = torch.Generator().manual_seed(T)
    pred = torch.randint(-3, 4, (T,), generator=gen)  # any bucket id, negative ones too
    conf = torch.randint(-2, 4, (T,), generator=gen).float() / 3  # many ties, negative confidences too
    if T > 3:
        conf[1], conf[2], conf[3] = -0.0, 0.0, float("nan")  # -0.0 == 0.0 == NaN (counted as 0)
    expected = _naive_positions(pred, conf)
    for fn in (bucket_positions_triton, bucket_positions_reference):
        for p in (pred, pred.int()):
            got = fn(p, conf)
            assert got.dtype == torch.int64 and torch.equal(got, expected), fn.__name__


def test_bucket_positions_is_a_ranking():
    gen = torch.Generator().manual_seed(3)
    pred, conf = torch.randint(0, 5, (300,), generator=gen), torch.rand(300, generator=gen)
    pos = bucket_positions_reference(pred, conf)
    for b in range(5):
        mine = pred == b
        assert sorted(pos[mine].tolist()) == list(range(int(mine.sum())))  # 0..n-1 within each bucket
        order = torch.argsort(pos[mine])
        assert (conf[mine][order].diff() <= 0).all()  # most confident first


def test_shuffle_rows_reference_grad_and_bad_input():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, -1, 0, 0, 3])
    out = torch.zeros(5, 3, dtype=torch.float64)
    y = shuffle_rows_reference(x, index, out)
    assert y is not out and (out == 0).all()  # with grad: fresh tensor, `out` untouched
    assert torch.autograd.gradcheck(lambda x: shuffle_rows_reference(x, index), (x,))
    with pytest.raises(ValueError):
        shuffle_rows_reference(x, index.view(5, 1))
    with pytest.raises(TypeError):
        shuffle_rows_reference(x, index.float())
    with pytest.raises(ValueError):
        shuffle_rows_reference(x.detach(), index, torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(TypeError):
        bucket_positions_reference(torch.zeros(3), torch.zeros(3))


def test_dispatchers_use_references_on_cpu():
    x = torch.randn(3, 4)
    index = torch.tensor([2, -1, 1])
    assert torch.equal(shuffle_rows(x, index), _naive_shuffle(x, index))
    pred, conf = torch.tensor([1, 1, 0, 1]), torch.tensor([0.2, 0.5, 0.1, 0.5])
    assert bucket_positions(pred, conf).tolist() == [2, 0, 0, 1]


def test_capacity_ranks_places_a_token_scored_minus_inf_where_there_is_room():
    """Token 0 prefers rank 0 and scores -inf on rank 1; once rank 0 is full it still gets rank 1
    (it used to keep rank -1, and the rebatch then dropped it from the permutation)."""
    from moelayers.schedule.token_shuffle import capacity_ranks, rebatch_ranks

    scores = torch.tensor([[0.0, float("-inf")], [0.0, 5.0], [1.0, 0.0], [1.0, 0.0]])
    ranks = capacity_ranks(scores, torch.tensor([2, 2]))
    assert ranks.tolist() == [1, 1, 0, 0]
    assert sorted(rebatch_ranks(ranks, 2).perm.tolist()) == [0, 1, 2, 3]


def test_shuffle_reference_refuses_an_index_past_the_rows():
    """Index T is outside [-1, T): an error, not the padding's zero row."""
    from moelayers.kernels.shuffle import shuffle_rows_reference

    x = torch.ones(2, 3)
    assert shuffle_rows_reference(x, torch.tensor([1, -1])).tolist() == [[1.0] * 3, [0.0] * 3]
    with pytest.raises(IndexError):
        shuffle_rows_reference(x, torch.tensor([2, 0]))
    assert shuffle_rows_reference(x[:0], torch.tensor([-1, -1])).tolist() == [[0.0] * 3] * 2
    with pytest.raises(IndexError, match="has no rows"):  # row 0 of no rows: it used to read the padding's zeros
        shuffle_rows_reference(x[:0], torch.tensor([0, -1]))
