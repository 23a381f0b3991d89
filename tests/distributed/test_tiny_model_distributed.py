"""TinyDecoder under attention-DP at world 2: a rank with no sequences still takes part in every
MoE exchange (its forward used to crash on the empty batch, leaving the other rank waiting)."""

import pytest
import torch

import moelayers as ml
from moelayers.models import TinyConfig, TinyDecoder
from moelayers.testing import run_distributed

V, H = 64, 32


def _model(groups) -> TinyDecoder:
    moe = ml.MoEConfig(hidden_size=H, ffn_hidden_size=16, num_experts=4, top_k=2, init_std=0.2,
                       params_dtype=torch.float64)
    cfg = TinyConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, init_std=0.2, dtype=torch.float64)
    return TinyDecoder(cfg, lambda i: ml.VanillaMoE(moe, groups, seed=i))


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))


def _worker(rank: int, world: int) -> tuple[list[int], torch.Tensor]:
    model = _model(ml.ParallelGroups.from_world())
    ids = _ids() if rank == 0 else torch.zeros(0, 5, dtype=torch.int64)  # rank 1: no sequences
    with torch.no_grad():
        out = model(ids)
    return list(out.shape), out


@pytest.mark.timeout(120)
def test_a_rank_without_sequences_joins_the_forward():
    (shape0, out0), (shape1, _) = run_distributed(_worker, 2, timeout=90)
    assert shape0 == [2, 5, V] and shape1 == [0, 5, V]
    with torch.no_grad():
        want = _model(ml.ParallelGroups.single())(_ids())
    torch.testing.assert_close(out0, want, rtol=0, atol=1e-12)
