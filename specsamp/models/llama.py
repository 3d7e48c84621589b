"""A Llama-family decoder in Flax: RMSNorm, rotary embeddings, grouped-query attention,
gated MLP, tied or untied head; the features of Qwen2/3, Mistral and Gemma 2/3 as the
config switches them on (`specsamp.models.config`): q/k/v bias, q/k norms, GeGLU, (1 + w)
norms, post-norms, scaled embeddings, soft-capping, sliding windows on some layers.

Axes: B batch, T tokens in this call, S cache slots, L layers, D model width, H query heads,
G query heads per KV head, J KV heads, E head dim, F MLP width, V vocab.

The model is a pure function `(tokens, positions, cache) -> (logits, new_cache)`. Positions
are explicit and per row; each call writes its T keys/values at the row's positions, which
must be contiguous (they are: prefill, draft steps and the K+1 scoring block). A query at
position p attends to cache slots 0..p only, so slots beyond a row's length hold stale
entries (rejected draft tokens, padding) that are never read and are overwritten by the
next write at those positions: rejection needs no cache copy. A sliding-window layer of
window W also skips slots at or below p - W (the cache stays full-length: slot = position).

A token tree's scoring block (`paths`, see `run_layers`) is the one call whose slots differ
from its positions: token t is written at slot start + t but sits at position start + its
depth, and reads its own path in place of the block; `specsamp.models.tree_cache` then
moves the accepted path to slot = position.

Layers are one `nn.scan` over stacked weights (leading axis L): one layer compiles once, and
early-exit drafting is the same module with `n_layers=L'` and the first L' weight slices.
What differs between layers (window, RoPE base) is scanned along as per-layer arrays
(`ModelConfig.layer_arrays`), not branched on in Python.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from specsamp import reductions
from specsamp.models.config import ModelConfig
from specsamp.models.rope import apply_rope, rope_tables
from specsamp.quant import dequantize_rows, is_quantized, matmul, matmul_many
from specsamp.reductions import softcap

__all__ = ["KVCache", "ModelConfig", "Transformer", "apply_rope", "init_cache", "init_params",
           "layer_rope", "rope_tables", "run_layers", "setup_decoder"]


@flax.struct.dataclass
class KVCache:
    # Heads before slots, so that attention reads each (row, head)'s [S, E] block as it
    # lies (a slot-major cache costs two transposed copies of the cache per layer).
    k: jax.Array  # [L, B, J, S, E]
    v: jax.Array  # [L, B, J, S, E]

    @property
    def size(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, slots, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def _stored(module: nn.Module, name: str, init, shape):
    """The parameter `name`: declared (with its float shape) when initializing, otherwise
    read as stored, which may be a quantized `QWeight` (Flax's `param` would compare its
    leaves against the float shape and refuse it)."""
    if module.is_initializing() or not module.has_variable("params", name):
        return module.param(name, init, shape)
    return module.get_variable("params", name)


class Linear(nn.Module):
    """nn.Dense over a float or quantized kernel [in, out] (same parameter names)."""

    features: int
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = _stored(self, "kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        if is_quantized(kernel):
            y = matmul(x, kernel).astype(x.dtype)
        else:
            y = reductions.row_dot(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return y


def _linears(module: nn.Module, x, specs):
    """Linear(features, use_bias, name)(x) for each (name, features, use_bias) of specs,
    declared in `module`. Where every kernel is a quantized weight on the native kernels
    and none has a bias (q, k, v; gate, up), the products run as one kernel call."""
    params = {} if module.is_initializing() else module.variables.get("params", {})
    kernels = [params.get(name, {}).get("kernel") for name, _, _ in specs]
    if all(is_quantized(k) for k in kernels) and not any(bias for _, _, bias in specs):
        return [y.astype(x.dtype) for y in matmul_many(x, kernels)]
    return [Linear(features, use_bias=bias, name=name)(x) for name, features, bias in specs]


class Embed(nn.Module):
    """nn.Embed over a float or quantized table [V, D]: lookup, and `attend` (the tied head)."""

    num_embeddings: int
    features: int

    def setup(self):
        self.embedding = _stored(self, "embedding", nn.initializers.variance_scaling(
            1.0, "fan_in", "normal", out_axis=0), (self.num_embeddings, self.features))

    def __call__(self, ids):
        if is_quantized(self.embedding):
            return dequantize_rows(self.embedding, ids.reshape(-1)).reshape(ids.shape + (-1,))
        return jnp.take(self.embedding, ids, axis=0)

    def attend(self, query):
        if is_quantized(self.embedding):
            return matmul(query, self.embedding)
        return reductions.row_dot(query, self.embedding, transposed=True)


class RMSNorm(nn.Module):
    """Over the last axis. plus_one (Gemma): scales by (1 + w) in float32, w stored from 0."""

    eps: float
    plus_one: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],))
        if self.plus_one:
            scale = 1.0 + scale.astype(jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(reductions.tree_mean(x32 * x32, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


def _norm(cfg: ModelConfig, name: str) -> RMSNorm:
    return RMSNorm(cfg.norm_eps, cfg.norm_plus_one, name=name)


def layer_rope(cfg: ModelConfig, positions: jax.Array) -> tuple:
    """The RoPE tables the layers take: ((cos, sin),) of the global layers, and a second
    pair for the sliding layers where their base differs (Gemma 3); each [B, T, E/2]."""
    tables = (rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),)
    if cfg.local_rope_theta is not None:
        tables += (rope_tables(positions, cfg.head_dim, cfg.local_rope_theta),)
    return tables


def _path_attention(q, k_cache, v_cache, visible, cap, start, paths):
    """`reductions.cache_attention` for a tree block (`run_layers`' paths [B, T, P]): each
    token's keys/values gathered so that its path lies at slots start..start + depth, where
    a chain's token at that position finds it, then the same reduction with each token a row
    of its own (a row's bits do not depend on the rows beside it). Costs a [S, E] gather per
    token and KV head."""
    b, t, j, g, e = q.shape
    s, depth = k_cache.shape[2], paths.shape[-1]
    rel = jnp.arange(s, dtype=jnp.int32)[None] - start[:, None]  # [B, S]
    col = jnp.broadcast_to(jnp.clip(rel, 0, depth - 1)[:, None], (b, t, s))
    entry = jnp.take_along_axis(paths, col, axis=2)  # [B, T, S]: the block slot read there
    on_path = ((rel >= 0) & (rel < depth))[:, None] & (entry >= 0)
    index = jnp.where(on_path, start[:, None, None] + entry, jnp.arange(s, dtype=jnp.int32))
    gather = jax.vmap(lambda c, i: jnp.moveaxis(jnp.take(c, i, axis=1), 1, 0))  # [T, J, S, E]
    keys = gather(k_cache, index).reshape(b * t, j, s, e)
    vals = gather(v_cache, index).reshape(b * t, j, s, e)
    out = reductions.cache_attention(q.reshape(b * t, 1, j, g, e), keys, vals,
                                     visible.reshape(b * t, 1, s), cap)
    return out.reshape(b, t, j, g, e)


def _write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, J, E] into a layer's cache [B, J, S, E] at each row's start slot."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)  # [B, J, T, E]
    return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (0, s, 0)))(
        cache, new, start)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, rope, positions, k_cache, v_cache, window, layer=None, paths=None):
        """k_cache, v_cache: this layer's [B, J, S, E]; returned with this call's T written.
        With `layer` (an index), the whole stacks [L, B, J, S, E] instead, written and read
        in place at that layer by the native kernel (`specsamp.quant.kernels.attend`).
        rope: this layer's (cos, sin); window: this layer's sliding window (0: none);
        paths: a tree block's [B, T, P] table (`run_layers`) or None."""
        cfg = self.cfg
        b, t, _ = x.shape
        h, j, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = _linears(self, x, [(name, n * e, cfg.qkv_bias)
                                     for name, n in (("q", h), ("k", j), ("v", j))])
        q, k, v = q.reshape(b, t, h, e), k.reshape(b, t, j, e), v.reshape(b, t, j, e)
        if cfg.qk_norm:
            q, k = _norm(cfg, "q_norm")(q), _norm(cfg, "k_norm")(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if layer is not None:
            from specsamp.quant.kernels import attend

            out, k_cache, v_cache = attend(layer, q, k, v, positions, k_cache, v_cache,
                                           cfg.scale, window, cfg.attn_softcap, paths)
            out = out.astype(x.dtype).reshape(b, t, h * e)
            return Linear(cfg.d_model, use_bias=False, name="o")(out), k_cache, v_cache

        start = positions[:, 0]
        k_cache, v_cache = _write(k_cache, k, start), _write(v_cache, v, start)

        q = q.reshape(b, t, j, h // j, e) * cfg.scale
        slots = jnp.arange(k_cache.shape[2])
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        if cfg.windowed:  # keys within the window: positions p - W < slot <= p
            visible &= (window <= 0) | (slots[None, None, :] > positions[:, :, None] - window)
        if paths is None:
            out = reductions.cache_attention(q, k_cache, v_cache, visible, cfg.attn_softcap)
        else:
            out = _path_attention(q, k_cache, v_cache, visible, cfg.attn_softcap, start, paths)
        # a cache wider than the activations (float32) stays in it: round to theirs
        out = out.astype(x.dtype).reshape(b, t, h * e)
        return Linear(cfg.d_model, use_bias=False, name="o")(out), k_cache, v_cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        gate, up = _linears(self, x, [("gate", self.cfg.d_ff, False), ("up", self.cfg.d_ff, False)])
        if self.cfg.activation == "gelu_tanh":
            gate = nn.gelu(gate, approximate=True)
        else:
            gate = nn.silu(gate)
        return Linear(self.cfg.d_model, use_bias=False, name="down")(gate * up)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, layer_cache, per_layer, rope, positions, layer=None, paths=None):
        """per_layer: this layer's entries of `ModelConfig.layer_arrays` (scalars); rope:
        `layer_rope`'s tables, of which the layer takes its own."""
        cfg = self.cfg
        k_cache, v_cache = layer_cache
        if len(rope) == 2:
            local = per_layer["local"] > 0
            rope = tuple(jnp.where(local, lo, gl) for gl, lo in zip(*rope))
        else:
            rope = rope[0]
        attn_out, k_cache, v_cache = Attention(cfg, name="attn")(
            _norm(cfg, "attn_norm")(x), rope, positions, k_cache, v_cache, per_layer["window"],
            layer, paths)
        if cfg.post_norms:
            attn_out = _norm(cfg, "post_attn_norm")(attn_out)
        x = x + attn_out
        mlp_out = MLP(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x))
        if cfg.post_norms:
            mlp_out = _norm(cfg, "post_mlp_norm")(mlp_out)
        return x + mlp_out, (k_cache, v_cache)


def run_layers(module: nn.Module, x, cache: KVCache, positions, attention: str = "xla",
               paths=None):
    """The layer stack of `module` (set up by `setup_decoder`) over x: (x, new cache).

    paths (a token tree's scoring block; None: a plain block): int32 [B, T, P] or [T, P]
    (every row alike), `tree.block_paths`' table. Token t is written at slot start + t
    (start = positions[:, 0]) and, at position p, attends to the cache slots before start
    (within the window by position) and to the block slots start + paths[t, d] for
    d = 0..p - start (its path by depth, itself last); entries past p - start are not read.
    Its logits are then bit for bit those of the last token of a plain call over its path
    at start..p (`_path_attention`; the native kernel alike).

    At init, Flax's nn.scan declares the stacked weights. At apply, a plain lax.scan over
    the layer index hands each layer a view of the stacked weights: a quantized weight on
    the native kernels keeps the whole stack and the index (the kernel reads the layer in
    place), where a sliced operand would make XLA copy every layer's bytes each step.

    attention "cpu": the whole cache is carried through the scan and each layer's native
    kernel writes and reads it in place (XLA's scan over per-layer cache slices rewrites
    the whole cache every step, and attends over every slot, used or not)."""
    cfg = module.cfg
    rope = layer_rope(cfg, positions)
    if paths is not None:
        paths = jnp.asarray(paths, jnp.int32)
        paths = jnp.broadcast_to(paths, positions.shape + paths.shape[-1:])
    per_layer = {k: jnp.asarray(a) for k, a in cfg.layer_arrays().items()}
    if module.is_initializing():
        x, (k, v) = module.layers(x, (cache.k, cache.v), per_layer, rope, positions)
        return x, KVCache(k=k, v=v)
    from specsamp.quant import layer_view

    stacked = module.variables["params"]["layers"]
    block = Block(cfg, parent=None)  # a free module, applied to one layer at a time

    def weights(i):  # layer i's view of the stacked weights
        return {"params": jax.tree.map(lambda a: layer_view(a, i), stacked, is_leaf=is_quantized)}

    def mine(i):  # layer i's per-layer features
        return {k: a[i] for k, a in per_layer.items()}

    if attention == "cpu":
        def carried(carry, i):
            x, k, v = carry
            x, (k, v) = block.apply(weights(i), x, (k, v), mine(i), rope, positions, i, paths)
            return (x, k, v), None

        (x, k, v), _ = jax.lax.scan(carried, (x, cache.k, cache.v),
                                    jnp.arange(cache.k.shape[0], dtype=jnp.int32))
        return x, KVCache(k=k, v=v)

    def body(x, inputs):
        i, k, v = inputs
        x, (k, v) = block.apply(weights(i), x, (k, v), mine(i), rope, positions, None, paths)
        return x, (k, v)

    x, (k, v) = jax.lax.scan(body, x, (jnp.arange(cache.k.shape[0]), cache.k, cache.v))
    return x, KVCache(k=k, v=v)


def setup_decoder(module: nn.Module) -> None:
    """Embedding, the scanned layer stack, final norm and (untied) head of `module.cfg`:
    shared by the decoder and the feature-conditioned draft, so their weights line up."""
    cfg = module.cfg
    module.embed = Embed(cfg.vocab_size, cfg.d_model, name="embed")
    module.layers = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, 0, nn.broadcast, nn.broadcast),
        length=cfg.n_layers,
    )(cfg, name="layers")
    module.final_norm = _norm(cfg, "final_norm")
    if not cfg.tie_embeddings:
        module.lm_head = Linear(cfg.vocab_size, use_bias=False, name="lm_head")


def compute_dtype(params) -> jnp.dtype:
    """The type activations are computed in: that of the float weights (the final norm's
    scale is one, never quantized)."""
    return params["final_norm"]["scale"].dtype


def embed_tokens(module: nn.Module, tokens) -> jax.Array:
    """The embeddings of tokens [B, T] -> [B, T, D] at the compute type (a quantized table's
    rows come in float32), times sqrt(D) rounded to that type where the config says (Gemma)."""
    x = module.embed(tokens)
    if not module.is_initializing():
        x = x.astype(compute_dtype(module.variables["params"]))
    if module.cfg.embed_scale:
        x = x * jnp.asarray(module.cfg.d_model ** 0.5, x.dtype)
    return x


class Transformer(nn.Module):
    """Decoder. `__call__` returns (logits [B, T, V], new cache); with `head=False` it
    returns the final-normed hidden states [B, T, D] instead (features for drafters, and
    prefill, which needs no logits)."""

    cfg: ModelConfig
    attention: str = "xla"  # or "cpu": the native cache-attention kernel (`run_layers`)

    def setup(self):
        setup_decoder(self)

    def __call__(self, tokens, positions, cache: KVCache, head: bool = True, paths=None):
        x = embed_tokens(self, tokens)
        x, cache = run_layers(self, x, cache, positions, self.attention, paths)
        hidden = self.final_norm(x)
        out = self.logits(hidden) if head else hidden
        return out, cache

    def logits(self, hidden):
        if self.cfg.tie_embeddings:
            out = self.embed.attend(hidden).astype(jnp.float32)
        else:
            out = self.lm_head(hidden).astype(jnp.float32)
        return softcap(out, self.cfg.final_softcap)


def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 1.0):
    """Random parameters (tests, tiny models). `scale` multiplies every weight."""
    return _init_params(cfg, jax.random.PRNGKey(seed), scale)


@jax.jit(static_argnames=("cfg",))
def _init_params(cfg: ModelConfig, key, scale):
    # One compiled program (op by op, an initialisation is hundreds of small programs).
    tokens = jnp.zeros((1, 2), jnp.int32)
    positions = jnp.arange(2, dtype=jnp.int32)[None]
    params = Transformer(cfg).init(key, tokens, positions, init_cache(cfg, 1, 4))["params"]
    return jax.tree.map(lambda a: a * scale, params)
