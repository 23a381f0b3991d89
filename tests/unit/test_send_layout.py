"""The send-layout kernel (Triton under the interpreter on CPU) vs its torch reference vs a loop."""

import importlib

import pytest
import torch

from moelayers.kernels import HAVE_TRITON, send_layout_reference, send_layout_triton


def _interpreted() -> bool:
    mod = importlib.import_module("moelayers.kernels.send_layout")
    return type(mod._send_layout_kernel).__name__ == "InterpretedFunction"


def _loop(dest_rank, num_ranks, flag, digest):
    """The layout by hand: rows ordered by (rank, token), one per token with an expert there."""
    t = dest_rank.shape[0]
    dest_map = torch.full((t, num_ranks), -1, dtype=torch.int64)
    header = torch.zeros(num_ranks, 4, dtype=torch.int64)
    row = 0
    for r in range(num_ranks):
        for i in range(t):
            hits = int((dest_rank[i] == r).sum())
            header[r, 1] += hits
            if hits:
                dest_map[i, r] = row
                header[r, 0] += 1
                row += 1
    header[:, 2] = 0 if flag is None else int(flag)
    header[:, 3] = digest
    return dest_map, header


def _ranks(t, k, r, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    dest_rank = torch.randint(0, r, (t, k), generator=g)
    dest_rank[torch.rand(t, k, generator=g) < 0.1] = -1  # padding: sent nowhere
    return dest_rank.to(dtype)


CASES = [(0, 2, 2), (1, 1, 1), (9, 3, 4), (40, 8, 2), (300, 6, 8), (77, 8, 64), (20, 2, 3)]
FLAGS = [None, torch.tensor(True), torch.tensor(False), torch.tensor(6, dtype=torch.int32)]


@pytest.mark.parametrize("t,k,r", CASES)
@pytest.mark.parametrize("flag", FLAGS, ids=["none", "true", "false", "int"])
def test_send_layout_reference_matches_a_loop(t, k, r, flag):
    dest_rank = _ranks(t, k, r, seed=t + 10 * r)
    digest = (1 << 62) - 12345
    for got, want in zip(send_layout_reference(dest_rank, r, flag, digest), _loop(dest_rank, r, flag, digest)):
        assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.skipif(not HAVE_TRITON or not _interpreted(), reason="triton missing or not interpreted")
@pytest.mark.parametrize("t,k,r", CASES + [(2100, 8, 4)])  # 2100 tokens: several token blocks
@pytest.mark.parametrize("flag", FLAGS, ids=["none", "true", "false", "int"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_send_layout_triton_matches_reference(t, k, r, flag, dtype):
    dest_rank = _ranks(t, k, r, seed=t + r, dtype=dtype)
    for got, want in zip(send_layout_triton(dest_rank, r, flag, 987654321), send_layout_reference(dest_rank, r, flag, 987654321)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fn", [send_layout_reference, send_layout_triton])
def test_send_layout_refuses_bad_input(fn):
    if fn is send_layout_triton and (not HAVE_TRITON or not _interpreted()):
        pytest.skip("triton missing or not interpreted")
    good = _ranks(5, 2, 2, 0)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        fn(good.flatten(), 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        fn(good.float(), 2)
    with pytest.raises(ValueError, match="num_ranks"):
        fn(good, 0)
    with pytest.raises(ValueError, match="one-element"):
        fn(good, 2, torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="digest"):
        fn(good, 2, None, -1)


def test_send_layout_gives_the_kernel_bounded_work(monkeypatch):
    """The kernel is one program walking the tokens twice: beyond TRITON_MAX_UNITS (token, rank)
    units the dispatcher takes the reference."""
    mod = importlib.import_module("moelayers.kernels.send_layout")
    calls = []
    monkeypatch.setattr(mod, "use_triton", lambda t: True)
    monkeypatch.setattr(mod, "send_layout_triton", lambda *a: calls.append("triton") or send_layout_reference(*a))
    # (1, 5000): within the units, but the kernel's tile (>= 16 tokens by the ranks) would pass
    # Triton's 2^20 elements at 65,536 ranks: TRITON_MAX_RANKS
    for t, r, kernel in [(4096, 32, True), (4097, 32, False), (2048, 64, True), (2048, 65, False), (0, 8, True),
                         (1, 4096, True), (1, 5000, False)]:
        calls.clear()
        mod.send_layout(_ranks(t, 2, r, 0), r)
        assert calls == (["triton"] if kernel else []), (t, r)
