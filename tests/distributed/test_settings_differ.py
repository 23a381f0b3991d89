"""Ranks whose layers differ in a setting the exchange compares (gloo, 2 ranks): every rank raises,
and the error names what differs, on which ranks, and what to do, instead of listing every cause."""

from __future__ import annotations

import pytest
import torch

import moelayers as ml
from moelayers.dispatch.flags import SettingsDiffer, settings_differences
from moelayers.testing import error_of, run_distributed

TIMEOUT = 90
CFG = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
HEAD = "serve different placements or layer settings (their ranks within the expert-parallel group, grouped by them: [[0], [1]])"


def _one_rank_differs(rank, world, case, kwargs):
    groups = ml.ParallelGroups.from_world()
    own = dict(kwargs, seed=1, layer_number=3)
    cfg = CFG
    if rank == 1:
        if case == "layer_number":
            own["layer_number"] = 4
        elif case == "placement":
            own["placement"] = ml.ExpertPlacement.from_phy2log(torch.tensor([[1, 0], [2, 3]]), 4)
        elif case == "top_k":
            cfg = CFG.replace(top_k=1)
        elif case == "class":
            layer = ml.VariabilityAwareMoE(cfg, groups, **own)
    if case != "class" or rank == 0:
        layer = ml.VanillaMoE(cfg, groups, **own)
    if case == "dtype" and rank == 1:
        layer.double()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank), dtype=layer.router.weight.dtype)
    with torch.no_grad():
        return error_of(layer, x), type(_last_error(layer, x)).__name__


def _last_error(layer, x):
    try:
        layer(x)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


NAMED = {
    "layer_number": ("layer_number is 3 on rank(s) [0], 4 on rank(s) [1]", "Every rank must call its layers in the same order"),
    "placement": ("the placement differs: phy2log[0][0] (expert-parallel rank 0's slot 0) is expert 0 on rank(s) [0], "
                  "expert 1 on rank(s) [1] (1 more entries differ)", "apply the same placement"),
    "top_k": ("config.top_k is 2 on rank(s) [0], 1 on rank(s) [1]", "build the layer alike"),
    "dtype": ("dtype of x is torch.float32 on rank(s) [0], torch.float64 on rank(s) [1]", "compute in the same dtype"),
    "class": ("layer class is 'VanillaMoE' on rank(s) [0], 'VariabilityAwareMoE' on rank(s) [1]", "build the layer alike"),
}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", sorted(NAMED))
def test_the_error_names_the_setting_that_differs(case, dispatcher):
    for got, typed in run_distributed(_one_rank_differs, 2, case, {"dispatcher": dispatcher}, timeout=TIMEOUT):
        what, advice = NAMED[case]
        assert HEAD in got and what in got and advice in got, got
        assert "load the same checkpoint moment or apply the same placement, build" not in got, got  # not every cause
        assert typed == "SettingsDiffer"  # raised again on the next forward alike
    assert issubclass(SettingsDiffer, ValueError)


def test_capacity_mode_keeps_the_list_of_causes():
    """Capacity mode compares the digests in flags that some ranks may not read: no more collectives there."""
    for got, _ in run_distributed(_one_rank_differs, 2, "layer_number", {"capacity": 8}, timeout=TIMEOUT):
        assert HEAD in got and "every rank must call its layers in the same order" in got, got
        assert "layer_number is" not in got, got


def test_settings_differences_names_each_difference_once():
    a = {"placement": [[0, 1], [2, 3]], "config.top_k": 2, "layer_number": None}
    b = {"placement": [[0, 1], [3, 2]], "config.top_k": 2, "layer_number": 1}
    text = settings_differences([a, a, b])
    assert text.startswith("the placement differs: phy2log[1][0] (expert-parallel rank 1's slot 0) is expert 2 on rank(s) "
                           "[0, 1], expert 3 on rank(s) [2] (1 more entries differ); layer_number is None on rank(s) "
                           "[0, 1], 1 on rank(s) [2]. "), text
    assert settings_differences([a, a]) == ""
    assert "phy2log shape is [2, 2] on rank 0, [1, 2] on rank 1" in settings_differences([a, dict(a, placement=[[0, 1]])])
    assert "extra is (not set) on rank(s) [0], 5 on rank(s) [1]" in settings_differences([a, dict(a, extra=5)])
    # the all-to-all's own settings are no difference of their own when the dispatcher differs
    alltoall, allgather = dict(a, dispatcher="alltoall", dedup=True, capacity=None), dict(a, dispatcher="allgather")
    assert settings_differences([alltoall, allgather]).startswith(
        "dispatcher is 'alltoall' on rank(s) [0], 'allgather' on rank(s) [1]. Every rank must build the layer alike")
    long = settings_differences([{"k": "x" * 100}, {"k": "y"}])
    assert "..." in long and len(long) < 200
