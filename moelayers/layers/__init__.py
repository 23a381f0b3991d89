"""Drop-in MoE layers: the shared base and one module per strategy."""

from moelayers.layers.base import MoELayerBase
from moelayers.layers.semantic import SemanticMoE
from moelayers.layers.vanilla import VanillaMoE
from moelayers.layers.variability import VariabilityAwareMoE

__all__ = ["MoELayerBase", "SemanticMoE", "VanillaMoE", "VariabilityAwareMoE"]
