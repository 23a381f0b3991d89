"""Integrations with other frameworks.

- :mod:`moelayers.integrations.megatron`: drop-in megatron-core adapter (``MegatronMoEAdapter``),
  ``moe_spec(layer_cls, **kw)`` for ``TransformerLayerSubmodules.mlp``, and helpers that build and
  load megatron-core's own ``MoELayer`` for benchmarks and equality checks.
- :mod:`moelayers.integrations.hf`: Hugging Face transformers: ``swap_moe_blocks(model, groups)``
  replaces a Mixtral / Qwen3-MoE / OLMoE / Qwen3-VL-MoE model's sparse MoE blocks with layers
  (``moe_config_from_hf``, ``weights_from_hf``; ``hf_weights`` for the way back); ``pass_token_ids``
  hands the layers of any model the token ids it embeds; it never imports transformers.

Submodules are not imported here, so ``import moelayers`` never imports megatron-core.
"""

__all__: list[str] = []  # (import moelayers.integrations.megatron explicitly: it imports megatron-core)
