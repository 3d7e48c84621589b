"""Llama-family decoder (Flax), its fixed-size KV cache, and `Model`, the seam every
caller goes through."""

from specsamp.models.llama import KVCache, ModelConfig, Transformer, init_cache
from specsamp.models.model import Model

__all__ = ["KVCache", "Model", "ModelConfig", "Transformer", "init_cache"]
