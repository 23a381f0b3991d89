"""`VanillaMoE`: the baseline — a fixed placement (linear by default), plain expert parallelism."""

from __future__ import annotations

from moelayers.layers.base import MoELayerBase


class VanillaMoE(MoELayerBase):
    """Expert-parallel MoE layer with the placement it was built with and the shared five-step
    forward; every other layer differs from it only in step 2 or in how its placement changes.

    Example:
        >>> cfg = MoEConfig(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)
        >>> layer = VanillaMoE(cfg, ParallelGroups.single())
        >>> y = layer(torch.randn(10, 64))
    """
