"""megatron-core distributed checkpointing (``sharded_state_dict``) of a moelayers layer.

A layer's ``experts.w13 [S, 2F, H]`` and ``experts.w2 [S, H, F]`` hold one row per *slot* of its
placement, and every expert-parallel rank holds other slots. The checkpoint stores them in logical
expert order instead: ``experts.w13`` is one global ``[E, 2F, H]`` tensor (``w2``: ``[E, H, F]``)
of which every slot contributes the row of its expert, as megatron's own ``SequentialMLP`` does with
its experts. So a checkpoint loads into any placement and any number of expert-parallel ranks
(semantic or variability-aware placements, replicas, e.g. saved at EP 2 and loaded at EP 1): each
rank reads the experts its own slots hold. The placement itself is not saved; the loading layer keeps its own.

Who saves what (``replica_id``, megatron's (PP, TP, DP) convention, main replica = all zeros):

- expert rows: the ranks that hold the same slots (megatron's expert-tensor- times expert-data-
  parallel ranks: moelayers keeps whole experts on every tensor-parallel rank) are TP and DP
  replicas; a placement's second and later copies of an expert are replicas along the first axis;
  empty slots (``-1``) are not saved, and set to zeros on load;
- the router and anything else of the layer: replicated over tensor- and data-parallel ranks, as
  megatron's default for a module without ``sharded_state_dict``;
- the placement (``_extra_state``): not saved (a ``LocalNonpersistentObject``): the load gives the
  layer back the placement it had when ``sharded_state_dict()`` was taken, the one the loaded rows
  were read for. A move between taking it and megatron's save or load is refused there.

The expert tensors are ``ShardedTensorFactory`` objects over the whole parameter, so megatron's
optimizers find them by parameter (``optimizer.sharded_state_dict``) and save Adam's moments and
the fp32 master weights in the same logical layout. The distributed optimizer's
``fully_sharded_model_space`` format asks the factories for flat slices, which are refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moelayers.checkpoint import EXPERT_KEYS, slot_copies
from moelayers.groups import ParallelGroups
from moelayers.layers.weights import placement_record



def expert_replica_coords(groups: ParallelGroups, expt_tp=None, expt_dp=None) -> tuple[int, int]:
    """This rank's place ``(tp, dp)`` among the ranks that hold the same expert slots as it does.

    moelayers keeps whole experts on every rank, so with megatron those ranks are its expert-tensor-
    parallel (``expt_tp``, by default as large as tensor parallelism) times expert-data-parallel
    (``expt_dp``) ranks. Taken from ``groups.edp`` if set (``(0, rank in edp)``); else, axis by axis,
    the given group (a megatron-core >= 0.19 ``pg_collection``'s) or megatron's initialised
    ``parallel_state``; else ``0`` when the expert-parallel group is the whole world.

    Raises:
        ValueError: several ranks could hold the same slots and none of the above says which.
    """
    if groups.edp is not None:
        return 0, _group_rank(groups.edp)
    try:
        from megatron.core import parallel_state as ps
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        ps = None
    megatron = ps is not None and ps.model_parallel_is_initialized()
    # per axis: a given group, else megatron's parallel_state
    tp = _group_rank(expt_tp) if expt_tp is not None else ps.get_expert_tensor_parallel_rank() if megatron else None
    dp = _group_rank(expt_dp) if expt_dp is not None else ps.get_expert_data_parallel_rank() if megatron else None
    if tp is not None and dp is not None:
        return tp, dp
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == groups.ep_size:
        return tp or 0, dp or 0
    raise ValueError(
        f"sharded_state_dict: {dist.get_world_size()} ranks, {groups.ep_size} expert-parallel: which ranks hold "
        "the same experts is unknown (neither ParallelGroups.edp, a pg_collection's expt_tp/expt_dp nor "
        "megatron's parallel_state): build the groups with edp (ParallelGroups.from_world builds it)")


def _group_rank(group) -> int:
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def layer_sharded_state_dict(layer, prefix: str, sharded_offsets: tuple, metadata: dict | None, *,
                             expert_replica: tuple[int, int]) -> dict:
    """megatron's ``sharded_state_dict`` of a moelayers layer (see the module docstring).

    Args:
        layer: a :class:`~moelayers.layers.base.MoELayerBase`.
        prefix: the layer's key prefix (e.g. ``'decoder.layers.3.mlp.layer.'``).
        sharded_offsets: megatron's offsets already applied by the enclosing modules (prepended).
        metadata: megatron's sharded-state-dict metadata (its ``dp_cp_group`` is used for the router).
        expert_replica: :func:`expert_replica_coords`.

    Returns:
        ``{state-dict key: ShardedTensor | ShardedTensorFactory | ShardedObject | LocalNonpersistentObject}``,
        the keys of ``layer.state_dict(prefix=prefix)``.
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    state = layer.state_dict(prefix="", keep_vars=True)
    rest = {k: v for k, v in state.items() if k not in EXPERT_KEYS and k != "_extra_state"}
    if (metadata is None or "dp_cp_group" not in metadata) and not parallel_state.model_parallel_is_initialized():
        # groups given without megatron's parallel_state (ParallelGroups.from_world, a pg_collection): their dp
        metadata = {**(metadata or {}), "dp_cp_group": layer.groups.dp}
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    if layer.groups.tp is None and metadata["dp_cp_group"] is None and not parallel_state.model_parallel_is_initialized():
        # no group at all (a world of one): megatron would read its parallel_state; world rank 0 is the main copy
        main = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        out = {f"{prefix}{k}": ShardedTensor.from_rank_offsets(f"{prefix}{k}", v, *sharded_offsets, replica_id=(0, 0, main))
               for k, v in rest.items()}
    else:
        out = make_sharded_tensors_for_checkpoint(rest, prefix, {}, sharded_offsets, tp_group=layer.groups.tp,
                                                  dp_cp_group=metadata["dp_cp_group"])
    # the layout the factories describe is the placement now; megatron builds them later (in save or
    # load), from the live parameter: a move in between is refused there, and a load hands the layer
    # this placement back with the rows read for it (a copy: a later move updates the live one)
    placement = layer.placement.copy()
    out[f"{prefix}_extra_state"] = LocalNonpersistentObject(placement_record(placement, layer.groups.ep_rank))
    slots = slot_copies(placement.phy2log, layer.groups.ep_rank)
    num_experts, axis = placement.num_experts, len(sharded_offsets)

    def build(key: str, data: torch.Tensor, replica_id, flattened_range) -> list:
        if layer.placement != placement:
            raise RuntimeError(f"{key}: the layer's placement changed after sharded_state_dict() was taken (a move, "
                               "apply_placement or a re-plan): its expert rows no longer match it; take "
                               "sharded_state_dict() again")
        if flattened_range is not None:
            raise ValueError(f"{key}: flattened (distributed-optimizer 'fully_sharded_model_space', megatron-core's "
                             "default) shards of moelayers experts are not supported: use a non-distributed megatron "
                             "optimizer, or another distrib_optim_sharding_type in the metadata (not checked with "
                             "moelayers)")
        pp, tp, dp = replica_id if isinstance(replica_id, tuple) else (replica_id, 0, 0)
        held = [ShardedTensor.from_rank_offsets(key, data[s], *sharded_offsets, (axis, e, num_experts),
                                                replica_id=(pp + copy, tp, dp), prepend_axis_num=axis + 1)
                for s, (e, copy) in enumerate(slots) if e >= 0]
        if held:
            return held
        # a rank holding no expert: megatron takes an empty list for common (non-sharded) data, which breaks
        # the save (a list clashing with the other ranks') and the load (a key missing on this rank alone);
        # a stand-in shard of an expert would be written by a fully parallel save, which picks any holder of
        # a shard as its writer. Its rows stay local: nothing saved, nothing read, zeros on a load
        return LocalNonpersistentObject(torch.zeros_like(data))

    def merger(param: torch.Tensor):
        def merge(loaded: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
            if isinstance(loaded, torch.Tensor):  # a rank holding no expert: its zero rows, as they are
                return loaded
            rows = iter(loaded)
            like = loaded[0] if loaded else param
            return torch.stack([next(rows) if e >= 0 else torch.zeros(param.shape[1:], dtype=like.dtype,
                                                                       device=like.device)
                                for e, _ in slots])
        return merge

    for name in EXPERT_KEYS:
        key, param = f"{prefix}{name}", state[name]
        out[key] = ShardedTensorFactory(key, param, build, merger(param), replica_id=(0, *expert_replica))
    return out
