"""moelayers.integrations.hf: HF sparse MoE blocks -> moelayers layers.

The core tests use small HF-like modules written here (transformers >= 5's fused experts and 4.x's
per-expert ``nn.ModuleList``, with HF's routing written out), so they run without transformers;
the tests at the end use the real transformers when it is installed."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moelayers as ml
from moelayers.integrations import hf
from moelayers.integrations.hf import hf_weights, moe_config_from_hf, swap_moe_blocks, weights_from_hf

H, FF, E, K = 16, 8, 6, 2


def hf_config(model_type: str = "qwen3_moe", **kw) -> SimpleNamespace:
    """An HF-like config with the fields each model type has."""
    fields = {"model_type": model_type, "hidden_size": H, "num_experts_per_tok": K, "hidden_act": "silu"}
    if model_type == "mixtral":
        fields.update(num_local_experts=E, intermediate_size=FF, router_jitter_noise=0.0)
    elif model_type == "olmoe":
        fields.update(num_experts=E, intermediate_size=FF, norm_topk_prob=False)
    else:
        fields.update(num_experts=E, moe_intermediate_size=FF, norm_topk_prob=False)
    fields.update(kw)
    return SimpleNamespace(**fields)


def hf_route(logits: torch.Tensor, k: int, norm: bool, mixtral: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routers: Qwen3/OLMoE softmax -> top-k -> optional renorm; Mixtral top-k of the logits -> softmax."""
    if mixtral:
        top, ids = torch.topk(logits, k, dim=-1)
        return F.softmax(top, dim=-1), ids
    probs = F.softmax(logits, dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if norm else top), ids


def hf_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t], w13[ids[t, j]]).chunk(2, dim=-1)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[ids[t, j]])
    return out


class Router5(nn.Module):
    def __init__(self, norm: bool | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H, dtype=torch.float64))
        self.top_k = K
        if norm is not None:
            self.norm_topk_prob = norm


class Experts5(nn.Module):
    """transformers >= 5's fused experts, with its layout flags."""

    def __init__(self, transposed: bool = False, **flags):
        super().__init__()
        shapes = ((E, H, 2 * FF), (E, FF, H)) if transposed else ((E, 2 * FF, H), (E, H, FF))
        self.gate_up_proj = nn.Parameter(torch.empty(*shapes[0], dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.empty(*shapes[1], dtype=torch.float64))
        self.has_gate, self.has_bias, self.has_post_expert_norm = True, False, False
        self.is_transposed, self.is_concatenated, self._is_expert_parallel = transposed, True, False
        for name, value in flags.items():
            setattr(self, name, value)

    def logical(self):
        if self.is_transposed:
            return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        return self.gate_up_proj, self.down_proj


def _default_apply_gate(self, gate_up_out):  # the name HF's decorator gives the default
    gate, up = gate_up_out.chunk(2, dim=-1)
    return F.silu(gate) * up


Experts5._apply_gate = _default_apply_gate


class Block5(nn.Module):
    """transformers >= 5 sparse block: [B, S, H] -> tensor."""

    def __init__(self, model_type="qwen3_moe", norm=False, transposed=False, seed=0, **flags):
        super().__init__()
        self.mixtral = model_type == "mixtral"
        self.norm = True if self.mixtral else norm
        self.gate = Router5(None if self.mixtral else norm)
        self.experts = Experts5(transposed, **flags)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)

    def logical(self):
        return self.experts.logical()

    def forward(self, x):
        x2 = x.reshape(-1, H)
        weights, ids = hf_route(F.linear(x2, self.gate.weight), K, self.norm, self.mixtral)
        return hf_experts(x2, *self.experts.logical(), weights, ids).reshape(x.shape)


class MLP4(nn.Module):
    def __init__(self, names, bias=False):
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(H, FF, bias=bias, dtype=torch.float64))
        setattr(self, up, nn.Linear(H, FF, bias=bias, dtype=torch.float64))
        setattr(self, down, nn.Linear(FF, H, bias=bias, dtype=torch.float64))
        self.names = names


class Block4(nn.Module):
    """transformers 4.x sparse block: nn.Linear router, per-expert MLPs, returns (y, router_logits)."""

    def __init__(self, model_type="qwen3_moe", norm=False, seed=0, bias=False):
        super().__init__()
        self.mixtral = model_type == "mixtral"
        self.norm_topk_prob, self.top_k = (True if self.mixtral else norm), K
        if self.mixtral:
            del self.norm_topk_prob
            self.jitter_noise = 0.0
        names = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
        self.gate = nn.Linear(H, E, bias=False, dtype=torch.float64)
        self.experts = nn.ModuleList([MLP4(names, bias) for _ in range(E)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)

    def logical(self):
        gate, up, down = self.experts[0].names
        w13 = torch.stack([torch.cat([getattr(m, gate).weight, getattr(m, up).weight]) for m in self.experts])
        return w13, torch.stack([getattr(m, down).weight for m in self.experts])

    def forward(self, x):
        x2 = x.reshape(-1, H)
        logits = self.gate(x2)
        weights, ids = hf_route(logits, K, True if self.mixtral else self.norm_topk_prob, self.mixtral)
        return hf_experts(x2, *self.logical(), weights, ids).reshape(x.shape), logits


class Decoder(nn.Module):
    def __init__(self, mlp, old: bool):
        super().__init__()
        self.mlp, self.old = mlp, old

    def forward(self, h):
        if self.old:  # 4.x Mixtral / OLMoE: `hidden_states, router_logits = self.mlp(hidden_states)`
            y, _ = self.mlp(h)
        else:
            y = self.mlp(h)
        return torch.tanh(h + y)


class Model(nn.Module):
    """MoE, dense, MoE decoder layers (Qwen3-MoE's mlp_only_layers), with .config as HF's."""

    def __init__(self, model_type="qwen3_moe", norm=False, old=False):
        super().__init__()
        self.config = hf_config(model_type, norm_topk_prob=norm)
        block = (lambda s: Block4(model_type, norm, seed=s)) if old else (lambda s: Block5(model_type, norm, seed=s))
        dense = nn.Sequential(nn.Linear(H, H, dtype=torch.float64))
        self.layers = nn.ModuleList([Decoder(block(1), old), nn.Sequential(dense), Decoder(block(2), old)])

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def _x(*shape, seed=3):
    return torch.randn(*shape, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layer(block, cfg):
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single())
    layer.load_full_weights(*weights_from_hf(block))
    return layer


CASES = [("qwen3_moe", False, "fused"), ("qwen3_moe", True, "fused"), ("olmoe", False, "fused"),
         ("mixtral", True, "fused"), ("qwen3_moe", False, "transposed"), ("qwen3_moe", False, "list"),
         ("qwen3_moe", True, "list"), ("olmoe", True, "list"), ("mixtral", True, "list")]


@pytest.mark.parametrize("model_type,norm,layout", CASES)
def test_layer_computes_the_hf_block(model_type, norm, layout):
    if layout == "list":
        block = Block4(model_type, norm)
    else:
        block = Block5(model_type, norm, transposed=layout == "transposed")
    cfg = moe_config_from_hf(block, hf_config(model_type, norm_topk_prob=norm))
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k) == (H, FF, E, K)
    assert (cfg.score_fn, cfg.norm_topk_prob, cfg.params_dtype) == ("softmax", norm, torch.float64)
    router, w13, w2 = weights_from_hf(block)
    want13, want2 = block.logical()
    assert torch.equal(router, block.gate.weight) and torch.equal(w13, want13) and torch.equal(w2, want2)
    layer = _layer(block, cfg)
    x = _x(2, 5)
    with torch.no_grad():
        expected = block(x)[0] if layout == "list" else block(x)
        y = layer(x)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)
    ref = ml.reference.moe_forward(x.reshape(-1, H), router, w13, w2, cfg)
    torch.testing.assert_close(y.reshape(-1, H), ref, rtol=0, atol=1e-12)


def test_norm_topk_prob_is_hf_default_false_and_matters():
    """HF's Qwen3-MoE / OLMoE default norm_topk_prob=False; MoEConfig's default True gives other outputs."""
    block = Block5("qwen3_moe", norm=False)
    config = hf_config()
    del config.norm_topk_prob  # a config without the field: HF's default
    cfg = moe_config_from_hf(block, config)
    assert cfg.norm_topk_prob is False
    x = _x(7)
    with torch.no_grad():
        assert torch.allclose(_layer(block, cfg)(x), block(x), rtol=0, atol=1e-12)
        assert not torch.allclose(_layer(block, cfg.replace(norm_topk_prob=True))(x), block(x), atol=1e-3)


def test_overrides_and_dtype():
    block = Block5()
    cfg = moe_config_from_hf(block, hf_config(), router_dtype=torch.float64, init_std=0.1)
    assert cfg.router_dtype == torch.float64 and cfg.init_std == 0.1
    assert moe_config_from_hf(block, hf_config(), dtype=torch.float32).params_dtype == torch.float32
    with pytest.raises(ValueError, match=r"reads \['norm_topk_prob'\] from the 'qwen3_moe' model"):
        moe_config_from_hf(block, hf_config(), norm_topk_prob=True)
    with pytest.raises(ValueError, match="as dtype=, not params_dtype="):
        moe_config_from_hf(block, hf_config(), params_dtype=torch.float32)
    block.gate.float()
    with pytest.raises(ValueError, match=r"dtypes \['torch.float32', 'torch.float64'\].*pass dtype="):
        moe_config_from_hf(block, hf_config())


@pytest.mark.parametrize("old", [False, True])
def test_swap_moe_blocks(old):
    model = Model("mixtral" if old else "qwen3_moe", norm=False, old=old).eval()
    x = _x(2, 4)
    with torch.no_grad():
        expected = model(x)
    blocks = [model.layers[0].mlp, model.layers[2].mlp]
    assert swap_moe_blocks(model, ml.ParallelGroups.single()) == ["layers.0.mlp", "layers.2.mlp"]
    layers = [model.layers[i].mlp for i in (0, 2)]
    if old:
        assert all(isinstance(m, hf.TupleOutput) for m in layers)
        layers = [m.layer for m in layers]
    assert all(isinstance(m, ml.VanillaMoE) for m in layers)
    assert [m.layer_number for m in layers] == [0, 1] and not any(m.training for m in layers)
    assert layers[0].config.norm_topk_prob is old  # Mixtral always renormalises; Qwen3 as its config
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-12)
    for block, name in zip(blocks, ("layers.0.mlp", "layers.2.mlp")):  # the way back, in the block's own names
        assert_loads_back(block, hf_weights(model.get_submodule(name)))


def assert_loads_back(block: nn.Module, back: dict) -> None:
    """``back`` (hf_weights) holds exactly the block's keys and values: a copy of the block with other
    weights takes it (strict) and then equals the block."""
    import copy

    fresh = copy.deepcopy(block)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(back, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), block.state_dict().values()))


def test_swap_keeps_frozen_weights_frozen_and_passes_layer_kwargs():
    model = Model()
    model.requires_grad_(False)
    swap_moe_blocks(model, ml.ParallelGroups.single(), layer_cls=ml.VariabilityAwareMoE, dispatcher="allgather")
    layer = model.layers[0].mlp
    assert isinstance(layer, ml.VariabilityAwareMoE) and layer.dispatcher_name == "allgather" and layer.training
    assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("old", [False, True], ids=["fused", "per_expert"])
def test_swap_with_cuda_graphs_shares_one_graph_pool(monkeypatch, old):
    """With cuda_graph=True the swapped layers (under a TupleOutput too) capture into one pool (a
    CPU stand-in for the handle: capture needs CUDA, tests/gpu/test_hf_gpu.py); without it, none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 99))
    model, plain = Model(old=old), Model(old=old)
    names = swap_moe_blocks(model, ml.ParallelGroups.single(), capacity=(4, 16), cuda_graph=True)
    swap_moe_blocks(plain, ml.ParallelGroups.single(), capacity=(4, 16))
    for m, pool in ((model, (0, 99)), (plain, None)):
        layers = [getattr(m.get_submodule(n), "layer", m.get_submodule(n)) for n in names]
        assert [layer.graph_pool for layer in layers] == [pool, pool]


def test_hf_weights_load_back_into_a_block():
    block, fresh = Block5(seed=1), Block5(seed=2)
    layer = _layer(block, moe_config_from_hf(block, hf_config()))
    fresh.load_state_dict(hf_weights(layer), strict=True)
    x = _x(5)
    with torch.no_grad():
        assert torch.equal(fresh(x), block(x))
    with pytest.raises(TypeError, match="hf_weights takes a moelayers layer"):
        hf_weights(block)


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("model_type,message", [
    ("qwen2_moe", "'qwen2_moe' MoE block to moelayers: its block adds a shared expert"),
    ("deepseek_v3", "'deepseek_v3' MoE block to moelayers: .*e_score_correction_bias.*group-limited top-k"),
    ("deepseek_v2", "'deepseek_v2' MoE block to moelayers: its block adds shared experts"),
    ("phimoe", r"'phimoe' MoE block to moelayers: the supported model types are \['mixtral', 'qwen3_moe'"),
])
def test_refuses_other_model_types(model_type, message):
    with pytest.raises(ValueError, match=message):
        moe_config_from_hf(Block5(), hf_config(model_type))
    model = Model()
    model.config.model_type = model_type
    with pytest.raises(ValueError, match=message):
        swap_moe_blocks(model, ml.ParallelGroups.single())
    assert isinstance(model.layers[0].mlp, Block5)  # nothing replaced


def test_refuses_settings_it_cannot_represent():
    block = Block5("mixtral")
    with pytest.raises(ValueError, match="'mixtral' MoE block to moelayers: router_jitter_noise=0.1: HF multiplies"):
        moe_config_from_hf(block, hf_config("mixtral", router_jitter_noise=0.1))
    block.jitter_noise = 0.01
    with pytest.raises(ValueError, match="router_jitter_noise=0.01"):
        moe_config_from_hf(block, hf_config("mixtral"))
    with pytest.raises(ValueError, match="'olmoe' MoE block to moelayers: hidden_act='gelu': .* are SwiGLU"):
        moe_config_from_hf(Block5(), hf_config("olmoe", hidden_act="gelu"))
    moe_config_from_hf(Block5(), hf_config(hidden_act="swish"))  # HF's other name of silu
    shared = Block5()
    shared.shared_expert = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="the block has shared_expert"):
        moe_config_from_hf(shared, hf_config())
    with pytest.raises(ValueError, match=r"hf_config.hidden_size=32 but the block's weights have 16"):
        moe_config_from_hf(Block5(), hf_config(hidden_size=32))
    with pytest.raises(ValueError, match=r"hf_config.moe_intermediate_size=4 but the block's weights have 8"):
        moe_config_from_hf(Block5(), hf_config(moe_intermediate_size=4))
    with pytest.raises(ValueError, match="built with norm_topk_prob=True, hf_config gives False"):
        moe_config_from_hf(Block5(norm=True), hf_config(norm_topk_prob=False))
    with pytest.raises(ValueError, match="routes to top_k=2 experts, hf_config.num_experts_per_tok=3"):
        moe_config_from_hf(Block4(), hf_config(num_experts_per_tok=3))
    with pytest.raises(ValueError, match="the 'qwen3_moe' config has no num_experts_per_tok"):
        moe_config_from_hf(Block5(), hf_config(num_experts_per_tok=None))
    gelu = Block5()
    gelu.experts.act_fn = nn.GELU()  # a model built with gelu experts, its config edited to silu afterwards
    with pytest.raises(ValueError, match="the block's experts compute GELU, not SiLU, whatever hf_config.hidden_act="):
        moe_config_from_hf(gelu, hf_config())
    gelu.experts.act_fn = nn.SiLU()
    moe_config_from_hf(gelu, hf_config())
    with pytest.raises(ValueError, match="output_router_logits is True: the layers return no router logits"):
        moe_config_from_hf(Block5(), hf_config(output_router_logits=True))  # (4.x: an aux loss of 0, silently)


def test_swap_casts_mixed_dtypes_and_tells_a_second_swap_and_writes_the_layout_read():
    """A float32 router beside float64 experts: 'pass dtype=', which swap_moe_blocks did not take; a
    second swap said 'no sparse MoE block'; a transposed block's weights came back untransposed."""
    model, x = Model(), _x(2, 3)
    with torch.no_grad():
        expected = model(x)  # (the fake block computes in one dtype)
    model.layers[0].mlp.gate.float()
    with pytest.raises(ValueError, match="weights have dtypes .*pass dtype="):
        swap_moe_blocks(model, ml.ParallelGroups.single())
    swap_moe_blocks(model, ml.ParallelGroups.single(), dtype=torch.float64)
    assert model.layers[0].mlp.router.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)  # (the router was float32)
    with pytest.raises(ValueError, match=r"holds moelayers layers already \(layers\.0\.mlp, \.\.\.\) .*swapped before"):
        swap_moe_blocks(model, ml.ParallelGroups.single())
    transposed = Model()
    block = Block5(transposed=True, seed=4)
    transposed.layers[0].mlp = block
    swap_moe_blocks(transposed, ml.ParallelGroups.single())
    assert_loads_back(block, hf_weights(transposed.layers[0].mlp))


@pytest.mark.parametrize("flags,message", [
    ({"is_concatenated": False}, r"layout moelayers cannot read: is_concatenated=False"),
    ({"has_bias": True}, r"cannot read: has_bias=True"),
    ({"has_post_expert_norm": True}, r"cannot read: has_post_expert_norm=True"),
    ({"_is_expert_parallel": True}, r"cannot read: _is_expert_parallel=True.*not HF's expert parallelism"),
    ({"down_proj_bias": nn.Parameter(torch.zeros(E, H))}, "have down_proj_bias: moelayers experts have no biases"),
])
def test_refuses_fused_layouts_it_cannot_read(flags, message):
    with pytest.raises(ValueError, match=message):
        weights_from_hf(Block5(**flags))


def test_refuses_other_blocks_and_shapes():
    block = Block5()
    type(block.experts)._apply_gate, saved = (lambda self, x: x), Experts5._apply_gate
    try:
        with pytest.raises(ValueError, match=r"override _apply_gate: moelayers computes silu\(gate\) \* up only"):
            weights_from_hf(block)
    finally:
        Experts5._apply_gate = saved
    block = Block5()
    del block.experts.is_transposed
    with pytest.raises(ValueError, match=r"no is_transposed flag.*cannot tell \[E, 2F, H\] from \[E, H, 2F\]"):
        weights_from_hf(block)
    block = Block5()
    block.experts.down_proj = nn.Parameter(torch.zeros(E, FF, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"w2 \(down\) must be \[E, H, F\] = \[6, 16, 8\], got \[6, 8, 16\]"):
        weights_from_hf(block)
    block = Block5()
    block.gate.weight = nn.Parameter(torch.zeros(E + 1, H, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"w13 \(gate and up\) must be \[E, 2F, H\] = \[7, 2F, 16\]"):
        weights_from_hf(block)
    block = Block5()
    block.gate.e_score_correction_bias = torch.zeros(E)
    with pytest.raises(ValueError, match="the router has e_score_correction_bias"):
        weights_from_hf(block)
    with pytest.raises(ValueError, match="has a bias: moelayers routers and experts have none"):
        weights_from_hf(Block4(bias=True))
    with pytest.raises(ValueError, match="Linear is not a sparse MoE block moelayers reads"):
        weights_from_hf(nn.Linear(2, 2))
    model = nn.Sequential(nn.Linear(H, H))
    model.config = hf_config()
    with pytest.raises(ValueError, match="has no sparse MoE block moelayers recognises"):
        swap_moe_blocks(model, ml.ParallelGroups.single())
    with pytest.raises(TypeError, match="swap_moe_blocks sets layer_number itself"):
        swap_moe_blocks(Model(), ml.ParallelGroups.single(), layer_number=3)


def test_import_does_not_import_transformers():
    code = "import sys, moelayers.integrations.hf; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------- real transformers
def _tiny(model_type: str, **kw):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if model_type == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, **common, **kw)
    elif model_type == "olmoe":
        cfg = transformers.OlmoeConfig(num_experts=4, **common, **kw)
    elif model_type == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, head_dim=8, **common, **kw)
    elif model_type == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                                          **common, **kw)
    else:
        cfg = transformers.DeepseekV3Config(n_routed_experts=4, moe_intermediate_size=24, n_group=2, topk_group=1,
                                            first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF's std-0.02 init leaves the MoE output negligible
        for name, p in model.named_parameters():
            if ".mlp." in name or "block_sparse_moe" in name:
                p.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("model_type,kw", [("qwen3_moe", {"norm_topk_prob": True}),
                                           ("qwen3_moe", {"norm_topk_prob": False}), ("mixtral", {}), ("olmoe", {})])
def test_real_transformers_logits_bit_identical(model_type, kw):
    transformers = pytest.importorskip("transformers")
    model = _tiny(model_type, **kw)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    names = swap_moe_blocks(model, ml.ParallelGroups.single())
    assert len(names) == 2
    layer = model.get_submodule(names[0])
    layer = getattr(layer, "layer", layer)
    assert layer.config.norm_topk_prob is (model_type == "mixtral" or kw.get("norm_topk_prob", False))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # 4.x sums the experts' terms in another order; with several threads the matmuls' blocking differs
    if int(transformers.__version__.split(".")[0]) >= 5 and torch.get_num_threads() == 1:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("model_type,message", [("qwen2_moe", "'qwen2_moe' MoE block.*shared expert"),
                                                ("deepseek_v3", "'deepseek_v3' MoE block.*e_score_correction_bias")])
def test_real_transformers_refusals(model_type, message):
    model = _tiny(model_type)
    with pytest.raises(ValueError, match=message):
        swap_moe_blocks(model, ml.ParallelGroups.single())


def test_real_transformers_qwen3_vl_moe_text():
    """Qwen3-VL-MoE's text block is Qwen3-MoE's, always renormalised; 4.x stored its experts transposed
    without a layout flag, which is refused."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3VLMoeTextModel"):
        pytest.skip("this transformers has no Qwen3-VL-MoE")
    cfg = transformers.Qwen3VLMoeTextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=24)
    if hasattr(cfg, "rope_scaling") and cfg.rope_scaling is None:  # 4.x
        cfg.rope_scaling = {"rope_type": "default", "mrope_section": [2, 1, 1]}
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeTextModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.3)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    if int(transformers.__version__.split(".")[0]) < 5:
        with pytest.raises(ValueError, match="no is_transposed flag"):
            swap_moe_blocks(model, ml.ParallelGroups.single())
        return
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    names = swap_moe_blocks(model, ml.ParallelGroups.single())
    assert len(names) == 2 and model.get_submodule(names[0]).config.norm_topk_prob is True
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(got, expected) or torch.get_num_threads() > 1  # (bit for bit on one thread)


def test_a_plan_serves_each_block_its_own_layer():
    """swap_moe_blocks(layer_cls=SemanticMoE, plan=plan) built every layer as the plan's layer 0 (a
    journey: outputs right, layers >= 1 in another layer's placement, without a word)."""
    from tests.distributed.test_semantic import make_plan

    plan = make_plan(E, 1, vocab=50, layers=2, mode="dp")
    model = Model()
    swap_moe_blocks(model, ml.ParallelGroups.single(), layer_cls=ml.SemanticMoE, plan=plan)
    assert [model.layers[i].mlp.layer_idx for i in (0, 2)] == [0, 1]
    with pytest.raises(TypeError, match="sets layer_idx itself with a plan="):
        swap_moe_blocks(Model(), ml.ParallelGroups.single(), layer_cls=ml.SemanticMoE, plan=plan, layer_idx=1)


def test_token_ids_reach_the_layers_and_the_recorder():
    """HF's decoder layers call their MLP with the hidden states only: SemanticMoE and TraceRecorder
    had no token ids (a journey wrote a pre-hook and a wrapper by hand). The ids are the ones the
    model embeds, per call and per thread (a review: a model pre-hook's ids went stale in calls that
    bypass it, or came from another thread), and the layers' keys stay as they were."""
    import copy
    import io
    import threading

    from moelayers.trace import TraceRecorder

    class WithIds(Model):  # an HF-like model taking input_ids
        def __init__(self, old=False):
            super().__init__("mixtral" if old else "qwen3_moe", old=old)
            self.emb = nn.Embedding(30, H, dtype=torch.float64)

        def get_input_embeddings(self):
            return self.emb

        def forward(self, input_ids=None, inputs_embeds=None):
            return super().forward(self.emb(input_ids) if inputs_embeds is None else inputs_embeds)

    for old in (False, True):
        model = WithIds(old).eval()
        ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
        with torch.no_grad():
            expected = model(input_ids=ids)
        keys = sorted(model.state_dict())
        swap_moe_blocks(model, ml.ParallelGroups.single(), token_ids=True)
        layer = model.get_submodule("layers.0.mlp")
        moe = layer.layer if old else layer
        seen = []
        watch = moe.register_forward_hook(lambda m, a, y: seen.append(None if m.last_token_ids is None else
                                                                      m.last_token_ids.tolist()))
        with torch.no_grad(), TraceRecorder(model, vocab_size=30) as rec:
            torch.testing.assert_close(model(input_ids=ids), expected, rtol=0, atol=1e-12)
            model(ids[:, :2])  # positional too
        assert rec.result.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 4, 5]
        assert np.diff(rec.result.seq_offsets).tolist() == [3, 3, 2, 2]
        with torch.no_grad():
            embedded = model.emb(ids)
            model(inputs_embeds=embedded)  # embedded elsewhere: no ids (not the last call's)
            model.layers[0](embedded)  # a part of the model called after it: no ids either
        assert seen[-2:] == [None, None]
        other = torch.tensor([[7, 8, 9], [10, 11, 12]])
        thread = threading.Thread(target=lambda: model(input_ids=other))  # another thread's call
        thread.start()
        with torch.no_grad():
            model(input_ids=ids)
        thread.join()
        assert [1, 2, 3, 4, 5, 6] in seen and [7, 8, 9, 10, 11, 12] in seen
        assert isinstance(moe, ml.VanillaMoE) and isinstance(layer, hf.TupleOutput) is old
        if not old:  # (4.x's TupleOutput adds a level of its own)
            assert "layers.0.mlp.router.weight" in model.state_dict() and not any(
                ".mlp.layer." in k for k in model.state_dict())
            assert {k for k in model.state_dict() if ".mlp." not in k} == {k for k in keys if ".mlp." not in k}
        assert sorted(hf_weights(layer)) == sorted(Block4("mixtral").state_dict() if old else
                                                   ["gate.weight", "experts.gate_up_proj", "experts.down_proj"])
        watch.remove()
        torch.save(moe, io.BytesIO())  # its hook pickles, without the ids
        copy.deepcopy(model)


def test_pass_token_ids_hands_a_model_of_ones_own_its_ids():
    """A model of one's own whose MoE blocks see hidden states only had no way to give the layers
    their token ids (TraceRecorder: "no MoE layer set last_token_ids"; a new-user journey)."""
    from moelayers.integrations.hf import pass_token_ids
    from moelayers.trace import TraceRecorder

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.float64)

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.moe = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=i)

        def forward(self, h):
            return h + self.moe(h)

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(30, H, dtype=torch.float64)
            self.blocks = nn.ModuleList(Block(i) for i in range(2))

        def forward(self, ids):
            h = self.tok(ids)
            for b in self.blocks:
                h = b(h)
            return h

    class Mine(nn.Module):
        def __init__(self, heads=1):
            super().__init__()
            self.body = Body()
            self.heads = nn.ModuleList(nn.Embedding(4, H) for _ in range(heads - 1))  # another embedding

        def forward(self, ids):
            return self.body(ids)

    model = Mine().eval()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        expected = model(ids)
        with pytest.raises(ValueError, match=r"no token ids: .*pass_token_ids\(model\)"), \
                TraceRecorder(model, vocab_size=30):
            model(ids)
    assert pass_token_ids(model) == ["body.blocks.0.moe", "body.blocks.1.moe"]
    with torch.no_grad(), TraceRecorder(model, vocab_size=30) as rec:
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=0)
        model(ids[:1])
    assert rec.result.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 1, 2, 3]
    moe = model.body.blocks[0].moe
    with torch.no_grad():
        h = torch.randn(2, 3, H, dtype=torch.float64)
        model(ids)
        moe(h)  # called after the model call: not that call's ids
        assert moe.last_token_ids is None
        model(ids[:1])
        model.body.blocks[0](h[:1])  # nor a block called on its own
        assert moe.last_token_ids is None
        moe(h, token_ids=ids + 1)  # its own ids win
        assert moe.last_token_ids.tolist() == (ids + 1).flatten().tolist()
    two = Mine(heads=2)
    with pytest.raises(ValueError, match=r"has 2 nn.Embedding modules \(body.tok, heads.0\): pass the one"):
        pass_token_ids(two)
    assert len(pass_token_ids(two, embedding=two.body.tok)) == 2
    with pytest.raises(ValueError, match="is not a submodule of Mine"):
        pass_token_ids(Mine(), embedding=nn.Embedding(3, H))
    with pytest.raises(ValueError, match="holds no moelayers layer"):
        pass_token_ids(nn.Sequential(nn.Embedding(3, H)))
    model = Mine()
    with pytest.raises(ValueError, match="it is the model itself"):  # (its hooks forgot the ids: none passed)
        pass_token_ids(model, embedding=model)

    class Unset(Mine):  # transformers' PreTrainedModel.get_input_embeddings without a base model
        def get_input_embeddings(self):
            raise NotImplementedError

    model = Unset().eval()
    assert pass_token_ids(model) == ["body.blocks.0.moe", "body.blocks.1.moe"]  # its only nn.Embedding
    with torch.no_grad():
        model(ids)
    assert model.body.blocks[1].moe.last_token_ids.tolist() == ids.flatten().tolist()


@pytest.mark.parametrize("flatten", [False, True])
def test_pass_token_ids_follows_the_models_layout(flatten):
    """A model that embeds [B, S] ids and computes in [S, B, H] (megatron's layout), or flattens
    before its MoE layer: matched by shape alone, the ids reached no layer, or, where B == S, the
    layers in the wrong order without a word (a review)."""
    from moelayers.integrations.hf import pass_token_ids
    from moelayers.trace import TraceRecorder

    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=FF, num_experts=E, top_k=K, params_dtype=torch.float64)

    class SB(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(30, H, dtype=torch.float64)
            self.moe = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=0)

        def forward(self, ids):
            h = self.tok(ids).transpose(0, 1)  # [S, B, H]
            return self.moe(h.reshape(-1, H)).view_as(h) if flatten else self.moe(h)

    ids = torch.tensor([[1, 2], [3, 4]])  # B == S: the shapes cannot tell the layouts apart
    model = SB().eval()
    pass_token_ids(model, layout="sb")
    with torch.no_grad(), TraceRecorder(model, vocab_size=30) as rec:
        rec.tag(["s0", "s1", "s0", "s1"])  # rows of [S, B]: position-major
        model(ids)
        rec.tag(["t0", "t1", "t2", "t0", "t1", "t2"])
        model(torch.tensor([[5, 6], [7, 8], [9, 10]]))  # B = 3, S = 2
    assert model.moe.last_token_ids.tolist() == [5, 7, 9, 6, 8, 10]  # [S, B] flattened
    assert rec.result.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # each sequence in order
    if not flatten:  # (flattened, the ids fit either layout: only the one given is right)
        as_embedded = SB().eval()
        pass_token_ids(as_embedded)  # layout="bs": [B, S] ids do not fit [S, B, H] where B != S
        with torch.no_grad():
            as_embedded(torch.tensor([[5, 6], [7, 8], [9, 10]]))
        assert as_embedded.moe.last_token_ids is None
    with pytest.raises(ValueError, match="layout must be 'bs'"):
        pass_token_ids(SB(), layout="bsh")


def test_token_ids_of_a_base_model_called_on_its_own_do_not_go_stale():
    """HF models wrap a base model (``model.model``) holding the embedding: a call of the base model
    alone kept the ids of the call before it, so an ``inputs_embeds`` call after ran with them."""
    model, mlps, seen = _swapped_with_ids(_Outer)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        embedded = model.model.emb(torch.tensor([[7, 8, 9]]))
        for call in (model, model.model, model.forward):
            call(input_ids=ids)
            call(inputs_embeds=embedded)
    assert seen[::2] == [[1, 2, 3], None] * 3  # (each layer once per call: the first of each pair)


class _Base(Model):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, H, dtype=torch.float64)

    def forward(self, input_ids=None, inputs_embeds=None):
        return super().forward(self.emb(input_ids) if inputs_embeds is None else inputs_embeds)


class _Outer(nn.Module):
    """An HF-like model: a base model holding the embedding (``model.model``)."""

    def __init__(self):
        super().__init__()
        self.model = _Base()
        self.config = self.model.config

    def get_input_embeddings(self):
        return self.model.emb

    def forward(self, input_ids=None, inputs_embeds=None):
        return self.model(input_ids=input_ids, inputs_embeds=inputs_embeds)


class _Multimodal(_Outer):
    """Qwen3-VL's way: the outer model embeds the ids, then calls its text model with the embeddings."""

    def forward(self, input_ids=None, inputs_embeds=None):
        return self.model(inputs_embeds=self.model.emb(input_ids))


def _swapped_with_ids(cls):
    model = cls().eval()
    swap_moe_blocks(model, ml.ParallelGroups.single(), token_ids=True)
    mlps = [model.model.layers[i].mlp for i in (0, 2)]
    seen = []
    for m in mlps:
        m.register_forward_hook(lambda m, a, y: seen.append(None if m.last_token_ids is None else
                                                            m.last_token_ids.tolist()))
    return model, mlps, seen


def test_token_ids_across_an_interrupted_a_nested_and_a_multimodal_call():
    """A Ctrl-C skips torch's always_call hooks: the call never left, and its ids stayed for good; a
    call of the model from inside itself gave the outer call's later layers the inner call's ids; a
    model that embeds and then calls its text model with inputs_embeds keeps its ids (a review)."""
    ids, other = torch.tensor([[1, 2, 3]]), torch.tensor([[7, 8, 9]])
    model, mlps, seen = _swapped_with_ids(_Outer)
    with torch.no_grad():
        embedded = model.model.emb(other)

        def ctrl_c(module, args):
            raise KeyboardInterrupt

        hook = mlps[0].register_forward_pre_hook(ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids)
        hook.remove()
        model(inputs_embeds=embedded)
        assert seen == [None, None]  # not the interrupted call's ids
        seen.clear()
        model(input_ids=ids)
        assert seen == [[1, 2, 3]] * 2

    model, mlps, seen = _swapped_with_ids(_Outer)
    nested = []

    def call_inside(module, args, y):
        if not nested:
            nested.append(True)
            model(input_ids=other)

    mlps[0].register_forward_hook(call_inside)
    with torch.no_grad():
        model(input_ids=ids)
    assert seen == [[1, 2, 3], [7, 8, 9], [7, 8, 9], [1, 2, 3]]  # outer 1st, inner 1st and 2nd, outer 2nd

    model, mlps, seen = _swapped_with_ids(_Multimodal)
    with torch.no_grad():
        model(input_ids=ids)
        assert seen == [[1, 2, 3]] * 2
        hook = mlps[0].register_forward_pre_hook(ctrl_c)  # a multimodal call cut off: the next ones have ids
        for _ in range(3):
            with pytest.raises(KeyboardInterrupt):
                model(input_ids=ids)
        hook.remove()
        seen.clear()
        model(input_ids=other)
    assert seen == [[7, 8, 9]] * 2
    source = next(h.__self__ for h in model.model.emb._forward_pre_hooks.values())  # the CallInputs
    assert source.ids is None and source._calls() == []  # nothing left of the calls cut off


class _Masked(nn.Module):
    """An HF-like model taking ``attention_mask`` (by keyword or second position; 0 = padding) and
    ``cache_position`` (a decode step after cached tokens: the mask then covers those too)."""

    def __init__(self, old=False):
        super().__init__()
        self.model = Model("mixtral" if old else "qwen3_moe", old=old)
        self.emb = nn.Embedding(30, H, dtype=torch.float64)
        self.config = self.model.config

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids=None, attention_mask=None, cache_position=None):
        return self.model(self.emb(input_ids))


def test_skip_padding_computes_only_the_positions_the_mask_keeps():
    """Padded positions were routed and exchanged like tokens (their experts' loads, the recorder and
    replans saw them): with skip_padding=True the layers get the mask's non-zero rows only, the
    outputs there are HF's, zeros come out of the layers at the padded ones."""
    from moelayers.trace import TraceRecorder

    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 1], [0, 0, 0, 0, 2]])
    mask = (ids != 0).long()  # left padding
    for old in (False, True):
        plain, skipping = _Masked(old).eval(), _Masked(old).eval()
        skipping.load_state_dict(plain.state_dict())
        swap_moe_blocks(plain, ml.ParallelGroups.single(), token_ids=True)
        names = swap_moe_blocks(skipping, ml.ParallelGroups.single(), token_ids=True, skip_padding=True)
        moes = [getattr(m, "layer", m) for m in map(skipping.get_submodule, names)]
        seen = []
        moes[0].register_forward_hook(lambda m, a, y: seen.append((m.last_topk_ids.shape[0], m.last_token_ids.tolist(),
                                                                   None if m.last_input_rows is None else
                                                                   m.last_input_rows.tolist())))
        with torch.no_grad():
            expected = plain(ids, attention_mask=mask)
            for call in (lambda: skipping(ids, attention_mask=mask), lambda: skipping(ids, mask)):  # keyword, position
                got = call()
                keep = mask.bool()
                torch.testing.assert_close(got[keep], expected[keep], rtol=0, atol=1e-12)
                assert not torch.equal(got[~keep], expected[~keep])  # (zeros out of the layers there)
            assert seen[-1] == (9, [3, 4, 5, 6, 7, 8, 9, 1, 2], [2, 3, 4, 5, 6, 7, 8, 9, 14])
            # a decode step: the mask covers the cache too (its last S columns are this forward's)
            skipping(ids[:, -1:], attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                          cache_position=torch.tensor([5]))
            assert seen[-1] == (3, [5, 1, 2], None)  # nothing padded: every row, no rows named
            skipping(ids)  # no mask: every row
            assert seen[-1][0] == 15 and seen[-1][2] is None
            skipping(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.zeros(2, 3))  # all padding
            assert seen[-1] == (0, [], [])
            reused = mask.clone()  # a mask buffer the caller changes between calls: each call's own rows
            skipping(ids, attention_mask=reused)
            reused[1, :4] = 0
            skipping(ids, attention_mask=reused)
            assert seen[-1] == (5, [3, 4, 5, 1, 2], [2, 3, 4, 9, 14])
            assert moes[1].last_input_rows.tolist() == [2, 3, 4, 9, 14]  # (the call's later layers: the same rows)
            # the recorder keeps the sequences (rows) of the tokens the layers computed
            with TraceRecorder(skipping, vocab_size=30) as rec:
                skipping(ids, attention_mask=mask)
                skipping(ids[:, -1:], attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                          cache_position=torch.tensor([5]))
            assert rec.result.token_ids.tolist() == [3, 4, 5, 5, 6, 7, 8, 9, 1, 1, 2, 2]
            assert np.diff(rec.result.seq_offsets).tolist() == [4, 6, 2]


def _skipping_pair(train: bool = False):
    """A left-padded batch, a ``_Masked`` model swapped with ``skip_padding=True`` and its unswapped twin."""
    ids = torch.tensor([[0, 2, 3], [4, 5, 6]])
    plain, model = _Masked().train(train), _Masked().train(train)
    model.load_state_dict(plain.state_dict())
    names = swap_moe_blocks(model, ml.ParallelGroups.single(), skip_padding=True)
    return ids, (ids != 0).long(), plain, model, names


def test_skip_padding_forced_routing_gradients_and_checkpointing():
    """Forced routing laid out like the model's input keeps the kept rows; gradients flow through
    the kept rows; a model training with gradient checkpointing is refused (the recomputation would
    not know the mask)."""
    ids, mask, plain, model, names = _skipping_pair(train=True)
    layer = model.get_submodule(names[0])
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [3, 2], [5, 4]])
    layer.force_routing(forced.view(2, 3, 2))
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert layer.last_topk_ids.tolist() == forced[1:].tolist()
    for m in (model, plain):  # a loss over the positions that are not padding: the same gradients
        (m(ids, attention_mask=mask) * mask[..., None]).sum().backward()
    torch.testing.assert_close(layer.experts.w13.grad, plain.model.layers[0].mlp.experts.gate_up_proj.grad,
                               rtol=0, atol=1e-12)
    model.model.layers[0].gradient_checkpointing = True  # as HF's gradient_checkpointing_enable() marks its layers
    for m in (ids, torch.ones_like(ids)):  # refused with padding or without: every rank alike
        with pytest.raises(ValueError, match=r"skip_padding=True\) cannot leave padding out.*gradient checkpointing"):
            model(ids, attention_mask=m)
    with torch.no_grad():
        model(ids, attention_mask=mask)  # (nothing recomputed: fine)
    model.eval()
    model(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="skip_padding=True reads the attention_mask"):
        swap_moe_blocks(Model(), ml.ParallelGroups.single(), skip_padding=True)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_real_transformers_skip_padding(model_type):
    """Left-padded batches with skip_padding=True: the logits at the positions that are not padding
    and greedy generate's tokens are HF's; the layers saw none of the padding; the recorded trace is
    the one recorded without skip_padding."""
    import transformers

    from moelayers.trace import TraceRecorder

    hf_model = _tiny(model_type)
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = mask[2, :5] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        expected = hf_model(input_ids=ids, attention_mask=mask).logits
        want = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    traces = []
    for skip in (False, True):
        model = _tiny(model_type)
        names = swap_moe_blocks(model, ml.ParallelGroups.single(), token_ids=True, skip_padding=skip)
        layer = model.get_submodule(names[0])
        layer = getattr(layer, "layer", layer)
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-5)
            assert layer.last_topk_ids.shape[0] == (int(mask.sum()) if skip else ids.numel())
            with TraceRecorder(model, pad_token_id=0) as rec:
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                     pad_token_id=0)
        assert torch.equal(out, want)
        assert rec.padding_dropped == int((mask == 0).sum())  # (left out by the layers, or by the recorder)
        traces.append(rec.result)
        if int(transformers.__version__.split(".")[0]) >= 5:  # chunked prefill: a row may be all padding in a chunk
            with torch.no_grad(), TraceRecorder(model, pad_token_id=0) as chunked:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               prefill_chunk_size=2)
            assert np.array_equal(chunked.result.seq_offsets, traces[0].seq_offsets)
            assert np.array_equal(chunked.result.token_ids, traces[0].token_ids)
        if skip:  # training with HF's gradient checkpointing, reentrant (4.x's default) or not: refused
            model.train()
            for reentrant in (True, False):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
                with pytest.raises(ValueError, match="gradient checkpointing"):
                    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    plain, skipped = traces
    assert np.array_equal(plain.token_ids, skipped.token_ids) and np.array_equal(plain.topk_ids, skipped.topk_ids)
    assert np.array_equal(plain.seq_offsets, skipped.seq_offsets) and np.diff(plain.seq_offsets).tolist() == [7, 9, 4]


def test_skip_padding_after_a_call_cut_off_by_ctrl_c():
    """A Ctrl-C skips torch's always_call forward hooks: the rows the pre-hook kept for the cut-off call
    stayed, and the next call's layer got them back (an IndexError in the next decode step, a review)."""
    ids, mask, plain, model, names = _skipping_pair()

    def ctrl_c(module, args, output):
        raise KeyboardInterrupt

    hook = model.get_submodule(names[1]).register_forward_hook(ctrl_c)
    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            model(ids, attention_mask=mask)
        hook.remove()
        layer = model.get_submodule(names[1])
        x = _x(2, 3)
        torch.testing.assert_close(layer(x), plain.model.layers[2].mlp(x), rtol=0, atol=1e-12)  # alone: no rows
        for m in (torch.ones_like(ids), mask):
            keep = m.bool()
            torch.testing.assert_close(model(ids, attention_mask=m)[keep], plain(ids, attention_mask=m)[keep],
                                       rtol=0, atol=1e-12)
    source = next(h.__self__ for h in layer._forward_pre_hooks.values())
    assert source._dropped() == {}


def test_skip_padding_refusal_follows_the_checkpointed_decoder_layer_and_user_hooks_keep_working():
    """(a second review) A user's pre-hook returning a new tensor made the output unplaceable (matched by
    the tensor sent); a nested no_grad call of the model cleared the refusal for the rest of the outer
    call, which then trained with wrong gradients under a reentrant checkpoint; the refusal followed the
    model's train mode where HF checkpoints by its decoder layer's; a refused call left the flag set."""
    ids, mask, plain, model, names = _skipping_pair()
    layer = model.get_submodule(names[0])
    hook = layer.register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))  # a new tensor, after ours
    with torch.no_grad():
        keep = mask.bool()
        torch.testing.assert_close(model(ids, attention_mask=mask)[keep], plain(ids, attention_mask=mask)[keep],
                                   rtol=0, atol=1e-12)
    hook.remove()
    decoder = model.model.layers[0]
    decoder.gradient_checkpointing = True
    refused = r"skip_padding=True\) cannot leave padding out"
    model.eval()
    decoder.train()  # HF checkpoints by the decoder layer's own mode
    with pytest.raises(ValueError, match=refused):
        model(ids, attention_mask=mask)
    with torch.no_grad():
        model.model.layers[2].mlp(_x(2, 3))  # after a refused call: a block alone in eval runs
    model.train()
    decoder.eval()
    model(ids, attention_mask=mask).sum().backward()  # nothing checkpointed: not refused
    decoder.train()
    nested = []

    def reference_pass(module, args):  # a no_grad call of the model from inside the outer one
        if not nested:
            nested.append(True)
            with torch.no_grad():
                model(ids, attention_mask=mask)

    handle = model.model.layers[2].register_forward_pre_hook(reference_pass)
    decoder.gradient_checkpointing = False
    model.model.layers[2].gradient_checkpointing = True
    with pytest.raises(ValueError, match=refused):  # the outer call's second block is still refused
        model(ids, attention_mask=mask)
    assert nested == [True]
    handle.remove()
