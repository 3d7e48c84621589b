"""Tensor-parallel placement of a decoder's weights and KV cache on a 1-D mesh ("tp").

Megatron-style: q/k/v, gate and up are split by output columns, o and down by input rows,
so each device computes its heads / its slice of the MLP and one all-reduce per block
joins the partial sums; the head (tied embedding or lm_head) is split by vocabulary rows,
and the logits stay split: the sampler's reductions over the vocabulary (maxima, sums,
running mass) run on each device's part and are joined by all-reduces. The KV cache
[L, B, J, S, E] is split by KV heads, the same way as k and v, so that each device's
attention reads only its own cache.

Uneven counts: an axis is split only where N divides it; otherwise that weight is
replicated (every device computes the whole of it, which is correct and costs memory,
not exactness). Attention is split by KV heads (each device keeps whole groups of query
heads with their KV head), so it needs n_kv_heads % N == 0: SmolLM2-135M has 9 query and
3 KV heads, so at N = 2, 4, 8 its attention (and KV cache) is replicated while its MLP
(1536 columns) and head (49152 rows) are split; at N = 3 everything is split.

Quantized weights (`QWeight`) follow their float parameter: the same split on the fields
(codes, scales, minimums), where the split of inputs also needs whole quantization blocks
per device. The native kernels are FFI calls that XLA cannot partition, so a sharded
model runs the pure-XLA dequantize path (`backend="xla"`), which GSPMD partitions like
any dot.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specsamp.mesh import AXIS, replicate
from specsamp.quant import is_quantized
from specsamp.quant.blocks import plain


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def float_spec(cfg, names: tuple[str, ...], ndim: int, n: int) -> list:
    """The split of a float parameter named `names` (e.g. layers/attn/q/kernel) over n
    devices, as a PartitionSpec list, before divisibility of the actual shape is checked."""
    spec = [None] * ndim
    owner = names[-2] if len(names) > 1 else ""
    heads = cfg.n_kv_heads % n == 0
    if owner in ("q", "k", "v") and heads:  # kernel [L, D, out] and bias [L, out]
        spec[-1] = AXIS
    elif owner == "o" and heads:  # [L, H*E, D]: rows are heads
        spec[-2] = AXIS
    elif owner in ("gate", "up"):  # [L, D, F]
        spec[-1] = AXIS
    elif owner == "down":  # [L, F, D]
        spec[-2] = AXIS
    elif owner == "embed":  # [V, D]
        spec[0] = AXIS
    elif owner == "lm_head":  # [D, V]
        spec[-1] = AXIS
    return spec


def _fit(spec: list, shape, n: int) -> list:
    """Drop the split of any axis that n does not divide (that axis is replicated)."""
    return [a if a is None or shape[i] % n == 0 else None for i, a in enumerate(spec)]


def _qweight_sharding(w, spec: list, mesh: Mesh, n: int):
    """The float split `spec` (over W.T for a Dense kernel) moved onto the fields
    [..., rows, cols] of a QWeight; one sharding for all fields, so that a block's codes
    and its scale always live on the same device."""
    lead, a, b = spec[:-2], spec[-2], spec[-1]
    rows, cols = (b, a) if w.transposed else (a, b)
    fields = [f for f in (w.codes, w.scale, w.min) if f is not None]
    field_spec = list(lead) + [rows, cols]
    for f in fields:
        field_spec = _fit(field_spec, f.shape, n)
    s = NamedSharding(mesh, PartitionSpec(*field_spec))
    return w.replace(codes=s, scale=s, min=None if w.min is None else s, layer=None)


def leaf_sharding(cfg, names: tuple[str, ...], leaf, mesh: Mesh):
    """The NamedSharding of the parameter `names` (e.g. ("layers", "mlp", "up", "kernel")),
    an array or a QWeight (then one per field)."""
    n = mesh.shape[AXIS]
    spec = float_spec(cfg, names, len(leaf.shape), n)
    if is_quantized(leaf):
        return _qweight_sharding(leaf, spec, mesh, n)
    return NamedSharding(mesh, PartitionSpec(*_fit(spec, leaf.shape, n)))


def param_shardings(cfg, params, mesh: Mesh):
    """A pytree like `params` with a NamedSharding for each array (QWeight: per field)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf_sharding(cfg, _names(path), leaf, mesh), params, is_leaf=is_quantized)


def place_leaf(cfg, names: tuple[str, ...], leaf, mesh: Mesh):
    """One parameter placed on the mesh as `shard_params` places it (loading places the
    weights one at a time, so a whole copy of them never sits on one device first)."""
    if is_quantized(leaf):
        leaf = plain(leaf).replace(backend="xla")
    return jax.device_put(leaf, leaf_sharding(cfg, names, leaf, mesh))


def _xla(params):
    return jax.tree.map(lambda w: plain(w).replace(backend="xla") if is_quantized(w) else w,
                        params, is_leaf=is_quantized)


def shard_params(cfg, params, mesh: Mesh):
    """`params` placed on the mesh; quantized weights switched to the XLA path."""
    params = _xla(params)
    return jax.device_put(params, param_shardings(cfg, params, mesh))


def replicate_params(params, mesh: Mesh | None):
    """A whole copy of `params` on every device of the mesh (a small co-located draft),
    quantized weights on the XLA path (an FFI call in a partitioned program is not
    something XLA can split)."""
    return params if mesh is None else replicate(_xla(params), mesh)


def cache_sharding(cfg, mesh: Mesh) -> NamedSharding:
    """KV cache [L, B, J, S, E] split by KV heads where they divide, else replicated."""
    heads = AXIS if cfg.n_kv_heads % mesh.shape[AXIS] == 0 else None
    return NamedSharding(mesh, PartitionSpec(None, None, heads, None, None))
