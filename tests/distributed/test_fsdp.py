"""Training with torch FSDP (``fully_shard``) over the dense weights and moelayers' expert parallelism
over the experts, against the dense float64 model (gloo, worlds 2 and 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import moelayers as ml
from moelayers import checkpoint as mlc
from moelayers.testing import error_of, run_distributed
from tests.distributed.test_training_paths import _placement

H, F, E, K = 8, 6, 4, 2
MAX_NORM = 1e-2


def _cfg() -> ml.MoEConfig:
    return ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=torch.float64)


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(E, H, generator=g, dtype=torch.float64), torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64)
            * 0.3, torch.randn(E, H, F, generator=g, dtype=torch.float64) * 0.3]


def _inputs(world: int) -> list[torch.Tensor]:
    return [torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]


def _pre() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(H, H, dtype=torch.float64)


def _fsdp_step(rank: int, world: int, ep: int, root: str, device: str = "cpu", ignore: bool = True) -> dict:
    """One AdamW step of ``fully_shard(model)`` (experts left to the layer), the gradient clipped;
    saved with moelayers.checkpoint and loaded into a plain model at EP1 (also on GPUs, tests/gpu)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device == "cuda":
        torch.cuda.set_device(rank)
    moe = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(ep=ep), placement=_placement("replicas", E, ep),
                        device=device)
    moe.load_full_weights(*(w.to(device) for w in _weights()))
    model = nn.Sequential(_pre().to(device), moe)
    fully_shard(model, mesh=init_device_mesh(device, (world,)),
                **({"ignored_params": ml.rank_local_params(model)} if ignore else {}))
    experts = ml.rank_local_params(model)  # a param group of their own: torch's foreach steps take one kind of tensor
    optim = torch.optim.AdamW([{"params": [p for p in model.parameters() if p not in experts]},
                               {"params": sorted(experts, key=lambda p: p.dim())}], lr=1e-2)
    model(_inputs(world)[rank].to(device)).pow(2).sum().backward()
    if not ignore:
        refused = []
        for call in (ml.reduce_expert_grads, lambda m: ml.clip_grad_norm_(m, MAX_NORM)):
            with pytest.raises(ValueError) as info:
                call(model)
            refused.append(str(info.value))
        return {"refused": refused}
    ml.reduce_expert_grads(model)
    norm = ml.clip_grad_norm_(model, MAX_NORM)
    optim.step()
    _, w13, w2 = moe.export_full_weights()
    out = {"norm": float(norm), "pre": model[0].weight.full_tensor().cpu(), "router": moe.router.weight.full_tensor().cpu(),
           "w13": w13.cpu(), "w2": w2.cpu()}
    dcp.save({"model": mlc.model_state_dict(model)}, checkpoint_id=root)
    plain = nn.Sequential(_pre().to(device), ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(ep=1), seed=3,
                                                           device=device))
    state = {"model": mlc.model_state_dict(plain)}
    dcp.load(state, checkpoint_id=root)
    mlc.load_model_state_dict(plain, state["model"])
    _, p13, p2 = plain[1].export_full_weights()
    out["loaded"] = all(torch.equal(a.cpu(), b) for a, b in ((plain[0].weight.detach(), out["pre"]), (p13, out["w13"]),
                                                             (p2, out["w2"]), (plain[1].router.weight.detach(),
                                                                               out["router"])))
    return out


def _dense(world: int) -> dict:
    pre = _pre()
    weights = [w.clone().requires_grad_() for w in _weights()]
    optim = torch.optim.AdamW([*pre.parameters(), *weights], lr=1e-2)
    (sum(ml.reference.moe_forward(pre(x), *weights, _cfg()).pow(2).sum() for x in _inputs(world)) / world).backward()
    norm = torch.nn.utils.clip_grad_norm_([*pre.parameters(), *weights], MAX_NORM)
    optim.step()
    return {"norm": float(norm), "pre": pre.weight.detach(), **dict(zip(("router", "w13", "w2"),
                                                                        (w.detach() for w in weights)))}


def check_against_dense(results: list[dict], world: int) -> None:
    dense = _dense(world)
    assert dense["norm"] > 10 * MAX_NORM  # the clipping acts
    for rank, got in enumerate(results):
        assert got["norm"] == pytest.approx(dense["norm"], rel=1e-12), rank
        for key in ("pre", "router", "w13", "w2"):
            torch.testing.assert_close(got[key], dense[key], rtol=1e-10, atol=1e-14, msg=f"rank {rank} {key}")
        assert got["loaded"], f"rank {rank}: the checkpoint did not load bit for bit"


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_fsdp_training_step_is_the_dense_models(tmp_path, world, ep):
    """fully_shard over the model with ml.rank_local_params ignored, replicated experts (and at (4, 2)
    two expert-parallel groups): the forward, reduce_expert_grads, clip_grad_norm_ and an AdamW step
    give the dense model's weights; moelayers.checkpoint saves the FSDP model and a plain EP1 model
    loads it bit for bit."""
    check_against_dense(run_distributed(_fsdp_step, world, ep, str(tmp_path / "ckpt"), timeout=240), world)


def test_fsdp_over_the_experts_is_refused(tmp_path):
    """fully_shard without ignoring the experts shards every rank's own slot table as if it were one
    tensor (the forward then computes with other ranks' experts): reduce_expert_grads and
    clip_grad_norm_ refuse the layer and name the fix."""
    for result in run_distributed(_fsdp_step, 2, 2, str(tmp_path / "ckpt"), "cpu", False, timeout=240):
        for message in result["refused"]:
            assert "sharded by FSDP (fully_shard)" in message and "ml.rank_local_params(model)" in message


def _head() -> nn.Linear:
    torch.manual_seed(2)
    return nn.Linear(H, 1, dtype=torch.float64)  # one row: FSDP leaves one rank an empty shard of it


def _inf_norm(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    moe = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(), placement=_placement("replicas", E, world))
    moe.load_full_weights(*_weights())
    model = nn.Sequential(_pre(), moe, _head())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params=ml.rank_local_params(model))
    model(_inputs(world)[rank]).pow(2).sum().backward()
    ml.reduce_expert_grads(model)
    return float(ml.clip_grad_norm_(model, MAX_NORM, float("inf")))


def test_fsdp_inf_norm_with_an_empty_shard():
    """A weight with fewer rows than ranks leaves a rank an empty FSDP shard, on which torch's
    inf-norm raises: clip_grad_norm_ takes the largest entry over the shards that have one and
    finds the dense model's inf-norm on every rank."""
    pre, head = _pre(), _head()
    weights = [w.clone().requires_grad_() for w in _weights()]
    (sum(head(ml.reference.moe_forward(pre(x), *weights, _cfg())).pow(2).sum() for x in _inputs(2)) / 2).backward()
    dense = float(torch.nn.utils.get_total_norm([p.grad for p in (*pre.parameters(), *weights, *head.parameters())],
                                                float("inf")))
    assert run_distributed(_inf_norm, 2, timeout=240) == [pytest.approx(dense, rel=1e-12)] * 2


def _mixed_precision(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg32 = ml.MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, params_dtype=torch.float32)
    moe = ml.VanillaMoE(cfg32, ml.ParallelGroups.from_world(), placement=_placement("replicas", E, world))
    moe.load_full_weights(*(w.float() for w in _weights()))
    model = nn.Sequential(_pre().float(), moe)
    mesh, ignored = init_device_mesh("cpu", (world,)), ml.rank_local_params(model)
    # the README's recipe: the MoE layer on its own, computing in float32 (its inputs cast), the rest in bf16
    fully_shard(moe, mesh=mesh, ignored_params=ignored, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    fully_shard(model, mesh=mesh, ignored_params=ignored, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    y = model(_inputs(world)[rank].float())
    y.float().pow(2).sum().backward()
    ml.reduce_expert_grads(model)
    return [str(y.dtype), float(ml.clip_grad_norm_(model, MAX_NORM))]


def test_fsdp_mixed_precision_with_the_moe_layer_sharded_on_its_own():
    """FSDP's MixedPrecisionPolicy casts the router but not the ignored experts, which the layer
    refuses (one dtype for its weights); sharded on its own with float32 parameters (its inputs cast)
    it trains beside a bf16 rest of the model, every rank clipping by the same norm."""
    (dtype0, norm0), (dtype1, norm1) = run_distributed(_mixed_precision, 2, timeout=240)
    assert dtype0 == dtype1 == "torch.float32" and norm0 == norm1 and norm0 > 0


def _sub_world_mesh(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicas", "shards"))
    moe = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(), placement=_placement("replicas", E, world))
    model = nn.Sequential(_pre(), moe)
    fully_shard(model, mesh=mesh["shards"], ignored_params=ml.rank_local_params(model))  # 2 of the 4 ranks
    model(_inputs(world)[rank]).pow(2).sum().backward()
    with pytest.raises(ValueError) as info:
        ml.reduce_expert_grads(model)
    return str(info.value)


def test_fsdp_over_part_of_the_world_is_refused():
    """FSDP over 2 of 4 ranks averages the dense gradients over those 2, the experts' would be the mean
    over all 4: reduce_expert_grads refuses on every rank."""
    for message in run_distributed(_sub_world_mesh, 4, timeout=240):
        assert "FSDP shards some weights over [2] of the 4 ranks" in message


def _full_weights_under_fsdp(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ep = min(world, 2)
    moe = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world(ep=ep),
                        placement=_placement("replicas" if ep > 1 else "linear", E, ep))
    moe.load_full_weights(*_weights())
    model = nn.Sequential(_pre(), moe)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params=ml.rank_local_params(model))
    out = [error_of(moe.check_weights)]  # the sharded router has no copies: it said every row differed
    exported = moe.export_full_weights()
    out.append(all(type(t) is torch.Tensor and torch.equal(t, w) for t, w in zip(exported, _weights())))
    changed = [w * 2 for w in _weights()]
    router = changed[0].clone().requires_grad_() * 1  # not a leaf: cast by a migration script under grad
    moe.load_full_weights(router, *changed[1:])
    exported = moe.export_full_weights()
    out.append(all(torch.equal(t, w) for t, w in zip(exported, changed)))
    with torch.no_grad():
        moe.router.weight.mul_(3)  # through the parameter: the export was a copy, not a view of it
    out[-1] = out[-1] and torch.equal(exported[0], changed[0])
    x = _inputs(world)[rank]
    with torch.no_grad():
        moe.router.weight.div_(3)
    out.append(bool(torch.allclose(model(x), ml.reference.moe_forward(model[0](x), *changed, _cfg()))))
    out.append(error_of(moe.check_weights))  # (after a forward without autograd)
    return out


def test_full_weights_of_a_layer_under_fsdp():
    """Under fully_shard, export_full_weights gave the router as FSDP's DTensor shard (a torch.save
    of it did not compare with plain tensors), and load_full_weights failed copying a plain tensor
    into it. The router loaded may be a non-leaf tensor; the export is a copy. Also on a mesh of
    one rank, where full_tensor() has nothing to gather."""
    for world in (1, 4):
        for rank, out in enumerate(run_distributed(_full_weights_under_fsdp, world, timeout=180)):
            assert out == ["no error", True, True, True, "no error"], (world, rank, out)


def _meta_init_under_fsdp(rank: int, world: int) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    groups = ml.ParallelGroups.from_world()
    out = []
    for seed in (1, 2):
        reference = ml.VanillaMoE(_cfg(), groups, seed=seed)
        with torch.device("meta"):
            moe = ml.VanillaMoE(_cfg(), groups, seed=seed)
        fully_shard(moe, mesh=init_device_mesh("cpu", (world,)), ignored_params=ml.rank_local_params(moe))
        moe.to_empty(device="cpu")
        torch.manual_seed(100 + rank)  # the draw must not depend on torch's global generator
        moe.reset_parameters()
        out.append(all(torch.equal(a, b) for a, b in zip(moe.export_full_weights(), reference.export_full_weights())))
    return out


def test_reset_parameters_of_a_sharded_router_follows_the_seed():
    """FSDP2's deferred init (build on meta, ``fully_shard``, ``to_empty``, ``reset_parameters``):
    the router, a DTensor shard, was drawn from torch's global generator (a DTensor's ``normal_``
    ignores the one passed), so it differed from the seeded layer's and between seeds alike."""
    for out in run_distributed(_meta_init_under_fsdp, 2, timeout=180):
        assert out == [True, True], out


def _forgot_to_empty(rank: int, world: int) -> str:
    with torch.device("meta"):
        moe = ml.VanillaMoE(_cfg(), ml.ParallelGroups.from_world())
    try:
        moe(_inputs(world)[rank])
    except TypeError as exc:
        return str(exc)
    return "ran"


def test_a_meta_layer_refuses_its_input_clearly_at_world_2():
    """Built on meta and never given storage: one process said so, but at world 2 the refusal's
    stand-in exchange on meta failed with "Cannot copy out of meta tensor" on every rank."""
    for message in run_distributed(_forgot_to_empty, 2, timeout=120):
        assert "the layer is on meta" in message and "to_empty(device=...)" in message, message
