"""torch distributed checkpointing through ``moelayers.checkpoint`` on 2 GPUs over NCCL: the CPU
test's save, load into other placements and expert-parallel sizes, and resume, on CUDA in float32."""

from __future__ import annotations

import pytest
import torch

from moelayers.testing import run_distributed
from tests.distributed.test_checkpoint import _resume_in_saved_placement, _save_and_resume

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def test_dcp_checkpoint_resumes_training_in_any_placement_and_expert_parallel_size_nccl(tmp_path):
    """Loaded bit for bit in every layout (checked on the ranks); three more float32 Adam steps stay
    within 1e-5 of the uninterrupted run (another layout sums the tokens in another order)."""
    results = run_distributed(_save_and_resume, 2, str(tmp_path / "ckpt"), "cuda", torch.float32, backend="nccl",
                              timeout=300)
    for errors in results:
        assert len(errors) == 5
        print({f"ep{ep}/{place}": f"{err:.1e}" for (ep, place), err in errors.items()})
        for case, err in errors.items():
            assert err < 1e-5, (case, err)


def test_dcp_checkpoint_resumes_in_the_saved_placement_nccl(tmp_path):
    """The CPU test's move into the saved placement after loading, over NCCL (float64 on CUDA): the
    slots and Adam's moments bit for bit, three more steps exactly the uninterrupted run's."""
    for out in run_distributed(_resume_in_saved_placement, 2, str(tmp_path / "ckpt"), "cuda", backend="nccl",
                               timeout=300):
        assert out["placement"] and out["bit_for_bit"], out
        assert out["resumed"] == 0.0, out["resumed"]


def _one_rank_apart_checks(rank: int, world: int, device: str = "cuda") -> dict:
    """Every case of the CPU tests of a checkpoint refused on one rank, in one world."""
    from tests.distributed.test_one_rank_errors import (LOAD_CASES, _model_state_check, _placement_check,
                                                        _placement_mixed_groups, _placement_move_fails_in_one_group)

    out = {f"placement/{case}": _placement_check(rank, world, case, device)
           for case in ("bad_entry", "missing_entry", "meta_entry")}
    out["placement/mixed_groups"] = _placement_mixed_groups(rank, world, device)
    out["placement/move_fails_in_one_group"] = _placement_move_fails_in_one_group(rank, world, device)
    out.update({f"load/{case}": _model_state_check(rank, world, case, device) for case in LOAD_CASES})
    return out


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_checkpoint_refused_on_one_rank_is_refused_everywhere_at_world_4_nccl():
    """The loaders' agreement over NCCL at world 4 (two expert-parallel groups of 2, expert data
    parallel across them): one rank's refused entry or state dict raises on every rank, and no rank
    loads or moves anything (tests/distributed/test_one_rank_errors.py, there on gloo)."""
    _assert_refused_everywhere(run_distributed(_one_rank_apart_checks, 4, backend="nccl", timeout=400))


def _assert_refused_everywhere(results: list[dict]) -> None:
    from tests.distributed.test_one_rank_errors import LOAD_CASES, _assert_all_raise

    own = {"bad_entry": "ValueError: load_placement_state_dict: moe.placement is not a placement of 4 experts",
           "missing_entry": "KeyError", "meta_entry": ""}
    for case, start in own.items():
        outcomes = [r[f"placement/{case}"] for r in results]
        _assert_all_raise([loaded for loaded, _, _ in outcomes], start,
                          "ValueError: load_placement_state_dict: another rank refused its entry")
        assert all(served == "ok" and not moved for _, served, moved in outcomes), (case, outcomes)
    mixed = [r["placement/mixed_groups"] for r in results]
    _assert_all_raise([first for first, *_ in mixed], "KeyError",
                      "ValueError: load_placement_state_dict: another rank refused its entry")
    assert all(unmoved and retry == "ok" and b == [3, 2, 1, 0] for _, unmoved, retry, b in mixed), mixed
    for rank, r in enumerate(results):
        loaded, placements, same = r["placement/move_fails_in_one_group"]
        expected = "failed while staging" if rank >= 2 else "the move failed in another expert-parallel group"
        assert loaded.startswith("PlacementMoveError") and expected in loaded, (rank, loaded)
        assert placements == [[0, 1, 2, 3]] * 2 and same, (rank, placements, same)
    for case, start in LOAD_CASES.items():
        outcomes = [r[f"load/{case}"] for r in results]
        what = "load_optimizer_state_dict" if case.startswith("optimizer") else "load_model_state_dict"
        _assert_all_raise([loaded for loaded, _ in outcomes], start, f"ValueError: {what}: another rank refused its state dict")
        assert all(unchanged for _, unchanged in outcomes), (case, outcomes)
