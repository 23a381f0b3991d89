"""Gradient clipping for models with moelayers layers under torch data parallelism.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on an expert-parallel model takes
the norm over *this rank's* expert slots: every rank finds another norm, clips its replicated
weights (attention, router, embeddings) by another factor, and the ranks' copies drift apart; and a
replicated expert counts once per copy. :func:`clip_grad_norm_` takes the norm of the whole model's
gradient, as the dense model has it, and clips every rank by the same factor.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moelayers.checkpoint import slot_copies
from moelayers.layers.base import MoELayerBase, _check_not_sharded, _is_dtensor, _mark_reduced, _reduced_already
from moelayers.groups import collective_device

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with moelayers layers: the same norm and the
    same clipping factor on every rank.

    The norm is the dense model's: every logical expert's gradient counted once (its main replica,
    summed over the layer's expert-parallel group), every other parameter once, taken as the same
    on every rank (as after torch DDP's all-reduce and :func:`moelayers.reduce_expert_grads`; call
    that first). FSDP's sharded gradients (DTensors) count with their whole tensor. A collective
    over each layer's expert-parallel group: call it on every rank.

    Args:
        model: the model (DDP-wrapped or not); all its parameters with a gradient are clipped.
        max_norm: the largest norm kept.
        norm_type: the p of the p-norm, ``inf`` for the largest absolute value.
        error_if_nonfinite: raise if the norm is NaN or infinite (on every rank: they share it).
        foreach: as torch's (the fast multi-tensor path).

    Returns:
        the total norm (a 0-d tensor on the gradients' device, in their promoted dtype), before clipping.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (torch's takes ``model.parameters()``).
        ValueError: ``norm_type`` is not positive; expert weights sharded by FSDP (see
            :func:`moelayers.rank_local_params`).
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"clip_grad_norm_ takes the model (an nn.Module), not {type(model).__name__}: it reads the "
                        "experts' placement from the model's moelayers layers (torch's takes model.parameters())")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:  # (torch's 0-"norm" counts the tensors with a gradient that is not zero: slot tables)
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")
    layers = [m for m in model.modules() if isinstance(m, MoELayerBase)]
    _check_not_sharded(layers, "clip_grad_norm_")
    params = [p for p in model.parameters() if p.grad is not None]
    total = _total_norm(params, layers, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), "
                           "so they cannot be clipped; error_if_nonfinite=False clips anyway")
    reduced = [(layer, p) for layer in layers for p in (layer.experts.w13, layer.experts.w2)
               if p.grad is not None and _reduced_already(layer, p)]
    _scale_([p.grad for p in params], torch.clamp(max_norm / (total + 1e-6), max=1.0), foreach)  # (torch's factor)
    for layer, p in reduced:  # scaled, still reduced: a second reduce_expert_grads stays refused
        _mark_reduced(layer, p)
    return total


def _total_norm(params: list[nn.Parameter], layers: list[MoELayerBase], norm_type: float,
                foreach: bool | None) -> torch.Tensor:
    """The dense model's gradient norm: the other parameters' gradients (plain tensors and FSDP's
    DTensors apart: torch's norm takes one kind at a time), then each expert-parallel group's experts."""
    device = params[0].grad.device if params else torch.device("cpu")
    dtype = functools.reduce(torch.promote_types, {p.grad.dtype for p in params}, torch.float32)
    slot_major = {id(p) for layer in layers for p in (layer.experts.w13, layer.experts.w2)}
    others = [p.grad for p in params if id(p) not in slot_major]
    plain = [g for g in others if not _is_dtensor(g)]
    sharded = [g for g in others if _is_dtensor(g)]
    parts = []
    if plain:
        norm = torch.nn.utils.get_total_norm(plain, norm_type, foreach=foreach)
        parts.append(_norm_part(norm.reshape(1).double(), norm_type))
    if sharded and norm_type == float("inf"):
        parts.append(_sharded_max(sharded))
    elif sharded:  # full_tensor: the norm over every rank's shard
        norm = torch.nn.utils.get_total_norm(sharded, norm_type, foreach=foreach).full_tensor()
        parts.append(_norm_part(norm.reshape(1).double(), norm_type))
    for (_, group), partial in _expert_parts(layers, norm_type).items():
        parts.append(_reduce(partial, group, norm_type))
    total = torch.stack([p.to(device) for p in parts]) if parts else torch.zeros(1, dtype=torch.float64, device=device)
    total = total.max() if norm_type == float("inf") else total.sum() ** (1.0 / norm_type)
    return total.to(dtype)


def _scale_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """``grads *= coef`` in place; a DTensor gradient through its local shard (torch's foreach
    refuses a mix of DTensors and tensors)."""
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        g = g.to_local() if _is_dtensor(g) else g
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), group in by_device.items():
        if foreach is False:
            for g in group:
                g.mul_(coef.to(dev))
        else:
            torch._foreach_mul_(group, coef.to(dev))


def _sharded_max(grads: list[torch.Tensor]) -> torch.Tensor:
    """The largest ``|entry|`` of DTensor gradients, over all their shards: the local shards' maxima
    (an empty shard, a dimension smaller than the mesh, has none: torch's inf-norm raises there),
    then a MAX all-reduce along every dimension of each mesh (the same under any placement)."""
    by_mesh: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for g in grads:
        by_mesh.setdefault(id(g.device_mesh), (g.device_mesh, []))[1].append(g.to_local())
    out = []
    for mesh, local in by_mesh.values():
        maxima = [t.detach().abs().max().double().reshape(1) for t in local if t.numel()]
        part = torch.cat(maxima).max() if maxima else torch.zeros((), dtype=torch.float64, device=local[0].device)
        for dim in range(mesh.ndim):
            part = _reduce(part, mesh.get_group(dim), float("inf"))
        out.append(part.reshape(1))
    return torch.cat(out).max()


def _norm_part(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """What norms of parts contribute to the total: their largest (inf-norm) or sum of p-th powers."""
    if norms.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=norms.device)
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _expert_parts(layers: list[MoELayerBase], norm_type: float) -> dict[tuple, torch.Tensor]:
    """Per expert-parallel group (in the order of the layers, the same on every rank): this rank's
    part of the experts' norm, from the main replica of each expert it holds."""
    parts: dict[tuple, torch.Tensor] = {}
    for layer in layers:
        mains = [s for s, (e, copy) in enumerate(slot_copies(layer.placement.phy2log, layer.groups.ep_rank))
                 if e >= 0 and copy == 0]
        key = (id(layer.groups.ep), layer.groups.ep)
        dev = layer.experts.w13.device
        for p in (layer.experts.w13, layer.experts.w2):
            if p.grad is None or not mains:
                part = torch.zeros((), dtype=torch.float64, device=dev)
            else:
                rows = p.grad[mains].flatten(1)
                part = _norm_part(torch.linalg.vector_norm(rows, norm_type, dim=1, dtype=torch.float64), norm_type)
            parts[key] = part if key not in parts else (torch.maximum(parts[key], part)
                                                        if norm_type == float("inf") else parts[key] + part)
    return parts


def _reduce(partial: torch.Tensor, group, norm_type: float) -> torch.Tensor:
    """``partial`` summed (max for the inf-norm) over ``group``; NaN on one rank is NaN on all (a
    MAX all-reduce may drop it: a flag goes with the value)."""
    if group is None:
        return partial
    nan = torch.isnan(partial)
    comm = torch.stack([torch.where(nan, 0.0, partial), nan.double()]).to(collective_device(group))
    dist.all_reduce(comm, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM, group=group)
    comm = comm.to(partial.device)
    return torch.where(comm[1] > 0, float("nan"), comm[0])
