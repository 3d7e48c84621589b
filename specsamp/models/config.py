"""`ModelConfig`: the shape and the family features of a decoder (`specsamp.models.llama`).

The defaults are a plain Llama: SwiGLU MLP, RMSNorm scaling by w, one RoPE base, full
causal attention. Other families switch features on (the loaders set them, `hf.py`):
Qwen2's q/k/v biases; Qwen3's q/k norms; Gemma 2/3's GeGLU, (1 + w) norms, norms after
attention and MLP, sqrt(D)-scaled embeddings, query scale, soft-capping, sliding windows on
some layers and (Gemma 3) another RoPE base on those; RoPE scaling (`specsamp.models.rope`).

The config is static (it is hashed into compiled programs), so per-layer features are
tuples here and become per-layer arrays carried through the layer scan (`layer_arrays`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    max_seq_len: int = 8192
    # RoPE scaling of the global layers: sorted (key, value) pairs of the checkpoint's
    # rope parameters ('rope_type' among them); () is plain RoPE.
    rope_scaling: tuple = ()
    # RoPE base of the sliding-window layers (plain RoPE); None: as the global layers.
    local_rope_theta: float | None = None
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(D) (Gemma)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs (Gemma 2/3)
    qk_norm: bool = False  # RMSNorm over each head's query and key (Qwen3, Gemma 3)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask
    final_softcap: float | None = None  # the same on the logits
    # A query at position p sees keys at positions > p - sliding_window on the layers
    # flagged in `sliding_layers` (one flag per layer; () : none).
    sliding_window: int | None = None
    sliding_layers: tuple = ()

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, not {self.activation!r}")
        # JSON (a saved config) gives lists: back to hashable tuples.
        object.__setattr__(self, "rope_scaling", tuple(
            (str(k), tuple(v) if isinstance(v, list) else v) for k, v in self.rope_scaling))
        object.__setattr__(self, "sliding_layers", tuple(bool(s) for s in self.sliding_layers))
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ValueError("sliding_layers needs one flag per layer")
        if any(self.sliding_layers) and not self.sliding_window:
            raise ValueError("sliding layers need a sliding_window")

    def truncated(self, n_layers: int) -> "ModelConfig":
        return dataclasses.replace(self, n_layers=n_layers,
                                   sliding_layers=self.sliding_layers[:n_layers])

    @property
    def windowed(self) -> bool:
        """Whether any layer has a sliding window (else no window mask is built at all)."""
        return any(self.sliding_layers)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    def layer_arrays(self) -> dict[str, np.ndarray]:
        """Per-layer features as arrays [L], scanned with the layers: `window` (int32, the
        layer's sliding window, 0 for none) and `local` (int32 1 where the layer takes the
        sliding layers' RoPE tables)."""
        sliding = np.asarray(self.sliding_layers or (False,) * self.n_layers, bool)
        return {"window": np.where(sliding, self.sliding_window or 0, 0).astype(np.int32),
                "local": (sliding & (self.local_rope_theta is not None)).astype(np.int32)}

    @property
    def n_params(self) -> int:
        d, f, e = self.d_model, self.d_ff, self.head_dim
        attn = d * e * (self.n_heads * 2 + self.n_kv_heads * 2)
        norms = (4 if self.post_norms else 2) * d + (2 * e if self.qk_norm else 0)
        per_layer = attn + 3 * d * f + norms
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * per_layer + d + head
