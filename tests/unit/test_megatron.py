"""megatron-core integration on CPU (megatron-core 0.16): specs, padding, routing mapping, weights.

Single-process tests run here; the megatron ``parallel_state`` tests (which need
torch.distributed) run once in a 2-process gloo world (``initialize_model_parallel`` works on
gloo/CPU) and each check is reported as its own test.

megatron's ``MoELayer`` with the all-to-all dispatcher cannot be built on CPU (the dispatcher
creates CUDA streams, the router moves its weight to CUDA in forward), so ``megatron_moe_layer``
itself is covered by tests/gpu/test_megatron_gpu.py; here its builder runs on CPU with the
all-gather dispatcher and ``load_megatron_weights`` is checked by running megatron's own router
scoring and expert modules (SequentialMLP, and GroupedMLP with a torch stand-in for grouped_gemm).
"""

from __future__ import annotations

import importlib.util
import re
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import moelayers as ml  # noqa: E402
from moelayers.integrations import megatron as mi  # noqa: E402
from moelayers.integrations import megatron_peer as mpeer  # noqa: E402
from moelayers.testing import check_close, run_distributed  # noqa: E402

H, FF, E, K = 16, 8, 4, 2


def _tc(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FF, num_moe_experts=E,
                moe_router_topk=K, moe_ffn_hidden_size=FF, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                use_cpu_initialization=True, hidden_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g), 0.3 * torch.randn(E, 2 * FF, H, generator=g),
            0.3 * torch.randn(E, H, FF, generator=g))


def _ref64(x2, weights, cfg, topk_ids=None):
    r, w13, w2 = (w.double() for w in weights)
    return ml.reference.moe_forward(x2.double(), r, w13, w2, cfg, topk_ids=topk_ids)


def _build(spec, tc, style):
    from megatron.core.transformer.spec_utils import build_module

    if style == "build_module":  # megatron-core 0.16: TransformerLayer -> build_module(spec, config=...)
        return build_module(spec, config=tc)
    # megatron-core >= 0.19: the mlp slot is called as a builder
    return spec(config=tc, pg_collection=None, is_mtp_layer=False, name="decoder.layers.0.mlp")


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("style", ["build_module", "builder"])
def test_spec_builds_and_matches_reference(style):
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = mi.moe_spec(ml.VanillaMoE)
    assert isinstance(spec, ModuleSpec) and spec.module is mi.MegatronMoEAdapter
    assert spec.params["layer_cls"] is ml.VanillaMoE
    adapter = _build(spec, _tc(), style)
    assert isinstance(adapter, mi.MegatronMoEAdapter) and isinstance(adapter.layer, ml.VanillaMoE)
    assert adapter.groups.ep_size == 1 and adapter.groups.ep is None
    weights = _weights()
    adapter.load_full_weights(*weights)
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(1))
    out = adapter(x)
    assert isinstance(out, tuple) and len(out) == 2 and out[1] is None
    assert out[0].shape == x.shape and out[0].dtype == torch.float32
    err = check_close("adapter", out[0], _ref64(x, weights, adapter.moe_config))
    assert err is None, err
    assert adapter.moe_config is adapter.layer.config
    assert adapter.double().moe_config.params_dtype == torch.float64  # it stayed float32 after a cast


def test_spec_layers_use_megatrons_init_methods(monkeypatch):
    """A layer built from a spec is initialised by megatron's init_method (router, w13) and
    output_layer_init_method (w2), each logical expert alike wherever it lives; the caller's random
    state is untouched; perform_initialization=False keeps the layer's own init."""
    spec = mi.moe_spec(ml.VanillaMoE)
    marked = _build(spec, _tc(init_method=lambda w: w.fill_(0.5), output_layer_init_method=lambda w: w.fill_(-0.25)),
                    "builder")
    assert (marked.layer.router.weight == 0.5).all()
    assert (marked.layer.experts.w13 == 0.5).all() and (marked.layer.experts.w2 == -0.25).all()
    # megatron's defaults: N(0, std) and N(0, std / sqrt(2 num_layers)); the same expert under any placement
    state = torch.get_rng_state()
    std, layers = 0.2, 8
    tc = _tc(init_method_std=std, num_layers=layers, num_moe_experts=16, moe_ffn_hidden_size=64, hidden_size=64,
             ffn_hidden_size=64)
    a = _build(spec, tc, "builder")
    assert torch.equal(torch.get_rng_state(), state)
    perm = ml.ExpertPlacement(torch.arange(16).flip(0)[None], 16)  # slot s holds expert 15 - s
    b = _build(mi.moe_spec(ml.VanillaMoE, placement=perm), tc, "builder")
    assert torch.equal(a.layer.experts.w13, b.layer.experts.w13.flip(0))
    assert torch.equal(a.layer.experts.w2, b.layer.experts.w2.flip(0))
    assert torch.equal(a.layer.router.weight, b.layer.router.weight)
    n = a.layer.router.weight.numel()  # the router draws under its own seed, not expert 0's
    assert not torch.equal(a.layer.router.weight.flatten(), a.layer.experts.w13[0].flatten()[:n])
    assert abs(a.layer.experts.w13.std().item() / std - 1) < 0.02
    assert abs(a.layer.experts.w2.std().item() / (std / (2 * layers) ** 0.5) - 1) < 0.02
    # the GPUs' generators are left alone (torch.manual_seed would reseed them all)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: pytest.fail("reseeded every GPU"))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: pytest.fail("reseeded a GPU"))
    c = _build(spec, tc, "builder")
    assert torch.equal(c.layer.experts.w13, a.layer.experts.w13)
    # megatron numbers its layers after building them: each number starts from other weights
    c.set_layer_number(2)
    assert not torch.equal(c.layer.experts.w13, a.layer.experts.w13)
    a.set_layer_number(2)
    assert torch.equal(c.layer.experts.w13, a.layer.experts.w13) and a.layer_number == 2
    own = _build(spec, _tc(perform_initialization=False, init_method_std=std), "builder")
    ref = ml.VanillaMoE(ml.MoEConfig.from_megatron(_tc(init_method_std=std)), ml.ParallelGroups.single())
    assert torch.equal(own.layer.experts.w13, ref.experts.w13) and torch.equal(own.layer.router.weight, ref.router.weight)


def test_padding_mask():
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "build_module")
    weights = _weights(2)
    adapter.load_full_weights(*weights)
    s, b = 6, 3
    x = torch.randn(s, b, H, generator=torch.Generator().manual_seed(3))
    pad_bs = torch.zeros(b, s, dtype=torch.bool)  # megatron: [B, S], True = padding
    pad_bs[0, 4:] = True
    pad_bs[2, 1:] = True
    pad_sb = pad_bs.t()
    x[pad_sb] = float("nan")  # garbage in padded positions must not reach real tokens
    x.requires_grad_(True)
    y, bias = adapter(x, padding_mask=pad_bs)
    assert bias is None and y.shape == x.shape
    keep = ~pad_sb.reshape(-1)
    y2 = y.reshape(-1, H)
    assert torch.equal(y2[~keep], torch.zeros_like(y2[~keep]))
    real = x.detach().reshape(-1, H)[keep]
    err = check_close("padded adapter", y2[keep], _ref64(real, weights, adapter.moe_config))
    assert err is None, err
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and torch.equal(x.grad[pad_sb], torch.zeros_like(x.grad[pad_sb]))
    # [S, B] masks are accepted when unambiguous (S != B) and give the same result
    y_sb, _ = adapter(x.detach(), padding_mask=pad_sb)
    assert torch.equal(y_sb, y.detach())
    # integer masks work like bool; everything padded -> zeros
    y_int, _ = adapter(x.detach(), padding_mask=pad_bs.long())
    assert torch.equal(y_int, y.detach())
    y_all, _ = adapter(x.detach(), padding_mask=torch.ones(b, s, dtype=torch.bool))
    assert torch.equal(y_all, torch.zeros_like(y_all))
    with pytest.raises(ValueError, match="padding_mask"):
        adapter(x.detach(), padding_mask=torch.zeros(s + 1, b, dtype=torch.bool))
    with pytest.raises(TypeError, match="padding_mask"):
        adapter(x.detach(), padding_mask=pad_bs.float())
    # no mask == all-real mask
    x_ok = torch.randn(s, b, H)
    assert torch.equal(adapter(x_ok)[0], adapter(x_ok, padding_mask=torch.zeros(b, s, dtype=torch.bool))[0])


def test_expert_params_not_allreduced():
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "builder")
    experts = adapter.layer.experts
    assert experts.w13.allreduce is False and experts.w2.allreduce is False
    assert getattr(adapter.layer.router.weight, "allreduce", True) is True  # replicated: reduced as usual
    names = {n for n, p in adapter.named_parameters() if getattr(p, "allreduce", True) is False}
    assert names == {"layer.experts.w13", "layer.experts.w2"}


def test_layer_kwargs_and_build_extras():
    from megatron.core.transformer.spec_utils import build_module

    spec = mi.moe_spec(ml.VanillaMoE, dispatcher="allgather", seed=5, expert_backend="loop", device="cpu")
    tc = _tc()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # megatron's known build extras are ignored silently
        adapter = build_module(spec, config=tc, layer_number=7, tp_group=None, vp_stage=None)
    assert adapter.layer.dispatcher_name == "allgather" and adapter.layer.seed == 5
    assert adapter.layer.experts.backend == "loop"
    assert adapter.layer_number == 7 and set(adapter.ignored_build_kwargs) == {"tp_group", "vp_stage"}
    adapter.set_layer_number(9)
    assert adapter.layer_number == 9
    with pytest.warns(UserWarning, match="ignores build arguments"):
        adapter = build_module(spec, config=_tc(), some_future_argument=1)
    assert "some_future_argument" in adapter.ignored_build_kwargs
    with pytest.raises(TypeError, match="does not take"):
        mi.moe_spec(ml.VanillaMoE, dispatchr="alltoall")
    with pytest.raises(TypeError, match="supplied by megatron-core"):
        mi.moe_spec(ml.VanillaMoE, config=_tc())
    with pytest.raises(TypeError, match="layer_cls"):
        mi.moe_spec(object)
    with pytest.raises(NotImplementedError):
        adapter(torch.randn(2, 1, H), intermediate_tensors=(1,))


@pytest.mark.parametrize(
    "score,pre,topk,norm",
    [("softmax", False, 2, True), ("softmax", True, 2, False), ("softmax", True, 1, False),
     ("sigmoid", False, 2, True), ("sigmoid", False, 1, False)],
)
def test_from_megatron_mapping(score, pre, topk, norm):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    tc = _tc(moe_router_score_function=score, moe_router_pre_softmax=pre, moe_router_topk=topk,
             moe_ffn_hidden_size=6, params_dtype=torch.float32, init_method_std=0.05)
    cfg = ml.MoEConfig.from_megatron(tc)
    assert (cfg.score_fn, cfg.norm_topk_prob, cfg.top_k) == (score, norm, topk)
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.init_std) == (H, 6, E, 0.05)
    assert mpeer._router_mapping(cfg) == (score, pre)  # what megatron_moe_layer configures
    # megatron's own routing gives the same experts and weights as ours
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(4))
    probs, routing_map = topk_routing_with_score_function(logits, topk, use_pre_softmax=pre, score_function=score)
    ids, weights = ml.router.scores_to_topk(logits, cfg)
    ours = torch.zeros_like(probs).scatter(1, ids, weights)
    assert torch.equal(routing_map.bool(), ours != 0)
    torch.testing.assert_close(ours, probs, rtol=1e-6, atol=1e-6)  # both score in fp32


@pytest.mark.parametrize("score,pre,topk", [("softmax", False, 6), ("softmax", True, 6), ("sigmoid", False, 6),
                                            ("sigmoid", False, 1)])
def test_bf16_router_picks_megatrons_experts_ties_included(score, pre, topk):
    """megatron-core 0.16's default router dtype keeps bf16 scores for its top-k (``.type_as(logits)``):
    near-ties become exact ties (0.19 ranks them in float32). from_megatron's configs rank as the
    installed megatron does (rank_in_logits_dtype, rank_post_softmax_by_logits), so the router and the
    reference pick megatron's experts exactly, ties included; where megatron rounds, float32 ranking
    picks others."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from moelayers.config import megatron_rounds_scores

    cfg = ml.MoEConfig.from_megatron(_tc(moe_router_score_function=score, moe_router_pre_softmax=pre,
                                         moe_router_topk=topk, num_moe_experts=64, params_dtype=torch.bfloat16))
    assert cfg.rank_in_logits_dtype == megatron_rounds_scores() and cfg.rank_post_softmax_by_logits
    assert cfg.router_dtype is None
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4000, 64, generator=g) * 0.5).to(torch.bfloat16)  # fine bf16 spacing: many near-ties
    probs, routing_map = topk_routing_with_score_function(logits, topk, use_pre_softmax=pre, score_function=score)
    ids, weights = ml.router.scores_to_topk(logits, cfg)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, ids, True))
    torch.testing.assert_close(weights.to(torch.bfloat16), probs.gather(1, ids), rtol=1e-2, atol=1e-3)
    ref_ids, _ = ml.reference._routing(logits, cfg, None)  # the reference's routing, written apart
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, ref_ids, True), routing_map)
    # the test has teeth: some tokens' k-th and next scores are exact bf16 ties, which float32 ranking breaks
    # by value, picking other experts than megatron
    fp32_ids, _ = ml.router.scores_to_topk(logits, cfg.replace(rank_in_logits_dtype=False))
    changed = (torch.zeros_like(routing_map).scatter(1, fp32_ids, True) != routing_map).any(1).sum()
    if megatron_rounds_scores() and not (score == "softmax" and not pre):  # post-softmax ranks the logits: no new ties
        assert changed > 0
    elif not megatron_rounds_scores():
        assert changed == 0


def test_the_ranking_probe_asks_megatrons_routing_function(monkeypatch):
    """from_megatron follows the installed megatron-core's top-k: scores rounded to the logits' dtype
    (0.16) or ranked in float32 (0.19, where a bf16 router picked another expert than megatron's on the
    GPU for 1 of 64 tokens); found by calling megatron's routing function, whatever its version says."""
    from megatron.core.transformer.moe import moe_utils

    from moelayers import config as config_module

    def routing(rounds_sigmoid, rounds_softmax):
        def fake(logits, topk, use_pre_softmax=False, score_function="softmax", **_):
            scores = torch.sigmoid(logits.float()) if score_function == "sigmoid" else torch.softmax(logits.float(), -1)
            if rounds_sigmoid if score_function == "sigmoid" else rounds_softmax:
                scores = scores.type_as(logits)
            _, ids = torch.topk(scores, topk, dim=1)
            return scores, torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
        return fake

    try:
        for sig, soft, want in ((True, True, True), (False, False, False), (True, False, RuntimeError)):
            config_module.megatron_rounds_scores.cache_clear()
            monkeypatch.setattr(moe_utils, "topk_routing_with_score_function", routing(sig, soft))
            if want is RuntimeError:
                with pytest.raises(RuntimeError, match="rounds its sigmoid and softmax scores differently"):
                    config_module.megatron_rounds_scores()
            else:
                assert config_module.megatron_rounds_scores() is want
                assert ml.MoEConfig.from_megatron(_tc(params_dtype=torch.bfloat16)).rank_in_logits_dtype is want
    finally:
        monkeypatch.undo()
        config_module.megatron_rounds_scores.cache_clear()


def test_fp32_router_picks_megatrons_experts_in_bf16():
    """moe_router_dtype='fp32' -> router_dtype=float32: bf16 inputs and weights, fp32 logits, the same
    experts and weights as megatron's router on them (near-ties included); the bf16 router differs."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = ml.MoEConfig.from_megatron(_tc(moe_router_dtype="fp32", params_dtype=torch.bfloat16, num_moe_experts=64,
                                         moe_router_topk=6))
    assert cfg.router_dtype is torch.float32 and cfg.logits_dtype(torch.bfloat16) is torch.float32
    router = ml.TopKRouter(cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(64, H, generator=g))
        x = torch.randn(4000, H, generator=g).to(torch.bfloat16)
        ids, weights = router(x)
        logits = x.float() @ router.weight.float().t()  # what megatron's fp32 router gating computes
        probs, routing_map = topk_routing_with_score_function(logits, 6, use_pre_softmax=False, score_function="softmax")
        assert torch.equal(routing_map.bool(), torch.zeros_like(routing_map, dtype=torch.bool).scatter(1, ids, True))
        torch.testing.assert_close(weights.float(), probs.gather(1, ids), rtol=1e-2, atol=0)
        plain = ml.TopKRouter(cfg.replace(router_dtype=None))
        plain.weight.copy_(router.weight)
        bf16_ids, _ = plain(x)  # logits in bf16: some near-ties break the other way
        assert not torch.equal(bf16_ids.sort(1).values, ids.sort(1).values)
    with pytest.raises(ValueError, match="moe_router_dtype"):
        ml.MoEConfig.from_megatron(_tc(moe_router_dtype="fp8"))


@pytest.mark.parametrize("setting, match", [
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"), "moe_router_enable_expert_bias=True"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups=2"),
    # deprecated, rewritten into num_groups / group_topk by megatron: the error named only those
    (dict(moe_router_topk_limited_devices=1, expert_model_parallel_size=1), "moe_router_topk_limited_devices=1"),
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor=1.0"),
    (dict(moe_shared_expert_intermediate_size=16), "moe_shared_expert_intermediate_size=16"),
    (dict(activation_func=F.gelu), "activation_func=F.silu"),
    (dict(add_bias_linear=True), "add_bias_linear=False"),
    (dict(moe_input_jitter_eps=0.5), "moe_input_jitter_eps=0.5"),
    (dict(fp4="nvfp4"), "fp4='nvfp4'"),
    # megatron's RouterReplay could not reach our router: the layer kept routing by its own scores
    (dict(moe_enable_routing_replay=True), "moe_enable_routing_replay=True"),
    # TransformerEngine's fused top-k ranks and breaks ties its own way: it was accepted silently
    (dict(moe_router_fusion=True), "moe_router_fusion=True"),
    # megatron's per-module quantization recipe: its TE expert GEMMs run quantized (fp8 and fp4 unset); it
    # was accepted silently
    ("quant_recipe", "quant_recipe="),
])
def test_from_megatron_refuses_what_it_does_not_implement(setting, match):
    """A setting that changes megatron's output is an error, never silently dropped."""
    if setting == "quant_recipe":  # (built here: megatron's quantization module is not imported at collection)
        from megatron.core.quantization.quant_config import RecipeConfig

        setting = dict(quant_recipe=RecipeConfig(matchers=[], config_dict={}))
    try:
        tc = _tc(**setting)
    except (ValueError, AssertionError) as e:  # this megatron-core version's own check of the combination
        pytest.skip(f"TransformerConfig refuses {setting}: {e}")
    with pytest.raises(ValueError, match=re.escape(match)):
        ml.MoEConfig.from_megatron(tc)
    assert ml.MoEConfig.from_megatron(_tc(moe_router_load_balancing_type="seq_aux_loss")).top_k == K  # training-only


@pytest.mark.parametrize("score,topk,norm", [("sigmoid", 2, False), ("sigmoid", 1, True), ("softmax", 1, True)])
def test_mapping_without_megatron_equivalent(score, topk, norm):
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=topk, score_fn=score, norm_topk_prob=norm)
    with pytest.raises(ValueError, match="no megatron equivalent"):
        mpeer._router_mapping(cfg)


def test_router_dtype_reaches_megatron():
    """megatron_moe_layer scores in the config's router dtype, and refuses one megatron cannot."""
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.bfloat16)
    assert mpeer._router_dtype_name(cfg) is None
    assert mpeer._router_dtype_name(cfg.replace(router_dtype=torch.float32)) == "fp32"
    with pytest.raises(ValueError, match="router_dtype"):
        mpeer._router_dtype_name(cfg.replace(router_dtype=torch.float16))


def test_adapter_token_ids_layout():
    """token_ids pair with hidden_states' [S, B] rows: megatron's [B, S] input_ids are refused (they
    would pair ids with the wrong tokens), with and without a padding mask."""
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "build_module")
    s, b = 5, 3
    x = torch.randn(s, b, H, generator=torch.Generator().manual_seed(6))
    ids_bs = torch.arange(b * s).view(b, s)  # megatron's input_ids layout
    for pad in (None, torch.zeros(b, s, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"transpose megatron's \[B, S\] input_ids"):
            adapter(x, padding_mask=pad, token_ids=ids_bs)
        adapter(x, padding_mask=pad, token_ids=ids_bs.t())
        assert torch.equal(adapter.layer.last_token_ids, ids_bs.t().reshape(-1))
        adapter(x, padding_mask=pad, token_ids=ids_bs.t().reshape(-1))  # flat, in hidden_states' order
        assert torch.equal(adapter.layer.last_token_ids, ids_bs.t().reshape(-1))
    with pytest.raises(ValueError, match="token_ids"):
        adapter(x, token_ids=torch.arange(s * b + 1))


def test_adapter_export_full_weights():
    """The adapter's export_full_weights (promised by its docs) returns what load_full_weights took."""
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "builder")
    weights = _weights(7)
    adapter.load_full_weights(*weights)
    exported = adapter.export_full_weights()
    assert len(exported) == 3
    for got, want in zip(exported, weights):
        assert torch.equal(got, want)


@pytest.mark.parametrize("setting, match", [
    (dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01), "moe_aux_loss_coeff=0.01"),
    (dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3), "'seq_aux_loss' loss"),
    (dict(moe_router_load_balancing_type=["none", "global_aux_loss"], moe_aux_loss_coeff=[0.0, 0.5]),
     "'global_aux_loss' loss"),
    (dict(moe_z_loss_coeff=1e-3), "moe_z_loss_coeff=0.001"),
])
def test_adapter_refuses_to_train_with_training_losses(setting, match):
    """megatron adds aux / z losses to the router's gradient in training; moelayers has none: the
    adapter refuses to train with them (never a silent loss) but serves with them as usual."""
    tc = _tc(**setting)
    assert ml.MoEConfig.from_megatron(tc) == ml.MoEConfig.from_megatron(_tc())  # the output does not change
    adapter = _build(mi.moe_spec(ml.VanillaMoE), tc, "builder")
    adapter.load_full_weights(*_weights(5))
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match=re.escape(match)):
        adapter.train()(x)
    with torch.no_grad():
        y_no_grad, _ = adapter(x)
    y_eval, _ = adapter.eval()(x)
    assert torch.equal(y_no_grad, y_eval)


def test_adapter_refuses_to_train_with_sequence_parallel_tensor_parallelism():
    """With TP > 1 and sequence parallelism each TP rank routes its own tokens: the router's and experts'
    gradients are partial sums megatron does not add up for the adapter, so training is refused (the
    copies drifted apart); inference runs. One rank stands in (groups=single): the check reads the config."""
    tc = _tc(tensor_model_parallel_size=2, sequence_parallel=True)
    adapter = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.single())
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(6))
    with pytest.raises(RuntimeError, match="tensor_model_parallel_size=2 and sequence_parallel=True is not supported"):
        adapter.train()(x)
    with torch.no_grad():
        assert adapter.train()(x)[0].shape == x.shape
    plain = mi.MegatronMoEAdapter(_tc(tensor_model_parallel_size=2), ml.VanillaMoE, groups=ml.ParallelGroups.single())
    plain.train()(x)[0].sum().backward()  # without sequence parallelism the TP ranks see the same tokens


def test_adapter_forward_takes_megatrons_positional_order():
    """MoELayer.forward(hidden_states, intermediate_tensors=None, padding_mask=None): a positional
    intermediate_tensors used to be read as the padding mask."""
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "builder")
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(7))
    pad = torch.zeros(2, 4, dtype=torch.bool)
    pad[1, 3] = True
    with torch.no_grad():
        y, _ = adapter(x, None, pad)
        assert torch.equal(y, adapter(x, padding_mask=pad)[0]) and (y[3, 1] == 0).all()
        with pytest.raises(NotImplementedError, match="intermediate_tensors"):
            adapter(x, [torch.zeros(1)])


def test_from_megatron_accepts_inactive_training_losses():
    """Coefficients megatron's router does not use (zero, or for a type not selected) are accepted."""
    base = ml.MoEConfig.from_megatron(_tc())
    for setting in (dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.01),
                    dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0),
                    dict(moe_router_load_balancing_type=["aux_loss", "none"], moe_aux_loss_coeff=[0.0, 0.3])):
        assert ml.MoEConfig.from_megatron(_tc(**setting)) == base, setting
        assert ml.config.megatron_training_losses(_tc(**setting)) == [], setting


def test_from_megatron_load_balancing_list():
    """A list of load-balancing types (megatron combines them like one aux-loss type) is accepted when
    every entry is supported; otherwise refused with the offending entries named."""
    base = ml.MoEConfig.from_megatron(_tc())
    tc = _tc(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.0, 0.0])
    assert ml.MoEConfig.from_megatron(tc) == base
    assert ml.MoEConfig.from_megatron(_tc(moe_router_load_balancing_type=["none"], moe_aux_loss_coeff=[0.0])) == base
    try:
        bad = _tc(moe_router_load_balancing_type=["none", "sinkhorn"], moe_aux_loss_coeff=[0.0, 0.0])
    except (ValueError, AssertionError) as e:  # this megatron-core version's own check of the list
        pytest.skip(f"TransformerConfig refuses the list: {e}")
    with pytest.raises(ValueError, match=re.escape("entries ['sinkhorn']")):
        ml.MoEConfig.from_megatron(bad)


def test_from_megatron_num_groups_without_group_topk():
    """megatron routes group-limited only when moe_router_group_topk is set: num_groups alone is plain
    top-k (checked on megatron's own routing), so from_megatron accepts it."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    assert ml.MoEConfig.from_megatron(_tc(moe_router_num_groups=2)) == ml.MoEConfig.from_megatron(_tc())
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(8))
    plain = topk_routing_with_score_function(logits, K, use_pre_softmax=False, score_function="softmax")
    grouped = topk_routing_with_score_function(logits, K, use_pre_softmax=False, num_groups=2, group_topk=None,
                                               score_function="softmax")
    assert all(torch.equal(p, g) for p, g in zip(plain, grouped))
    with pytest.raises(ValueError, match=re.escape("moe_router_group_topk=1")):
        ml.MoEConfig.from_megatron(_tc(moe_router_num_groups=2, moe_router_group_topk=1))
    # every group selected masks nothing: plain top-k on megatron's routing too (it was refused)
    assert ml.MoEConfig.from_megatron(_tc(moe_router_num_groups=2, moe_router_group_topk=2)) == \
        ml.MoEConfig.from_megatron(_tc())
    every = topk_routing_with_score_function(logits, K, use_pre_softmax=False, num_groups=2, group_topk=2,
                                             score_function="softmax")
    assert all(torch.equal(p, g) for p, g in zip(plain, every))


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_from_megatron_half_precision(flag, dtype):
    """bf16 / fp16: megatron's Float16Module casts the adapter's parameters; the layer computes in that dtype."""
    from megatron.core.transformer.module import Float16Module

    tc = _tc(**{flag: True})  # params_dtype left at its default, float32
    assert ml.MoEConfig.from_megatron(tc).params_dtype is dtype
    assert ml.MoEConfig.from_megatron(_tc(**{flag: True, "params_dtype": dtype})).params_dtype is dtype
    adapter = _build(mi.moe_spec(ml.VanillaMoE), tc, "build_module")
    Float16Module(tc, adapter)
    assert {p.dtype for p in adapter.parameters()} == {dtype}
    weights = tuple(w.to(dtype) for w in _weights(9))
    adapter.load_full_weights(*weights)
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    y, _ = adapter(x)
    assert y.dtype is dtype and y.shape == x.shape and torch.isfinite(y).all()
    with pytest.raises(ValueError, match=f"{flag}=True with params_dtype=torch.float64"):
        ml.MoEConfig.from_megatron(_tc(**{flag: True, "params_dtype": torch.float64}))


def test_fp8_params_dtype_refused():
    with pytest.raises(TypeError, match="params_dtype=torch.float8_e4m3fn is not supported"):
        ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=re.escape("transformer_config.params_dtype=torch.float8_e4m3fn")):
        ml.MoEConfig.from_megatron(_tc(params_dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("changes, match", [
    (dict(ep_size=2), "ep is None (a group of one) but ep_size=2"),
    (dict(tp_size=2, world_size=2), "tp is None (a group of one) but tp_size=2"),
    (dict(ep_size=0), "ep_size must be a positive int"),
    (dict(dp_size=True), "dp_size must be a positive int"),
    (dict(rank=1), "rank must be an int in [0, world_size=1)"),
    (dict(ep_rank=-1), "ep_rank must be an int"),
])
def test_parallel_groups_validated(changes, match):
    """Sizes, ranks and groups must agree at construction (ep=None with ep_size=2 used to fail later)."""
    import dataclasses

    single = ml.ParallelGroups.single()
    with pytest.raises(ValueError, match=re.escape(match)):
        dataclasses.replace(single, **changes)
    assert dataclasses.replace(single) == single


def test_graphed_forward_release(monkeypatch):
    """GraphedForward.release synchronizes the device the graph was captured on (not the current
    device), and makes no CUDA call when nothing was captured. CPU stand-ins only: the capture itself
    needs CUDA (tests/gpu)."""
    from moelayers.layers.graphs import GraphedForward

    calls = []

    def fake_synchronize(*args, **kwargs):
        calls.append((args, kwargs))

    monkeypatch.setattr(torch.cuda, "synchronize", fake_synchronize)
    graphed = GraphedForward(lambda x, n, f: (x, x), capacity=4, hidden=H, dtype=torch.float32, device=torch.device("cpu"))
    graphed.release()
    assert calls == []
    graphed.graph, graphed.y, graphed.aux = object(), graphed.x, graphed.x  # as after a capture
    graphed.release()
    assert calls == [((graphed.x.device,), {})]
    assert graphed.graph is None and graphed.y is None and graphed.aux is None


def test_graphed_forward_sets_its_static_inputs_only_where_they_change(monkeypatch):
    """A replay of a batch like the previous one launches no kernel to set the static inputs (the
    padding rows are zero already, the fills hold their values); whatever the order of the calls, the
    graph sees the rows given, zeros after them, and the row count and flag of the call. CPU
    stand-ins: a "graph" that runs the function on the static inputs."""
    import contextlib

    from moelayers.layers.graphs import GraphedForward

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    seen = []

    def fn(x, num_valid, flag):
        seen.append((x.clone(), int(num_valid), int(flag)))
        return x * 2, x[:, :1]

    graphed = GraphedForward(fn, capacity=6, hidden=H, dtype=torch.float32, device=torch.device("cpu"))

    class _Replay:
        def replay(self):
            graphed.y, graphed.aux = fn(graphed.x, graphed.num_valid, graphed.flag)

    graphed._capture = lambda: setattr(graphed, "graph", _Replay())
    kernels = []
    for name in ("zero_", "fill_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name: kernels.append(_name) or _real(t, *a))
    for rows, num_valid, flag in ((5, None, 0), (2, None, 0), (2, None, 0), (4, 7, 0), (1, None, 4), (1, None, 0)):
        x = torch.randn(rows, H)
        kernels.clear()
        y, _ = graphed(x, num_valid=num_valid, flag=flag)
        sx, sn, sf = seen[-1]
        assert torch.equal(y, 2 * x) and torch.equal(sx[:rows], x) and not sx[rows:].any()
        assert (sn, sf) == (rows if num_valid is None else num_valid, flag)
        if (rows, num_valid, flag) == (2, None, 0):
            assert kernels.count("zero_") <= 1 and (len(seen) < 3 or kernels == [])  # the repeat: no kernel


# ------------------------------------------------------------------ 2 processes: parallel_state on gloo
def _padded_tokens(rank: int):
    s, b = 3 + rank, 2
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(s, b, H, generator=g)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[rank % b, s - 1 - rank:] = True  # a different amount of padding per rank
    return x, pad


def _check_adapter(adapter, rank, world, weights, name):
    assert adapter.groups.ep_size == world and adapter.groups.ep_rank == rank, adapter.groups
    assert adapter.layer.placement.slots_per_rank == E // world
    adapter.load_full_weights(*weights)
    x, pad = _padded_tokens(rank)
    pad_sb = pad.t()
    x[pad_sb] = float("nan")
    y, bias = adapter(x, padding_mask=pad)
    assert bias is None and y.shape == x.shape
    keep = ~pad_sb.reshape(-1)
    y2 = y.reshape(-1, H)
    assert torch.equal(y2[~keep], torch.zeros_like(y2[~keep])), f"{name}: padded rows not zero"
    return check_close(name, y2[keep], _ref64(x.reshape(-1, H)[keep], weights, adapter.moe_config))


def _check_ep_build_module(rank, world):
    """megatron-core 0.16 path: no pg_collection -> parallel_state's groups."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron.core.transformer.utils import sharded_state_dict_default

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    adapter = build_module(mi.moe_spec(ml.VanillaMoE), config=_tc(expert_model_parallel_size=world))
    # what megatron's TransformerLayer calls for its mlp: the experts in logical order, this rank's own
    sharded = sharded_state_dict_default(adapter, prefix="mlp.")
    assert set(sharded) == {"mlp." + k for k in adapter.state_dict()}, sorted(sharded)
    rows = sharded["mlp.layer.experts.w13"].build()
    assert isinstance(sharded["mlp.layer.experts.w13"], ShardedTensorFactory)
    assert [t.global_offset[0] for t in rows] == adapter.layer.placement.experts_on(rank)
    assert {t.global_shape for t in rows} == {(E, 2 * FF, H)}
    return _check_adapter(adapter, rank, world, _weights(10), "ep build_module")


def _check_ep_pg_collection(rank, world):
    """megatron-core >= 0.19 path: builder(config=, pg_collection=, is_mtp_layer=, name=)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    spec = mi.moe_spec(ml.VanillaMoE, dispatcher="allgather")
    adapter = spec(config=_tc(expert_model_parallel_size=world),
                   pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False, name="mlp")
    assert adapter.layer.dispatcher_name == "allgather"
    import copy

    twin = copy.deepcopy(adapter)  # failed on megatron's expert groups ("cannot pickle ProcessGroup")
    assert twin._expert_groups[1] is adapter._expert_groups[1] and twin.layer is not adapter.layer
    return (_check_adapter(adapter, rank, world, _weights(11), "ep pg_collection")
            or _check_adapter(twin, rank, world, _weights(11), "ep pg_collection, a deep copy"))


def _check_transformer_layer(rank, world):
    """The adapter inside megatron's own TransformerLayer (0.16 build path, padding_mask forwarded)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        mlp=mi.moe_spec(ml.VanillaMoE), mlp_bda=get_bias_dropout_add))
    layer = build_module(spec, config=_tc(expert_model_parallel_size=world), layer_number=1)
    assert isinstance(layer.mlp, mi.MegatronMoEAdapter) and layer.mlp.layer_number == 1
    assert layer.mlp.groups.ep_size == world
    weights = _weights(12)
    layer.mlp.load_full_weights(*weights)
    x, pad = _padded_tokens(rank)
    out = layer(x, attention_mask=None, padding_mask=pad)
    hidden = out[0] if isinstance(out, tuple) else out
    keep = ~pad.t().reshape(-1)
    x2, h2 = x.reshape(-1, H), hidden.reshape(-1, H)
    assert torch.equal(h2[~keep], x2[~keep]), "padded rows must be the residual alone"
    ref = x2[keep].double() + _ref64(x2[keep], weights, layer.mlp.moe_config)
    return check_close("TransformerLayer", h2[keep], ref)


def _check_transformer_layer_moe_recompute(rank, world):
    """megatron's TransformerLayer with the selective recompute of its MoE layer, over the expert-parallel
    ranks (the all-to-all runs again in the backward), a padding mask and forced routing: the gradients
    of the layer without recompute."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        mlp=mi.moe_spec(ml.VanillaMoE), mlp_bda=get_bias_dropout_add))
    layers = [build_module(spec, config=_tc(expert_model_parallel_size=world, **kw), layer_number=1)
              for kw in ({}, dict(recompute_granularity="selective", recompute_modules=["moe"]))]
    assert [layer.mlp.recompute for layer in layers] == [False, True]
    layers[1].load_state_dict(layers[0].state_dict())
    calls = []
    layers[1].mlp.layer.register_forward_pre_hook(lambda *_: calls.append(1))
    x, pad = _padded_tokens(rank)
    s, b = x.shape[:2]
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s * b)]).view(s, b, K)
    grads = []
    for layer in layers:
        xg = x.clone().requires_grad_()
        layer.mlp.layer.force_routing(ids)
        out = layer(xg, attention_mask=None, padding_mask=pad)
        (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
        assert torch.equal(layer.mlp.layer.last_topk_ids, ids.reshape(-1, K)[~pad.t().reshape(-1)])
        grads.append([xg.grad, *layer.mlp.layer.expert_grads_full(), layer.mlp.layer.router.weight.grad])
    assert len(calls) == 2, calls  # the forward, and its recomputation in the backward
    bad = [i for i, (a, c) in enumerate(zip(*grads)) if not torch.equal(a, c)]
    return f"gradients differ with the MoE layer recomputed: {bad}" if bad else None


def _megatron_layer_cpu(cfg, world, grouped):
    """megatron_moe_layer's builder on CPU with the all-gather dispatcher (all-to-all needs CUDA)."""
    layer = mpeer._build_megatron_moe(cfg, dtype=cfg.params_dtype, device="cpu", dispatcher="allgather", grouped=grouped)
    assert type(layer.experts).__name__ == ("GroupedMLP" if grouped else "SequentialMLP")
    assert layer.config.expert_model_parallel_size == world
    assert layer.config.moe_router_dtype == {None: None, torch.float32: "fp32"}[cfg.router_dtype]
    assert len(layer.local_expert_indices) == E // world
    return layer


def _run_megatron_parts(layer, x2, world):
    """megatron's router scoring and expert module on this rank's experts; outputs summed over ranks."""
    import torch.distributed as dist

    logits = x2.float() @ layer.router.weight.float().t()  # TopKRouter.gating moves weights to CUDA
    probs, routing_map = layer.router.routing(logits)
    local = list(layer.local_expert_indices)
    rows = [routing_map[:, e].nonzero().squeeze(1) for e in local]
    tokens = torch.cat([x2[r] for r in rows])
    token_probs = torch.cat([probs[r, e] for r, e in zip(rows, local)])
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    out, bias = layer.experts(tokens, counts, token_probs)
    assert bias is None
    y = torch.zeros(x2.shape, dtype=torch.float32).index_add(0, torch.cat(rows), out.float())
    if world > 1:
        dist.all_reduce(y)
    ids = torch.topk(routing_map.float() + probs.float(), K, dim=1).indices  # the chosen experts
    return y, ids


def _check_load_sequential(rank, world):
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K)
    layer = _megatron_layer_cpu(cfg, world, grouped=False)
    weights = _weights(13)
    mi.load_megatron_weights(layer, *weights)
    assert torch.equal(layer.router.weight, weights[0])
    back = mi.megatron_weights(layer)  # the inverse: every expert, gathered from the expert-parallel ranks
    assert all(torch.equal(a, b) for a, b in zip(back, weights)), "megatron_weights did not give the weights back"
    with torch.no_grad():
        layer.experts.local_experts[0].linear_fc1.weight[0, 0] += 1.0  # this rank's first expert changes
    changed = [int(torch.ne(a, b).any()) for a, b in zip(mi.megatron_weights(layer)[1], weights[1])]
    assert changed == [1 if e % (E // world) == 0 else 0 for e in range(E)], changed  # every rank's, in its slot
    with torch.no_grad():
        layer.experts.local_experts[0].linear_fc1.weight[0, 0] -= 1.0
    x2 = torch.randn(20, H, generator=torch.Generator().manual_seed(7))  # same tokens on every rank
    y, _ = _run_megatron_parts(layer, x2, world)
    return check_close("SequentialMLP", y, _ref64(x2, weights, cfg))


def _torch_gmm(a, b, batch_sizes, trans_b=False):
    """Stand-in for the grouped_gemm package's ``gmm`` (not installed here): per-group matmuls."""
    outs, start = [], 0
    for i, n in enumerate(batch_sizes.tolist()):
        outs.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
        start += n
    return torch.cat(outs)


def _check_load_grouped(rank, world):
    from types import SimpleNamespace

    if not HAVE_GROUPED_MLP:
        return None  # skipped by the test
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if not gg.grouped_gemm_is_available():  # run megatron's GroupedMLP code with a torch gmm
        gg.assert_grouped_gemm_is_available = lambda: None
        gg.ops = SimpleNamespace(gmm=_torch_gmm)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.bfloat16,
                       router_dtype=torch.float32)  # as _run_megatron_parts scores
    layer = _megatron_layer_cpu(cfg, world, grouped=True)
    weights = tuple(w.bfloat16() for w in _weights(14))
    mi.load_megatron_weights(layer, *weights)
    assert all(torch.equal(a, b) for a, b in zip(mi.megatron_weights(layer), weights))  # GroupedMLP's transposed layout
    x2 = torch.randn(20, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    y, ids = _run_megatron_parts(layer, x2, world)
    ref64 = _ref64(x2, weights, cfg, topk_ids=ids)  # same experts: compare the expert math only
    ref_bf16 = ml.reference.moe_forward(x2, *weights, cfg, topk_ids=ids)
    return check_close("GroupedMLP", y.bfloat16(), ref64, ref_bf16)


def _check_groups_validated(rank, world):
    """A real group whose size or rank differs from the declared one is refused at construction."""
    import dataclasses

    groups = ml.ParallelGroups.from_megatron()
    assert groups.ep_size == world and groups.ep is not None
    for changes, match in ((dict(ep=None), f"ep is None (a group of one) but ep_size={world}"),
                           (dict(ep_size=1, ep_rank=0), f"ep has {world} ranks"),
                           (dict(ep_rank=(rank + 1) % world), f"this process is its rank {rank}")):
        with pytest.raises(ValueError, match=re.escape(match)):
            dataclasses.replace(groups, **changes)
    return None


DIST_CHECKS = {
    "groups_validated": _check_groups_validated,
    "ep_build_module": _check_ep_build_module,
    "ep_pg_collection": _check_ep_pg_collection,
    "transformer_layer": _check_transformer_layer,
    "transformer_layer_moe_recompute": _check_transformer_layer_moe_recompute,
    "load_sequential": _check_load_sequential,
    "load_grouped": _check_load_grouped,
}


def _dist_checks(rank: int, world: int) -> dict[str, str | None]:
    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True  # megatron's jit_fuser is torch.compile: no CPU compile here
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(expert_model_parallel_size=world)
    results = {}
    for name, check in DIST_CHECKS.items():
        try:
            results[name] = check(rank, world)
        except Exception:  # report, keep the other checks (they are independent collectives)
            results[name] = f"{name}: {traceback.format_exc()}"
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_dist_checks, 2, timeout=180)


HAVE_GROUPED_MLP = importlib.util.find_spec("megatron.core.transformer.moe.grouped_gemm_util") is not None


@pytest.mark.parametrize("check", list(DIST_CHECKS))
def test_two_process_gloo(dist_results, check):
    if check == "load_grouped" and not HAVE_GROUPED_MLP:
        pytest.skip("this megatron-core has no legacy GroupedMLP (removed by 0.19: TEGroupedMLP needs TransformerEngine)")
    for rank, res in enumerate(dist_results):
        assert res[check] is None, f"rank {rank}: {res[check]}"


# ------------------------------------------------------------- distributed checkpointing (gloo)
def _replicated_placement(world: int) -> ml.ExpertPlacement:
    """E experts over ``world`` ranks with one more slot per rank, the extra slots holding copies."""
    per = E // world + 1
    order = torch.cat([torch.arange(E), torch.arange(per * world - E)])
    return ml.ExpertPlacement(order.view(world, per), E)


def _adapter_with_adam(world: int, placement=None, tp: int = 1):
    """An EP=``world`` (TP=``tp``) adapter and a torch Adam over it whose state is a function of the
    weights (``exp_avg = 2 w``, ``exp_avg_sq = w²``), so that it can be checked in any placement."""
    from megatron.core.transformer.spec_utils import build_module

    kw = {} if placement is None else {"placement": placement}
    tc = _tc(expert_model_parallel_size=world, tensor_model_parallel_size=tp)
    adapter = build_module(mi.moe_spec(ml.VanillaMoE, **kw), config=tc)
    opt = torch.optim.Adam(adapter.parameters())
    for p in adapter.parameters():
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": 2 * p.detach(), "exp_avg_sq": p.detach() ** 2}
    return adapter, opt


def _sharded(adapter, opt):
    """Model and optimizer sharded state dicts, as megatron's (non-distributed) optimizers build them."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    model = adapter.sharded_state_dict(prefix="mlp.")
    state = opt.state_dict()
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model, adapter.parameters()),
                                  exclude_keys=("step",))
    return {"model": model, "optimizer": state}


def _load_and_check(adapter, opt, ckpt_dir, weights) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded(adapter, opt), ckpt_dir)
    adapter.load_state_dict({k[len("mlp."):]: v for k, v in loaded["model"].items()})
    for state in loaded["optimizer"]["state"].values():
        state["step"] = torch.tensor(3.0)  # not saved (megatron's optimizers keep it in their param groups)
    opt.load_state_dict(loaded["optimizer"])
    got = adapter.export_full_weights()
    assert all(torch.equal(a, b) for a, b in zip(got, weights)), "weights"
    for name, p in adapter.named_parameters():
        st = opt.state[p]
        assert torch.equal(st["exp_avg"], 2 * p.detach()) and torch.equal(st["exp_avg_sq"], p.detach() ** 2), name


def _sharded_checkpoint_round_trip(rank, world, root):
    """Save the adapter and its optimizer state with megatron's distributed checkpointing at EP=2 in the
    linear and in a replicated placement; load each into another placement at EP=2 and at EP=1 (DP=2);
    save and load at TP=2 (megatron's expert TP = 2 too: replicas of whole experts); a move after the
    sharded state dict was taken (refused at the save; between a load and ``load_state_dict``, the
    rows keep the placement they were read for). Placements with a rank that holds no expert, saved
    and loaded. Flat shards (the distributed optimizer's 'fully_sharded_model_space') are refused clearly."""
    import os

    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True
    # megatron's checkpoint writer assumes CUDA: stand-ins for its two calls
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    weights = _weights(21)
    # a rank holding no expert: its empty list of rows was taken for common (non-sharded) data, which made
    # the checkpoint unloadable (saved with rank 0 empty) or the load raise on that rank alone
    empty_first = ml.ExpertPlacement(torch.tensor([[-1] * E, list(range(E))]), E)
    empty_last = ml.ExpertPlacement(torch.tensor([list(range(E)), [-1] * E]), E)
    saved_in = {"linear": None, "replicated": _replicated_placement(world), "empty_first": empty_first}
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    for name, placement in saved_in.items():
        adapter, opt = _adapter_with_adam(world, placement)
        adapter.load_full_weights(*weights)
        for p in adapter.parameters():
            opt.state[p].update(exp_avg=2 * p.detach(), exp_avg_sq=p.detach() ** 2)
        os.makedirs(f"{root}/{name}", exist_ok=True)
        dist_checkpointing.save(_sharded(adapter, opt), f"{root}/{name}")
        if name == "linear":  # megatron's distributed-optimizer format 'fully_sharded_model_space' asks for flat slices
            factory = adapter.sharded_state_dict(prefix="mlp.")["mlp.layer.experts.w2"]
            with pytest.raises(ValueError, match="use a non-distributed megatron optimizer"):
                factory.build_fn(factory.key, factory.data, factory.replica_id, slice(0, 4))
    # megatron's fully parallel save (Megatron-LM's default) picks any rank listing a shard as its writer: a
    # stand-in shard on the rank without experts wrote its uninitialised memory as expert 0
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    adapter, opt = _adapter_with_adam(world, empty_first)
    adapter.load_full_weights(*weights)
    for p in adapter.parameters():
        opt.state[p].update(exp_avg=2 * p.detach(), exp_avg_sq=p.detach() ** 2)
    os.makedirs(f"{root}/fully_parallel", exist_ok=True)
    dist_checkpointing.save(_sharded(adapter, opt), f"{root}/fully_parallel", FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), ps.get_data_parallel_group(with_context_parallel=True)))
    saved_in["fully_parallel"] = empty_first
    reversed_ = ml.ExpertPlacement(torch.arange(E - 1, -1, -1).view(world, -1), E)
    for name in saved_in:
        for placement in (reversed_, _replicated_placement(world), empty_last):
            _load_and_check(*_adapter_with_adam(world, placement), f"{root}/{name}", weights)
    # a move after sharded_state_dict() was taken: the rows no longer match it, refused at the save
    adapter, opt = _adapter_with_adam(world)
    adapter.load_full_weights(*weights)
    taken = _sharded(adapter, opt)
    adapter.layer.apply_placement(reversed_)
    os.makedirs(f"{root}/moved", exist_ok=True)
    with pytest.raises(RuntimeError, match="placement changed after sharded_state_dict"):
        dist_checkpointing.save(taken, f"{root}/moved")
    # ... and between a load and load_state_dict: the rows come with the placement they were read for
    adapter, opt = _adapter_with_adam(world)
    linear = adapter.layer.placement.copy()
    loaded = dist_checkpointing.load(_sharded(adapter, opt), f"{root}/linear")
    adapter.layer.apply_placement(reversed_)
    adapter.load_state_dict({k[len("mlp."):]: v for k, v in loaded["model"].items()})
    assert adapter.layer.placement == linear
    assert all(torch.equal(a, b) for a, b in zip(adapter.export_full_weights(), weights))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=1)  # every rank holds every expert
    for name in saved_in:
        _load_and_check(*_adapter_with_adam(1), f"{root}/{name}", weights)
    ps.destroy_model_parallel()
    # tensor parallelism (expert TP = TP by default): both ranks hold whole experts, one saves them
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    adapter, opt = _adapter_with_adam(1, tp=world)
    adapter.load_full_weights(*weights)
    for p in adapter.parameters():
        opt.state[p].update(exp_avg=2 * p.detach(), exp_avg_sq=p.detach() ** 2)
    os.makedirs(f"{root}/tp", exist_ok=True)
    dist_checkpointing.save(_sharded(adapter, opt), f"{root}/tp")
    _load_and_check(*_adapter_with_adam(1, tp=world), f"{root}/linear", weights)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    _load_and_check(*_adapter_with_adam(world, reversed_), f"{root}/tp", weights)
    ps.destroy_model_parallel()
    # groups of our own, without megatron's parallel_state: its data-parallel group is theirs (megatron's
    # default read parallel_state and failed)
    groups = ml.ParallelGroups.from_world(ep=world)
    adapter = mi.MegatronMoEAdapter(_tc(expert_model_parallel_size=world), ml.VanillaMoE, groups=groups,
                                    placement=reversed_)
    loaded = dist_checkpointing.load({"model": adapter.sharded_state_dict(prefix="mlp.")}, f"{root}/linear")
    adapter.load_state_dict({k[len("mlp."):]: v for k, v in loaded["model"].items()})
    assert all(torch.equal(a, b) for a, b in zip(adapter.export_full_weights(), weights))


def _sharded_checkpoint_world_of_one(rank, world, root):
    """Groups of a world of one without megatron's parallel_state: no group at all for the router."""
    warnings.filterwarnings("ignore")
    torch._dynamo.config.disable = True
    torch.cuda.synchronize = lambda *a, **k: None  # megatron's checkpoint writer assumes CUDA
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing

    weights = _weights(21)
    adapter = mi.MegatronMoEAdapter(_tc(), ml.VanillaMoE, groups=ml.ParallelGroups.from_world())
    adapter.load_full_weights(*weights)
    dist_checkpointing.save({"model": adapter.sharded_state_dict(prefix="mlp.")}, root)
    permuted = ml.ExpertPlacement(torch.tensor([[3, 1, 0, 2]]), E)
    fresh = mi.MegatronMoEAdapter(_tc(), ml.VanillaMoE, groups=ml.ParallelGroups.from_world(), placement=permuted)
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict(prefix="mlp.")}, root)
    fresh.load_state_dict({k[len("mlp."):]: v for k, v in loaded["model"].items()})
    return all(torch.equal(a, b) for a, b in zip(fresh.export_full_weights(), weights))


def test_sharded_checkpoint_of_a_world_of_one_without_parallel_state(tmp_path):
    """megatron's helper reads its parallel_state when given neither a TP nor a DP group, and failed."""
    __import__("psutil")  # megatron-core's checkpoint writer needs it: a dependency of moelayers, not skipped
    assert run_distributed(_sharded_checkpoint_world_of_one, 1, str(tmp_path), timeout=120, daemon=False) == [True]


def test_sharded_checkpoint_loads_in_any_placement_and_expert_parallel_size(tmp_path):
    __import__("psutil")  # megatron-core's checkpoint writer needs it: a dependency of moelayers, not skipped
    run_distributed(_sharded_checkpoint_round_trip, 2, str(tmp_path), timeout=240, daemon=False)


@pytest.mark.parametrize("setting", [{"moe_token_dispatcher_type": "flex"},
                                     {"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}])
def test_adapter_says_megatrons_flex_dispatcher_is_not_used(setting):
    """A config asking for megatron's flex dispatcher (DeepEP) gets ours, which changes no output: said once."""
    with pytest.warns(UserWarning, match="flex token dispatcher \\(DeepEP\\) is not used.*'alltoall'"):
        adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(**setting), "build_module")
    assert adapter.layer.dispatcher_name == "alltoall"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _build(mi.moe_spec(ml.VanillaMoE), _tc(moe_token_dispatcher_type="alltoall"), "build_module")
    assert not [w for w in caught if "dispatcher" in str(w.message)], [str(w.message) for w in caught]


def test_router_gemm_fix_without_te():
    """megatron-core 0.16.x without TE: RouterGatingLinearFunction reads an unbound te_general_gemm."""
    from megatron.core.transformer.moe import moe_utils

    mpeer._fix_router_gemm_without_te()
    x, w = torch.randn(7, H).bfloat16(), torch.randn(E, H).bfloat16()
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ w.float().t())


@pytest.mark.parametrize("module", ["moelayers.integrations.megatron_peer", "moelayers.integrations.megatron"])
def test_each_integration_module_imports_first(module):
    """In a fresh interpreter either module may be imported first (they refer to each other)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import {module} as m; "
                           "from moelayers.integrations.megatron import megatron_moe_layer, load_megatron_weights"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_forced_routing_with_padding_mask():
    """Forced routing (trace replay) laid out like hidden_states, [S, B, K] or [S * B, K], with a padding
    mask: the padded rows are dropped from it as from the tokens; an all-False mask is no mask. A forced
    routing of another layout is refused, and dropped (the next forward routes by itself)."""
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "build_module")
    weights = _weights(4)
    adapter.load_full_weights(*weights)
    s, b = 4, 3
    x = torch.randn(s, b, H, generator=torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(9)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s * b)]).view(s, b, K)
    adapter.layer.force_routing(ids)
    y_plain, _ = adapter(x)
    for forced in (ids, ids.reshape(-1, K)):
        adapter.layer.force_routing(forced)
        assert torch.equal(adapter(x, padding_mask=torch.zeros(b, s, dtype=torch.bool))[0], y_plain)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 3] = True
    pad[2, 1:] = True
    keep = ~pad.t().reshape(-1)
    x_pad = x.clone()
    x_pad[pad.t()] = float("nan")
    ref = _ref64(x.reshape(-1, H)[keep], weights, adapter.moe_config, topk_ids=ids.reshape(-1, K)[keep])
    for forced in (ids, ids.reshape(-1, K)):
        adapter.layer.force_routing(forced)
        y, _ = adapter(x_pad, padding_mask=pad)
        y2 = y.reshape(-1, H)
        assert torch.equal(adapter.layer.last_topk_ids, ids.reshape(-1, K)[keep])
        assert torch.equal(y2[~keep], torch.zeros_like(y2[~keep]))
        err = check_close("forced + padded", y2[keep], ref)
        assert err is None, err
    adapter.layer.force_routing(ids.reshape(-1, K)[keep])  # already without the padded rows: ambiguous, refused
    with pytest.raises(ValueError, match="forced routing has shape"):
        adapter(x_pad, padding_mask=pad)
    adapter(x_pad, padding_mask=pad)  # the refused routing was dropped: routed by the router
    assert not torch.equal(adapter.layer.last_topk_ids, ids.reshape(-1, K)[keep])


def test_from_megatron_refuses_router_dtype_below_params_dtype():
    """params_dtype=float64 with moe_router_dtype='fp32': megatron computes the logits in float32, moelayers'
    router_dtype only raises precision (they would stay float64), so near-ties would pick other experts:
    refused. A router dtype at or above the parameters' dtype is accepted."""
    with pytest.raises(ValueError, match="moe_router_dtype='fp32' with params_dtype=torch.float64"):
        ml.MoEConfig.from_megatron(_tc(params_dtype=torch.float64, moe_router_dtype="fp32"))
    for params, router, want in ((torch.float64, "fp64", torch.float64), (torch.float64, None, None),
                                 (torch.float32, "fp32", torch.float32), (torch.bfloat16, "fp64", torch.float64)):
        cfg = ml.MoEConfig.from_megatron(_tc(params_dtype=params, moe_router_dtype=router))
        assert cfg.router_dtype is want and cfg.logits_dtype(params) is (want or params)


def test_from_megatron_takes_a_zero_topk_scaling_factor_as_none():
    """megatron scales the top-k probabilities only `if scaling_factor:`: 0.0 is no scaling, not a
    setting to refuse; any other factor still is."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = torch.randn(6, E)
    zero, _ = topk_routing_with_score_function(logits, K, use_pre_softmax=False, scaling_factor=0.0)
    none, _ = topk_routing_with_score_function(logits, K, use_pre_softmax=False, scaling_factor=None)
    assert torch.equal(zero, none)
    assert ml.MoEConfig.from_megatron(_tc(moe_router_topk_scaling_factor=0.0)) == ml.MoEConfig.from_megatron(_tc())
    with pytest.raises(ValueError, match=re.escape("moe_router_topk_scaling_factor=2.5")):
        ml.MoEConfig.from_megatron(_tc(moe_router_topk_scaling_factor=2.5))


def _padded_case(seed: int = 4):
    s, b = 4, 3
    x = torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s * b)]).view(s, b, K)
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 3] = True
    pad[2, 1:] = True
    return x, ids, pad


def _forced_padded_grads(adapter, x, ids, pad, wrap=None) -> list[torch.Tensor]:
    """Gradients of a forced forward with a padding mask, the adapter called through ``wrap``."""
    adapter.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    adapter.layer.force_routing(ids)
    fn = lambda h: adapter(h, padding_mask=pad)[0]  # noqa: E731
    y = fn(x) if wrap is None else wrap(fn, x)
    y.pow(2).sum().backward()
    return [x.grad, adapter.layer.router.weight.grad, *adapter.layer.expert_grads_full()]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_adapter_recomputes_forced_routing_with_a_padding_mask(reentrant):
    """With a padding mask the layer gets the unpadded rows, a new tensor in every forward, so the
    recomputation of a forced forward could not find its routing: the backward raised ValueError. The
    adapter now keys the routing by its hidden_states: the gradients are the unwrapped adapter's."""
    from torch.utils.checkpoint import checkpoint

    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "build_module")
    adapter.load_full_weights(*_weights(4))
    x, ids, pad = _padded_case()
    want = _forced_padded_grads(adapter, x, ids, pad)
    got = _forced_padded_grads(adapter, x, ids, pad, lambda fn, t: checkpoint(fn, t, use_reentrant=reentrant))
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    routed = _forced_padded_grads(adapter, x, ids.roll(1, 0), pad)  # (the forced ids matter)
    assert not torch.equal(routed[1], want[1])


def test_adapter_applies_megatron_selective_moe_recompute():
    """recompute_granularity='selective' with 'moe' in recompute_modules checkpoints megatron's MoELayer;
    the adapter ignored it (no recompute, the memory the user had turned it on to save). It now
    checkpoints its training forwards, forced routing and padding mask included, with the gradients of
    the plain adapter; inference and no_grad forwards run once."""
    plain = _build(mi.moe_spec(ml.VanillaMoE), _tc(), "build_module")
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(recompute_granularity="selective", recompute_modules=["moe"]),
                     "build_module")
    assert adapter.recompute and not plain.recompute
    for a in (plain, adapter):
        a.load_full_weights(*_weights(4))
    calls = []
    adapter.layer.register_forward_pre_hook(lambda *_: calls.append(1))
    x, ids, pad = _padded_case()
    want = _forced_padded_grads(plain, x, ids, pad)
    got = _forced_padded_grads(adapter, x, ids, pad)
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    with torch.no_grad():
        y = adapter(x, padding_mask=pad)[0]
    assert len(calls) == 3 and torch.equal(y, plain(x, padding_mask=pad)[0])


def test_forced_routing_under_megatrons_full_recompute_is_refused_in_the_forward(monkeypatch):
    """recompute_granularity='full' re-runs the whole transformer layer, whose MoE input is made inside it:
    the forced ids cannot be found again, and the backward raised, after the whole forward. The adapter now
    refuses in the forward, naming the selective recompute that works; unforced forwards run."""
    from megatron.core.tensor_parallel import random as mrandom

    if not hasattr(mrandom, "is_checkpointing"):
        pytest.skip("this megatron-core does not flag its checkpointing (the backward's error remains)")
    adapter = _build(mi.moe_spec(ml.VanillaMoE), _tc(recompute_granularity="full", recompute_method="uniform",
                                                     recompute_num_layers=1), "build_module")
    x, ids, pad = _padded_case()
    monkeypatch.setattr(mrandom, "IS_CHECKPOINTING", True)  # inside megatron's CheckpointFunction (CUDA-only here)
    adapter.layer.force_routing(ids)
    with pytest.raises(ValueError, match="recompute_granularity='selective' with 'moe'"):
        adapter(x, padding_mask=pad)
    adapter(x, padding_mask=pad)  # the refused ids were dropped; routed by the router
    monkeypatch.setattr(mrandom, "IS_CHECKPOINTING", False)
    adapter.layer.force_routing(ids)
    adapter(x)  # outside a megatron checkpoint: forced as usual
    assert torch.equal(adapter.layer.last_topk_ids, ids.reshape(-1, K))
    with pytest.warns(UserWarning, match="'moe_act'"):
        _build(mi.moe_spec(ml.VanillaMoE), _tc(recompute_granularity="selective", recompute_modules=["moe_act"],
                                               moe_grouped_gemm=True), "build_module")


def _replica_clip_warning(rank, world):
    """Which training forwards warn that megatron's clipping counts replicated experts once per copy."""
    from megatron.core import parallel_state as ps

    torch._dynamo.config.disable = True
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, placement in (("linear", None), ("replicated", _replicated_placement(world))):
        adapter, _ = _adapter_with_adam(world, placement)
        adapter.load_full_weights(*_weights(3))
        for mode in ("eval", "train", "train again"):
            adapter.train(mode != "eval")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                adapter(x)[0].sum().backward()
            out[(name, mode)] = [str(w.message) for w in caught if "clip_grad" in str(w.message)]
    ps.destroy_model_parallel()
    return out


def test_adapter_warns_that_megatron_clipping_counts_replicas_per_copy():
    """megatron's gradient clipping takes norms per parameter, so a replicated expert's gradient counts
    once per copy: training a replicated placement warns, once per layer; inference and placements
    without replicas do not."""
    for out in run_distributed(_replica_clip_warning, 2, timeout=120):
        assert out[("replicated", "train")] and "once per copy" in out[("replicated", "train")][0]
        assert not out[("replicated", "eval")] and not out[("replicated", "train again")]
        assert not any(out[("linear", mode)] for mode in ("eval", "train", "train again"))


def test_adapter_on_the_meta_device():
    """megatron's ``init_model_with_meta_device`` builds under ``with torch.device("meta")``: the
    config's routing probe crashed there in a fresh process (its bf16 probe landed on meta), the
    adapter put its weights on CPU while the rest of the model was on meta, and ``device="meta"``
    failed in ``megatron_init``. Now the weights are on meta, and ``to_empty`` + ``megatron_init``
    give a CPU-built adapter's weights."""
    from moelayers.config import megatron_rounds_scores

    tc = _tc(moe_router_dtype="fp32")
    megatron_rounds_scores.cache_clear()  # as in a fresh process
    with torch.device("meta"):
        built = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.single(), layer_number=1)
    explicit = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.single(), layer_number=1,
                                     device="meta")
    reference = mi.MegatronMoEAdapter(tc, ml.VanillaMoE, groups=ml.ParallelGroups.single(), layer_number=1)
    for adapter in (built, explicit):
        assert {p.device.type for p in adapter.parameters()} == {"meta"}
        adapter.to_empty(device="cpu")
        assert mi.megatron_init(adapter.layer, tc, 1)
        assert all(torch.equal(p, q) for p, q in zip(adapter.parameters(), reference.parameters()))


def test_from_megatron_without_megatron_names_the_package(monkeypatch):
    """A journey found a bare `No module named 'megatron'` from from_megatron on an environment without
    megatron-core, where the other megatron entry points name the package and the pip command."""
    import sys

    from moelayers.config import megatron_rounds_scores

    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe.moe_utils", None)  # import fails
    megatron_rounds_scores.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"from_megatron needs megatron-core .*pip install megatron-core"):
            ml.MoEConfig.from_megatron(_tc(num_moe_experts=8))
    finally:
        megatron_rounds_scores.cache_clear()


def test_share_graph_pool_sets_one_pool_and_drops_the_graphs_captured_before():
    """CPU stand-ins (a pool handle is a tuple; capture needs CUDA: tests/gpu): every moelayers layer
    in the module takes the pool, graphs captured elsewhere are dropped, a copy starts without it."""
    import copy

    class _Graph:
        released = False

        def release(self):
            self.released = True

    cfg = ml.MoEConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2)
    model = torch.nn.ModuleList([ml.VanillaMoE(cfg, ml.ParallelGroups.single(), capacity=(2, 4)) for _ in range(2)])
    model[0]._graphed = {2: (graph := _Graph())}
    assert ml.share_graph_pool(model, pool=(0, 7)) == (0, 7)
    assert [m.graph_pool for m in model] == [(0, 7), (0, 7)] and graph.released and model[0]._graphed == {}
    model[1]._graphed = {4: (kept := _Graph())}
    ml.share_graph_pool(model[1], pool=(0, 7))  # the pool it has already: its graphs stay
    assert not kept.released
    model[1]._graphed = {}
    assert copy.deepcopy(model[0]).graph_pool is None
    if not torch.cuda.is_available():
        assert ml.share_graph_pool(model) is None  # nothing to share: graphs run eagerly
    with pytest.raises(ValueError, match="holds no moelayers layer"):
        ml.share_graph_pool(torch.nn.Linear(2, 2))
