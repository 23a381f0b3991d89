"""VanillaMoE equals the dense float64 reference at world sizes 1, 2 and 4 (gloo, CPU).

Each world size spawns its processes once (module-scoped fixture) and runs every case of
tests/equivalence_cases.py; each case is then reported as its own test.
"""

import pytest

from moelayers.testing import run_distributed
from tests.equivalence_cases import case_list, run_cases

WORLD_SIZES = (1, 2, 4)
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = [run_cases(0, 1)] if world == 1 else run_distributed(run_cases, world, timeout=600)
    return _results[world]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", [c["name"] for c in case_list(2)])
def test_vanilla_matches_reference(world, case):
    for rank, res in enumerate(results_for(world)):
        assert case in res, f"case {case} did not run on rank {rank}"
        assert res[case] is None, f"world {world}, rank {rank}: {res[case]}"
