"""Drop-in MoE layers: the shared base and one module per strategy."""

from typing import TYPE_CHECKING, Any

from moelayers.layers.base import MoELayerBase
from moelayers.layers.moves import PlacementMoveError, PlacementRejected
from moelayers.layers.semantic import SemanticMoE
from moelayers.layers.vanilla import VanillaMoE
from moelayers.layers.variability import VariabilityAwareMoE

__all__ = ["MoELayerBase", "PlacementMoveError", "PlacementRejected", "SemanticMoE", "VanillaMoE",
           "VariabilityAwareMoE"]

_MOVED_TO_TRAINING = ("rank_local_names", "rank_local_params", "reduce_expert_grads")

if TYPE_CHECKING:  # what the lazy names below are (type checkers see these, and no other name, here)
    from moelayers.training import rank_local_names, rank_local_params, reduce_expert_grads  # noqa: F401
else:
    def __getattr__(name: str) -> Any:
        """The data-parallel helpers live in :mod:`moelayers.training` (``moelayers.<name>``); still
        importable from here (imported on first use: ``moelayers.training`` imports this package)."""
        if name in _MOVED_TO_TRAINING:
            from moelayers import training

            return getattr(training, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
