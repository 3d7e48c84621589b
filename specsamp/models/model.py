"""`Model`: the one way the rest of specsamp calls a decoder.

A `Model` is static and hashable (it goes into compiled programs as a constant); its
parameters are a separate, traced pytree, so one compiled program serves any weights of the
same shapes and formats. Every forward pass, head read and layer slice goes through here, so
a change of weight format (quantized blocks, `specsamp.quant`) or of placement touches this
file and the layers below it, not the decoding loop.

    model = Model(cfg)
    logits, cache = model.forward(params, tokens, positions, cache)
    hidden, cache = model.forward(params, tokens, positions, cache, head=False)
    logits = model.logits(params, hidden)
    rows = model.head_rows(params, ids)          # [N, D] float32 head rows
    small, small_params = model.first_layers(params, 2)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from specsamp.models.llama import KVCache, ModelConfig, Transformer, init_cache


@dataclasses.dataclass(frozen=True)
class Model:
    cfg: ModelConfig
    # A jax.sharding.Mesh (axis "tp", `specsamp.mesh`) to split the weights and cache
    # over, or None: one device. Placement only; the computation is the same program.
    mesh: Any = None
    # How attention over the KV cache runs: "cpu", the native kernel (one CPU device, the
    # kernels built; it reads only the slots a row has filled), or "xla". None: chosen.
    attention: str | None = None

    def __post_init__(self):
        if self.attention is None:
            object.__setattr__(self, "attention", default_attention(self.cfg, self.mesh))
        if self.attention not in ("cpu", "xla"):
            raise ValueError(f"attention must be 'cpu' or 'xla', not {self.attention!r}")

    def forward(self, params, tokens, positions, cache: KVCache, head: bool = True,
                paths=None):
        """(logits [B, T, V] float32, or final-normed hidden [B, T, D] with head=False;
        the cache with this call's keys/values written at `positions`).

        paths: a token tree's scoring block (`tree.block_paths`, [T, P] or per row
        [B, T, P]): tokens are written at slots start..start+T-1 (start = positions[:, 0])
        while positions are start + depth, and each reads the cache before start and its
        own path only; every token's output equals, bit for bit, the last token's of a
        plain call over its path (`llama.run_layers`). Afterwards the cache holds the
        block, not the path: `tree_cache.keep_path` moves the accepted one."""
        return Transformer(self.cfg, cache_attention(self.attention, cache)).apply(
            {"params": params}, tokens, positions, cache, head=head, paths=paths)

    def full_forward(self, params, tokens, head: bool = True):
        """Teacher-forced pass over tokens [B, T] at positions 0..T-1 with a fresh cache.
        On XLA's attention: training differentiates it (the kernel has no gradient), and a
        fresh cache has no unused slots for the kernel to skip."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        model = dataclasses.replace(self, attention="xla")
        out, _ = model.forward(params, tokens, positions, self.init_cache(b, t), head=head)
        return out

    def logits(self, params, hidden):
        """The head on final-normed hidden states [..., D] -> float32 [..., V]."""
        return Transformer(self.cfg).apply({"params": params}, hidden, method=Transformer.logits)

    def head_rows(self, params, ids) -> jax.Array:
        """Float32 head rows [N, D] of token ids [N] (embedding rows when tied)."""
        from specsamp.quant import dequantize_rows, is_quantized

        ids = jnp.asarray(ids, jnp.int32)
        w = params["embed"]["embedding"] if self.cfg.tie_embeddings else params["lm_head"]["kernel"]
        if is_quantized(w):
            return dequantize_rows(w, ids)
        return w[ids] if self.cfg.tie_embeddings else w[:, ids].T

    def embed_rows(self, params) -> jax.Array:
        """The whole embedding table [V, D], float32 (training and export only)."""
        from specsamp.quant import dequantize

        return dequantize(params["embed"]["embedding"])

    @staticmethod
    def layer_params(params, idx):
        """The stacked layer weights at layer indices `idx` (array of ints or a slice)."""
        return jax.tree.map(lambda a: a[idx], params["layers"])

    def first_layers(self, params, n_layers: int):
        """(Model, params) of this model's first `n_layers` layers (early exit)."""
        return (Model(self.cfg.truncated(n_layers), self.mesh, self.attention),
                {**params, "layers": self.layer_params(params, slice(0, n_layers))})

    def param_shapes(self):
        """The float parameter tree's shapes (jax.ShapeDtypeStruct leaves), without weights."""
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
        return jax.eval_shape(lambda t: Transformer(self.cfg).init(
            jax.random.PRNGKey(0), t, t, self.init_cache(1, 1)), tokens)["params"]

    def _read_per_step(self, params, count) -> int:
        """count(tree) over the parameters one decode step reads: every matrix once (the
        embedding table too when it is the tied head; an untied embedding only gives a row
        per token, no product)."""
        total = count(params)
        return total if self.cfg.tie_embeddings else total - count(params["embed"])

    def step_bytes(self, params) -> int:
        """Weight bytes one decode step reads."""
        return self._read_per_step(
            params, lambda tree: sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree)))

    def step_flops(self, params) -> int:
        """Floating-point operations of one decode step per row in its weight products:
        2 per weight of the matrices `step_bytes` counts (attention over the cache and the
        element-wise work come on top)."""
        from specsamp.quant.blocks import is_quantized

        def weights(tree):
            leaves = jax.tree.leaves(tree, is_leaf=is_quantized)
            return sum(math.prod(w.shape) if is_quantized(w) else int(w.size) for w in leaves)

        return 2 * self._read_per_step(params, weights)

    def init_cache(self, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
        return self.shard_cache(init_cache(self.cfg, batch, slots, dtype))

    # Placement on the mesh (tensor parallel); identity without a mesh. The rules (and how
    # uneven head counts are handled) are in `specsamp.models.sharding`.
    def shard_params(self, params):
        """`params` split over the mesh (quantized weights on the XLA path there)."""
        if self.mesh is None:
            return params
        from specsamp.models.sharding import shard_params

        return shard_params(self.cfg, params, self.mesh)

    def param_shardings(self, params):
        """The NamedSharding of each array of `params` (None without a mesh)."""
        if self.mesh is None:
            return None
        from specsamp.models.sharding import param_shardings

        return param_shardings(self.cfg, params, self.mesh)

    def cache_sharding(self):
        """The KV cache's NamedSharding: split by KV heads (None without a mesh)."""
        if self.mesh is None:
            return None
        from specsamp.models.sharding import cache_sharding

        return cache_sharding(self.cfg, self.mesh)

    def shard_cache(self, cache: KVCache) -> KVCache:
        if self.mesh is None:
            return cache
        return jax.device_put(cache, self.cache_sharding())


def cache_attention(chosen: str, cache: KVCache) -> str:
    """`chosen` ('cpu' or 'xla') where the native kernel reads the cache's type (float32,
    float16), else 'xla'."""
    return chosen if cache.k.dtype in (jnp.float32, jnp.float16) else "xla"


def default_attention(cfg: ModelConfig, mesh, native: bool | None = None) -> str:
    """'cpu' where the native attention kernel applies: a CPU backend with one device (the
    decoding loop builds its models without the mesh, so a process with several devices
    keeps XLA's attention, which shards), the kernels loaded (SPECSAMP_QUANT_BACKEND=xla
    turns them off), a head width the kernel takes. native: whether the native kernels run
    the program (decided once by its caller, `decoding.decode.Program.native`); None:
    decided now."""
    from specsamp.quant import kernels

    fits = cfg.head_dim <= 256
    if native is None:
        native = kernels.on_one_cpu_device()
    return "cpu" if mesh is None and fits and native else "xla"
