"""Rotary position embeddings: plain, and the scalings checkpoints ask for ('linear',
'llama3', 'yarn'), as Hugging Face transformers defines them.

GGUF files carry Llama 3's scaling as per-frequency divisors instead ('divisors', from
the file's rope_freqs tensor). A scaling changes only the inverse frequencies (and, for
yarn, multiplies cos and sin by an attention factor); they depend on the config alone, so
they are computed once here in numpy (float32 where transformers computes in float32) and
enter the program as constants.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("default", "linear", "llama3", "yarn")


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: tuple = ()):
    """cos/sin [B, T, E/2] for the rotate-half layout (Hugging Face's convention).
    `scaling`: sorted (key, value) pairs of the checkpoint's rope parameters; () is plain."""
    params = dict(scaling)
    kind = params.get("rope_type", "default")
    if kind == "default":
        inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        factor = 1.0
    else:
        inv_freq, factor = scaled_frequencies(head_dim, theta, params)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor != 1.0:
        cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
    return cos, sin


def _plain(head_dim: int, theta: float) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def scaled_frequencies(head_dim: int, theta: float, p: dict) -> tuple[np.ndarray, float]:
    """(inverse frequencies [E/2] float32, attention factor) of a scaled RoPE."""
    kind = p["rope_type"]
    inv_freq = _plain(head_dim, theta)
    if kind == "linear":
        return (inv_freq / np.float32(p["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, p)
    if kind == "divisors":  # GGUF's rope_freqs (llama.cpp's form of Llama 3's scaling)
        return (inv_freq / np.asarray(p["divisors"], np.float32)).astype(np.float32), 1.0
    raise ValueError(f"RoPE scaling {kind!r} is not one of {SCALINGS}")


def _llama3(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between the two bands."""
    factor, low, high = (np.float32(p[k])
                         for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = np.float32(p["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(head_dim: int, theta: float, p: dict) -> tuple[np.ndarray, float]:
    """YaRN: interpolated (divided by `factor`) below a band of dimensions, extrapolated
    (kept) above it, a linear ramp between; cos/sin scaled by the attention factor."""
    factor = float(p["factor"])
    original = float(p["original_max_position_embeddings"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32)
                                      / np.float32(head_dim))
    inv = (np.float32(1) / (np.float32(factor) * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep
    return inv.astype(np.float32), float(attention)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, E]: rotate the pairs (i, i + E/2) by the position's angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
