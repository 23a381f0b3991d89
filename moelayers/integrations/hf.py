"""Hugging Face transformers integration: swap a model's sparse MoE blocks for moelayers layers.

Three lines::

    import moelayers as ml
    from moelayers.integrations.hf import swap_moe_blocks

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)   # (torch_dtype= in older transformers)
    names = swap_moe_blocks(model, ml.ParallelGroups.from_world(ep=4))   # or ParallelGroups.single()

Supported (``config.model_type``), each a softmax router and SwiGLU experts without biases:

- ``mixtral``: softmax over all experts, top-k, renormalised (``norm_topk_prob=True``);
- ``qwen3_moe`` and ``olmoe``: softmax, top-k, renormalised iff the HF config's
  ``norm_topk_prob``, which defaults to **False** in both (``MoEConfig``'s default is True: a
  hand-made config that keeps it gives other weights without any error);
- ``qwen3_vl_moe`` (its text model, ``qwen3_vl_moe_text``): Qwen3-MoE's block that always
  renormalises (its router ignores ``norm_topk_prob``); transformers >= 5 only.

Both expert layouts are read (:func:`weights_from_hf`): transformers >= 5's fused experts
(``experts.gate_up_proj [E, 2F, H]``, gate rows first, and ``experts.down_proj [E, H, F]``, with
the ``is_transposed`` / ``is_concatenated`` / ``has_bias`` ... flags its experts carry) and
transformers 4.x's ``nn.ModuleList`` of per-expert MLPs (``gate_proj`` / ``up_proj`` /
``down_proj``; Mixtral's ``w1`` / ``w3`` / ``w2``) with an ``nn.Linear`` router ``gate``.

Refused, with a ``ValueError`` naming the model type and the reason (a conversion would give other
outputs without any error): every other model type, in particular

- ``qwen2_moe`` (and other blocks with shared experts): its ``shared_expert`` and sigmoid
  ``shared_expert_gate`` would need a wrapper that keeps them beside the layer;
- ``deepseek_v2`` / ``deepseek_v3``: shared experts, plus routing moelayers does not implement
  (V3: sigmoid scores shifted by ``e_score_correction_bias`` to choose the experts, group-limited
  top-k over ``n_group`` groups, ``routed_scaling_factor``; V2: group-limited greedy top-k);
- Mixtral's ``router_jitter_noise > 0`` (HF multiplies the input by noise in training; the layers
  add none), expert or router biases, experts that are not SwiGLU (``hidden_act`` other than
  ``'silu'``), the fused layouts moelayers cannot read (interleaved gate/up, a custom gate, no gate,
  a post-expert norm, experts sharded by HF's own expert parallelism).

Notes on the HF side:

- Set ``model.config.output_router_logits = False`` (a config with it on is refused; do not pass
  ``output_router_logits=True`` either): the layers expose no router logits, and HF's
  load-balancing loss then raises (transformers 5) or is 0 without a word (4.x).
- With expert parallelism (``ep > 1``) call ``model.generate(..., synced_gpus=True)``: every rank
  must run the same number of forwards; a rank whose sequences end early (EOS) would leave the
  others waiting in the expert exchange until the process group's timeout.
- HF routes float64 models in float32 (its routers' ``softmax(..., dtype=torch.float)``), the
  layers in float64: differences of about 1e-7 in float64 are HF's rounding (float32 models were
  observed bit-identical with transformers 5's eager and grouped_mm experts on one CPU thread, within
  1e-6 otherwise).
- :class:`~moelayers.SemanticMoE` plans and :class:`~moelayers.trace.TraceRecorder` need ``token_ids``,
  which HF's decoder layer does not pass to its mlp: ``swap_moe_blocks(..., token_ids=True)``
  passes them (the ids the model embeds, by hooks: :class:`CallInputs`); :func:`pass_token_ids`
  does the same for a model of one's own that holds moelayers layers already.
- Padded positions are routed and exchanged as HF computes them, unless ``swap_moe_blocks(...,
  skip_padding=True)``: the layers then compute only the positions the model call's
  ``attention_mask`` marks non-zero (fewer rows to exchange, and padding out of the layers' loads
  and traces), with zeros at the padded ones, whose outputs HF discards (not with gradient
  checkpointing in training).
- ``save_pretrained`` of a swapped model does not round-trip: the layers' keys
  (``mlp.router.weight``, ``mlp.experts.w13`` ...) are not HF's, and ``from_pretrained``
  re-initialises every MoE weight (with only a load report saying so). Write HF's names with
  :func:`hf_weights`.

This module never imports transformers: it reads blocks and configs by their attributes, so it
also works on HF-like modules of other libraries that follow the same layout.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

import torch
from torch import nn

from moelayers._autograd import in_backward
from moelayers.config import MoEConfig
from moelayers.groups import ParallelGroups
from moelayers.layers import VanillaMoE

__all__ = ["SUPPORTED_MODEL_TYPES", "moe_config_from_hf", "weights_from_hf", "swap_moe_blocks", "hf_weights",
           "pass_token_ids", "TupleOutput", "CallInputs"]

#: ``config.model_type`` -> (config field of ``E``, config field of ``F``, how ``norm_topk_prob`` is set:
#: ``True`` always, or ``None`` for the config's ``norm_topk_prob``, False where it is missing as in HF)
_MODEL_TYPES: dict[str, tuple[str, str, bool | None]] = {
    "mixtral": ("num_local_experts", "intermediate_size", True),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", None),
    "olmoe": ("num_experts", "intermediate_size", None),
    "qwen3_vl_moe_text": ("num_experts", "moe_intermediate_size", True),
}
#: the model types :func:`moe_config_from_hf` converts (``qwen3_vl_moe`` reads its ``text_config``)
SUPPORTED_MODEL_TYPES = (*_MODEL_TYPES, "qwen3_vl_moe")

#: model types refused with the reason (what a conversion would need)
_REFUSED: dict[str, str] = {
    "qwen2_moe": "its block adds a shared expert scaled by a sigmoid shared_expert_gate, which a moelayers layer "
                 "does not compute; it would need a wrapper that keeps block.shared_expert and "
                 "block.shared_expert_gate and adds their output to the layer's",
    "deepseek_v3": "its router chooses experts by sigmoid scores plus e_score_correction_bias, limits the top-k "
                   "to topk_group of n_group expert groups and scales the weights by routed_scaling_factor, and "
                   "its block adds shared experts: moelayers has no score-correction bias or group-limited "
                   "top-k (routed_scaling_factor could be folded into w2 and the shared experts kept in a "
                   "wrapper, but a bias or n_group > 1 cannot be represented)",
    "deepseek_v2": "its block adds shared experts and its router may use group-limited greedy top-k "
                   "(topk_method='group_limited_greedy') and routed_scaling_factor, which moelayers does not "
                   "implement",
}
_SILU = ("silu", "swish")  # the same function in HF's ACT2FN
_SILU_MODULES = ("SiLU", "SiLUActivation")  # what ACT2FN gives for them (torch's, transformers')


def _act_of(experts: Any) -> Any:
    """The experts' activation module (``act_fn`` of the fused experts or of the first MLP), or ``None``."""
    act = getattr(experts, "act_fn", None)
    if act is None and isinstance(experts, nn.ModuleList) and len(experts):
        act = getattr(experts[0], "act_fn", None)
    return act


# ---------------------------------------------------------------------------------------- configs
def _text_config(hf_config: Any) -> Any:
    """The text config of a composite (vision-language) HF config, else ``hf_config``."""
    if getattr(hf_config, "model_type", None) == "qwen3_vl_moe":
        sub = getattr(hf_config, "text_config", None)
        if sub is None:
            raise ValueError("hf_config.model_type is 'qwen3_vl_moe' but it has no text_config")
        return sub
    return hf_config


def _required(hf_config: Any, name: str, model_type: str) -> Any:
    value = getattr(hf_config, name, None)
    if value is None:
        raise ValueError(f"the {model_type!r} config has no {name}: pass the model's own config (model.config)")
    return value


def _refuse(model_type: str, reason: str) -> ValueError:
    return ValueError(f"cannot convert a {model_type!r} MoE block to moelayers: {reason}")


def _block_dtype(block: nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in block.parameters()}
    if len(dtypes) != 1:
        raise ValueError(f"the block's weights have dtypes {sorted(str(d) for d in dtypes)}: a moelayers layer holds "
                         "one params_dtype; pass dtype= (and cast the weights to it)")
    return dtypes.pop()


def moe_config_from_hf(block: nn.Module, hf_config: Any, *, dtype: torch.dtype | None = None,
                       **overrides: Any) -> MoEConfig:
    """The :class:`~moelayers.MoEConfig` that computes what HF's sparse MoE ``block`` computes.

    Args:
        block: an HF sparse MoE block (``model.model.layers[i].mlp``): a router ``gate`` and
            ``experts``, in either layout of :func:`weights_from_hf`.
        hf_config: the model's config (``model.config``; for ``qwen3_vl_moe`` the composite config
            or its ``text_config``). Read: ``model_type``, ``hidden_size``, ``num_experts_per_tok``,
            ``hidden_act``, ``norm_topk_prob`` (Qwen3-MoE, OLMoE), ``router_jitter_noise``
            (Mixtral), and the number of experts and expert width where the config has them (checked
            against the weights' shapes).
        dtype: ``params_dtype`` (default: the block's weights' dtype, which must be one).
        **overrides: other :class:`~moelayers.MoEConfig` fields (``init_std``, ``router_dtype``,
            ...). The fields read from the model (sizes, ``top_k``, ``score_fn``,
            ``norm_topk_prob``, ``activation``) cannot be overridden.

    Returns:
        the config; ``norm_topk_prob`` is HF's (False unless the HF config sets it, Mixtral and
        Qwen3-VL-MoE: True).

    Raises:
        ValueError: a model type or setting moelayers cannot represent (see the module docstring;
            the message names the model type and the reason), a config that disagrees with the
            block's weights or its router's own settings, an override of a field read from the
            model, or a block whose weights have several dtypes and no ``dtype``.
    """
    config = _text_config(hf_config)
    model_type = getattr(config, "model_type", None)
    if model_type in _REFUSED:
        raise _refuse(model_type, _REFUSED[model_type])
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"cannot convert a {model_type!r} MoE block to moelayers: the supported model types are "
                         f"{list(SUPPORTED_MODEL_TYPES)} (a block of another type may route, scale or add shared "
                         "experts in ways these layers would not reproduce, so it is refused rather than guessed)")
    read = {"hidden_size", "ffn_hidden_size", "num_experts", "top_k", "score_fn", "norm_topk_prob", "activation"}
    fixed = sorted(read & set(overrides))
    if fixed:
        raise ValueError(f"moe_config_from_hf reads {fixed} from the {model_type!r} model; overriding them would "
                         "compute another MoE than the HF block")
    if "params_dtype" in overrides:
        raise ValueError("pass the weights' dtype as dtype=, not params_dtype=")
    e_field, f_field, norm_rule = _MODEL_TYPES[model_type]

    act = getattr(config, "hidden_act", "silu")
    if act not in _SILU:
        raise _refuse(model_type, f"hidden_act={act!r}: moelayers experts are SwiGLU (silu(x W1^T) * x W3^T); "
                                  "another activation would compute other experts")
    act_fn = _act_of(getattr(block, "experts", None))
    if act_fn is not None and type(act_fn).__name__ not in _SILU_MODULES:  # (the config edited after the build)
        raise _refuse(model_type, f"the block's experts compute {type(act_fn).__name__}, not SiLU, whatever "
                                  f"hf_config.hidden_act={act!r} says: moelayers experts are SwiGLU")
    if getattr(hf_config, "output_router_logits", False) or getattr(config, "output_router_logits", False):
        raise ValueError("hf_config.output_router_logits is True: the layers return no router logits, so HF's "
                         "load-balancing loss would fail (transformers 5) or be 0 without a word (4.x); set "
                         "model.config.output_router_logits = False (an aux loss of one's own can take "
                         "x @ layer.router.weight.T)")
    if model_type == "mixtral":
        jitter = max(float(getattr(config, "router_jitter_noise", 0.0) or 0.0),
                     float(getattr(block, "jitter_noise", 0.0) or 0.0))
        if jitter > 0:
            raise _refuse(model_type, f"router_jitter_noise={jitter}: HF multiplies the block's input by uniform "
                                      "noise in training mode, which the layers do not add; set "
                                      "config.router_jitter_noise = 0 (and block.jitter_noise = 0) to convert, e.g. "
                                      "for serving, where HF applies no noise")
    for shared in ("shared_expert", "shared_experts"):
        if getattr(block, shared, None) is not None:
            raise _refuse(model_type, f"the block has {shared}, which a moelayers layer does not compute")

    router, w13, w2 = weights_from_hf(block)
    e, two_f, h = w13.shape
    f = two_f // 2
    hidden = int(_required(config, "hidden_size", model_type))
    top_k = int(_required(config, "num_experts_per_tok", model_type))
    expected = {"hidden_size": (hidden, h), e_field: (getattr(config, e_field, None), e),
                f_field: (getattr(config, f_field, None), f)}
    for name, (want, got) in expected.items():
        if want is not None and int(want) != got:
            raise ValueError(f"hf_config.{name}={want} but the block's weights have {got} (w13 {list(w13.shape)}, "
                             f"router {list(router.shape)}): pass the config of this block's model")
    if norm_rule is None:
        norm = getattr(config, "norm_topk_prob", False)
        norm = bool(False if norm is None else norm)
    else:
        norm = norm_rule
    # the router's own settings (5.x: on block.gate; 4.x: on the block) are what runs: a config that disagrees
    # with them describes another model
    for owner in (getattr(block, "gate", None), block):
        own_k = getattr(owner, "top_k", None)
        if isinstance(own_k, int) and own_k != top_k:
            raise ValueError(f"the block routes to top_k={own_k} experts, hf_config.num_experts_per_tok={top_k}: pass "
                             "the config of this block's model")
        own_norm = getattr(owner, "norm_topk_prob", None)
        if isinstance(own_norm, bool) and own_norm != norm:
            raise ValueError(f"the block was built with norm_topk_prob={own_norm}, hf_config gives {norm} for "
                             f"{model_type!r}: pass the config of this block's model")
    params_dtype = _block_dtype(block) if dtype is None else dtype
    return MoEConfig(hidden_size=h, ffn_hidden_size=f, num_experts=e, top_k=top_k, score_fn="softmax",
                     norm_topk_prob=norm, params_dtype=params_dtype, **overrides)


# ---------------------------------------------------------------------------------------- weights
def _weight(module: Any, what: str) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{what} has no weight tensor")
    if getattr(module, "bias", None) is not None:
        raise ValueError(f"{what} has a bias: moelayers routers and experts have none")
    return w.detach()


def _fused_experts(ex: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [E, 2F, H], w2 [E, H, F])`` of transformers >= 5's fused experts."""
    flags = {"has_gate": True, "is_concatenated": True, "has_bias": False, "has_post_expert_norm": False,
             "_is_expert_parallel": False}
    bad = [f"{k}={getattr(ex, k)!r}" for k, ok in flags.items() if hasattr(ex, k) and bool(getattr(ex, k)) != ok]
    if bad:
        raise ValueError(f"the fused experts ({type(ex).__name__}) have a layout moelayers cannot read: "
                         f"{', '.join(bad)} (needed: gate and up projections concatenated, no biases, no post-expert "
                         "norm, all experts on this process, not HF's expert parallelism)")
    for bias in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(ex, bias, None) is not None:
            raise ValueError(f"the fused experts have {bias}: moelayers experts have no biases")
    apply_gate = getattr(type(ex), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        raise ValueError(f"the fused experts ({type(ex).__name__}) override _apply_gate: moelayers computes "
                         "silu(gate) * up only")
    if not hasattr(ex, "is_transposed"):
        raise ValueError(f"the fused experts ({type(ex).__name__}) carry no is_transposed flag (transformers >= 5's "
                         "layout flags): cannot tell [E, 2F, H] from [E, H, 2F]; only transformers >= 5 fused "
                         "experts are read")
    gu, down = ex.gate_up_proj.detach(), ex.down_proj.detach()
    if gu.dim() != 3 or down.dim() != 3:
        raise ValueError(f"experts.gate_up_proj and experts.down_proj must be 3-D, got {list(gu.shape)} and "
                         f"{list(down.shape)}")
    if ex.is_transposed:  # [E, H, 2F] and [E, F, H]: x @ w instead of x @ w^T
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    return gu, down


_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # Qwen3 / OLMoE, Mixtral


def _listed_experts(experts: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` stacked from transformers 4.x's per-expert MLPs."""
    first = experts[0]
    names = next((n for n in _PER_EXPERT_NAMES if all(hasattr(first, a) for a in n)), None)
    if names is None:
        raise ValueError(f"the experts ({type(first).__name__}) have neither gate_proj/up_proj/down_proj nor "
                         "w1/w3/w2 projections")
    gate, up, down = names
    w13, w2 = [], []
    for i, mlp in enumerate(experts):
        g, u, d = (_weight(getattr(mlp, n), f"experts[{i}].{n}") for n in names)
        if g.shape != u.shape:
            raise ValueError(f"experts[{i}].{gate} {list(g.shape)} and .{up} {list(u.shape)} differ in shape")
        w13.append(torch.cat([g, u], dim=0))  # gate rows first, then up
        w2.append(d)
    shapes = {(tuple(a.shape), tuple(b.shape)) for a, b in zip(w13, w2)}
    if len(shapes) != 1:
        raise ValueError(f"the experts have different shapes: {sorted(shapes)}")
    return torch.stack(w13), torch.stack(w2)


def _is_moe_block(module: Any) -> bool:
    ex, gate = getattr(module, "experts", None), getattr(module, "gate", None)
    if ex is None or gate is None or not isinstance(getattr(gate, "weight", None), torch.Tensor):
        return False
    if hasattr(ex, "gate_up_proj") and hasattr(ex, "down_proj"):
        return True
    return isinstance(ex, nn.ModuleList) and len(ex) > 0 and \
        any(all(hasattr(ex[0], a) for a in names) for names in _PER_EXPERT_NAMES)


def weights_from_hf(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logical weights of an HF sparse MoE block, as :meth:`~moelayers.MoELayerBase.load_full_weights`
    takes them.

    Layouts: transformers >= 5's fused experts (``block.experts.gate_up_proj [E, 2F, H]``, gate rows
    first, ``block.experts.down_proj [E, H, F]``; ``[E, H, 2F]`` / ``[E, F, H]`` with
    ``is_transposed``) with a router ``block.gate.weight [E, H]``; transformers 4.x's
    ``block.experts`` ``nn.ModuleList`` of MLPs with ``gate_proj`` / ``up_proj`` / ``down_proj``
    (Qwen3-MoE, OLMoE) or ``w1`` / ``w3`` / ``w2`` (Mixtral) ``nn.Linear`` s, with an ``nn.Linear``
    router ``block.gate``.

    Returns:
        ``(router_weight [E, H], w13 [E, 2F, H], w2 [E, H, F])``, detached, in the block's dtype and
        device: views of the block's parameters in the fused layout, new tensors in the 4.x one.

    Raises:
        ValueError: not a sparse MoE block of these layouts, biases, a fused layout moelayers cannot
            read (interleaved gate/up, no gate, a custom gate, a post-expert norm, HF's expert
            parallelism, no layout flags), or shapes that do not agree (the message gives them).
    """
    if not _is_moe_block(block):
        raise ValueError(f"{type(block).__name__} is not a sparse MoE block moelayers reads: it needs a router `gate` "
                         "with a weight and `experts` with gate_up_proj/down_proj (transformers >= 5) or a "
                         "ModuleList of gate_proj/up_proj/down_proj (or w1/w3/w2) MLPs (transformers 4.x)")
    router = _weight(block.gate, "the router (block.gate)")
    for extra in ("e_score_correction_bias",):
        if getattr(block.gate, extra, None) is not None:
            raise ValueError(f"the router has {extra}, which moelayers cannot represent")
    ex = block.experts
    w13, w2 = _fused_experts(ex) if hasattr(ex, "gate_up_proj") else _listed_experts(ex)
    if router.dim() != 2:
        raise ValueError(f"the router weight must be [E, H], got {list(router.shape)}")
    e, h = router.shape
    if w13.dim() != 3 or w13.shape[0] != e or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 (gate and up) must be [E, 2F, H] = [{e}, 2F, {h}] for a router of shape "
                         f"{list(router.shape)}, got {list(w13.shape)}")
    f = w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, f):
        raise ValueError(f"w2 (down) must be [E, H, F] = [{e}, {h}, {f}], got {list(w2.shape)}")
    return router, w13, w2


# ---------------------------------------------------------------------------------------- swapping
class TupleOutput(nn.Module):
    """Stands where a transformers 4.x sparse block stood: returns ``(y, None)``, as the 4.x block's
    ``(hidden_states, router_logits)``, which 4.x's Mixtral and OLMoE decoder layers unpack (the
    ``None`` is where router logits would be: keep ``output_router_logits=False``).

    Args:
        layer: the moelayers layer; ``forward(hidden_states [B, S, H])``.
        names: the block's per-expert projections (``gate_proj``, ``up_proj``, ``down_proj``, or
            Mixtral's ``w1``, ``w3``, ``w2``), for :func:`hf_weights`' keys.
    """

    def __init__(self, layer: nn.Module, names: tuple[str, str, str] = _PER_EXPERT_NAMES[0]):
        super().__init__()
        self.layer = layer
        self.names = names

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.layer(hidden_states), None


class CallInputs:
    """What the layers need to know of the model call under way (``swap_moe_blocks(...,
    token_ids=True, skip_padding=True)`` installs it): the ids the model embeds and its
    ``attention_mask``.

    A forward pre-hook of the model's input embedding keeps the ids it embeds; hooks of the modules
    on the way from the model to its embedding (the model, its base model ...) keep a call's
    ``attention_mask`` (``[B, S_total]``, by keyword or position) and forget both when the
    outermost of them starts and ends a call, so that a call from outside the model
    (``model.model(...)`` alone, chunked prefill calling ``forward``) starts without the last
    call's (a call with ``inputs_embeds`` has no ids; a nested call of the model keeps the ids of
    the call around it for after it; a module called twice within one call, the second time with
    ``inputs_embeds``, keeps the call's ids). A forward pre-hook of each layer passes the ids as
    ``token_ids`` where they are laid out like its hidden states (``[B, S]`` for ``[B, S, H]``)
    and, with ``skip_padding``, hands the layer only the rows the mask's last ``S`` columns mark
    non-zero (``[N, H]``; a forward hook puts them back into ``[B, S, H]``, zeros at the padded
    positions, and the layer's ``last_input_rows`` says which rows of ``B * S`` it computed). Per
    thread; nothing of it is pickled.

    Args:
        token_ids: pass the ids.
        skip_padding: leave padded positions out of the layers.
        layout: where the layers' hidden states keep the positions of ``[B, S]`` ids: ``'bs'`` as
            embedded (``[B, S, H]``, HF's), ``'sb'`` transposed (``[S, B, H]``); a layer called with
            them flattened (``[B * S, H]`` or ``[S * B, H]``) gets the ids flattened alike.
            ``None`` (HF): only hidden states laid out like the ids get them.
    """

    def __init__(self, *, token_ids: bool = True, skip_padding: bool = False, layout: str | None = None) -> None:
        if layout not in (None, "bs", "sb"):
            raise ValueError(f"layout must be 'bs' ([B, S, H] for [B, S] ids) or 'sb' ([S, B, H]), got {layout!r}")
        self.token_ids, self.skip_padding, self.layout = token_ids, skip_padding, layout
        self._local = threading.local()

    @property
    def ids(self) -> torch.Tensor | None:
        return getattr(self._local, "ids", None)

    @property
    def mask(self) -> torch.Tensor | None:
        return getattr(self._local, "mask", None)

    def forget(self, *_: Any, **__: Any) -> None:
        self._local.ids = self._local.mask = self._local.rows = self._local.grad = None
        self._local.around = ()

    def _state(self) -> tuple:
        return self.ids, self.mask, getattr(self._local, "grad", None), getattr(self._local, "around", ())

    def _calls(self) -> list:
        calls = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A module between the model and its embedding starts a call: the outermost one, or another
        call of a module whose call is under way (the model called from inside itself), starts
        without ids or mask; those before it come back when it ends. Calls a Ctrl-C cut off (torch
        runs no forward hook then, so they never left) are dropped first: their frames are gone."""
        caller = sys._getframe(1)  # torch's call of the module: on the stack while its forward runs
        calls = self._live_calls(caller)
        fresh = not calls or any(m is module for m, _, _ in calls)
        calls.append((module, self._state(), caller))
        if fresh:
            self.forget()
            # whether the call records autograd, read here: HF checkpoints a decoder layer that trains with grad on,
            # and a reentrant checkpoint runs its first pass (where the layers' hooks run) under no_grad
            self._local.grad = torch.is_grad_enabled()
        if self.skip_padding:
            mask = _argument(module, args, kwargs, "attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                self._local.mask = mask
            # (a 4-D mask, or none: the mask of the call around it, if any; no padding left out)

    def _live_calls(self, frame: Any) -> list:
        """The calls under way, less those a Ctrl-C cut off (their frames are not on the stack of
        ``frame``); with none left, the ids and mask of the calls cut off are forgotten."""
        calls = self._calls()
        if not calls:
            return calls
        live, innermost = set(), calls[-1][2]
        while frame is not None:
            if frame is innermost:  # the usual case, found a few frames up: every call around it is live too
                return calls
            live.add(id(frame))
            frame = frame.f_back
        if any(id(c[2]) not in live for c in calls):  # (a frame held here keeps its id its own)
            calls[:] = [c for c in calls if id(c[2]) in live]
            if not calls:
                self.forget()
                self._local.dropped = {}  # (their layers' rows: torch ran no forward hook to take them back)
        return calls

    def leave(self, module: nn.Module, *_: Any, **__: Any) -> None:
        calls = self._calls()
        for i in range(len(calls) - 1, -1, -1):
            if calls[i][0] is module:
                _, before, _ = calls.pop(i)
                outer = any(m is module for m, _, _ in calls)  # a call inside a call of the same module
                if not calls:
                    self.forget()
                elif outer:  # (a nested call of the same module: the outer call's state again)
                    self._local.ids, self._local.mask, self._local.grad, self._local.around = before
                return

    def keep(self, module: nn.Module, args: tuple) -> None:
        ids = args[0] if args else None
        self._local.ids = ids if isinstance(ids, torch.Tensor) and not ids.is_floating_point() else None

    def _ids_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The call's ids laid out like the hidden states ``x`` (``layout``), or ``None`` (another
        call's ids, or a layout they do not fit)."""
        ids = self.ids
        if ids is None:
            return None
        if self.layout == "sb" and ids.dim() == 2:
            ids = ids.t()
        if tuple(ids.shape) == tuple(x.shape[:-1]):
            return ids
        if self.layout is not None and x.dim() == 2 and ids.numel() == x.shape[0]:
            return ids.reshape(-1)
        return None

    def pass_to(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The layer's forward pre-hook: its ``token_ids`` and, with ``skip_padding``, its rows."""
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        calls = self._live_calls(sys._getframe(1))  # (a layer called after a call a Ctrl-C cut off: not its state)
        x, given = args[0], kwargs.get("token_ids")
        ids = self._ids_for(x) if self.token_ids and given is None else given
        if self.skip_padding and not in_backward() and self._checkpointed(calls):
            # whether or not this batch has padding; through the layer's exchange, so that a rank configured
            # otherwise (not checkpointing) raises too instead of waiting for this one
            refusal = ValueError(
                f"swap_moe_blocks(skip_padding=True) cannot leave padding out of {type(layer).__name__} while the "
                "model trains with gradient checkpointing: its recomputation in the backward would not know the "
                "mask. Swap without skip_padding (padded positions are then computed, as HF does), or turn "
                "gradient checkpointing off (model.gradient_checkpointing_disable(); "
                "activation_checkpointing_disable() in recent transformers)")
            refuse = getattr(layer, "refuse_input", None)
            if callable(refuse):
                refuse(refusal)  # raises
            raise refusal
        rows = self._rows_of(x) if self.skip_padding else None
        if self.skip_padding and not in_backward():  # (as the layer's last_* attributes: not a recomputation's)
            layer.last_input_rows = rows
        if rows is None:
            return None if ids is given else (args, {**kwargs, "token_ids": ids.to(x.device)})
        sent = x.reshape(-1, x.shape[-1]).index_select(0, rows)
        self._dropped().setdefault(id(layer), []).append((rows, x))
        if ids is not None and ids.numel() == x.shape[0] * x.shape[1]:  # (else the layer tells the caller)
            ids = ids.to(x.device).reshape(-1).index_select(0, rows)
        n = x.shape[0] * x.shape[1]
        forced = getattr(layer, "_forced_ids", None)  # force_routing's rows, laid out like x: the kept ones
        if isinstance(forced, torch.Tensor) and forced.dim() in (2, 3) and forced.shape[:-1].numel() == n:
            layer._forced_ids = forced.reshape(n, -1).index_select(0, rows.to(forced.device))
        return (sent, *args[1:]), {**kwargs, "token_ids": ids}

    def _checkpointed(self, calls: list) -> bool:
        """Whether HF checkpoints the decoder layer this layer sits in: it has ``gradient_checkpointing``
        on and trains (:meth:`around`), and the call records autograd (read where it started)."""
        grad = getattr(self._local, "grad", None) if calls else torch.is_grad_enabled()
        return bool(grad) and bool(getattr(self._local, "around", ()))

    def around(self, module: nn.Module, *_: Any, **__: Any) -> None:
        """Forward pre-hook of the module a layer sits in (HF's decoder layer, which it checkpoints):
        whether it checkpoints (``gradient_checkpointing`` on and training), until :meth:`out`."""
        outer = getattr(self._local, "around", ())
        self._local.around = (*outer, module) if getattr(module, "gradient_checkpointing", False) is True \
            and module.training else outer

    def out(self, module: nn.Module, *_: Any, **__: Any) -> None:
        around = getattr(self._local, "around", ())
        if module in around:
            self._local.around = around[:around.index(module)]

    def put_back(self, layer: nn.Module, args: tuple, output: Any) -> Any:
        """The layer's forward hook (``always_call``): its ``[N, H]`` output back into ``[B, S, H]``."""
        stack = self._dropped().get(id(layer))
        if not stack:
            return None
        rows, x = stack.pop()  # (a call cut off by a Ctrl-C left none: _live_calls dropped them)
        if not stack:
            del self._dropped()[id(layer)]
        if not isinstance(output, torch.Tensor):  # the forward raised
            return None
        if output.dim() != 2 or output.shape[0] != rows.numel():
            raise RuntimeError(f"swap_moe_blocks(skip_padding=True): {type(layer).__name__} returned "
                               f"{list(output.shape)} for the {rows.numel()} rows it was given (a hook of yours "
                               "changed its input or output?): cannot put them back into the padded batch")
        full = output.new_zeros(x.shape[0] * x.shape[1], output.shape[-1])
        return full.index_copy(0, rows, output).view(*x.shape[:2], output.shape[-1])

    def _dropped(self) -> dict:
        dropped = getattr(self._local, "dropped", None)
        if dropped is None:
            dropped = self._local.dropped = {}
        return dropped

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[N]`` the rows of ``x [B, S, H]`` (flattened to ``B * S``) that are not padding, or
        ``None`` where none is (or the mask is not laid out like ``x``)."""
        mask = self.mask
        if mask is None or x.dim() != 3 or mask.shape[0] != x.shape[0] or mask.shape[1] < x.shape[1]:
            return None
        cached = getattr(self._local, "rows", None)  # (the call's later layers: one host sync per call)
        if cached is not None and cached[0] is mask and cached[1] == (x.shape[1], x.device):
            return cached[2]
        keep = mask[:, mask.shape[1] - x.shape[1]:].to(x.device) != 0
        rows = None if bool(keep.all()) else keep.reshape(-1).nonzero().squeeze(1)
        self._local.rows = (mask, (x.shape[1], x.device), rows)
        return rows

    def __getstate__(self) -> dict:  # (torch.save of the model: the hooks go with it, the ids do not)
        return {"token_ids": self.token_ids, "skip_padding": self.skip_padding}

    def __setstate__(self, state: dict) -> None:
        self.token_ids, self.skip_padding = state.get("token_ids", True), state.get("skip_padding", False)
        self._local = threading.local()  # (and its call stack)


def _argument(module: nn.Module, args: tuple, kwargs: dict, name: str) -> Any:
    """The argument ``name`` of a call ``module(*args, **kwargs)``, by keyword or by the position its
    ``forward`` gives it (``None`` if absent or the signature cannot tell)."""
    if name in kwargs or not args:
        return kwargs.get(name)
    try:
        return inspect.signature(module.forward).bind_partial(*args).arguments.get(name)
    except (TypeError, ValueError):
        return None


def _moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if name and _is_moe_block(module):
            found.append((name, module))
            inside = (*inside, name + ".")
    return found


def swap_moe_blocks(model: nn.Module, groups: ParallelGroups, layer_cls: type = VanillaMoE, *,
                    dtype: torch.dtype | None = None, token_ids: bool = False, skip_padding: bool = False,
                    **layer_kwargs: Any) -> list[str]:
    """Replace every sparse MoE block of the HF ``model`` in place with a moelayers layer.

    Each block's config comes from :func:`moe_config_from_hf` (``model.config``) with the block's
    dtype as ``params_dtype``, its weights from :func:`weights_from_hf`. Each layer gets
    ``layer_number`` = the block's index among the model's MoE blocks, the block's device (unless
    ``device=`` is given), its train/eval mode and its weights' ``requires_grad``. Every block is
    checked before any is replaced, and every layer built and loaded before any is put in.

    In transformers >= 5 the block takes ``[B, S, H]`` and returns a tensor: the layer takes its
    place as it is. In transformers 4.x it returned ``(hidden_states, router_logits)``: the layer
    is wrapped in a :class:`TupleOutput`.

    At world > 1 every rank calls it on the same model (the same weights): each layer's
    ``load_full_weights`` is a collective over the expert-parallel group.

    Args:
        model: the HF model (``model.config.model_type`` one of :data:`SUPPORTED_MODEL_TYPES`).
        groups: the layers' process groups (``ParallelGroups.single()`` for one process).
        layer_cls: :class:`~moelayers.VanillaMoE` (default), :class:`~moelayers.VariabilityAwareMoE`,
            :class:`~moelayers.SemanticMoE` (which needs ``token_ids``: see the module docstring).
        dtype: the layers' ``params_dtype`` (default: each block's; needed where a block holds
            weights of several dtypes, e.g. a float32 router beside bf16 experts: cast to it).
        token_ids: pass the ids the model embeds to the layers as ``token_ids`` (hooks of
            :class:`CallInputs`; the layers' state dict keys stay as they are): for
            :class:`~moelayers.SemanticMoE` and for recording with
            :class:`~moelayers.trace.TraceRecorder`, which need them.
        skip_padding: the layers compute only the positions the model call's ``attention_mask``
            (``[B, S_total]``, its last ``S`` columns this forward's) marks non-zero, and give zeros
            at the others (HF computes them and discards their outputs): fewer rows to route and
            exchange, and no padding in the layers' loads, statistics and traces. The logits at
            non-padded positions are HF's; at padded ones they differ (HF's training loss with
            left padding counts the last padded position's prediction of the first token). Not in
            training with gradient checkpointing (``ValueError`` in every such forward, on every
            rank, padding or not: the recomputation would not know the mask).
        **layer_kwargs: passed to each ``layer_cls(config, groups, ...)`` (``dispatcher``,
            ``placement``, ``capacity``, ...), except ``layer_number``, which is set here, as is
            ``layer_idx`` with a ``plan=`` (:class:`~moelayers.SemanticMoE`: block ``i`` serves the
            plan's layer ``i``). With ``cuda_graph=True`` the layers swapped in capture their
            graphs into one memory pool (:func:`moelayers.share_graph_pool`). Run the model's
            forwards one after another on one CUDA stream, as ``generate`` does: two forwards at
            once on two streams would use the same memory.

    Returns:
        the swapped modules' names (``model.get_submodule(name)`` is the layer, or its
        :class:`TupleOutput` for transformers 4.x).

    Raises:
        ValueError: the model has no sparse MoE block moelayers recognises, or a block or setting
            :func:`moe_config_from_hf` / :func:`weights_from_hf` refuse (nothing is replaced then).
        TypeError: ``layer_number`` in ``layer_kwargs``, or ``layer_cls`` not an ``nn.Module`` class.
    """
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, nn.Module)):
        raise TypeError(f"layer_cls must be a moelayers layer class, got {layer_cls!r}")
    if "layer_number" in layer_kwargs:
        raise TypeError("swap_moe_blocks sets layer_number itself (the block's index among the model's MoE blocks)")
    if "layer_idx" in layer_kwargs and layer_kwargs.get("plan") is not None:
        raise TypeError("swap_moe_blocks sets layer_idx itself with a plan= (block i serves the plan's layer i)")
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass the HF model (PreTrainedModel)")
    blocks = _moe_blocks(model)
    if not blocks:
        model_type = getattr(hf_config, "model_type", None)
        swapped = [n for n, m in model.named_modules() if getattr(m, "moe_layer_marker", False) is True]
        if swapped:
            raise ValueError(f"{type(model).__name__} holds moelayers layers already ({swapped[0]}, ...) and no HF "
                             "sparse MoE block: swapped before?")
        raise ValueError(f"{type(model).__name__} (model_type {model_type!r}) has no sparse "
                         "MoE block moelayers recognises (a module with a router `gate` and `experts`)")
    # refusals before anything changes
    configs = [moe_config_from_hf(block, hf_config, dtype=dtype) for _, block in blocks]
    source = CallInputs(token_ids=token_ids, skip_padding=skip_padding) if token_ids or skip_padding else None
    embedding = None
    if source is not None:
        get = getattr(model, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        if not isinstance(embedding, nn.Module):
            what = "token_ids=True reads the ids the model embeds" if token_ids else \
                "skip_padding=True reads the attention_mask of the calls on the way to the model's embedding"
            raise ValueError(f"{what}: {type(model).__name__} has no get_input_embeddings() module")
    new: list[nn.Module] = []
    for number, ((name, block), cfg) in enumerate(zip(blocks, configs)):
        gate: Any = block.gate
        router, w13, w2 = weights_from_hf(block)
        kwargs = {"device": router.device, **layer_kwargs}
        if layer_kwargs.get("plan") is not None:  # SemanticMoE: block i is the plan's layer i (every one was layer 0)
            kwargs["layer_idx"] = number
        layer: Any = layer_cls(cfg, groups, layer_number=number, **kwargs)
        dev, to = layer.router.weight.device, cfg.params_dtype
        layer.load_full_weights(router.to(dev, to), w13.to(dev, to), w2.to(dev, to))
        layer.train(block.training)
        experts: Any = block.experts
        layer.router.requires_grad_(any(p.requires_grad for p in gate.parameters()))
        layer.experts.requires_grad_(any(p.requires_grad for p in experts.parameters()))
        if getattr(experts, "is_transposed", False):
            layer._hf_transposed = True  # hf_weights writes the layout read: [E, H, 2F] and [E, F, H]
        if source is not None:
            layer.register_forward_pre_hook(source.pass_to, with_kwargs=True)
            if skip_padding:
                layer.register_forward_hook(source.put_back, always_call=True)
        module: nn.Module = layer
        if not hasattr(experts, "gate_up_proj"):
            module = TupleOutput(module, next(n for n in _PER_EXPERT_NAMES if all(hasattr(experts[0], a) for a in n)))
        new.append(module)
    if layer_kwargs.get("cuda_graph"):  # the model calls its blocks one after another: one pool for their graphs
        from moelayers.layers.graphs import share_graph_pool

        share_graph_pool(nn.ModuleList(new))
    for (name, _), module in zip(blocks, new):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, module)
        if source is not None and skip_padding:  # (HF checkpoints the decoder layer a block sits in)
            parent.register_forward_pre_hook(source.around)
            parent.register_forward_hook(source.out, always_call=True)
    if source is not None and embedding is not None:
        _watch_calls(model, embedding, source)
    return [name for name, _ in blocks]


def _watch_calls(model: nn.Module, embedding: nn.Module, source: CallInputs) -> None:
    """Hooks that let ``source`` know the ids ``embedding`` embeds and where a call of ``model``
    (or of a module between it and the embedding) starts and ends."""
    embedding.register_forward_pre_hook(source.keep)
    where = next((n for n, m in model.named_modules() if m is embedding), "")
    parts = where.split(".")[:-1] if where else []
    for module in [model] + [model.get_submodule(".".join(parts[:i + 1])) for i in range(len(parts))]:
        module.register_forward_pre_hook(source.enter, with_kwargs=True)
        module.register_forward_hook(source.leave, always_call=True)


def pass_token_ids(model: nn.Module, embedding: nn.Module | None = None, *, layout: str = "bs") -> list[str]:
    """Hand every moelayers layer of a model of one's own the token ids of the model call under way
    as ``token_ids`` (what :func:`swap_moe_blocks` ``(token_ids=True)`` does for HF models), so that
    :class:`~moelayers.trace.TraceRecorder` and :class:`~moelayers.SemanticMoE`'s token table work
    without changing the blocks' signatures: the ids ``embedding`` embeds (its first argument, e.g.
    ``[B, S]``) reach each layer, laid out as ``layout`` says the model lays out its hidden states; a
    layer called with ``token_ids=`` keeps its own, one called with hidden states the ids do not fit
    or outside a call of ``model`` gets none (:class:`CallInputs` says how calls are told apart).
    Only calls of the layers (``forward``) are hooked, not ``SemanticMoE.forward_tp``. The layout
    cannot be told from the shapes where ``B == S``: give the model's.

    Args:
        model: a module that holds moelayers layers (``moe_layer_marker``) and embeds token ids.
        embedding: the module that embeds them, inside ``model``; default
            ``model.get_input_embeddings()`` where it has one, else the model's only ``nn.Embedding``.
        layout: ``'bs'`` (default): the layers see ``[B, S, H]`` for ``[B, S]`` ids, as embedded;
            ``'sb'``: the model transposes to ``[S, B, H]`` (megatron's layout). Either way a block
            that flattens its hidden states first (``layer(h.view(-1, H))``) gets the ids flattened
            in the same order.

    Returns:
        The names of the layers that get the ids, in module order.

    Raises:
        ValueError: no moelayers layer in ``model``, no embedding (or several ``nn.Embedding`` and
            none given), an ``embedding`` that is not a submodule of ``model``, or another ``layout``.
    """
    if layout not in ("bs", "sb"):
        raise ValueError(f"layout must be 'bs' ([B, S, H] for [B, S] ids) or 'sb' ([S, B, H]), got {layout!r}")
    layers = [(n, m) for n, m in model.named_modules() if getattr(m, "moe_layer_marker", False) is True]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no moelayers layer: swap its MoE blocks first")
    if embedding is None:
        get = getattr(model, "get_input_embeddings", None)
        try:
            embedding = get() if callable(get) else None
        except NotImplementedError:  # (transformers' PreTrainedModel without a base model or embed_tokens)
            embedding = None
    if embedding is None:
        found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
        if len(found) != 1:
            raise ValueError(f"{type(model).__name__} has {len(found)} nn.Embedding modules"
                             f"{' (' + ', '.join(n for n, _ in found) + ')' if found else ''}: pass the one that "
                             "embeds the token ids as embedding=")
        embedding = found[0][1]
    if not isinstance(embedding, nn.Module) or embedding is model or not any(m is embedding for m in model.modules()):
        raise ValueError(f"embedding ({type(embedding).__name__}) is not a submodule of {type(model).__name__}"
                         + (" (it is the model itself: pass the module that embeds the ids)" if embedding is model
                            else ""))
    source = CallInputs(token_ids=True, layout=layout)
    for _, layer in layers:
        layer.register_forward_pre_hook(source.pass_to, with_kwargs=True)
    _watch_calls(model, embedding, source)
    return [n for n, _ in layers]


def hf_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's weights under HF's names, relative to the block, in the layout
    :func:`swap_moe_blocks` read.

    transformers >= 5: ``{'gate.weight': [E, H], 'experts.gate_up_proj': [E, 2F, H],
    'experts.down_proj': [E, H, F]}`` (``[E, H, 2F]`` and ``[E, F, H]`` for a block of
    ``is_transposed`` experts); 4.x (a :class:`TupleOutput`): ``gate.weight`` and
    ``experts.<e>.gate_proj.weight`` ... (Mixtral's ``w1`` / ``w3`` / ``w2``). From
    :meth:`~moelayers.MoELayerBase.export_full_weights`, in logical expert order: a collective
    over the expert-parallel group at world > 1 (every rank calls it; every rank gets every expert).
    A swapped model's HF state dict, for ``save_pretrained(..., state_dict=sd)``::

        sd = {k: v for k, v in model.state_dict().items() if not k.startswith(tuple(n + "." for n in names))}
        for n in names:
            sd.update({f"{n}.{k}": v for k, v in hf_weights(model.get_submodule(n)).items()})

    Args:
        layer: a moelayers layer, or the :class:`TupleOutput` around one.

    Raises:
        TypeError: not a moelayers layer.
    """
    inner: Any = layer.layer if isinstance(layer, TupleOutput) else layer
    if not callable(getattr(inner, "export_full_weights", None)):
        raise TypeError(f"hf_weights takes a moelayers layer (or swap_moe_blocks' TupleOutput), got "
                        f"{type(layer).__name__}")
    router, w13, w2 = inner.export_full_weights()
    if not isinstance(layer, TupleOutput):
        if getattr(inner, "_hf_transposed", False):  # a block of is_transposed experts (swap_moe_blocks)
            w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        return {"gate.weight": router, "experts.gate_up_proj": w13, "experts.down_proj": w2}
    gate, up, down = layer.names  # transformers 4.x: per-expert nn.Linear weights
    f = w2.shape[-1]
    out = {"gate.weight": router}
    for e in range(w13.shape[0]):
        out.update({f"experts.{e}.{gate}.weight": w13[e, :f], f"experts.{e}.{up}.weight": w13[e, f:],
                    f"experts.{e}.{down}.weight": w2[e]})
    return out
