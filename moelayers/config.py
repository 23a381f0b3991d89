"""`MoEConfig`: the one validated description of an MoE block."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu",)


#: megatron-core TransformerConfig fields that change an MoE layer's output, and the only values moelayers
#: implements; ``MoEConfig.from_megatron`` refuses any other value.
MEGATRON_SUPPORTED_VALUES: dict[str, tuple] = {
    "moe_router_topk_scaling_factor": (None, 1.0),
    # sinkhorn changes the weights; the auxiliary losses only matter in training
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
    "moe_router_enable_expert_bias": (False,),   # the bias shifts which experts are chosen
    "moe_router_num_groups": (None,),            # group-limited routing
    "moe_router_group_topk": (None,),
    "moe_expert_capacity_factor": (None,),       # token dropping
    "moe_apply_probs_on_input": (False,),
    "moe_input_jitter_eps": (None,),             # megatron's router jitters its input, in eval mode too
    "moe_router_force_load_balancing": (False,),
    "moe_shared_expert_intermediate_size": (None,),  # shared experts
    "moe_latent_size": (None,),
    "glu_linear_offset": (0.0,),
    "activation_func_clamp_value": (None,),
}


#: megatron-core ``moe_router_dtype`` -> ``MoEConfig.router_dtype``
ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class MoEConfig:
    """Shape and routing of one MoE block.

    Args:
        hidden_size: model width ``H``.
        ffn_hidden_size: per-expert intermediate width ``F`` (gate and up are each ``F`` wide).
        num_experts: logical experts ``E``.
        top_k: experts per token ``K`` (``1 <= K <= E``).
        score_fn: ``'softmax'`` or ``'sigmoid'`` scoring of router logits.
        norm_topk_prob: renormalise the ``K`` selected scores to sum to one.
        activation: expert activation; only ``'swiglu'`` (``silu(gate) * up``).
        params_dtype: dtype of all weights (router and experts).
        init_std: standard deviation of the default normal initialisation.
        router_dtype: dtype the router logits ``x W^T`` are computed in, at least (``None``: the
            input's dtype). ``torch.float32`` is megatron-core's ``moe_router_dtype='fp32'``: with
            bf16 weights it picks the same experts as megatron's router, near-ties included.
    """

    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    top_k: int
    score_fn: str = "softmax"
    norm_topk_prob: bool = True
    activation: str = "swiglu"
    params_dtype: torch.dtype = torch.float32
    init_std: float = 0.02
    router_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {value}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must not exceed num_experts ({self.num_experts})"
            )
        if self.score_fn not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.score_fn must be one of {SCORE_FUNCTIONS}, got {self.score_fn!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise TypeError(f"MoEConfig.params_dtype must be a floating torch.dtype, got {self.params_dtype!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"MoEConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, numbers.Real) \
                or not math.isfinite(self.init_std) or not self.init_std > 0:
            raise ValueError(f"MoEConfig.init_std must be a finite number > 0, got {self.init_std!r}")
        if self.router_dtype is not None and (not isinstance(self.router_dtype, torch.dtype)
                                              or not self.router_dtype.is_floating_point):
            raise TypeError(f"MoEConfig.router_dtype must be None or a floating torch.dtype, got {self.router_dtype!r}")

    def logits_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype router logits are computed in for inputs of ``x_dtype``."""
        return x_dtype if self.router_dtype is None else torch.promote_types(x_dtype, self.router_dtype)

    def replace(self, **changes: Any) -> "MoEConfig":
        """A validated copy with some fields changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ValueError(f"MoEConfig has no field(s) {sorted(unknown)}")
        values.update(changes)
        return MoEConfig(**values)

    @classmethod
    def from_megatron(cls, transformer_config: Any) -> "MoEConfig":
        """Build from a megatron-core ``TransformerConfig``.

        Reads ``hidden_size``, ``moe_ffn_hidden_size`` (falls back to ``ffn_hidden_size``),
        ``num_moe_experts``, ``moe_router_topk``, ``moe_router_score_function``,
        ``moe_router_pre_softmax``, ``moe_router_dtype``, ``gated_linear_unit``, ``params_dtype`` and
        ``init_method_std``.
        Megatron's softmax router without pre-softmax takes the top-k of the logits and then a
        softmax over them, which is a renormalised top-k (``norm_topk_prob=True``); with
        pre-softmax it is a plain top-k of the softmax. Its sigmoid router always renormalises
        when ``top_k > 1``.

        Raises:
            ValueError: not an MoE config, or a setting that would change what megatron's layer
                computes and that moelayers does not implement (it is never silently dropped):
                see :data:`MEGATRON_SUPPORTED_VALUES`, non-SwiGLU experts, linear biases.
        """
        import torch.nn.functional as F

        tc = transformer_config
        if getattr(tc, "num_moe_experts", None) is None:
            raise ValueError("transformer_config.num_moe_experts is not set: not an MoE config")
        if not getattr(tc, "gated_linear_unit", False) or getattr(tc, "activation_func", F.silu) is not F.silu:
            raise ValueError("moelayers experts are SwiGLU: transformer_config needs gated_linear_unit=True and "
                             "activation_func=F.silu")
        if getattr(tc, "add_bias_linear", False):
            raise ValueError("moelayers router and experts have no biases: set transformer_config.add_bias_linear=False")
        bad = [f"{name}={getattr(tc, name)!r}" for name, accepted in MEGATRON_SUPPORTED_VALUES.items()
               if getattr(tc, name, accepted[0]) not in accepted]
        if bad:
            raise ValueError(f"transformer_config sets what moelayers does not implement: {', '.join(bad)} "
                             "(outputs would differ from megatron's MoELayer)")
        score_fn = getattr(tc, "moe_router_score_function", "softmax")
        topk = int(tc.moe_router_topk)
        if score_fn == "softmax":
            norm = not getattr(tc, "moe_router_pre_softmax", False)
        else:
            norm = topk > 1
        ffn = getattr(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size
        router_name = getattr(tc, "moe_router_dtype", None)
        if router_name not in ROUTER_DTYPES:
            raise ValueError(f"transformer_config.moe_router_dtype={router_name!r}: one of {sorted(ROUTER_DTYPES, key=str)}")
        router_dtype = ROUTER_DTYPES[router_name]
        return cls(
            hidden_size=int(tc.hidden_size),
            ffn_hidden_size=int(ffn),
            num_experts=int(tc.num_moe_experts),
            top_k=topk,
            score_fn=score_fn,
            norm_topk_prob=norm,
            params_dtype=getattr(tc, "params_dtype", torch.float32),
            init_std=float(getattr(tc, "init_method_std", 0.02)),
            router_dtype=router_dtype,
        )
