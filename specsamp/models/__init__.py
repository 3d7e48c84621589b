"""Llama-family decoder (Flax) and its fixed-size KV cache."""

from specsamp.models.llama import KVCache, ModelConfig, Transformer, init_cache

__all__ = ["KVCache", "ModelConfig", "Transformer", "init_cache"]
