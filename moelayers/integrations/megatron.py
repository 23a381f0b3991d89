"""megatron-core integration: drop-in MoE specs and megatron's own ``MoELayer`` for comparisons.

Drop-in use::

    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
    from moelayers.integrations.megatron import moe_spec
    import moelayers as ml

    submodules = TransformerLayerSubmodules(..., mlp=moe_spec(ml.VanillaMoE, dispatcher="alltoall"))

``moe_spec`` returns a ``ModuleSpec(module=MegatronMoEAdapter, params={'layer_cls': ..., **kw})``.
megatron-core 0.16 builds it with ``build_module(spec, config=transformer_config)`` (an unknown MLP
type gets no process groups: the adapter then uses ``parallel_state``'s groups); megatron-core
>= 0.19 calls the mlp slot as a builder, ``spec(config=, pg_collection=, is_mtp_layer=, name=)``
(``ModuleSpec.__call__`` is ``build_module``), and the adapter uses the given ``pg_collection``.

Peer helpers for benchmarks and equality checks: :func:`megatron_moe_layer` builds megatron-core's
own ``MoELayer`` (local spec, no TransformerEngine) for a :class:`~moelayers.MoEConfig`, and
:func:`load_megatron_weights` loads the logical weights ``router [E, H]``, ``w13 [E, 2F, H]``,
``w2 [E, H, F]`` into it.

megatron-core 0.16.x without TransformerEngine cannot run its router (``RouterGatingLinearFunction``
reads an unbound ``te_general_gemm``); :func:`megatron_moe_layer` binds that name to ``None``, the
value megatron's own TE-less fallback uses, when it is missing.

To serve a trained megatron model with our layers, :func:`megatron_weights` reads the logical
weights back out of megatron's ``MoELayer`` (gathered over its expert-parallel ranks):
``adapter.load_full_weights(*megatron_weights(megatron_layer))``.

megatron's distributed checkpointing (``sharded_state_dict``) stores the experts in logical order,
so a checkpoint loads into any placement and expert- or tensor-parallel size, with the state of
megatron's non-distributed optimizers (:mod:`moelayers.integrations.megatron_ckpt`; the distributed
optimizer's default ``fully_sharded_model_space`` format is refused; megatron's writer needs ``psutil``).

Limitations: training with tensor and sequence parallelism, or with tensor parallelism and several
expert-parallel ranks, is refused (inference works); expert tensor parallelism is not supported by
:func:`load_megatron_weights` / :func:`megatron_weights`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from moelayers._autograd import in_backward
from moelayers._compile import eager_under_compile
from moelayers._warnings import warn_caller
from moelayers.config import MoEConfig, megatron_training_losses
from moelayers.experts import GroupedExperts
from moelayers.groups import ParallelGroups, collective_device
from moelayers.layers.base import layer_kwargs as _layer_kwargs
from moelayers.layers.turns import turn_of

try:
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    HAVE_MEGATRON = True
except ImportError:  # pragma: no cover - megatron-core is a dependency
    ModuleSpec = build_module = None  # type: ignore[assignment]
    HAVE_MEGATRON = False

_INSTALL_HINT = "pip install 'megatron-core>=0.16'"

#: Keyword arguments megatron-core passes when it builds an mlp submodule (0.16 ``build_module``
#: extras, >= 0.19 builder arguments, and a few other call sites) that the adapter accepts and
#: ignores without a warning. (It takes ``layer_number``, ``is_mtp_layer``, ``name`` and
#: ``pg_collection`` as arguments of its own.)
MEGATRON_BUILD_KWARGS = frozenset({
    "submodules", "tp_group", "model_comm_pgs", "vp_stage", "pp_layer_offset", "is_expert",
    "input_size", "ffn_hidden_size", "shared_expert", "gate", "hidden_dropout",
})


def _require_megatron(what: str) -> None:
    if not HAVE_MEGATRON:
        raise ImportError(f"{what} needs megatron-core: {_INSTALL_HINT}")


# ---------------------------------------------------------------------------------------- helpers
def _check_layer_cls(layer_cls: Any) -> None:
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, nn.Module)):
        raise TypeError(f"layer_cls must be a moelayers layer class (an nn.Module subclass), got {layer_cls!r}")


def _drop_singleton_groups(groups: ParallelGroups) -> ParallelGroups:
    """Megatron hands out real groups of one; moelayers spells a group of one ``None``."""
    changes = {}
    for name in ("ep", "tp", "dp"):
        if getattr(groups, name) is not None and getattr(groups, f"{name}_size") == 1:
            changes[name] = None
    return dataclasses.replace(groups, **changes) if changes else groups


def groups_for_megatron(pg_collection: Any = None) -> ParallelGroups:
    """The :class:`ParallelGroups` an adapter built by megatron-core uses.

    ``pg_collection`` given (megatron-core >= 0.19 builders) -> its ``ep``/``tp``/``dp``;
    else megatron's initialised ``parallel_state``; else, for a single process (torch.distributed
    not initialised, or a world of one), :meth:`ParallelGroups.single`. Groups of one become ``None``.

    Raises:
        ValueError: several processes but neither ``pg_collection`` nor ``parallel_state``.
    """
    if pg_collection is not None:
        return _drop_singleton_groups(ParallelGroups.from_megatron(pg_collection))
    if HAVE_MEGATRON and _parallel_state_initialised():
        return _drop_singleton_groups(ParallelGroups.from_megatron())
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return ParallelGroups.single()
    raise ValueError(
        f"torch.distributed has {dist.get_world_size()} ranks but megatron-core parallel_state is not "
        "initialised: call parallel_state.initialize_model_parallel(expert_model_parallel_size=...) "
        "before building the model, or pass pg_collection"
    )


def _pick_device(transformer_config: Any, groups: ParallelGroups) -> torch.device:
    """torch's default device where it is set (``with torch.device("meta")``: megatron's
    ``init_model_with_meta_device``); else NCCL groups -> the current CUDA device; gloo groups -> CPU;
    a single process -> CUDA if available (megatron's convention) unless ``use_cpu_initialization``
    is set."""
    chosen = torch.get_default_device()
    if chosen.type != "cpu":
        return chosen
    devices = {collective_device(g) for g in (groups.ep, groups.tp, groups.dp) if g is not None}
    if devices:  # any NCCL group: its GPU
        return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
    if torch.cuda.is_available() and not getattr(transformer_config, "use_cpu_initialization", False):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _padding_to_sb(padding_mask: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """megatron's ``[B, S]`` (True = pad) -> ``[S, B]`` bool; ``[S, B]`` is accepted when unambiguous."""
    if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2:
        raise ValueError(f"padding_mask must be a [B, S] = [{b}, {s}] tensor (True = padding)")
    if padding_mask.dtype.is_floating_point:
        raise TypeError("padding_mask must be bool (True = padding) or integer, not floating point")
    if tuple(padding_mask.shape) == (b, s):
        pad = padding_mask.transpose(0, 1)
    elif tuple(padding_mask.shape) == (s, b):
        pad = padding_mask
    else:
        raise ValueError(f"padding_mask has shape {list(padding_mask.shape)}, expected [B, S] = [{b}, {s}]")
    return pad != 0


# ---------------------------------------------------------------------------------------- adapter
@torch.no_grad()
def megatron_init(layer: nn.Module, config: Any, layer_number: int | None = None) -> bool:
    """Initialise ``layer``'s router and experts with megatron's ``init_method`` (router weight
    ``[E, H]``, each expert's ``w13 [2F, H]``) and ``output_layer_init_method`` (each ``w2 [H, F]``),
    as megatron initialises its own MoE weights.

    The initialisers draw from the default generator of the weights' device; each logical expert
    (and the router) draws under its own seed (from ``layer.seed`` and ``layer_number``) with that
    generator's state saved and restored around it, so every replica of an expert, on any rank, gets
    the same values, layers of different numbers get different ones, and no generator of the caller
    (of this or any other device) is left changed. Empty slots stay zero.

    Returns:
        ``False`` (nothing changed) when ``config.perform_initialization`` is false, it has no
        ``init_method`` or the weights are on the meta device (shapes only: call it again after
        ``to_empty(device=...)``).
    """
    init = getattr(config, "init_method", None)
    w13, w2, router = layer.experts.w13, layer.experts.w2, layer.router.weight
    dev = w13.device
    if init is None or not getattr(config, "perform_initialization", True) or dev.type == "meta":
        return False
    out_init = getattr(config, "output_layer_init_method", None) or init
    base = (layer.seed + 7919 * (layer_number or 0)) * 1_000_003
    module = None if dev.type == "cpu" else torch.get_device_module(dev.type)

    def seed(value: int) -> None:  # the weights' device only (torch.manual_seed would reseed every GPU)
        if module is None:
            torch.random.default_generator.manual_seed(value)
        else:
            with module.device(dev):
                module.manual_seed(value)

    with torch.random.fork_rng(devices=[dev] if module is not None else [], device_type=dev.type):
        seed(base + layer.config.num_experts)
        init(router)
        for s, e in enumerate(layer.placement.experts_on(layer.groups.ep_rank)):
            if e < 0:
                w13[s].zero_()
                w2[s].zero_()
                continue
            seed(base + e)
            init(w13[s])
            out_init(w2[s])
    return True


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (``None``, a group of one: this rank)."""
    if group is None:
        return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
    return sorted(dist.get_process_group_ranks(group))


def _check_groups_are_megatrons(groups: ParallelGroups, pg_collection: Any) -> None:
    """Refuse explicit ``groups`` whose expert- or tensor-parallel ranks are not megatron's, where
    megatron has groups (``pg_collection``, or an initialised ``parallel_state``): the expert
    parameters carry ``allreduce = False``, so megatron's DDP reduces their gradients over its own
    expert-data-parallel group, i.e. over ranks that hold other experts (or hold the same experts
    but are left out), without any error.

    Raises:
        ValueError: naming both sets of ranks and the way out.
    """
    if pg_collection is None and not (HAVE_MEGATRON and _parallel_state_initialised()):
        return
    theirs = groups_for_megatron(pg_collection)
    for name, what in (("ep", "expert-parallel"), ("tp", "tensor-parallel")):
        mine, meg = _group_ranks(getattr(groups, name)), _group_ranks(getattr(theirs, name))
        if mine != meg:
            raise ValueError(
                f"MegatronMoEAdapter: groups= has {what} ranks {mine} on this rank, megatron's "
                f"{'pg_collection' if pg_collection is not None else 'parallel_state'} {meg}: megatron's DDP "
                "reduces the experts' gradients over its own expert-data-parallel group (their parameters carry "
                "allreduce=False), so they would be summed over ranks that hold other experts without an error. "
                "Leave groups= out (the adapter takes megatron's), or initialise megatron with these sizes "
                "(parallel_state.initialize_model_parallel(expert_model_parallel_size=..., "
                "tensor_model_parallel_size=...))")


def _parallel_state_initialised() -> bool:
    from megatron.core import parallel_state as ps

    return bool(ps.model_parallel_is_initialized())


class MegatronMoEAdapter(nn.Module):
    """A moelayers layer in megatron-core's mlp slot.

    Built by megatron-core from :func:`moe_spec`. Accepts both build conventions:
    0.16's ``build_module(spec, config=transformer_config, ...)`` and >= 0.19's
    ``builder(config=, pg_collection=, is_mtp_layer=, name=)``.

    Args:
        config: megatron ``TransformerConfig``; the layer's :class:`MoEConfig` is
            ``MoEConfig.from_megatron(config)``.
        layer_cls: the moelayers layer class (default :class:`moelayers.VanillaMoE`).
        pg_collection: megatron ``ProcessGroupCollection`` (>= 0.19 passes one); see
            :func:`groups_for_megatron` for what is used without it.
        groups: explicit :class:`ParallelGroups` (instead of ``pg_collection``'s); where megatron
            has groups, their expert- and tensor-parallel ranks must be megatron's.
        layer_number, is_mtp_layer, name: megatron's bookkeeping, stored.
        **kwargs: keyword arguments of ``layer_cls`` (from the spec's ``params``) go to the layer;
            megatron build-time extras (:data:`MEGATRON_BUILD_KWARGS`) are ignored; anything else is
            ignored with a warning. Ignored names are kept in ``ignored_build_kwargs``.

    Default device: torch's default device where one is set (``with torch.device("meta")``, as
    megatron's ``init_model_with_meta_device`` builds), else the current CUDA device with NCCL groups
    (or a single process on a CUDA machine without ``use_cpu_initialization``), else CPU; pass
    ``device=`` in the spec to override. Built on the meta device, the weights get values after
    ``to_empty(device=...)`` from a checkpoint, or from ``megatron_init(adapter.layer, config,
    layer_number)``.
    Weights: megatron's own initialisers (:func:`megatron_init`): ``config.init_method`` for the
    router and each expert's ``w13``, ``config.output_layer_init_method`` for its ``w2`` (by
    default ``N(0, init_method_std)`` and ``N(0, init_method_std / sqrt(2 num_layers))``), each
    logical expert from its own seed so that replicas and ranks agree; with
    ``perform_initialization=False`` the layer keeps its own default initialisation. Then usually
    :meth:`load_full_weights`. Expert parameters carry ``allreduce = False`` (megatron's DDP reduces
    them over the expert-data-parallel group only).
    """

    def __init__(
        self,
        config: Any,
        layer_cls: type | None = None,
        *,
        pg_collection: Any = None,
        groups: ParallelGroups | None = None,
        layer_number: int | None = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
        **kwargs: Any,
    ):
        super().__init__()
        if layer_cls is None:
            from moelayers.layers import VanillaMoE

            layer_cls = VanillaMoE
        _check_layer_cls(layer_cls)
        accepted = _layer_kwargs(layer_cls)
        layer_kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        ignored = sorted(k for k in kwargs if k not in accepted)
        unknown = [k for k in ignored if k not in MEGATRON_BUILD_KWARGS]
        if unknown:
            warnings.warn(
                f"MegatronMoEAdapter ignores build arguments {unknown}: neither {layer_cls.__name__} "
                "nor megatron-core's known mlp build arguments take them",
                stacklevel=2,
            )
        self.ignored_build_kwargs: tuple[str, ...] = tuple(ignored)
        self.config = config  # megatron's TransformerConfig, as on megatron modules
        moe_config = MoEConfig.from_megatron(config)
        self.training_losses: tuple[str, ...] = tuple(megatron_training_losses(config))
        if groups is not None and not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a ParallelGroups, got {type(groups).__name__}")
        if groups is not None:
            _check_groups_are_megatrons(groups, pg_collection)
        self.groups = groups if groups is not None else groups_for_megatron(pg_collection)
        if "device" in accepted and layer_kwargs.get("device") is None:
            layer_kwargs["device"] = _pick_device(config, self.groups)
        self.layer_number, self.is_mtp_layer = layer_number, bool(is_mtp_layer)
        self.layer = layer_cls(moe_config, self.groups, **layer_kwargs)
        self.layer.layer_number = layer_number  # compared across the ranks in every exchange
        megatron_init(self.layer, config, layer_number)
        modules = getattr(config, "recompute_modules", None) or ()
        selective = getattr(config, "recompute_granularity", None) == "selective"
        #: megatron's selective recompute of the MoE layer (``recompute_granularity='selective'``, ``'moe'``
        #: in ``recompute_modules``, not with ``cuda_graph_impl='local'``): forwards with grad enabled are
        #: checkpointed, as megatron's ``MoELayer`` checkpoints its own
        self.recompute = selective and "moe" in modules and getattr(config, "cuda_graph_impl", None) != "local"
        if selective and "moe_act" in modules and "moe" not in modules:
            warnings.warn("MegatronMoEAdapter: recompute_modules 'moe_act' (megatron's recompute of its experts' "
                          "activation) does not apply to moelayers' experts, which keep their activations; 'moe' "
                          "recomputes the whole layer", stacklevel=2)
        if getattr(config, "moe_token_dispatcher_type", None) == "flex" or getattr(config, "moe_enable_deepep", False):
            warnings.warn(f"MegatronMoEAdapter: megatron's flex token dispatcher (DeepEP) is not used: the layer "
                          f"exchanges tokens with moelayers' {self.layer.dispatcher_name!r} dispatcher (moe_spec("
                          "..., dispatcher=...)); the output is the same", stacklevel=2)
        self._expert_groups = (getattr(pg_collection, "expt_tp", None), getattr(pg_collection, "expt_dp", None))
        self._warned_replica_clip = False
        for module in self.layer.modules():
            if isinstance(module, GroupedExperts):
                for p in module.parameters(recurse=False):
                    p.allreduce = False

    def __deepcopy__(self, memo: dict) -> "MegatronMoEAdapter":
        """A copy (a reference model, an EMA copy) that shares megatron's expert process groups, as
        the layer's copy shares its own (handles cannot be copied)."""
        import copy

        for group in self._expert_groups:
            if group is not None:
                memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    @property
    def moe_config(self) -> MoEConfig:
        """The layer's :class:`MoEConfig` (from megatron's config; ``params_dtype`` follows a cast of the
        adapter, ``.to(dtype)``, as the layer's does)."""
        return self.layer.config

    def set_layer_number(self, layer_number: int) -> None:
        """Called by megatron's ``TransformerLayer`` right after building the mlp: the initial weights
        are drawn again for this layer number (:func:`megatron_init`), so that the layers of one spec
        do not all start alike (load trained weights after building the model, as usual)."""
        if layer_number != self.layer_number:
            megatron_init(self.layer, self.config, layer_number)
        self.layer_number = self.layer.layer_number = layer_number

    def load_full_weights(self, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                          verify: bool = True) -> None:
        """``router_weight [E, H]``, ``w13 [E, 2F, H]``, ``w2 [E, H, F]`` (see ``MoELayerBase``; ``verify``
        compares the weights across the expert-parallel ranks, a collective)."""
        self.layer.load_full_weights(router_weight, w13, w2, verify=verify)

    def export_full_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The wrapped layer's logical weights (see ``MoELayerBase.export_full_weights``).

        Every expert-parallel rank must call it (the experts are gathered over the EP group).

        Returns:
            ``(router_weight [E, H], w13 [E, 2F, H], w2 [E, H, F])``, in logical expert order: what
            :meth:`load_full_weights` takes.
        """
        return self.layer.export_full_weights()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        """megatron's distributed checkpointing of the wrapped layer, in logical expert order.

        Expert rows are saved as one ``[E, ...]`` tensor per weight, whatever the placement and the
        number of expert-parallel ranks, so the checkpoint loads into any placement and any
        expert-parallel size; the layer keeps its own placement (see
        :mod:`moelayers.integrations.megatron_ckpt`). megatron's ``TransformerLayer`` calls it for its
        mlp; optimizers find the expert weights by parameter.

        Args:
            prefix: key prefix (e.g. ``'decoder.layers.0.mlp.'``).
            sharded_offsets: megatron's offsets of the enclosing modules.
            metadata: megatron's sharded-state-dict metadata.

        Returns:
            megatron's sharded state dict of the wrapped layer (keys ``{prefix}layer.*``).

        Raises:
            ValueError: several ranks may hold the same experts and neither ``ParallelGroups.edp``,
                the builder's ``pg_collection`` nor megatron's ``parallel_state`` says which; and,
                when megatron builds the expert shards, flat ones (``fully_sharded_model_space``).
            RuntimeError: when megatron builds the expert shards in its save or load, the layer's
                placement has changed since this call.
        """
        from moelayers.integrations.megatron_ckpt import expert_replica_coords, layer_sharded_state_dict

        return layer_sharded_state_dict(self.layer, f"{prefix}layer.", sharded_offsets, metadata,
                                        expert_replica=expert_replica_coords(self.groups, *self._expert_groups))

    @eager_under_compile  # eager under torch.compile, as MoELayerBase.forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
        *,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """megatron's mlp interface (``MoELayer.forward``'s positional order).

        Args:
            hidden_states: ``[S, B, H]``.
            intermediate_tensors: megatron's partial CUDA-graph capture; must be ``None`` (pass a
                padding mask by keyword, ``padding_mask=``, or third).
            padding_mask: optional ``[B, S]`` bool, True = padding (megatron's convention; an
                ``[S, B]`` mask is accepted when ``S != B``). Padded tokens are dropped before the
                layer -- never routed, never sent -- and their output rows are zero, so they
                cannot change the output of real tokens (nor the layer's statistics). megatron-core's
                own ``MoELayer`` (0.16) still routes and computes padded tokens (it reads the mask
                for its auxiliary losses only): compare the two on real tokens only.
            token_ids: optional token ids (for layers that use them): ``[S, B]`` like
                ``hidden_states``, or ``[S * B]`` in its flattened order. megatron's ``[B, S]``
                ``input_ids`` must be transposed first (``input_ids.t()``): with ``S != B`` they
                are refused, since they would pair ids with the wrong tokens.

        Returns:
            ``(output [S, B, H], None)``: no bias.

        Forced routing (``self.layer.force_routing(ids)``, e.g. trace replay) is laid out like
        ``hidden_states``: ``[S, B, K]`` or ``[S * B, K]``; with a ``padding_mask`` the padded rows
        are dropped from it as from ``hidden_states``. Activation checkpointing that hands the
        adapter the same ``hidden_states`` again recomputes the forward with the routing it had
        (padding mask or not), as does megatron's selective recompute of the MoE layer
        (``recompute_granularity='selective'``, ``'moe'`` in ``recompute_modules``), which the
        adapter applies itself to forwards with grad enabled (:attr:`recompute`).

        Raises:
            RuntimeError: training (``self.training`` with grad enabled) while the config turns on
                megatron's auxiliary or z loss, which moelayers does not add to the router's
                gradient (:attr:`training_losses`); tensor parallelism with sequence parallelism,
                where each TP rank routes other tokens and the router's and experts' gradients would
                need a sum over the TP ranks that megatron does not do for them; or tensor
                parallelism without sequence parallelism and several expert-parallel ranks, where
                every TP rank sends the same tokens to the experts and their gradients would be
                counted once per TP rank (megatron's ``MoELayer`` refuses to train with TP > 1
                without sequence parallelism), and the same with one expert-parallel rank when
                ``expert_tensor_parallel_size`` differs from the TP size (megatron's DDP sums the
                experts' identical gradients over the TP ranks then), and in any training with an
                ``expert_tensor_parallel_size`` other than the TP size (with TP 1 and expert TP 2,
                megatron leaves the expert-TP ranks out of the expert gradients' sum, and their
                whole copies of the experts drift apart). Inference runs as usual.
            NotImplementedError: ``intermediate_tensors`` is given.
            TypeError, ValueError: ``hidden_states``, ``padding_mask``, ``token_ids`` or the forced
                routing are refused.
            Whatever the adapter refuses on one rank, with several expert-parallel ranks that rank
            first takes part in the layer's exchange with no tokens, so the other ranks raise
            ``ValueError`` too instead of waiting for it (the layer's ``_refuse_in_step``).
        """
        training = self.training and torch.is_grad_enabled()
        refusal = self._training_refusal(training)
        if refusal is None and intermediate_tensors is not None:
            hint = ("; a bool tensor was passed second: the padding mask goes third or by keyword "
                    "(forward(hidden_states, padding_mask=mask))"
                    if torch.is_tensor(intermediate_tensors) and intermediate_tensors.dtype == torch.bool else "")
            refusal = NotImplementedError("MegatronMoEAdapter does not support partial CUDA-graph capture "
                                          f"(intermediate_tensors){hint}")
        if refusal is not None:  # every expert-parallel rank raises, not this one alone
            self._refuse(refusal)
        if training and not self._warned_replica_clip and int(self.layer.placement.logcnt.max()) > 1:
            self._warned_replica_clip = True
            warn_caller(
                "MegatronMoEAdapter trains a placement with replicated experts: megatron's gradient clipping "
                "(OptimizerConfig.clip_grad > 0; its default is 1.0) takes the norm parameter by parameter and "
                "counts such an expert's gradient once per copy, so its norm is larger than the dense model's and "
                "clipping scales the step down more. Set clip_grad=0.0 while training with replicas, or train in a "
                "placement without them (outputs and gradients are right either way)")
        if (self.layer._forced_ids is not None and self.training and not in_backward()  # megatron: training only
                and getattr(self.config, "recompute_granularity", None) == "full" and _in_megatron_checkpoint()):
            self._refuse(ValueError(
                "forced routing under megatron's full recompute (recompute_granularity='full'): the recomputation "
                "re-runs this layer on a tensor made inside the recomputed transformer layer, where the forced ids "
                "cannot be found again. Use recompute_granularity='selective' with 'moe' in recompute_modules (the "
                "adapter checkpoints the MoE itself, forced routing included)"))
        if self.recompute and torch.is_grad_enabled() and not in_backward() and self.layer.capacity is None:
            # megatron's MoELayer checkpoints itself likewise (its moe_layer_recompute); torch's non-reentrant
            # checkpoint runs on CPU too (megatron's saves CUDA RNG states), and the layer draws no random numbers
            y = torch.utils.checkpoint.checkpoint(self._forward, hidden_states, padding_mask, token_ids,
                                                  use_reentrant=False)
        else:
            y = self._forward(hidden_states, padding_mask, token_ids)
        return y, None

    def _training_refusal(self, training: bool) -> RuntimeError | None:
        """Why this forward cannot train through the adapter (see :meth:`forward`'s Raises), or ``None``."""
        if not training:
            return None
        if self.training_losses:
            return RuntimeError(
                f"the transformer_config turns on training losses moelayers does not implement: "
                f"{', '.join(self.training_losses)}; megatron would add them to the router's gradient here, "
                "moelayers would silently miss them. Set the coefficients to 0 to train, or run inference "
                "(model.eval() or torch.no_grad())"
            )
        tp = int(getattr(self.config, "tensor_model_parallel_size", 1) or 1)
        if tp > 1 and getattr(self.config, "sequence_parallel", False):
            return RuntimeError(
                f"training through the adapter with tensor_model_parallel_size={tp} and sequence_parallel=True is "
                "not supported: each TP rank routes its own tokens, so the router's and experts' gradients are "
                "partial sums that megatron's gradient reduction does not add up over the TP ranks here (the "
                "copies would drift apart). Train with sequence_parallel=False or tensor_model_parallel_size=1; "
                "inference runs as usual")
        if tp > 1 and not getattr(self.config, "sequence_parallel", False) and self.groups.ep_size > 1:
            return RuntimeError(
                f"training through the adapter with tensor_model_parallel_size={tp}, sequence_parallel=False and "
                f"{self.groups.ep_size} expert-parallel ranks is not supported: the TP ranks hold the same tokens and "
                "each sends them to the experts, so the experts' gradients would count every token once per TP rank "
                "(megatron's own MoELayer refuses to train with tensor parallelism without sequence parallelism). "
                "Train with tensor_model_parallel_size=1 or expert_model_parallel_size=1; inference runs as usual")
        etp = int(getattr(self.config, "expert_tensor_parallel_size", None) or tp)  # megatron's default: tp
        if etp != tp:  # (tp > 1 here runs without sequence parallelism: refused above)
            why = (f"every TP rank computes the experts' whole gradient from the same tokens, and the expert-data-"
                   f"parallel group megatron's DDP sums the expert gradients over holds the TP ranks: they would "
                   f"count {tp // max(etp, 1)} times" if etp < tp else
                   f"megatron shards each expert over the {etp} expert-TP ranks and sums the expert gradients over "
                   f"the expert-data-parallel group only, which leaves those ranks out; they route different tokens "
                   f"(moelayers keeps whole experts on each), so each would keep its own gradient and the copies "
                   f"of an expert drift apart from the first step")
            return RuntimeError(
                f"training through the adapter with tensor_model_parallel_size={tp} and expert_tensor_parallel_size="
                f"{etp} is not supported: {why}. Train with expert_tensor_parallel_size={tp} (megatron's default: the "
                "tensor-parallel size); inference runs as usual")
        return None

    def _forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None,
                 token_ids: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` after the training checks (and its recomputation), in the layer's turn: its
        forced routing, replay key and forward belong to one call (``moelayers/layers/turns.py``)."""
        with turn_of(self.layer):
            return self._forward_rows(hidden_states, padding_mask, token_ids)

    def _forward_rows(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None,
                      token_ids: torch.Tensor | None) -> torch.Tensor:
        """Validates, drops padded rows, runs the layer."""
        try:
            if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
                raise ValueError("hidden_states must be an [S, B, H] tensor")
            s, b, h = hidden_states.shape
            if token_ids is not None:
                if not isinstance(token_ids, torch.Tensor):
                    raise TypeError(f"token_ids must be a tensor, got {type(token_ids).__name__}")
                if token_ids.numel() != s * b or (token_ids.dim() > 1 and tuple(token_ids.shape) != (s, b)):
                    raise ValueError(f"token_ids must be [S, B] = [{s}, {b}] like hidden_states (or flat [{s * b}]), "
                                     f"got {list(token_ids.shape)}: transpose megatron's [B, S] input_ids first")
                token_ids = token_ids.reshape(-1)
            if padding_mask is not None:
                keep = ~_padding_to_sb(padding_mask, s, b).reshape(-1).to(hidden_states.device)
                idx = keep.nonzero().squeeze(1)
                # (a recomputation leaves the ids forced for the next forward where they are)
                forced = None if in_backward() else self._forced_rows(s, b, idx)
        except Exception as exc:  # whatever this rank's input raised: the other ranks must learn it
            self._refuse(exc)  # raises
        if padding_mask is None:
            return self.layer(hidden_states, token_ids=token_ids)
        x2 = hidden_states.reshape(s * b, h)
        ids = None if token_ids is None else token_ids.index_select(0, idx.to(token_ids.device))
        if forced is not None:
            self.layer.force_routing(forced)
        rows = x2.index_select(0, idx)
        # activation checkpointing recomputes this forward from hidden_states (the rows are new tensors):
        # the layer keys its routing by them, so that a forced routing is recomputed as it was
        self.layer._replay_key = hidden_states
        try:
            y_kept = self.layer(rows, token_ids=ids)  # every rank calls: collectives
        finally:
            self.layer._replay_key = None
        return x2.new_zeros(s * b, h).index_copy(0, idx, y_kept).view(s, b, h)

    def _forced_rows(self, s: int, b: int, idx: torch.Tensor) -> torch.Tensor | None:
        """The layer's pending forced routing (``[S, B, K]`` or ``[S * B, K]``, laid out like
        ``hidden_states``) as ``[S * B, K]`` rows, keeping the rows ``idx`` of the unpadded tokens;
        ``None`` when no routing is forced. The caller forces the result again.

        Raises:
            ValueError: the forced routing is not laid out like ``hidden_states``.
        """
        forced = self.layer._forced_ids
        if forced is None:
            return None
        if forced.dim() == 3 and tuple(forced.shape[:2]) == (s, b):
            forced = forced.reshape(s * b, forced.shape[-1])
        if forced.dim() != 2 or forced.shape[0] != s * b:
            raise ValueError(f"forced routing has shape {list(forced.shape)}; with a padding_mask it must be laid out "
                             f"like hidden_states: [S, B, K] = [{s}, {b}, K] or [S * B, K] = [{s * b}, K]")
        return forced.index_select(0, idx.to(forced.device))

    def _refuse(self, exc: Exception) -> NoReturn:
        """Raise ``exc`` for this rank's input refused by the adapter; with several expert-parallel
        ranks only after taking part in the layer's exchange (``_refuse_in_step``), so that the other
        ranks raise too instead of waiting for this one. Pending forced routing is dropped, as the
        layer drops it in a forward that raises."""
        if not in_backward():
            self.layer._forced_ids = None
        if self.groups.ep_size > 1:  # the exchange of MoELayerBase.forward, which the adapter runs in any mode
            self.layer._refuse_in_step(exc)  # raises (not refuse_input: SemanticMoE's in tp mode agrees otherwise)
        raise exc

    def extra_repr(self) -> str:
        return f"layer_number={self.layer_number}, is_mtp_layer={self.is_mtp_layer}"


def _in_megatron_checkpoint() -> bool:
    """Whether megatron's own activation checkpointing (``tensor_parallel.checkpoint``) is running, as far
    as this megatron-core says (``is_checkpointing``; without it, or under TransformerEngine's
    checkpoint, the recomputation's own error in the backward remains)."""
    try:
        from megatron.core.tensor_parallel.random import is_checkpointing
    except ImportError:  # pragma: no cover - another megatron-core layout
        return False
    return bool(is_checkpointing())


def moe_spec(layer_cls: type, **layer_kwargs: Any) -> "ModuleSpec":
    """A megatron ``ModuleSpec`` for ``TransformerLayerSubmodules.mlp``.

    Args:
        layer_cls: a moelayers layer class, e.g. ``moelayers.VanillaMoE``.
        **layer_kwargs: keyword arguments of ``layer_cls`` (``dispatcher=``, ``placement=``,
            ``device=``, ...), plus optionally ``groups=`` (a :class:`ParallelGroups`; where megatron
            has groups, with megatron's expert- and tensor-parallel ranks: others are refused).

    Returns:
        ``ModuleSpec(module=MegatronMoEAdapter, params={'layer_cls': layer_cls, **layer_kwargs})``;
        megatron-core 0.16 builds it with ``build_module(spec, config=...)``, >= 0.19 calls it as
        ``spec(config=, pg_collection=, is_mtp_layer=, name=)``.

    Raises:
        TypeError: ``layer_cls`` is not a layer class, or it does not take one of ``layer_kwargs``.
    """
    _require_megatron("moe_spec")
    _check_layer_cls(layer_cls)
    reserved = {"config", "layer_cls", "pg_collection", "layer_number", "is_mtp_layer", "name"} & set(layer_kwargs)
    if reserved:
        raise TypeError(f"moe_spec: {sorted(reserved)} are supplied by megatron-core at build time")
    unknown = set(layer_kwargs) - _layer_kwargs(layer_cls) - {"groups"}
    if unknown:
        raise TypeError(f"moe_spec: {layer_cls.__name__} does not take {sorted(unknown)}")
    return ModuleSpec(module=MegatronMoEAdapter, params={"layer_cls": layer_cls, **layer_kwargs})


def __getattr__(name: str) -> Any:
    """megatron's own MoELayer (the peer) lives in megatron_peer.py, which imports this module:
    ``load_megatron_weights``, ``megatron_moe_layer`` and ``megatron_weights`` are re-exported here lazily."""
    if name in ("load_megatron_weights", "megatron_moe_layer", "megatron_weights"):
        from moelayers.integrations import megatron_peer

        return getattr(megatron_peer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HAVE_MEGATRON", "MEGATRON_BUILD_KWARGS", "MegatronMoEAdapter", "groups_for_megatron",
    "load_megatron_weights", "megatron_init", "megatron_moe_layer", "megatron_weights", "moe_spec",
]
