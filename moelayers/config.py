"""`MoEConfig`: the one validated description of an MoE block."""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu",)
#: weight dtypes the layers compute in (fp8 weights would need scaling factors moelayers does not keep)
PARAMS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: megatron-core TransformerConfig fields that change an MoE layer's output, and the only values moelayers
#: implements; ``MoEConfig.from_megatron`` refuses any other value.
MEGATRON_SUPPORTED_VALUES: dict[str, tuple] = {
    "moe_router_topk_scaling_factor": (None, 1.0, 0.0),  # megatron scales only `if scaling_factor:`
    # sinkhorn changes the weights; the auxiliary losses only matter in training (see
    # ``megatron_training_losses``); a list combines several aux-loss types: each entry must be one of these
    "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
    "moe_router_enable_expert_bias": (False,),   # the bias shifts which experts are chosen
    # group-limited routing; megatron ignores moe_router_num_groups while moe_router_group_topk is
    # unset (None or 0), and so does from_megatron. Its deprecated moe_router_topk_limited_devices
    # becomes those two in megatron's __post_init__: named here, so the error names what was set
    "moe_router_topk_limited_devices": (None, 0),
    "moe_router_num_groups": (None,),
    "moe_router_group_topk": (None, 0),
    "moe_expert_capacity_factor": (None,),       # token dropping
    "moe_apply_probs_on_input": (False,),
    "moe_input_jitter_eps": (None,),             # megatron's router jitters its input, in eval mode too
    "moe_router_force_load_balancing": (False,),
    "moe_shared_expert_intermediate_size": (None,),  # shared experts
    "moe_latent_size": (None,),
    "glu_linear_offset": (0.0,),
    "fp8": (None,),                              # fp8 / fp4 matmuls (TransformerEngine) change the outputs
    "fp4": (None,),
    # per-module quantization (megatron's RecipeConfig): its TE linear / grouped-linear modules run their
    # matmuls quantized where a matcher names them (the experts' included), with fp8 and fp4 unset
    "quant_recipe": (None,),
    "activation_func_clamp_value": (None,),
    # megatron's RouterReplay (RL: replay rollout routing in training) has no hook into our router;
    # replay routing with the layer's force_routing instead
    "moe_enable_routing_replay": (False,),
    # TransformerEngine's fused top-k: it ranks the scores and breaks exact ties its own way (float32
    # scores in recent versions, its own order among ties in older ones), not megatron's torch.topk
    "moe_router_fusion": (False,),
}


#: megatron-core ``moe_router_dtype`` -> ``MoEConfig.router_dtype``
ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}

#: megatron-core's auxiliary load-balancing losses (``moe_router_load_balancing_type`` entries)
MEGATRON_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _megatron_unsupported(tc: Any) -> list[str]:
    """``name=value`` for each :data:`MEGATRON_SUPPORTED_VALUES` field that ``tc`` sets to a value
    moelayers does not implement.

    A list ``moe_router_load_balancing_type`` (megatron combines several aux-loss types) passes when
    every entry is supported; ``moe_router_num_groups`` only counts with ``moe_router_group_topk`` set,
    as in megatron's router (``if group_topk:`` selects group-limited routing), and neither counts when
    ``group_topk`` selects every group (nothing is masked).
    """
    bad = []
    group_topk = getattr(tc, "moe_router_group_topk", None)
    # every group selected (group_topk == num_groups) masks nothing: megatron's plain top-k
    group_limited = bool(group_topk) and group_topk != getattr(tc, "moe_router_num_groups", None)
    for name, accepted in MEGATRON_SUPPORTED_VALUES.items():
        value = getattr(tc, name, accepted[0])
        if name in ("moe_router_num_groups", "moe_router_group_topk") and not group_limited:
            continue
        if name == "moe_router_load_balancing_type" and isinstance(value, (list, tuple)):
            wrong = [v for v in value if v not in accepted]
            if wrong:
                bad.append(f"{name}={value!r} (entries {wrong!r}; each must be one of {accepted})")
        elif value not in accepted:
            bad.append(f"{name}={value!r}")
    return bad


def _megatron_aux_loss_coeff(tc: Any, loss_type: str) -> Any:
    """The coefficient megatron's router gives ``loss_type`` (its ``TopKRouter.get_aux_loss_coeff``):
    ``moe_aux_loss_coeff`` (or its entry at the type's first position in a list
    ``moe_router_load_balancing_type``) when the type is selected, else 0."""
    types = getattr(tc, "moe_router_load_balancing_type", "aux_loss")
    coeffs = getattr(tc, "moe_aux_loss_coeff", 0.0)
    if isinstance(types, str):
        return coeffs if types == loss_type else 0.0
    types = list(types)
    if loss_type not in types:
        return 0.0
    return coeffs[types.index(loss_type)] if isinstance(coeffs, (list, tuple)) else coeffs


def megatron_training_losses(tc: Any) -> list[str]:
    """The auxiliary / z losses a megatron ``TransformerConfig`` turns on, as ``name=value`` strings.

    megatron's router adds them to its gradient in training (``training`` and grad enabled) and
    never changes the output with them; moelayers has no such term, so
    :class:`~moelayers.integrations.megatron.MegatronMoEAdapter` refuses to train with them rather
    than drop them silently, while inference (serving, rollouts) is unaffected.
    """
    bad = []
    for loss_type in MEGATRON_AUX_LOSS_TYPES:
        if _megatron_aux_loss_coeff(tc, loss_type):
            bad.append(f"moe_aux_loss_coeff={tc.moe_aux_loss_coeff!r} (the {loss_type!r} loss)")
    z = getattr(tc, "moe_z_loss_coeff", None)
    if z is not None and z != 0:
        bad.append(f"moe_z_loss_coeff={z!r}")
    return bad


def _megatron_params_dtype(tc: Any) -> torch.dtype:
    """The dtype megatron's weights end up in: ``params_dtype``, or bf16 / fp16 with ``bf16`` /
    ``fp16`` set (megatron's ``Float16Module`` casts every parameter, the adapter's included)."""
    params = getattr(tc, "params_dtype", torch.float32)
    half = torch.bfloat16 if getattr(tc, "bf16", False) else torch.float16 if getattr(tc, "fp16", False) else None
    if half is not None:
        flag = "bf16" if half is torch.bfloat16 else "fp16"
        if params not in (torch.float32, half):
            raise ValueError(f"transformer_config sets {flag}=True with params_dtype={params}: megatron's Float16Module "
                             f"casts the weights to {half}; set params_dtype={half}")
        params = half
    if params not in PARAMS_DTYPES:
        raise ValueError(f"transformer_config.params_dtype={params} is not supported: one of "
                         f"{[str(d) for d in PARAMS_DTYPES]} (fp8 weights need scaling factors moelayers does not keep)")
    return params


@functools.lru_cache(maxsize=1)
def megatron_rounds_scores() -> bool:
    """Whether the installed megatron-core ranks sigmoid and softmax-before-top-k scores rounded to
    the logits' dtype (0.16: ``.type_as(logits)`` before its top-k) or in float32 (0.19).

    Asked of megatron's own routing function, not of its version number: each probe holds two rows
    of bf16 logits whose float32 scores are strictly ordered one way in the first row and the other
    way in the second, but equal once rounded to bf16. Ranked in float32 the two rows pick mirrored
    experts; rounded they are the same exact tie, which ``torch.topk`` breaks alike in both rows.

    Raises:
        RuntimeError: the two score functions disagree (a megatron-core this code does not know).
    """
    try:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    except ModuleNotFoundError as exc:
        if not str(exc.name or "").startswith("megatron"):
            raise
        raise ImportError("MoEConfig.from_megatron needs megatron-core (it asks megatron's routing how it ranks "
                          "bf16 scores): pip install megatron-core") from exc

    answers = []
    for score_function, pre, row, k in (("sigmoid", False, [0.86328125, 0.8671875], 1),  # 0.70335 < 0.70416
                                        ("softmax", True, [0.0, 2.0 ** -10, -4.0], 1)):  # 0.49522 < 0.49571
        first = torch.tensor(row, dtype=torch.bfloat16, device="cpu")  # (not a default device: meta has no values)
        mirrored = first.clone()
        mirrored[:2] = first[:2].flip(0)
        out = topk_routing_with_score_function(torch.stack([first, mirrored]), k, use_pre_softmax=pre,
                                               score_function=score_function)
        picked = out[1].int().argmax(1).tolist()  # (probs, routing_map [2, E])
        answers.append(picked != [1, 0])
    if answers[0] != answers[1]:
        raise RuntimeError("this megatron-core rounds its sigmoid and softmax scores differently before the top-k "
                           f"(sigmoid rounded: {answers[0]}, softmax rounded: {answers[1]}); moelayers cannot match "
                           "its ranking: use moe_router_dtype='fp32'")
    return answers[0]


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
        router_dtype: dtype the router logits ``x W^T`` are computed in, at least, under
            ``torch.autocast`` too (``None``: the input's dtype). ``torch.float32`` is megatron-core's ``moe_router_dtype='fp32'``: with
            bf16 weights it picks the same experts as megatron's router, near-ties included.
        rank_in_logits_dtype: round sigmoid scores and softmax-before-top-k scores
            (``norm_topk_prob=False``) to the logits' dtype before the top-k, as megatron-core's
            router does up to 0.16 (from 0.19 it ranks them in float32): with bf16 logits, near-ties
            become exact ties that ``torch.topk`` breaks, as in megatron. ``False`` (the default, as
            Hugging Face's routers): scores in float32.
        rank_post_softmax_by_logits: softmax-after-top-k (``norm_topk_prob=True``) ranks the
            logits themselves, as megatron-core does, instead of their float32 softmax (the same
            order up to how ``torch.topk`` breaks exact ties).
            ``from_megatron`` sets both as the installed megatron-core ranks; neither changes
            anything for float32 logits.

    Raises:
        TypeError: a field of the wrong type (e.g. a float size, a non-bool flag), or a
            ``params_dtype`` / ``router_dtype`` outside :data:`PARAMS_DTYPES`.
        ValueError: a field out of range or not among its allowed values (non-positive sizes,
            ``top_k`` outside ``[1, E]``, an unknown ``score_fn`` or ``activation``, ``init_std``
            not a finite positive number); the message names the field.
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
    rank_in_logits_dtype: bool = False
    rank_post_softmax_by_logits: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"MoEConfig.{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {value}")
            object.__setattr__(self, name, int(value))  # numpy ints (sizes read from files) as plain ints
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
        if self.params_dtype not in PARAMS_DTYPES:
            raise TypeError(f"MoEConfig.params_dtype={self.params_dtype} is not supported: one of "
                            f"{[str(d) for d in PARAMS_DTYPES]} (fp8 weights need scaling factors moelayers does not keep)")
        for name in ("norm_topk_prob", "rank_in_logits_dtype", "rank_post_softmax_by_logits"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))  # a numpy bool (read from a file) as a bool
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, numbers.Real) \
                or not math.isfinite(self.init_std) or not self.init_std > 0:
            raise ValueError(f"MoEConfig.init_std must be a finite number > 0, got {self.init_std!r}")
        if self.router_dtype is not None and self.router_dtype not in PARAMS_DTYPES:  # fp8 cannot be promoted
            raise TypeError(f"MoEConfig.router_dtype must be None or one of {[str(d) for d in PARAMS_DTYPES]} "
                            f"(megatron's moe_router_dtype: fp32 or fp64), got {self.router_dtype!r}")

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
        ``moe_router_pre_softmax``, ``moe_router_dtype``, ``gated_linear_unit``, ``params_dtype``,
        ``bf16`` / ``fp16`` and ``init_method_std``.
        ``bf16=True`` (``fp16=True``) makes ``params_dtype`` bf16 (fp16): megatron's
        ``Float16Module`` casts every parameter to it, whatever ``params_dtype`` they were made in.
        Megatron's softmax router without pre-softmax takes the top-k of the logits and then a
        softmax over them, which is a renormalised top-k (``norm_topk_prob=True``); with
        pre-softmax it is a plain top-k of the softmax. Its sigmoid router always renormalises
        when ``top_k > 1``.

        Raises:
            TypeError: ``transformer_config`` is a dict (build a ``TransformerConfig`` from it).
            ValueError: not an MoE config, or a setting that would change what megatron's layer
                computes and that moelayers does not implement (it is never silently dropped):
                see :data:`MEGATRON_SUPPORTED_VALUES`, non-SwiGLU experts, linear biases, a
                ``params_dtype`` outside :data:`PARAMS_DTYPES` (fp8), ``params_dtype`` contradicting
                ``bf16`` / ``fp16``, or a ``moe_router_dtype`` below ``params_dtype`` (``'fp32'`` with
                float64 parameters: megatron would compute the logits in float32, moelayers'
                ``router_dtype`` only raises their precision). The auxiliary / z loss coefficients do
                not change the output and are accepted here; the megatron adapter refuses to *train* with them
                (:func:`megatron_training_losses`).
        """
        import torch.nn.functional as F

        tc = transformer_config
        if isinstance(tc, dict):
            raise TypeError("from_megatron takes megatron-core's TransformerConfig (an object with its fields), "
                            "not a dict: build one with TransformerConfig(**fields)")
        if getattr(tc, "num_moe_experts", None) is None:
            raise ValueError("transformer_config.num_moe_experts is not set: not an MoE config")
        if not getattr(tc, "gated_linear_unit", False) or getattr(tc, "activation_func", F.silu) is not F.silu:
            raise ValueError("moelayers experts are SwiGLU: transformer_config needs gated_linear_unit=True and "
                             "activation_func=F.silu")
        if getattr(tc, "add_bias_linear", False):
            raise ValueError("moelayers router and experts have no biases: set transformer_config.add_bias_linear=False")
        bad = _megatron_unsupported(tc)
        if bad:
            raise ValueError(f"transformer_config sets what moelayers does not implement: {', '.join(bad)} "
                             "(outputs would differ from megatron's MoELayer)")
        params_dtype = _megatron_params_dtype(tc)
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
        if router_dtype is not None and torch.promote_types(params_dtype, router_dtype) != router_dtype:
            raise ValueError(
                f"transformer_config.moe_router_dtype={router_name!r} with params_dtype={params_dtype} is not supported: "
                f"megatron computes the router logits in {router_dtype} (below the parameters' dtype), while moelayers' "
                f"router_dtype only raises the logits' precision (they would stay {params_dtype}), so near-ties would "
                "pick other experts than megatron's. Set moe_router_dtype=None (or 'fp64') with float64 parameters")
        return cls(
            hidden_size=int(tc.hidden_size),
            ffn_hidden_size=int(ffn),
            num_experts=int(tc.num_moe_experts),
            top_k=topk,
            score_fn=score_fn,
            norm_topk_prob=norm,
            params_dtype=params_dtype,
            init_std=float(getattr(tc, "init_method_std", 0.02)),
            router_dtype=router_dtype,
            # megatron's top-k: scores in the logits' dtype up to 0.16, float32 from 0.19 (asked of its code)
            rank_in_logits_dtype=megatron_rounds_scores(),
            rank_post_softmax_by_logits=True,
        )
