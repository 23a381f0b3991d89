"""The equivalence suite on GPUs with NCCL: 1 GPU in-process, then every GPU of the machine."""

import pytest
import torch

from moelayers.testing import run_distributed
from tests.equivalence_cases import case_list, run_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CASES = [c["name"] for c in case_list(2)]


def _world_sizes():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({w for w in (2, 4, 8, n) if 2 <= w <= n})


_results = {}


def _results_for(world):
    if world not in _results:
        if world == 1:
            _results[world] = [run_cases(0, 1, "cuda")]
        else:
            _results[world] = run_distributed(run_cases, world, "cuda", backend="nccl", timeout=900)
    return _results[world]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("world", [1] + _world_sizes())
@pytest.mark.parametrize("case", CASES)
def test_vanilla_matches_reference_gpu(world, case):
    for rank, res in enumerate(_results_for(world)):
        assert res[case] is None, f"world {world}, rank {rank}: {res[case]}"
