"""Integrations with other frameworks.

- :mod:`moelayers.integrations.megatron`: drop-in megatron-core adapter (``MegatronMoEAdapter``),
  ``moe_spec(layer_cls, **kw)`` for ``TransformerLayerSubmodules.mlp``, and helpers that build and
  load megatron-core's own ``MoELayer`` for benchmarks and equality checks.

Submodules are not imported here, so ``import moelayers`` never imports megatron-core.
"""

__all__: list[str] = []  # (import moelayers.integrations.megatron explicitly: it imports megatron-core)
