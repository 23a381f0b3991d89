"""`VanillaMoE`: the baseline — a fixed placement (linear by default), plain expert parallelism."""

from __future__ import annotations

from moelayers.layers.base import MoELayerBase


class VanillaMoE(MoELayerBase):
    """Expert-parallel MoE layer with the placement it was built with and the shared five-step
    forward. The other layers keep that forward and differ in where their experts live and when that
    changes (``VariabilityAwareMoE`` records loads and re-plans around it), and ``SemanticMoE`` in
    where its tokens go (``forward_tp``'s shuffle around it).

    Example:
        >>> cfg = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)
        >>> layer = VanillaMoE(cfg, ParallelGroups.single())
        >>> y = layer(torch.randn(10, 64))
    """
