"""moelayers: Mixture-of-Experts parallel layers for serving and RL rollout.

Public API (README.md, "A short tour", walks through it)::

    import moelayers as ml
    cfg = ml.MoEConfig(hidden_size=2048, ffn_hidden_size=768, num_experts=128, top_k=8)
    layer = ml.VanillaMoE(cfg, ml.ParallelGroups.from_world(ep=4))
    y = layer(x)
"""

from moelayers import metrics, reference, trace
from moelayers.config import MoEConfig
from moelayers.dispatch import AllGatherDispatcher, AllToAllDispatcher, LocalFirstPolicy, Routes
from moelayers.experts import GroupedExperts
from moelayers.groups import ParallelGroups
from moelayers.layers import (MoELayerBase, PlacementMoveError, PlacementRejected, SemanticMoE, VanillaMoE,
                              VariabilityAwareMoE)
from moelayers.layers.deferred import check_pending
from moelayers.layers.graphs import share_graph_pool
from moelayers.metrics import MoEStats
from moelayers.placement import ExpertPlacement, SlotMove
from moelayers.router import TopKRouter
from moelayers.training import clip_grad_norm_, rank_local_names, rank_local_params, reduce_expert_grads

__version__ = "0.1.0"

__all__ = [
    "AllGatherDispatcher", "AllToAllDispatcher", "ExpertPlacement", "GroupedExperts", "LocalFirstPolicy",
    "MoEConfig", "MoELayerBase", "MoEStats", "ParallelGroups", "Routes", "SlotMove", "TopKRouter", "VanillaMoE",
    "VariabilityAwareMoE", "metrics", "reference", "trace",
    "SemanticMoE", "rank_local_names", "rank_local_params", "reduce_expert_grads", "clip_grad_norm_",
    "PlacementMoveError", "PlacementRejected", "share_graph_pool", "check_pending",
]
