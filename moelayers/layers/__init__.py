"""Drop-in MoE layers: the shared base and one module per strategy."""

from moelayers.layers.base import MoELayerBase, rank_local_names, rank_local_params, reduce_expert_grads
from moelayers.layers.semantic import SemanticMoE
from moelayers.layers.vanilla import VanillaMoE
from moelayers.layers.variability import VariabilityAwareMoE

__all__ = ["MoELayerBase", "SemanticMoE", "VanillaMoE", "VariabilityAwareMoE", "rank_local_names", "rank_local_params",
           "reduce_expert_grads"]
