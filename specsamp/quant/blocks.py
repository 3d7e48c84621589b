"""Quantized weight matrices kept as their blocks: `QWeight` and its reference arithmetic.

A `QWeight` stands for a float matrix W [R, C] (R output rows, C inputs) stored as codes
plus a scale (and, for offset formats, a minimum) per block of `block` consecutive inputs
of a row; a value is `code * scale + min`, computed in float32 exactly as llama.cpp's
reference dequantizer (gguf-py) computes it, so the model is the stored model itself:

- 4-bit (GGUF Q4_0 and Q4_1; Q4_0's `(q - 8) * d` is stored as Q4_1 with min = -8 d,
  which gives the same float32 value, every term being exact): codes uint8 [R, C/2], two
  codes a byte in GGUF's order (in each block of 32, byte j holds input j in its low
  nibble and input j + 16 in its high nibble), scale and min float16 [R, C/32].
- 8-bit (GGUF Q8_0, block 32, float16 scales; or int8 per-channel, block = C, a float32
  scale per row): codes int8 [R, C], min None.

Leading axes (the stacked layer axis L) are allowed on every field; `transposed` says the
parameter this replaces is W.T (a Dense kernel [in, out]) rather than W (an embedding
[V, D]). `backend` picks who computes products: "xla" (dequantize then dot, inside the
fusion: the reference, and the path on TPU/GPU) or "cpu" (the native kernels of
`specsamp.quant.kernels`).

`layout` is "gguf" (the order above) or "tiles": the same bytes permuted so that each
group of 16 output rows and block of 32 inputs is contiguous in the order the CPU's tile
unit (AMX) reads it (amx.h). Weights take it on the "cpu" backend where the kernels run on
AMX (`to_qweight`); every function here reads either layout (the values do not change).

`activations` is "float32" (products of the float inputs with the stored weights, exact
but for float32's rounding) or "int8": the native kernels round each block of 32 inputs
to bytes first and sum byte products (llama.cpp's arithmetic for these formats; a8.h says
exactly what is computed). Such weights are in the tile layout and only the native
kernels compute their products ("stored-a8" weights, `specsamp.loading`).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class QWeight:
    codes: jax.Array
    scale: jax.Array
    min: Any  # jax.Array or None
    layer: Any = None  # int32 scalar: this is layer `layer` of the stacked fields (a view)
    bits: int = flax.struct.field(pytree_node=False, default=4)
    block: int = flax.struct.field(pytree_node=False, default=32)
    transposed: bool = flax.struct.field(pytree_node=False, default=True)
    backend: str = flax.struct.field(pytree_node=False, default="xla")
    layout: str = flax.struct.field(pytree_node=False, default="gguf")  # or "tiles"
    activations: str = flax.struct.field(pytree_node=False, default="float32")  # or "int8"

    @property
    def rows(self) -> int:
        return self.codes.shape[-2]

    @property
    def cols(self) -> int:
        return self.codes.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float parameter this stands for."""
        lead = tuple(self.codes.shape[:-2])
        return lead + ((self.cols, self.rows) if self.transposed else (self.rows, self.cols))

    @property
    def nbytes(self) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(self))


def is_quantized(w) -> bool:
    return isinstance(w, QWeight)


def layer_view(w, i):
    """Layer i of a stacked weight: a view (whole stack plus index) for the native
    kernels, which read the layer in place; a slice otherwise."""
    if isinstance(w, QWeight) and w.backend == "cpu" and w.layer is None:
        from specsamp.quant import kernels

        if kernels.supports(w):
            return w.replace(layer=jnp.asarray(i, jnp.int32))
    return jax.tree.map(lambda a: a[i], w)


# ---- the tile layout: for each group of TILE outputs, block b, the bytes of a tile.
TILE = 16


def _tile_view(a, bits: int | None):
    """Shape of a field [..., N, X] as [..., N/16, 16, nb, k, i] (codes: k rows of i bytes
    per block; bits None: a scale or min [..., N, nb] as [..., N/16, 16, nb])."""
    *lead, n, x = a.shape
    if bits is None:
        return (*lead, n // TILE, TILE, x)
    per = 4 if bits == 4 else 8  # a block's bytes in 4-byte tile columns: 16 or 32 bytes
    return (*lead, n // TILE, TILE, x // (4 * per), per, 4)


def tile_fields(fields: dict, bits: int, xp=np) -> dict:
    """GGUF-order fields {codes, scale, min} [..., N, ...] in the tile layout (same shapes)."""
    out = {}
    for name, a in fields.items():
        if a is None or name not in ("codes", "scale", "min"):
            out[name] = a
            continue
        view = xp.reshape(a, _tile_view(a, bits if name == "codes" else None))
        axis = -4 if name == "codes" else -2  # the 16 outputs go inside each block
        out[name] = xp.reshape(xp.moveaxis(view, axis, -2 if name == "codes" else -1), a.shape)
    return out


def _untile(a, bits: int | None, xp=jnp):
    shape = _tile_view(a, bits)
    if bits is None:
        moved = (*shape[:-2], shape[-1], shape[-2])
        return xp.reshape(xp.swapaxes(xp.reshape(a, moved), -1, -2), a.shape)
    moved = (*shape[:-4], shape[-3], shape[-2], shape[-4], shape[-1])
    return xp.reshape(xp.moveaxis(xp.reshape(a, moved), -2, -4), a.shape)


def tileable(fields: dict) -> bool:
    """Whether the kernels' tile path takes these host fields: Q4 with float16 scales and
    minimums, or Q8_0 (blocks of 32, float16 scales), with whole groups of 16 outputs."""
    codes, scale, minimum = fields["codes"], fields["scale"], fields.get("min")
    bits, block = block_bits(fields)
    halves = scale.dtype == np.float16 and (bits == 8 or (minimum is not None and minimum.dtype == np.float16))
    return block == 32 and halves and codes.shape[-2] % TILE == 0


def plain(w: QWeight) -> QWeight:
    """`w` in the GGUF layout (a copy where it is in the tile layout)."""
    if w.layout == "gguf":
        return w
    un = lambda a, bits: None if a is None else _untile(a, bits)
    return w.replace(codes=un(w.codes, w.bits), scale=un(w.scale, None), min=un(w.min, None),
                     layout="gguf")


def _resolve(w: QWeight) -> QWeight:
    """A view as the plain (sliced) weight, in the GGUF layout."""
    if w.layer is not None:
        take = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, w.layer, keepdims=False)
        w = w.replace(codes=take(w.codes), scale=take(w.scale), min=take(w.min), layer=None)
    return plain(w)


def _rows(w: QWeight, ids):
    """(codes, scale, min) of rows `ids` in the GGUF layout: gathered from the tile layout
    without undoing the whole matrix (an embedding lookup reads a few rows)."""
    if w.layer is not None or w.layout == "gguf":
        w = _resolve(w)
        take = lambda a: None if a is None else jnp.take(a, ids, axis=-2)
        return take(w.codes), take(w.scale), take(w.min)
    ids = jnp.asarray(ids)
    group, lane = ids // TILE, ids % TILE

    def take(a, bits):
        if a is None:
            return None
        shape = _tile_view(a, bits)  # GGUF order; in memory the 16 outputs sit inside
        if bits is None:
            picked = jnp.reshape(a, (shape[0], shape[2], TILE))[group, :, lane]
        else:
            picked = jnp.reshape(a, (shape[0], shape[2], shape[3], TILE, 4))[group, :, :, lane]
        return jnp.reshape(picked, ids.shape + (a.shape[-1],))

    return take(w.codes, w.bits), take(w.scale, None), take(w.min, None)


def _values(w: QWeight, codes, scale, minimum) -> jax.Array:
    """Float32 rows [..., r, C] from the fields (already indexed to the wanted rows)."""
    *lead, r, _ = codes.shape
    nb = scale.shape[-1]
    if w.bits == 4:
        q = codes.reshape(*lead, r, nb, w.block // 2)
        q = jnp.concatenate([q & 0xF, q >> 4], axis=-1)
    else:
        q = codes.reshape(*lead, r, nb, w.block)
    v = q.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    if minimum is not None:
        v = v + minimum.astype(jnp.float32)[..., None]
    return v.reshape(*lead, r, nb * w.block)


def dequantize(w) -> jax.Array:
    """The float32 parameter `w` stands for (a float array is returned as it is)."""
    if not isinstance(w, QWeight):
        return w
    w = _resolve(w)
    v = _values(w, w.codes, w.scale, w.min)
    return jnp.swapaxes(v, -1, -2) if w.transposed else v


def dequantize_rows(w, ids) -> jax.Array:
    """Float32 rows W[ids] [N, C] of a quantized matrix (only those rows are decoded)."""
    return _values(w, *_rows(w, ids))


def matmul(x: jax.Array, w) -> jax.Array:
    """x [..., C] times W.T: x @ kernel for a Dense kernel, x @ E.T for an embedding."""
    if w.backend == "cpu":
        from specsamp.quant import kernels

        if kernels.supports(w):
            return kernels.qmatmul(x, w)
    if w.activations != "float32":
        raise ValueError("8-bit activations are computed by the native CPU kernels only")
    from specsamp.reductions import row_dot

    w = _resolve(w)
    rows = _values(w, w.codes, w.scale, w.min)
    return row_dot(x.astype(jnp.float32), rows, transposed=True)  # batch-invariant


def matmul_many(x: jax.Array, ws) -> list[jax.Array]:
    """[matmul(x, w) for w in ws]: one native kernel call where all of ws are on the
    kernels in one format (the same numbers as separate calls: each output is computed
    alone), separate products otherwise."""
    if len(ws) > 1 and all(isinstance(w, QWeight) and w.backend == "cpu" for w in ws):
        from specsamp.quant import kernels

        first = ws[0]
        if all(kernels.supports(w) and w.bits == first.bits and w.cols == first.cols
               and w.layer is first.layer and w.layout == first.layout
               and w.activations == first.activations for w in ws):
            return kernels.qmatmul_many(x, ws)
    return [matmul(x, w) for w in ws]


# ---- building blocks on the host (numpy), from GGUF block bytes or float matrices


def from_gguf_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> dict:
    """Fields {codes, scale, min} of one GGUF tensor's raw bytes (uint8 [rows, bytes per
    row]) for kind 'Q4_0', 'Q4_1' or 'Q8_0'."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 32, -1)
    if kind == "Q8_0":  # d f16, 32 x int8
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return {"codes": codes, "scale": scale, "min": None}
    if kind == "Q4_1":  # d f16, m f16, 16 bytes of nibbles
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        codes = blocks[..., 4:].reshape(rows, cols // 2)
        return {"codes": np.ascontiguousarray(codes), "scale": scale, "min": minimum}
    if kind == "Q4_0":  # d f16, 16 bytes of nibbles; value (q - 8) d == q d + (-8 d)
        scale = blocks[..., :2].copy().view(np.float16)[..., 0]
        minimum = (scale.astype(np.float32) * -8.0)
        # -8 d is exact in float16 unless it overflows; keep float32 then.
        minimum = minimum.astype(np.float16) if np.all(np.isfinite(minimum.astype(np.float16))) \
            else minimum
        codes = blocks[..., 2:].reshape(rows, cols // 2)
        return {"codes": np.ascontiguousarray(codes), "scale": scale, "min": minimum}
    raise ValueError(f"no block layout for {kind}")


def quantize_int8_rows(w: np.ndarray) -> dict:
    """Symmetric int8 per output row of W [R, C] (weight-only, round to nearest): a
    different model from its float source, by at most half a step per weight."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return {"codes": codes, "scale": scale, "min": None}


def to_qweight(fields: dict, transposed: bool, backend: str, activations: str = "float32") -> QWeight:
    """A QWeight (jax arrays) from host fields {codes, scale, min} in the GGUF layout; in
    the tile layout where the kernels run on AMX and take these fields. `activations`
    "int8" (native kernels only) applies where the tile layout takes the fields; other
    matrices keep float32 activations."""
    bits, block = block_bits(fields)
    layout = "gguf"
    if activations == "int8" and backend != "cpu":
        raise ValueError("8-bit activations are computed by the native CPU kernels only")
    act = "float32"
    if backend == "cpu" and tileable(fields):
        from specsamp.quant import kernels

        if kernels.amx() or activations == "int8":
            fields, layout, act = tile_fields(fields, bits), "tiles", activations
    m = fields.get("min")
    return QWeight(jnp.asarray(fields["codes"]), jnp.asarray(fields["scale"]),
                   None if m is None else jnp.asarray(m), None, bits=bits, block=block,
                   transposed=transposed, backend=backend, layout=layout, activations=act)


def int8_kernel(kernel, backend: str) -> QWeight:
    """A float kernel [..., in, out] as int8 per output channel."""
    w = np.swapaxes(np.asarray(kernel, np.float32), -1, -2)
    return to_qweight(quantize_int8_rows(w), transposed=True, backend=backend)


def take_rows(w: QWeight, ids, transposed: bool) -> QWeight:
    """The rows `ids` of a quantized matrix, still quantized (e.g. a reduced head), in
    `w`'s layout where the rows make whole groups of 16."""
    codes, scale, minimum = _rows(w, ids)
    fields = {"codes": codes, "scale": scale, "min": minimum}
    layout = w.layout if len(ids) % TILE == 0 else "gguf"
    if layout == "tiles":
        fields = tile_fields(fields, w.bits, xp=jnp)
    return QWeight(fields["codes"], fields["scale"], fields["min"], bits=w.bits, block=w.block,
                   transposed=transposed, backend=w.backend, layout=layout,
                   activations=w.activations if layout == "tiles" else "float32")


def block_bits(fields: dict) -> tuple[int, int]:
    """(bits, block) of fields built above."""
    codes, scale = fields["codes"], fields["scale"]
    bits = 4 if codes.dtype == np.uint8 else 8
    cols = codes.shape[-1] * (2 if bits == 4 else 1)
    return bits, cols // scale.shape[-1]
