"""megatron-core's own ``MoELayer`` as a peer for benchmarks and equality checks.

:func:`megatron_moe_layer` builds it (local spec, no TransformerEngine) for a
:class:`~moelayers.MoEConfig`; :func:`load_megatron_weights` loads the logical weights
``router [E, H]``, ``w13 [E, 2F, H]``, ``w2 [E, H, F]`` into it. See ``megatron.py`` for the
drop-in adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moelayers.config import ROUTER_DTYPES, MoEConfig
from moelayers.integrations.megatron import ModuleSpec, _require_megatron, build_module

# ------------------------------------------------------------------ megatron's own MoELayer (peers)
def _call_filtered(fn: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature takes (API drift between versions)."""
    params = inspect.signature(fn).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _grouped_gemm_available() -> bool:
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
    except ImportError:
        return False
    return bool(gg.grouped_gemm_is_available())


def _fix_router_gemm_without_te() -> None:
    """megatron-core 0.16.x without TransformerEngine: ``RouterGatingLinearFunction.forward`` reads the
    module global ``te_general_gemm``, which is only bound when TE imports (NameError otherwise).
    Bind it to ``None`` -- the value megatron's own TE-less fallback uses -- so the router takes its
    ``torch.mm`` path. Nothing is changed where the name exists."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if hasattr(moe_utils, "RouterGatingLinearFunction") and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _default_pg_collection() -> Any:
    """megatron's MoE process groups from ``parallel_state`` (``None``: let megatron pick them)."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    except ImportError:
        return None
    return get_default_pg_collection()


def _ensure_process_group(device: torch.device) -> None:
    """megatron's parallel_state needs torch.distributed: start a world of one if there is none."""
    if dist.is_initialized():
        return
    from moelayers.testing import free_port

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _router_mapping(config: MoEConfig) -> tuple[str, bool]:
    """``(moe_router_score_function, moe_router_pre_softmax)`` reproducing ``config``'s routing."""
    if config.score_fn == "softmax":
        # top-k of logits, then softmax over them == renormalised top-k of the softmax
        if config.top_k == 1 and config.norm_topk_prob:
            raise ValueError("megatron requires moe_router_pre_softmax for softmax top-1 routing, whose weight is "
                             "the softmax probability: norm_topk_prob=True with top_k=1 has no megatron equivalent")
        return "softmax", not config.norm_topk_prob
    if config.norm_topk_prob != (config.top_k > 1):
        raise ValueError(
            "megatron's sigmoid router renormalises exactly when top_k > 1: "
            f"norm_topk_prob={config.norm_topk_prob} with top_k={config.top_k} has no megatron equivalent"
        )
    return "sigmoid", False


def _router_dtype_name(config: MoEConfig) -> str | None:
    """megatron's ``moe_router_dtype`` for ``config.router_dtype`` (``None``: the input's dtype)."""
    names = {dtype: name for name, dtype in ROUTER_DTYPES.items()}
    if config.router_dtype not in names:
        raise ValueError(f"MoEConfig.router_dtype={config.router_dtype}: megatron's moe_router_dtype offers "
                         f"{sorted(map(str, names))} only")
    return names[config.router_dtype]


def _transformer_config(config: MoEConfig, dtype: torch.dtype, ep: int, tp: int, grouped: bool, cpu: bool,
                        dispatcher: str = "alltoall") -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    score_fn, pre_softmax = _router_mapping(config)
    wanted = dict(
        num_layers=1, hidden_size=config.hidden_size, num_attention_heads=1,
        ffn_hidden_size=config.ffn_hidden_size, moe_ffn_hidden_size=config.ffn_hidden_size,
        num_moe_experts=config.num_experts, moe_router_topk=config.top_k,
        moe_router_score_function=score_fn, moe_router_pre_softmax=pre_softmax,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none", moe_z_loss_coeff=None,
        moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_router_dtype=_router_dtype_name(config), moe_grouped_gemm=grouped, moe_permute_fusion=False,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype, pipeline_dtype=dtype,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        sequence_parallel=False, use_cpu_initialization=cpu, perform_initialization=False,
        init_method_std=config.init_std,
    )
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    required = {"hidden_size", "num_moe_experts", "moe_router_topk", "moe_token_dispatcher_type",
                "moe_router_score_function", "gated_linear_unit", "params_dtype", "expert_model_parallel_size"}
    missing = required - names
    if missing:
        raise RuntimeError(f"this megatron-core's TransformerConfig lacks {sorted(missing)}")
    return TransformerConfig(**{k: v for k, v in wanted.items() if k in names})


def megatron_moe_layer(config: MoEConfig, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda"):
    """megatron-core's own ``MoELayer`` for ``config``, for benchmarks and equality checks.

    Built from megatron's local spec (no TransformerEngine): ``GroupedMLP`` experts when the
    ``grouped_gemm`` package is installed and the layer is bf16 on CUDA, else ``SequentialMLP``
    (the class used is in ``layer.experts``). All-to-all dispatcher, no aux loss, no token dropping,
    router logits in ``config.router_dtype`` (megatron's ``moe_router_dtype``), no biases, SwiGLU;
    expert parallel over the whole world (``parallel_state`` is initialised with
    ``expert_model_parallel_size = world`` if it is not yet; torch.distributed is started as a world
    of one if it is not yet). Weights are ``N(0, config.init_std)`` from a fixed
    seed; use :func:`load_megatron_weights`. ``forward(x [S, B, H]) -> (y, None)``.

    Note: megatron-core's all-to-all dispatcher creates CUDA streams, so this needs CUDA.

    Args:
        config: the layer's shape and routing (a :class:`moelayers.MoEConfig`).
        dtype: megatron's ``params_dtype`` (its experts are ``GroupedMLP`` only in bfloat16).
        device: where the weights live (``"cuda"``: the current CUDA device).

    Raises:
        ImportError: megatron-core is missing.
        TypeError: ``config`` is not a ``MoEConfig``.
        ValueError: the routing has no megatron equivalent or ``num_experts`` does not divide over
            the expert-parallel group.
        NotImplementedError: megatron's expert tensor parallel size is not 1 (this peer is a
            benchmark baseline; ours supports expert tensor parallelism through ``tp``).
    """
    _require_megatron("megatron_moe_layer")
    return _build_megatron_moe(config, dtype=dtype, device=device, dispatcher="alltoall")


def _build_megatron_moe(config: MoEConfig, *, dtype: torch.dtype, device: str | torch.device,
                        dispatcher: str = "alltoall", grouped: bool | None = None):
    """:func:`megatron_moe_layer` with the dispatcher and expert module selectable (``grouped=None``:
    ``GroupedMLP`` where it can run). Tests build megatron's MoELayer on CPU with ``'allgather'``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import moe_module_specs

    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    _fix_router_gemm_without_te()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _ensure_process_group(device)
    if not ps.model_parallel_is_initialized():
        _call_filtered(ps.initialize_model_parallel, expert_model_parallel_size=dist.get_world_size())
    ep = ps.get_expert_model_parallel_world_size()
    tp = ps.get_tensor_model_parallel_world_size()
    if hasattr(ps, "get_expert_tensor_parallel_world_size") and ps.get_expert_tensor_parallel_world_size() != 1:
        raise NotImplementedError("megatron_moe_layer supports expert tensor parallel size 1 only")
    if config.num_experts % ep:
        raise ValueError(f"num_experts={config.num_experts} does not divide over expert parallel size {ep}")
    if grouped is None:
        grouped = dtype == torch.bfloat16 and device.type == "cuda" and _grouped_gemm_available()
    tc = _transformer_config(config, dtype, ep, tp, grouped, cpu=device.type == "cpu", dispatcher=dispatcher)
    spec = _call_filtered(moe_module_specs.get_moe_module_spec, use_te=False,
                          num_experts=config.num_experts, moe_grouped_gemm=grouped)
    pg_collection = _default_pg_collection()
    ctx = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        if isinstance(spec, ModuleSpec):
            layer = build_module(spec, config=tc, pg_collection=pg_collection)
        else:  # megatron-core >= 0.19: an MlpBuilder (e.g. functools.partial) instead of a ModuleSpec
            layer = _call_filtered(spec, config=tc, pg_collection=pg_collection, is_mtp_layer=False, name="moe")
    layer = layer.to(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(12345)
    with torch.no_grad():
        for _, p in sorted(layer.named_parameters(), key=lambda kv: kv[0]):
            p.normal_(0.0, config.init_std, generator=gen)
    return layer


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: megatron holds {list(dst.shape)}, got {list(src.shape)} "
                         "(expert tensor parallelism is not supported)")
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def _local_experts(layer: Any) -> list[int]:
    """The logical experts this expert-parallel rank of a megatron ``MoELayer`` holds, in its order."""
    local = getattr(layer, "local_expert_indices", None)
    if local is None:
        from megatron.core import parallel_state as ps

        n = layer.num_local_experts
        local = range(ps.get_expert_model_parallel_rank() * n, (ps.get_expert_model_parallel_rank() + 1) * n)
    return [int(i) for i in local]


@torch.no_grad()
def megatron_weights(layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logical weights of a megatron-core ``MoELayer``, the inverse of :func:`load_megatron_weights`:
    to serve a trained megatron model with our layers, ``adapter.load_full_weights(*megatron_weights(meg))``
    (a collective over megatron's expert-parallel group: every rank gathers every expert).

    Returns:
        ``(router_weight [E, H], w13 [E, 2F, H], w2 [E, H, F])`` in the layer's dtype and device, the
        same on every rank.

    Raises:
        ValueError: the router or the experts carry a non-zero bias (our experts have none), or the
            layout is not one this reads (expert tensor parallelism is not supported).
        TypeError: experts other than SequentialMLP, GroupedMLP and TEGroupedMLP.
    """
    tc = layer.config
    e, h = tc.num_moe_experts, tc.hidden_size
    f = getattr(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size
    local = _local_experts(layer)
    n = len(local)
    biases = [getattr(layer.router, "bias", None)]
    experts = layer.experts
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):  # GroupedMLP
        if tuple(experts.weight1.shape) != (h, n * 2 * f) or tuple(experts.weight2.shape) != (n * f, h):
            raise ValueError(f"GroupedMLP weights {list(experts.weight1.shape)}, {list(experts.weight2.shape)} do not "
                             f"match H={h}, F={f}, {n} local experts (expert tensor parallelism is not supported)")
        w13 = experts.weight1.view(n, h, 2 * f).transpose(1, 2)
        w2 = experts.weight2.view(n, f, h).transpose(1, 2)
    elif hasattr(experts, "local_experts"):  # SequentialMLP
        w13 = torch.stack([mlp.linear_fc1.weight for mlp in experts.local_experts])
        w2 = torch.stack([mlp.linear_fc2.weight for mlp in experts.local_experts])
        biases += [getattr(lin, "bias", None) for mlp in experts.local_experts for lin in (mlp.linear_fc1, mlp.linear_fc2)]
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):  # TEGroupedMLP
        w13 = torch.stack([getattr(experts.linear_fc1, f"weight{i}") for i in range(n)])
        w2 = torch.stack([getattr(experts.linear_fc2, f"weight{i}") for i in range(n)])
        biases += [getattr(lin, f"bias{i}", None) for i in range(n) for lin in (experts.linear_fc1, experts.linear_fc2)]
    else:
        raise TypeError(f"megatron_weights reads SequentialMLP, GroupedMLP and TEGroupedMLP experts, "
                        f"not {type(experts).__name__}")
    if tuple(w13.shape) != (n, 2 * f, h) or tuple(w2.shape) != (n, h, f):
        raise ValueError(f"megatron's experts hold {list(w13.shape)}, {list(w2.shape)}, expected {[n, 2 * f, h]}, "
                         f"{[n, h, f]} (expert tensor parallelism is not supported)")
    if any(isinstance(b, torch.Tensor) and b.numel() and bool(b.ne(0).any()) for b in biases):
        raise ValueError("megatron's router or experts have a non-zero bias: moelayers' experts have none "
                         "(add_bias_linear=False)")
    full13 = w13.new_empty(e, 2 * f, h)
    full2 = w2.new_empty(e, h, f)
    index = torch.tensor(local, dtype=torch.int64, device=w13.device)
    group = _expert_group()
    if group is None:
        if n != e:
            raise ValueError(f"this process holds {n} of {e} experts but no expert-parallel group is initialised")
        return layer.router.weight.detach().clone(), full13.index_copy_(0, index, w13), full2.index_copy_(0, index, w2)
    world = dist.get_world_size(group)
    parts = [torch.empty_like(t) for t in (index, w13.contiguous(), w2.contiguous()) for _ in range(world)]
    for k, t in enumerate((index, w13.contiguous(), w2.contiguous())):
        dist.all_gather(parts[k * world:(k + 1) * world], t, group=group)
    index_all = torch.cat(parts[:world])
    full13.index_copy_(0, index_all, torch.cat(parts[world:2 * world]))
    full2.index_copy_(0, index_all, torch.cat(parts[2 * world:]))
    return layer.router.weight.detach().clone(), full13, full2


def _expert_group():
    """megatron's expert-parallel process group, ``None`` for a group of one (or no parallel state)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        return None
    group = ps.get_expert_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


@torch.no_grad()
def load_megatron_weights(layer: Any, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Load logical weights into a megatron-core ``MoELayer`` (this EP rank's experts and the router).

    Args:
        layer: a megatron ``MoELayer`` (e.g. from :func:`megatron_moe_layer`).
        router_weight: ``[E, H]``; w13: ``[E, 2F, H]`` (gate rows, then up); w2: ``[E, H, F]``;
            the same on every rank.

    Layouts written (expert tensor parallel size 1):
      - ``GroupedMLP``: ``weight1 [H, E_local*2F]`` viewed as ``[E_local, H, 2F]`` holds ``w13[e]^T``,
        ``weight2 [E_local*F, H]`` viewed as ``[E_local, F, H]`` holds ``w2[e]^T``;
      - ``SequentialMLP``: ``local_experts[i].linear_fc1.weight = w13[e]`` (``[2F, H]``),
        ``linear_fc2.weight = w2[e]`` (``[H, F]``);
      - ``TEGroupedMLP``: ``linear_fc1.weight{i} = w13[e]``, ``linear_fc2.weight{i} = w2[e]``;
    with ``e = layer.local_expert_indices[i]``. Biases, if any, are zeroed.

    Raises:
        TypeError: a weight is not a tensor; the layer's experts are none of the modules above.
        ValueError: a weight has the wrong shape, or megatron's expert weights another shape than
            these weights give (expert tensor parallelism).
    """
    tc = layer.config
    e, h = tc.num_moe_experts, tc.hidden_size
    f = getattr(tc, "moe_ffn_hidden_size", None) or tc.ffn_hidden_size
    for name, t, shape in (("router_weight", router_weight, (e, h)), ("w13", w13, (e, 2 * f, h)), ("w2", w2, (e, h, f))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    local = _local_experts(layer)
    index = torch.tensor(local, dtype=torch.int64, device=w13.device)
    w13_l, w2_l = w13.index_select(0, index), w2.index_select(0, index)
    n = len(local)

    _copy(layer.router.weight, router_weight, "router.weight")
    if getattr(layer.router, "bias", None) is not None:
        layer.router.bias.zero_()

    experts = layer.experts
    if hasattr(experts, "weight1") and hasattr(experts, "weight2"):  # GroupedMLP
        if tuple(experts.weight1.shape) != (h, n * 2 * f) or tuple(experts.weight2.shape) != (n * f, h):
            raise ValueError(f"GroupedMLP weights {list(experts.weight1.shape)}, {list(experts.weight2.shape)} do not "
                             f"match H={h}, F={f}, {n} local experts (expert tensor parallelism is not supported)")
        experts.weight1.view(n, h, 2 * f).copy_(w13_l.transpose(1, 2).to(experts.weight1))
        experts.weight2.view(n, f, h).copy_(w2_l.transpose(1, 2).to(experts.weight2))
    elif hasattr(experts, "local_experts"):  # SequentialMLP
        for i, mlp in enumerate(experts.local_experts):
            _copy(mlp.linear_fc1.weight, w13_l[i], f"local_experts.{i}.linear_fc1.weight")
            _copy(mlp.linear_fc2.weight, w2_l[i], f"local_experts.{i}.linear_fc2.weight")
            for lin in (mlp.linear_fc1, mlp.linear_fc2):
                if getattr(lin, "bias", None) is not None:
                    lin.bias.zero_()
    elif hasattr(experts, "linear_fc1") and hasattr(experts.linear_fc1, "weight0"):  # TEGroupedMLP
        for i in range(n):
            _copy(getattr(experts.linear_fc1, f"weight{i}"), w13_l[i], f"linear_fc1.weight{i}")
            _copy(getattr(experts.linear_fc2, f"weight{i}"), w2_l[i], f"linear_fc2.weight{i}")
            for lin in (experts.linear_fc1, experts.linear_fc2):
                bias = getattr(lin, f"bias{i}", None)
                if isinstance(bias, torch.Tensor) and bias.numel():
                    bias.zero_()
    else:
        raise TypeError(f"load_megatron_weights supports SequentialMLP, GroupedMLP and TEGroupedMLP experts, "
                        f"not {type(experts).__name__}")


__all__ = ["load_megatron_weights", "megatron_moe_layer", "megatron_weights"]
