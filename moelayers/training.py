"""Training a model with moelayers layers under torch data parallelism (DDP, FSDP): what the
wrappers must leave alone (:func:`rank_local_names`, :func:`rank_local_params`), the expert
gradients' reduction (:func:`reduce_expert_grads`) and gradient clipping (:func:`clip_grad_norm_`).

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on an expert-parallel model takes
the norm over *this rank's* expert slots: every rank finds another norm, clips its replicated
weights (attention, router, embeddings) by another factor, and the ranks' copies drift apart; and a
replicated expert counts once per copy. :func:`clip_grad_norm_` takes the norm of the whole model's
gradient, as the dense model has it, and clips every rank by the same factor.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moelayers._warnings import warn_caller
from moelayers.checkpoint import slot_copies
from moelayers.dispatch.comm import all_gather_flat
from moelayers.groups import collective_device
from moelayers.layers.base import MoELayerBase
from moelayers.layers.weights import _is_dtensor

__all__ = ["rank_local_names", "rank_local_params", "reduce_expert_grads", "clip_grad_norm_"]


def rank_local_names(model: nn.Module) -> list[str]:
    """The names (as ``model.named_parameters()`` / ``named_buffers()`` give them) of what differs
    between the expert-parallel ranks in every moelayers layer of ``model``: its expert weights and
    its buffers (e.g. a ``VariabilityAwareMoE``'s load window). torch's ``DistributedDataParallel``
    over those ranks must leave them alone::

        DDP._set_params_and_buffers_to_ignore_for_model(model, ml.rank_local_names(model))
        model = DDP(model)

    Without it DDP copies rank 0's experts and buffers over every rank when it is built (the buffers
    before every forward) and averages the gradients of different experts, silently. DDP averages
    the other gradients over the ranks (the gradient of the ranks' mean loss); an expert's gradient
    is the sum over the tokens of its expert-parallel group only: :func:`reduce_expert_grads` after
    the backward makes it the same mean (megatron's DDP does both itself)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, MoELayerBase):
            head = f"{prefix}." if prefix else ""
            names += [f"{head}experts.w13", f"{head}experts.w2"] + [head + n for n, _ in module.named_buffers()]
    return names


def rank_local_params(model: nn.Module) -> set[nn.Parameter]:
    """The expert weights of every moelayers layer in ``model``: what FSDP must leave alone, since
    every rank holds other experts in them (not shards of one tensor)::

        fully_shard(block, ignored_params=ml.rank_local_params(model))

    Without it ``fully_shard`` keeps each rank's share of its own slots and gathers the other ranks'
    slots into the forward: wrong outputs, silently (:func:`reduce_expert_grads` and
    :func:`moelayers.clip_grad_norm_` refuse such layers). FSDP averages the other gradients over
    its ranks; :func:`reduce_expert_grads` gives the experts the same mean."""
    return {p for m in model.modules() if isinstance(m, MoELayerBase) for p in (m.experts.w13, m.experts.w2)}


def _check_not_sharded(layers: list["MoELayerBase"], what: str) -> None:
    """Refuse expert weights that a sharding wrapper (FSDP's ``fully_shard``) has made DTensors."""
    for layer in layers:
        if any(_is_dtensor(p) for p in (layer.experts.w13, layer.experts.w2)):
            raise ValueError(
                f"{what}: the expert weights of this {type(layer).__name__} were sharded by FSDP (fully_shard), which "
                "takes every rank's slots for shards of one tensor and gathers other ranks' experts into the "
                "forward: silently wrong outputs. Leave them to the layer: fully_shard(module, "
                "ignored_params=ml.rank_local_params(model))")


def _check_fsdp_mesh(model: nn.Module) -> None:
    """Refuse FSDP over part of the world: it averages the other gradients over its mesh, while
    :func:`reduce_expert_grads` makes the experts' the mean over the world (the same on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    sizes = {p.device_mesh.size() for p in model.parameters() if _is_dtensor(p)}
    if sizes - {world}:
        raise ValueError(f"reduce_expert_grads: FSDP shards some weights over {sorted(sizes - {world})} of the "
                         f"{world} ranks, averaging their gradients there, while the experts' are made the mean over "
                         "the world: shard over the whole world (a 2-D mesh for HSDP)")


def reduce_expert_grads(model: nn.Module) -> None:
    """After the last backward before an optimizer step of ``model`` under torch DDP over the whole
    world, leaving :func:`rank_local_names` alone (or FSDP's ``fully_shard``, ignoring
    :func:`rank_local_params`): give each moelayers layer's expert weights the gradient DDP (FSDP)
    gives the others, that of the mean loss over the world's ranks.

    An expert's gradient is the sum over the tokens its expert-parallel group sent it. With groups
    smaller than the world it is first summed over the ranks that hold the same experts (the
    groups' ``edp``, one rank of each expert-parallel group), then divided by the world size. Call
    it on every rank (a collective over the world), once per optimizer step: with gradient
    accumulation (``DDP.no_sync()``), after the last micro-batch's backward. The expert-parallel
    groups must serve the same placement (a ``VariabilityAwareMoE`` that re-planned in each group
    on its own loads does not).

    A non-finite expert gradient on any rank makes every rank's expert gradients non-finite (a NaN
    in each): with AMP's ``GradScaler``, call it before ``scaler.unscale_`` (or ``scaler.step``),
    so that every rank skips the step and lowers its scale together. The expert gradients are
    each rank's own, so an overflow used to skip the step on that rank alone.

    Raises:
        ValueError: nothing is reduced when

            * expert weights are sharded by FSDP (see :func:`rank_local_params`), or FSDP runs
              over part of the world;
            * a layer has tensor parallelism (the TP ranks share their batch, which DDP over the
              world would count ``tp`` times);
            * a layer's groups describe another world than torch.distributed's
              (``ParallelGroups.single()`` in a multi-rank job);
            * it is called a second time with no backward since the first (a call after each
              micro-batch's backward counts the earlier micro-batches again, which it cannot tell
              from a new step's gradients: call it once, after the last);
            * expert-parallel groups smaller than the world come without their ``edp`` group
              (``ParallelGroups.from_world`` builds it; pass it to ``from_groups``).

            Checked on every rank together, so that all raise: an ``edp`` group that does not hold
            one rank of each expert-parallel group at this rank's place, groups that serve
            different placements, and expert weights that require grad on some ranks only.
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayerBase)]
    _check_not_sharded(layers, "reduce_expert_grads")
    _check_fsdp_mesh(model)
    _check_each_layer_reducible(layers)
    _check_edp_groups_agree([layer for layer in layers if layer.groups.edp is not None])
    for layer in layers:
        g = layer.groups
        layer._reduced_grads = {}
        for p in (layer.experts.w13, layer.experts.w2):
            if not p.requires_grad:
                continue
            if p.grad is None:  # no rows reached this rank's experts
                if g.edp is None:
                    continue
                p.grad = torch.zeros_like(p)  # the other ranks of its edp group wait for its sum
            if g.edp is not None:
                dist.all_reduce(p.grad, group=g.edp)
            p.grad.div_(g.world_size)
    _spread_nonfinite(layers)
    for layer in layers:  # (after the last in-place change)
        for p in (layer.experts.w13, layer.experts.w2):
            if p.requires_grad and p.grad is not None:
                _mark_reduced(layer, p)


def _spread_nonfinite(layers: list["MoELayerBase"]) -> None:
    """Make the expert gradients non-finite on every rank where one is on any rank (one all-reduce of
    a flag over the world, no host sync). DDP's gradients are the same on every rank, so an
    overflow shows on all; the experts' are each rank's own, and AMP's ``GradScaler`` skipped the
    step on the rank that overflowed and stepped on the others: their weights and loss scales
    parted silently. A rank whose experts got no gradient at all has none to mark."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad for layer in layers for p in (layer.experts.w13, layer.experts.w2) if p.grad is not None]
    dev = collective_device(dist.group.WORLD)
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    if grads:
        bad = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).to(torch.int32).view(1).to(dev)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    flag = bad.bool().view(())
    for g in grads:  # (a NaN where any rank has a non-finite gradient: unchanged elsewhere, bit for bit)
        g.view(-1)[:1].masked_fill_(flag.to(g.device), float("nan"))


def _check_each_layer_reducible(layers: list[MoELayerBase]) -> None:
    """This rank's own checks of :func:`reduce_expert_grads` (no communication)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for layer in layers:
        g, name = layer.groups, type(layer).__name__
        if g.tp_size > 1:
            raise ValueError(f"reduce_expert_grads is for torch DDP over ranks with a batch each; this {name} has "
                             f"{g.tp_size} tensor-parallel ranks, which share their batch")
        if g.world_size != world:  # ParallelGroups.single() in a multi-rank job: nothing would be reduced
            raise ValueError(f"this {name}'s groups describe a world of {g.world_size} rank(s) (ParallelGroups.single()?) "
                             f"in a world of {world}: its experts would learn from this rank's tokens alone and the "
                             f"ranks' copies drift apart; to train every expert on every rank, build the groups "
                             f"with ParallelGroups.from_world(ep=1)")
        if g.ep_size < g.world_size and g.edp is None:
            raise ValueError(f"{name} has expert-parallel groups of {g.ep_size} of {g.world_size} ranks "
                             "but no expert-data-parallel group (ParallelGroups.edp): build the groups with "
                             "ParallelGroups.from_world(ep=...), or pass edp= to ParallelGroups.from_groups")
        for p in (layer.experts.w13, layer.experts.w2):
            if p.grad is not None and _reduced_already(layer, p):
                raise ValueError(f"reduce_expert_grads: the expert gradients of this {name} were reduced already "
                                 "(call it once per optimizer step, after the last backward)")


def _check_edp_groups_agree(edp_layers: list[MoELayerBase]) -> None:
    """The checks of :func:`reduce_expert_grads` that need the other ranks, in one all-reduce over
    the world, so that every rank raises together: each ``edp`` group holds one rank of each
    expert-parallel group at this rank's place, the groups serve one placement, and the expert
    weights train on every rank alike."""
    if not edp_layers:
        return
    dev = collective_device(dist.group.WORLD)
    wrong_edp = []
    for layer in edp_layers:  # every member at this rank's place (ep_rank), each from another expert-parallel group
        g = layer.groups
        first = min(dist.get_process_group_ranks(g.ep)) if g.ep is not None else g.rank
        mine = torch.tensor([g.ep_rank, first], dtype=torch.int64, device=dev)
        got = torch.empty(2 * dist.get_world_size(g.edp), dtype=torch.int64, device=dev)
        all_gather_flat(got, mine, group=g.edp)  # (gloo takes flat tensors)
        got = got.view(-1, 2).cpu()
        wrong_edp.append(int(bool((got[:, 0] != g.ep_rank).any()) or got[:, 1].unique().numel() != got.shape[0]))
    digests = torch.tensor([layer.placement.digest() for layer in edp_layers], dtype=torch.int64)
    # which expert weights train here: a rank that skipped one's all-reduce would leave the others in it
    trained = torch.tensor([int(layer.experts.w13.requires_grad) + 2 * int(layer.experts.w2.requires_grad)
                            for layer in edp_layers], dtype=torch.int64)
    both = torch.cat([digests, -digests, torch.tensor(wrong_edp), trained, -trained]).to(dev)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    both = both.tolist()  # one host sync for every check below
    n = len(edp_layers)
    frozen = [type(layer).__name__ for i, layer in enumerate(edp_layers) if both[3 * n + i] != -both[4 * n + i]]
    if frozen:
        raise ValueError(f"the expert weights of {len(frozen)} layer(s) ({frozen[0]} first) require grad on some "
                         "ranks and not on others (requires_grad_(False) on some ranks only): their gradients "
                         "cannot be summed over the ranks. Freeze or train them on every rank alike")
    if max(both[2 * n:3 * n]):
        raise ValueError("ParallelGroups.edp must hold the ranks at the same place (ep_rank) of every "
                         "expert-parallel group, one each: a rank's group does not (ParallelGroups.from_world "
                         "builds it)")
    # (frozen layers have no gradients to sum: a frozen rollout copy may serve other placements per group)
    differ = [type(layer).__name__ for i, layer in enumerate(edp_layers) if both[3 * n + i] and both[i] != -both[n + i]]
    if differ:
        raise ValueError(f"the expert-parallel groups serve different placements in {len(differ)} layer(s) "
                         f"({differ[0]} first): a slot holds other experts from one group to the next, so their "
                         "gradients cannot be summed. Keep one placement in every group while training: "
                         "apply_placement with the same placement on every rank (a VariabilityAwareMoE re-plans each "
                         "group on its own loads: auto_replan=False, or replan(loads=...) with the same loads in "
                         "every group)")


def _mark_reduced(layer: "MoELayerBase", p: torch.Tensor) -> None:
    """Record ``p.grad`` as reduced: the tensor itself (weakly: a step's new gradient may get a freed
    one's id) and its version (a backward that accumulates into it changes it)."""
    if not hasattr(layer, "_reduced_grads"):
        layer._reduced_grads = {}
    layer._reduced_grads[id(p)] = (weakref.ref(p.grad), p.grad._version)


def _reduced_already(layer: "MoELayerBase", p: torch.Tensor, *, changed_in_place: bool = False) -> bool:
    """Whether ``p.grad`` is the very tensor :func:`reduce_expert_grads` reduced, unchanged since
    (or changed in place since, with ``changed_in_place``)."""
    ref, version = getattr(layer, "_reduced_grads", {}).get(id(p), (lambda: None, None))
    return ref() is p.grad and (changed_in_place or p.grad._version == version)


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
        the total norm before clipping: a 0-d tensor on the gradients' device, in their promoted dtype
        but at least float32 (torch's is bfloat16 for bfloat16 gradients).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (torch's takes ``model.parameters()``).
        ValueError: ``norm_type`` is not positive, ``max_norm`` negative or NaN; expert weights sharded by FSDP (see
            :func:`moelayers.rank_local_params`).
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"clip_grad_norm_ takes the model (an nn.Module), not {type(model).__name__}: it reads the "
                        "experts' placement from the model's moelayers layers (torch's takes model.parameters())")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:  # (torch's 0-"norm" counts the tensors with a gradient that is not zero: slot tables)
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}")
    if not max_norm >= 0:  # (torch's scales by max_norm / total: a negative one flips every gradient, NaN fills them)
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    layers = [m for m in model.modules() if isinstance(m, MoELayerBase)]
    _check_not_sharded(layers, "clip_grad_norm_")
    params = [p for p in model.parameters() if p.grad is not None]
    total = _total_norm(params, layers, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({float(total)}), "
                           "so they cannot be clipped; error_if_nonfinite=False clips anyway")
    reduced = [(layer, p) for layer in layers for p in (layer.experts.w13, layer.experts.w2)
               if p.grad is not None and _reduced_already(layer, p)]
    _warn_if_not_reduced(layers)
    _scale_([p.grad for p in params], torch.clamp(max_norm / (total + 1e-6), max=1.0), foreach)  # (torch's factor)
    for layer, p in reduced:  # scaled, still reduced: a second reduce_expert_grads stays refused
        _mark_reduced(layer, p)
    return total


def _warn_if_not_reduced(layers: list[MoELayerBase]) -> None:
    """Warn, once per layer, about expert gradients clipped before :func:`reduce_expert_grads` in
    a layout that needs it (torch DDP over several ranks: ``edp`` known, or one expert-parallel group
    over the world, and no tensor parallelism): their norm counts them unreduced. A gradient counts
    as reduced while it is the tensor the reduction returned, changed in place or not (AMP's
    ``GradScaler.unscale_`` divides it in place)."""
    late = [layer for layer in layers
            if layer.groups.world_size > 1 and layer.groups.tp_size == 1 and not getattr(layer, "_warned_unreduced", False)
            and (layer.groups.edp is not None or layer.groups.ep_size == layer.groups.world_size)
            and any(p.grad is not None and not _reduced_already(layer, p, changed_in_place=True)
                    for p in (layer.experts.w13, layer.experts.w2))]
    for layer in late:
        layer._warned_unreduced = True
    if late:
        warn_caller(f"clip_grad_norm_: the expert gradients of {len(late)} layer(s) ({type(late[0]).__name__} first) "
                    "were not reduced by moelayers.reduce_expert_grads since their backward: under torch DDP call it "
                    "before clipping (the norm counts them unreduced, and a later reduction is not clipped)",
                    RuntimeWarning)


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
