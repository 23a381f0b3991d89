"""Small models for recipes and tests."""

from moelayers.models.tiny import KVCache, StepRequest, TinyConfig, TinyDecoder

__all__ = ["KVCache", "StepRequest", "TinyConfig", "TinyDecoder"]
