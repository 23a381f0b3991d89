"""An error on one rank raises on every rank (gloo, 2 ranks): a rank that refuses its input or its
state alone must still take part in the collectives the other ranks run (or all must agree first),
so that none waits forever and none goes on with another state. Each check returns every rank's
outcome; a rank left waiting fails the run by its timeout."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as tnf

import moelayers as ml
from moelayers.testing import run_distributed

TIMEOUT = 90


def _outcome(fn, *args, **kwargs) -> str:
    """``'ok'`` or ``'<ExceptionType>: <message>'``."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test compares every rank's outcome
        return f"{type(exc).__name__}: {exc}"
    return "ok"


REFUSED_ELSEWHERE = "ValueError: the layer refused the input of expert-parallel rank(s) [1]"


def _assert_all_raise(outcomes: list[str], own: str, others: str = REFUSED_ELSEWHERE) -> None:
    """Rank 1 raised its own error (starting ``own``), every other rank ``others`` -- not gloo's
    "connection closed" of a rank left waiting in a collective when rank 1 exited."""
    assert outcomes[1].startswith(own), f"rank 1: {outcomes[1]}"
    for rank, got in enumerate(outcomes):
        assert rank == 1 or got.startswith(others), f"rank {rank}: {got}"


# ------------------------------------------------------------------------------ megatron adapter
def _adapter_check(rank: int, world: int, case: str) -> str:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moelayers.integrations import megatron as mi

    warnings.simplefilter("ignore")
    extra = dict(moe_aux_loss_coeff=0.01) if case == "training_losses" else {}
    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=4, moe_ffn_hidden_size=4,
                           num_moe_experts=4 * world, moe_router_topk=2, gated_linear_unit=True, activation_func=tnf.silu,
                           add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, **extra)
    adapter = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.from_world()).eval()
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(rank))
    if case == "intermediate_tensors":
        with torch.no_grad():
            return _outcome(adapter, x, [torch.zeros(1)] if rank == 1 else None)
    adapter.train(rank == 1)  # rank 1 alone trains, with a loss moelayers does not implement
    return _outcome(adapter, x)


@pytest.mark.parametrize("case", ["intermediate_tensors", "training_losses"])
def test_megatron_adapter_refusals_on_one_rank(case):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    own = {"intermediate_tensors": "NotImplementedError: MegatronMoEAdapter does not support partial CUDA-graph",
           "training_losses": "RuntimeError: the transformer_config turns on training losses"}[case]
    _assert_all_raise(run_distributed(_adapter_check, 2, case, timeout=TIMEOUT), own)
