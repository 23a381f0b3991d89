"""The drop-in contract on CPU: our megatron adapter against megatron-core's whole ``MoELayer``.

megatron's ``MoELayer`` with its all-gather token dispatcher runs on gloo once one CUDA call is
answered for the CPU: the router's gating moves its weight to ``torch.cuda.current_device()``. In the
worker processes only (each rank is a new process), that call returns ``'cpu'``; megatron-core 0.16's
router gets the TE-less GEMM it expects (``megatron_peer._fix_router_gemm_without_te``, as the
benchmark peer does); megatron's ``jit_fuser`` functions run uncompiled (dynamo off). Nothing else is
changed: megatron's routing, dispatcher, permutation, experts (``SequentialMLP``) and combine run as
they are, in its tensor-, sequence- and expert-parallel layouts.

Both layers get the same weights (the adapter through ``load_full_weights``, megatron through
``load_megatron_weights``), the same ``[S, B, H]`` input and padding mask; the adapted layer also
runs with a placement that has replicas, with our all-gather dispatcher and with a fixed capacity.
Each rank's output must match the float64 dense reference (DESIGN.md's rule) and megatron's output.
In training, the input's gradient, the router's gradient and every expert's gradient must match the
reference's and megatron's too. (tests/gpu/test_megatron_gpu.py compares the two on GPUs with
megatron's all-to-all dispatcher.)
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import moelayers as ml  # noqa: E402
from moelayers.testing import check_close, run_distributed  # noqa: E402

H, FF, E, K = 16, 8, 8, 2
S, B = 8, 3  # megatron's [sequence, batch, hidden] layout


def _megatron_on_cpu() -> None:
    """The one CUDA call of megatron's CPU forward, answered for the CPU (in a worker process only)."""
    from moelayers.integrations import megatron_peer

    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True  # megatron's jit_fuser is torch.compile: no CPU compile here
    torch.cuda.current_device = lambda: "cpu"  # Router.gating moves its weight there
    megatron_peer._fix_router_gemm_without_te()


def _tc(tp: int, ep: int, sp: bool, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FF, moe_ffn_hidden_size=FF,
        num_moe_experts=E, moe_router_topk=K, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        bias_activation_fusion=False, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1, sequence_parallel=sp, params_dtype=dtype, bf16=dtype == torch.bfloat16)


def _weights(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return tuple(w.to(dtype) for w in (torch.randn(E, H, generator=g), 0.3 * torch.randn(E, 2 * FF, H, generator=g),
                                       0.3 * torch.randn(E, H, FF, generator=g)))


def _megatron_grads(meg):
    """megatron's gradients in our logical layout, gathered over its expert-parallel ranks:
    ``megatron_weights`` reads the parameters, so it reads the gradients once they stand in for them."""
    from moelayers.integrations.megatron_peer import megatron_weights

    params = list(meg.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return megatron_weights(meg)
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _reference(x2: torch.Tensor, weights: tuple, cfg, dtype: torch.dtype, train: bool) -> tuple:
    """The dense reference's output for this rank's tokens ``x2 [N, H]`` in ``dtype``, and in training
    the gradients of ``sum(y^2)``: the input's, the router's (this rank's tokens, as megatron's before
    its data-parallel reduction) and the experts' (summed over the ranks, whose tokens they all serve)."""
    leaves = [t.to(dtype).requires_grad_(train) for t in (x2, *weights)]
    with torch.set_grad_enabled(train):
        y = ml.reference.moe_forward(*leaves, cfg)
    if not train:
        return (y.detach(),)
    y.pow(2).sum().backward()
    for expert in leaves[2:]:
        torch.distributed.all_reduce(expert.grad)
    return (y.detach(), *(t.grad for t in leaves))


def _layer_kwargs(kind: str, ep: int) -> dict:
    """The adapted layer's options: ``plain`` (linear placement, all-to-all), ``replicas`` (experts
    permuted over the ranks and one replica of another rank's expert on each), ``allgather``
    (our all-gather dispatcher) or ``capacity`` (a fixed capacity of 64 rows per rank)."""
    if kind == "replicas":
        per = E // ep
        order = torch.randperm(E, generator=torch.Generator().manual_seed(3)).view(ep, per)
        spare = order.roll(1, dims=0)[:, :1]  # the first expert of the previous rank
        return dict(placement=ml.ExpertPlacement.from_phy2log(torch.cat([order, spare], 1), E))
    return {"plain": {}, "allgather": dict(dispatcher="allgather"), "capacity": dict(capacity=64)}[kind]


def _compare(tp: int, ep: int, sp: bool, pad: bool, dtype: torch.dtype, train: bool, kind: str) -> str | None:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from moelayers.integrations import megatron as mi
    from moelayers.integrations import megatron_peer as mpeer
    from moelayers.integrations.megatron_peer import load_megatron_weights

    tc = _tc(tp, ep, sp, dtype)
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    if isinstance(spec, ModuleSpec):  # megatron-core 0.16
        meg = build_module(spec, config=tc)
    else:  # >= 0.19: a builder (functools.partial), called as TransformerLayer calls it
        meg = mpeer._call_filtered(spec, config=tc, pg_collection=mpeer._default_pg_collection(), is_mtp_layer=False,
                                   name="mlp")
    adapter = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, **_layer_kwargs(kind, ep))
    assert adapter.groups.ep_size == ep
    weights = _weights(dtype)
    adapter.load_full_weights(*weights)
    load_megatron_weights(meg, *weights)
    meg.train(train), adapter.train(train)

    g = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())  # the same tokens within a TP group
    x_full = torch.randn(S, B, H, generator=g).to(dtype)
    x = x_full.chunk(tp, 0)[ps.get_tensor_model_parallel_rank()] if sp else x_full
    mask = None
    if pad:  # [B, S] as megatron takes it; True = padding
        mask = torch.zeros(B, x.shape[0], dtype=torch.bool)
        mask[torch.distributed.get_rank() % B, -2:] = True
    keep = torch.ones(x.shape[0] * B, dtype=torch.bool) if mask is None else ~mask.t().reshape(-1)

    found = {}  # name -> (output, input grad, router grad, w13 grad, w2 grad) of this rank's kept tokens
    for name, layer in (("adapter", adapter), ("megatron", meg)):
        xi = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            y, bias = layer(xi, padding_mask=mask)
        assert bias is None
        if not train:
            found[name] = (y.reshape(-1, H)[keep],)
            continue
        y.float().pow(2).mul(keep.view(x.shape[0], B, 1)).sum().backward()
        grads = (adapter.layer.router.weight.grad, *adapter.layer.expert_grads_full()) if layer is adapter \
            else _megatron_grads(meg)
        found[name] = (y.detach().reshape(-1, H)[keep], xi.grad.reshape(-1, H)[keep], *grads)

    x2 = x.reshape(-1, H)[keep]
    cfg = adapter.moe_config
    ref64 = _reference(x2, weights, cfg, torch.float64, train)
    ref_low = (None,) * len(ref64) if dtype == torch.float32 else _reference(x2, weights, cfg, dtype, train)
    parts = ("output", "input gradient", "router gradient", "w13 gradient", "w2 gradient")
    errors = [check_close(f"{name} {part}", got, r64, low) for name, tensors in found.items()
              for part, got, r64, low in zip(parts, tensors, ref64, ref_low)]
    if dtype == torch.float32:  # and the two layers against each other, megatron's result as the reference
        errors += [check_close(f"adapter {part} vs megatron", a, m.double())
                   for part, a, m in zip(parts, found["adapter"], found["megatron"])]
    return "; ".join(e for e in errors if e) or None


def _worker(rank: int, world: int, cases: list) -> dict:
    from megatron.core import parallel_state as ps

    _megatron_on_cpu()
    results = {}
    for case in cases:
        tp, ep, sp, pad, dtype, train, kind = case
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
        try:
            results[str(case)] = _compare(tp, ep, sp, pad, dtype, train, kind)
        except Exception:  # report it; the other cases are independent
            results[str(case)] = traceback.format_exc()
        finally:
            ps.destroy_model_parallel()
    return results


F32, BF16 = torch.float32, torch.bfloat16
# (tp, ep, sequence_parallel, padding, dtype, train, layer options)
CASES = {
    2: [(1, 2, False, False, F32, False, "plain"), (2, 1, False, False, F32, False, "plain"),
        (2, 1, True, True, F32, False, "plain"), (2, 2, True, False, F32, False, "plain"),
        (2, 2, False, True, F32, False, "replicas"), (2, 2, True, True, BF16, False, "plain"),
        (1, 2, False, True, F32, False, "allgather"), (1, 2, False, True, F32, True, "plain"),
        (1, 2, False, False, BF16, True, "plain"), (1, 2, False, True, F32, True, "replicas")],
    4: [(1, 4, False, True, F32, False, "capacity"), (2, 2, True, True, F32, False, "plain"),
        (4, 2, True, True, F32, False, "replicas"), (4, 4, True, False, BF16, False, "plain"),
        (1, 4, False, True, F32, True, "replicas"), (2, 2, False, False, F32, False, "allgather")],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def world_results(request):
    world = request.param
    return world, run_distributed(_worker, world, CASES[world], timeout=300)


def test_adapter_matches_megatrons_moelayer(world_results):
    world, results = world_results
    bad = [f"world {world} rank {r} (tp, ep, sp, pad, dtype, train, layer)={case}: {msg}"
           for r, res in enumerate(results) for case, msg in res.items() if msg]
    assert not bad, "\n".join(bad)


def _explicit_groups(rank: int, world: int) -> list:
    """Adapters given groups= under megatron's parallel_state at EP 2, then at EP 1."""
    from megatron.core import parallel_state as ps

    from moelayers.integrations import megatron as mi

    _megatron_on_cpu()
    said = []
    for ep, groups in ((2, ml.ParallelGroups.single()), (2, ml.ParallelGroups.from_world(ep=2)),
                       (1, ml.ParallelGroups.from_world(ep=2)), (1, ml.ParallelGroups.single())):
        ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1)
        try:
            mi.MegatronMoEAdapter(_tc(1, ep, False, torch.float32), ml.VanillaMoE, groups=groups)
            said.append(None)
        except ValueError as e:
            said.append(str(e))
        finally:
            ps.destroy_model_parallel()
    return said


def test_groups_other_than_megatrons_are_refused():
    """moe_spec(..., groups=) unlike megatron's parallel_state trained wrong without a word: the
    expert parameters carry allreduce=False, and megatron's DDP reduced their gradients over its own
    expert-data-parallel group (a megatron user journey: replicas drifted apart at EP 2 with
    groups=single(), different experts' gradients were averaged at EP 1 with from_world(ep=2))."""
    for rank, said in enumerate(run_distributed(_explicit_groups, 2, timeout=120)):
        assert said[1] is None and said[3] is None, said  # megatron's own ranks
        assert said[0].startswith(f"MegatronMoEAdapter: groups= has expert-parallel ranks [{rank}] on this rank, "
                                  "megatron's parallel_state [0, 1]: megatron's DDP reduces"), said[0]
        assert said[2].startswith("MegatronMoEAdapter: groups= has expert-parallel ranks [0, 1] on this rank, "
                                  f"megatron's parallel_state [{rank}]"), said[2]
        assert "Leave groups= out" in said[0]
