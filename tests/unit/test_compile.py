"""Models holding our layers under ``torch.compile``: the layers run eagerly (one graph break each),
the model around them compiles, and the outputs are eager's."""

import pytest
import torch

import moelayers as ml

H = 16


class Block(torch.nn.Module):
    """A linear layer before and after the MoE layer: what a model compiles around it."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.inp, self.moe, self.out = torch.nn.Linear(H, H), moe, torch.nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.relu(self.inp(x))))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cls", ["VanillaMoE", "VariabilityAwareMoE"])
def test_compiled_model_matches_eager_under_no_grad_and_with_grad(cls):
    """Under inductor and torch.no_grad() the layer crashed ("index 32577 is out of bounds"): inductor
    lost the writes into the all-to-all buffer (uint8 storage written through views of other
    dtypes), so uninitialised bytes went on the wire, which could as well have been a wrong output.
    With gradients it recompiled for every new load pattern, and a VariabilityAwareMoE recording its
    loads for every step."""
    torch.manual_seed(0)
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.5)
    kwargs = dict(window=2) if cls == "VariabilityAwareMoE" else {}
    model = Block(getattr(ml, cls)(cfg, ml.ParallelGroups.single(), seed=1, **kwargs))
    torch._dynamo.reset()
    compiled = torch.compile(model)  # inductor
    for t in (5, 9, 13):
        x = torch.randn(t, H)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
    x = torch.randn(7, H, requires_grad=True)
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    explained = torch._dynamo.explain(model)(torch.randn(6, H))
    assert explained.graph_break_count == 1, explained.break_reasons  # the layer's call, nothing inside it
    torch._dynamo.reset()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_compiled_tiny_decoder_matches_eager(attention):
    """The tiny decoder (its attention compiled, its MoE blocks eager), attention data-parallel and
    tensor-parallel (``SemanticMoE.forward_tp`` in every block), one rank."""
    from moelayers.models import TinyConfig, TinyDecoder

    moe_cfg = ml.MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, init_std=0.2)
    groups = ml.ParallelGroups.single()
    layer = (lambda i: ml.SemanticMoE(moe_cfg, groups, mode="tp", seed=i)) if attention == "tp" \
        else (lambda i: ml.VanillaMoE(moe_cfg, groups, seed=i))
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, init_std=0.2), layer,
                        attention=attention, groups=groups)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")  # (inductor: the test above)
    for length in (6, 11):
        ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids), model(ids))
    torch._dynamo.reset()


def test_a_failed_fake_tensor_trace_leaves_later_forwards_working():
    """``torch.export`` (or any FakeTensorMode trace) of a model with our layer fails (data-dependent
    shapes); it had also left fake tensors in the layers' caches (the flag constants, the placement's
    device tables), so every later forward that recorded autograd failed, in fresh layers too
    (torch.func's transforms left their wrappers there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moelayers.dispatch import alltoall
    from moelayers.dispatch import base as dispatch_base
    from moelayers.layers import base

    for cache in (base._CONSTANTS, dispatch_base._ARANGE, dispatch_base._ONES, alltoall._FIXED_ROWS):
        cache.clear()  # as in a process where the trace comes first
    cfg = ml.MoEConfig(hidden_size=H, ffn_hidden_size=8, num_experts=4, top_k=2, init_std=0.5)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)
    x = torch.randn(5, H)
    with pytest.raises(Exception):
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            layer(mode.from_tensor(x))
    for transform in (torch.func.functionalize, lambda f: torch.func.grad(lambda t: f(t).sum())):
        for cache in (base._CONSTANTS, dispatch_base._ARANGE, dispatch_base._ONES, layer.placement._device_cache):
            cache.clear()
        with pytest.raises(Exception):
            transform(layer)(x.clone().requires_grad_())
        kept = [*base._CONSTANTS.values(), *dispatch_base._ARANGE.values(), *dispatch_base._ONES.values(),
                *layer.placement._device_cache.values()]
        for t in (t for v in kept for t in (v if isinstance(v, tuple) else (v,))):
            assert type(t) is torch.Tensor and not torch._is_functional_tensor(t)
            assert not torch._C._functorch.is_functorch_wrapped_tensor(t)
    with torch.no_grad():
        ref = ml.reference.moe_forward(x, *layer.export_full_weights(), cfg)
    for model in (layer, ml.VanillaMoE(cfg, ml.ParallelGroups.single(), seed=1)):
        y = model(x)
        torch.testing.assert_close(y, ref)
        y.sum().backward()
