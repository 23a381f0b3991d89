"""megatron-core's own MoELayer vs moelayers on CUDA: same weights, bf16, DESIGN.md §1 rule.

On 1 GPU (and on 2 and 4 GPUs over NCCL, where the machine has them) build megatron's ``MoELayer`` with
``megatron_moe_layer`` (local spec, all-to-all dispatcher), our ``VanillaMoE`` and the megatron
adapter (``moe_spec(VanillaMoE)`` built from megatron's own ``TransformerConfig``), load the same
logical weights into all three and check each against the float64 reference with the bf16 rule.
Every score function runs with the input's router dtype and with fp32 router logits
(``MoEConfig.router_dtype``, megatron's ``moe_router_dtype``), the same setting on both sides.
``max|ours - megatron|`` is reported (printed, and as a junit property) but not asserted: a token
whose top-k is a near-tie may legitimately pick another expert in bf16 (the logits' summation order
differs), which the reference rule allows for but a direct comparison does not. So the
expert math is also compared with identical routing: megatron's chosen experts (captured from its
router) are forced on ours (``force_routing``), checked against the reference with those experts,
and that ``max|ours - megatron|`` is reported too.

Each world runs in spawned processes (``run_distributed``), so no process group or megatron
``parallel_state`` leaks into the pytest process. torch.compile (megatron's ``jit_fuser``) is
disabled in those processes: this is a numerical check, not a benchmark.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAVE_MCORE, reason="needs megatron-core (pip install 'megatron-core>=0.16')"),
]

H, FF, E, K = 128, 64, 8, 2
S, B = 16, 4
CASES = {f"{score_fn}/{name}": (score_fn, dtype) for score_fn in ("softmax", "sigmoid")
         for name, dtype in (("router=input", None), ("router=fp32", torch.float32))}


def _weights():
    g = torch.Generator().manual_seed(0)
    router = torch.randn(E, H, generator=g) / H ** 0.5
    w13 = torch.randn(E, 2 * FF, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, FF, generator=g) / FF ** 0.5
    return tuple(w.bfloat16() for w in (router, w13, w2))


def _inputs(rank: int, router: torch.Tensor) -> torch.Tensor:
    """``[S, B, H]`` bf16 inputs of ``rank`` without router near-ties under either score function: a
    near-tie may be broken one way by the GPU's bf16 logits and the other by the CPU bf16 reference."""
    from moelayers.testing import redraw_near_ties

    g = torch.Generator().manual_seed(100 + rank)
    draw = lambda n: torch.randn(n, H, generator=g).bfloat16().double()  # noqa: E731
    x, r64 = draw(S * B), router.double()
    for _ in range(20):
        before = x.clone()
        for score_fn in ("softmax", "sigmoid"):
            redraw_near_ties(x, r64, K, draw, score_fn=score_fn)
        if torch.equal(x, before):
            return x.view(S, B, H).bfloat16()
    raise RuntimeError("inputs without near-ties under both score functions not found")


def _compare(rank: int, world: int) -> dict:
    """Runs on every rank: megatron vs VanillaMoE vs adapter, for each score function."""
    import warnings

    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True

    import megatron.core

    import moelayers as ml
    from moelayers.config import megatron_rounds_scores
    from moelayers.integrations import megatron as mi
    from moelayers.testing import check_close, max_error, tolerance

    dev = torch.device("cuda", torch.cuda.current_device())
    weights = _weights()
    dev_weights = tuple(w.to(dev) for w in weights)
    x = _inputs(rank, weights[0])
    out = {"megatron_core": getattr(megatron.core, "__version__", "?"), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev)}
    for case, (score_fn, router_dtype) in CASES.items():
        cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, score_fn=score_fn,
                           norm_topk_prob=True, params_dtype=torch.bfloat16, router_dtype=router_dtype,
                           rank_in_logits_dtype=megatron_rounds_scores(),  # megatron's ranking (from_megatron's)
                           rank_post_softmax_by_logits=True)
        meg = mi.megatron_moe_layer(cfg, dtype=torch.bfloat16, device=dev)
        mi.load_megatron_weights(meg, *dev_weights)
        groups = mi.groups_for_megatron()  # megatron's parallel_state, initialised by megatron_moe_layer
        assert groups.ep_size == world, groups
        ours = ml.VanillaMoE(cfg, groups, device=dev)
        ours.load_full_weights(*dev_weights)
        adapter = mi.moe_spec(ml.VanillaMoE)(config=meg.config, pg_collection=None, is_mtp_layer=False, name="mlp")
        assert meg.config.moe_router_dtype == {None: None, torch.float32: "fp32"}[router_dtype]
        assert adapter.moe_config == cfg, (adapter.moe_config, cfg)  # from_megatron round trip
        adapter.load_full_weights(*dev_weights)

        captured = []  # megatron's routing, to also compare the expert math with identical routing
        hook = meg.router.register_forward_hook(lambda module, args, output: captured.append(output))
        with torch.no_grad():
            y_meg = meg(x.to(dev))
            if isinstance(y_meg, tuple):
                y_meg, bias = y_meg[0], y_meg[1]
                assert bias is None, "megatron returned a bias"
            y_ours = ours(x.to(dev))
            y_adapter, bias = adapter(x.to(dev))
            assert bias is None
        hook.remove()
        ref64 = ml.reference.moe_forward(x.double(), *(w.double() for w in weights), cfg)
        ref_bf16 = ml.reference.moe_forward(x, *weights, cfg)
        res = {
            "experts": type(meg.experts).__name__,
            # each on its own router's choice: a near-tie makes these loose (3 x the bf16 reference's
            # error); the checks with megatron's routing forced below are the tight ones
            "errors": [e for e in (check_close(f"megatron ({case})", y_meg, ref64, ref_bf16, allow_loose=True),
                                   check_close(f"VanillaMoE ({case})", y_ours, ref64, ref_bf16, allow_loose=True),
                                   check_close(f"adapter ({case})", y_adapter, ref64, ref_bf16, allow_loose=True)) if e],
            "max_ours_vs_megatron": max_error(y_ours.float(), y_meg.float().double()),
            "max_megatron_vs_ref64": max_error(y_meg, ref64),
            "max_ours_vs_ref64": max_error(y_ours, ref64),
            "tolerance": tolerance(ref64, ref_bf16, torch.bfloat16),
            "max_same_routing": None,
        }
        if captured and isinstance(captured[-1], tuple) and len(captured[-1]) >= 2:
            routing_map = captured[-1][1].reshape(S * B, E)
            ids = torch.topk(routing_map.float(), K, dim=-1).indices  # megatron's K experts per token
            with torch.no_grad():
                ours.force_routing(ids)
                y_forced = ours(x.to(dev))
            ids = ids.cpu()
            ref64_f = ml.reference.moe_forward(x.double(), *(w.double() for w in weights), cfg, topk_ids=ids)
            ref_bf16_f = ml.reference.moe_forward(x, *weights, cfg, topk_ids=ids)
            res["errors"] += [e for e in (
                check_close(f"megatron ({case}, its routing)", y_meg, ref64_f, ref_bf16_f),
                check_close(f"VanillaMoE ({case}, megatron's routing)", y_forced, ref64_f, ref_bf16_f)) if e]
            res["max_same_routing"] = max_error(y_forced.float(), y_meg.float().double())
        out[case] = res
    return out


def _check(results: list[dict], world: int, record_property) -> None:
    failures = []
    for rank, res in enumerate(results):
        for case in CASES:
            r = res[case]
            line = (f"world={world} rank={rank} {case} [{r['experts']}, megatron-core {res['megatron_core']}, "
                    f"torch {res['torch']}, {res['device']}]: max|ours - megatron| = {r['max_ours_vs_megatron']:.3e}, "
                    f"max|megatron - ref64| = {r['max_megatron_vs_ref64']:.3e}, "
                    f"max|ours - ref64| = {r['max_ours_vs_ref64']:.3e}, bf16 tolerance {r['tolerance']:.3e}; "
                    f"with megatron's routing max|ours - megatron| = "
                    + ("n/a" if r["max_same_routing"] is None else f"{r['max_same_routing']:.3e}"))
            print(line)
            record_property(f"w{world}_r{rank}_{case}_max_ours_vs_megatron", r["max_ours_vs_megatron"])
            record_property(f"w{world}_r{rank}_{case}_max_ours_vs_megatron_same_routing", r["max_same_routing"])
            failures += [f"rank {rank}: {e}" for e in r["errors"]]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(600)
def test_megatron_equality_1gpu(record_property):
    from moelayers.testing import run_distributed

    _check(run_distributed(_compare, 1, backend="nccl", timeout=500), 1, record_property)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", (2, 4))
def test_megatron_equality_multi_gpu(world, record_property):
    from moelayers.testing import run_distributed

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _check(run_distributed(_compare, world, backend="nccl", timeout=500), world, record_property)


def _adapter_recompute(rank: int, world: int, how: str) -> str | None:
    """A forced forward of the adapter with a padding mask on CUDA over NCCL, recomputed in the
    backward, against the same forward without recomputation: the gradients bit for bit.

    ``how``: ``"moe"``, megatron's selective MoE recompute (``'moe'`` in ``recompute_modules``: the
    adapter checkpoints its forward, all-to-all included); ``"mlp"``, ``'mlp'`` in
    ``recompute_modules``, where megatron's ``TransformerLayer`` checkpoints a non-``MoELayer`` mlp
    itself, ``tensor_parallel.checkpoint(partial(mlp, padding_mask=...), False, x)`` (a reentrant
    checkpoint whose first pass runs under no_grad)."""
    import dataclasses
    import functools
    import warnings

    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True
    from megatron.core import tensor_parallel

    import moelayers as ml
    from moelayers.integrations import megatron as mi

    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.bfloat16)
    meg = mi.megatron_moe_layer(cfg, dtype=torch.bfloat16, device=dev)  # initialises parallel_state
    weights = tuple(w.to(dev) for w in _weights())

    def adapter(recompute_modules=()):
        tc = dataclasses.replace(meg.config, recompute_granularity="selective" if recompute_modules else None,
                                 recompute_modules=list(recompute_modules))
        out = mi.moe_spec(ml.VanillaMoE)(config=tc, pg_collection=None, is_mtp_layer=False, name="mlp")
        out.load_full_weights(*weights)
        return out

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(S, B, H, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S * B)]).view(S, B, K).to(dev)
    pad = torch.zeros(B, S, dtype=torch.bool, device=dev)
    pad[rank % B, S - 3:] = True
    plain = adapter()
    if how == "moe":
        recomputed = adapter(("moe",))
        assert (plain.recompute, recomputed.recompute) == (False, True)
        runs = [(plain, lambda xg: plain(xg, padding_mask=pad)[0]),
                (recomputed, lambda xg: recomputed(xg, padding_mask=pad)[0])]
    else:
        mlp = adapter()
        runs = [(plain, lambda xg: plain(xg, padding_mask=pad)[0]),
                (mlp, lambda xg: tensor_parallel.checkpoint(functools.partial(mlp, padding_mask=pad), False, xg)[0])]
    grads = []
    for layer, run in runs:
        xg = x.clone().requires_grad_()
        layer.layer.force_routing(ids)
        run(xg).float().pow(2).sum().backward()
        grads.append([xg.grad, layer.layer.router.weight.grad, *layer.layer.expert_grads_full()])
    bad = [i for i, (a, b) in enumerate(zip(*grads)) if not torch.equal(a, b)]
    return f"rank {rank}: gradients {bad} differ with the adapter recomputed ({how})" if bad else None


@pytest.mark.timeout(300)
def test_adapter_selective_moe_recompute_nccl():
    from moelayers.testing import run_distributed

    world = min(2, torch.cuda.device_count())
    assert run_distributed(_adapter_recompute, world, "moe", backend="nccl", timeout=240) == [None] * world


@pytest.mark.timeout(300)
def test_adapter_under_megatrons_mlp_recompute_nccl():
    from moelayers.testing import run_distributed

    world = min(2, torch.cuda.device_count())
    assert run_distributed(_adapter_recompute, world, "mlp", backend="nccl", timeout=240) == [None] * world


def _resume(rank: int, world: int, root: str) -> float:
    """megatron's DDP and mixed-precision optimizer (bf16 weights, fp32 master weights, Adam) over the
    adapter on CUDA: save the model and the optimizer with megatron's distributed checkpointing after
    one step, take a second step; a fresh adapter in the reversed placement loads the checkpoint and
    takes the same second step. Returns ``max |difference|`` of the logical weights after it: a few
    bf16 ulps at most (another placement may sum in another order), where a lost optimizer state
    moves them by about the lr."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    import moelayers as ml
    from moelayers.integrations import megatron as mi

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    tc = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FF, num_moe_experts=E,
                           moe_router_topk=K, moe_ffn_hidden_size=FF, gated_linear_unit=True, activation_func=F.silu,
                           add_bias_linear=False, hidden_dropout=0.0, expert_model_parallel_size=world, bf16=True,
                           params_dtype=torch.bfloat16)
    weights = tuple(w.cuda() for w in _weights())

    def build(placement=None):
        kw = {} if placement is None else {"placement": placement}
        adapter = mi.moe_spec(ml.VanillaMoE, **kw)(config=tc, pg_collection=None, is_mtp_layer=False, name="mlp")
        adapter.load_full_weights(*weights)
        model = DistributedDataParallel(config=tc, module=adapter, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=5e-2, bf16=True, clip_grad=0.0), [model])
        return model, opt

    def step(model, opt, i):
        g = torch.Generator().manual_seed(100 * i + rank)
        x = torch.randn(S, B, H, generator=g).bfloat16().cuda()
        model.zero_grad_buffer()
        opt.zero_grad()
        model(x)[0].float().pow(2).mean().backward()
        model.finish_grad_sync()
        opt.step()

    def sharded(model, opt, loading):
        msd = model.module.sharded_state_dict(prefix="mlp.")
        return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=loading)}

    model, opt = build()
    step(model, opt, 0)
    os.makedirs(root, exist_ok=True)
    dist_checkpointing.save(sharded(model, opt, False), root)
    step(model, opt, 1)
    before = model.module.export_full_weights()
    model, opt = build(ml.ExpertPlacement(torch.arange(E - 1, -1, -1).view(world, -1), E))
    loaded = dist_checkpointing.load(sharded(model, opt, True), root)
    model.module.load_state_dict({k[len("mlp."):]: v for k, v in loaded["model"].items()})
    opt.load_state_dict(loaded["optimizer"])
    step(model, opt, 1)
    after = model.module.export_full_weights()
    ps.destroy_model_parallel()
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(before, after))


@pytest.mark.timeout(300)
def test_sharded_checkpoint_resumes_megatron_mixed_precision_training_in_another_placement_nccl(tmp_path):
    """bf16 weights with megatron's fp32 master weights and Adam state, saved in logical expert order and
    loaded into the reversed placement: training continues as it would have. (megatron's distributed
    optimizer is not run here: without TransformerEngine/apex its own resume is broken for any model,
    e.g. one shared ``step`` tensor for every parameter.)"""
    __import__("psutil")  # megatron-core's checkpoint writer needs it: a dependency of moelayers, not skipped
    from moelayers.testing import run_distributed

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    diffs = run_distributed(_resume, 2, str(tmp_path / "ckpt"), backend="nccl", timeout=240, daemon=False)
    print(f"resumed vs uninterrupted, max |difference| of the logical weights per rank: {diffs}")
    assert max(diffs) <= 5e-3, diffs  # a fresh Adam state would differ by about lr = 5e-2
