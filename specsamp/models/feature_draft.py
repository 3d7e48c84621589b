"""A feature-conditioned draft (EAGLE-style, Li et al. 2024): one decoder layer of the
target's width fed [token embedding; the target's final hidden state at the previous
position], reading the target's own embedding and head.

At position j the draft takes (x_j, h_{j-1}), where h is the target's final-normed hidden
state (what its head reads), and returns g_j, its guess of h_j; head(g_j) is the draft's
distribution of x_{j+1}. While chaining K draft tokens it feeds its own g in place of h.
Drafting may depend on anything already computed, so the rejection rule stays exact.

Parameters: `fc` (2D -> D), `layers` (one stacked block, as in `Transformer`), `final_norm`;
`embed` (and `lm_head` if the target's head is untied) are the target's, borrowed at load.
Optionally a reduced head: `head_ids` [N] int32 names the only tokens the draft can propose
(its probability is zero elsewhere; the residual (q - p)+ covers the rest, so sampling stays
exact) and `head.kernel` [D, N] holds the target's head rows for them (borrowed at load).
A step then reads N head rows instead of V: most of a one-layer draft's cost.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from specsamp.models.argmax import first_argmax
from specsamp.models.llama import (
    KVCache, Linear, ModelConfig, init_cache, run_layers, setup_decoder,
)
from specsamp.reductions import row_dot

BORROWED = ("embed", "lm_head", "head")


class FeatureDraft(nn.Module):
    """`__call__(tokens [B,T], features [B,T,D], positions, cache) -> (g [B,T,D], cache)`;
    `logits(g) -> [B,T,V]` with the target's head."""

    cfg: ModelConfig  # the target's config with n_layers = the draft's layers
    attention: str = "xla"  # or "cpu": the native cache-attention kernel (`run_layers`)

    def setup(self):
        setup_decoder(self)
        self.fc = Linear(self.cfg.d_model, use_bias=False, name="fc")

    def __call__(self, tokens, features, positions, cache: KVCache, paths=None):
        x = self.fc(jnp.concatenate([self.embed(tokens), features.astype(jnp.float32)], axis=-1))
        x, cache = run_layers(self, x, cache, positions, self.attention, paths)
        return self.final_norm(x), cache

    def logits(self, g):
        if self.cfg.tie_embeddings:
            return self.embed.attend(g).astype(jnp.float32)
        return self.lm_head(g).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class FeatureModel:
    """The seam for the feature draft, as `specsamp.models.Model` is for decoders:
    static config, traced parameters (own weights plus the borrowed embedding/head and the
    optional reduced head)."""

    cfg: ModelConfig

    def forward(self, params, tokens, features, positions, cache: KVCache, attention=None,
                paths=None):
        """(g [B, T, D], cache): the draft's guesses of the target's hidden states. Attention
        as the target's (`Model.attention`): the native kernel where it applies. paths: a
        token tree's block (`Model.forward`)."""
        from specsamp.models.model import cache_attention, default_attention

        if attention is None:
            attention = cache_attention(default_attention(self.cfg, None), cache)
        return FeatureDraft(self.cfg, attention).apply(
            {"params": module_params(params)}, tokens, features, positions, cache, paths=paths)

    def full_forward(self, params, tokens, features):
        """g [B, T, D] over tokens [B, T] at positions 0..T-1 with a fresh cache (XLA's
        attention: training differentiates it)."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        g, _ = self.forward(params, tokens, features, positions, init_cache(self.cfg, b, t), "xla")
        return g

    def logits(self, params, g):
        return draft_logits(self.cfg, params, g)

    def greedy_tokens(self, params, g, native: bool | None = None):
        """The argmax token [...] of the draft's logits (first index on ties), without the
        full-vocabulary logits where the head is reduced: its ids are sorted, so the first
        of equal reduced logits is the first in vocabulary order, as over `logits`."""
        if "head_ids" not in params:
            return first_argmax(self.logits(params, g), native)
        return params["head_ids"][first_argmax(head_product(g, params["head"]["kernel"]), native)]


def module_params(params):
    """The parameters FeatureDraft itself declares (without the reduced head)."""
    return {k: v for k, v in params.items() if k not in ("head", "head_ids")}


def draft_logits(cfg: ModelConfig, params, g):
    """Logits [..., V] of the draft: the target's full head, or the reduced head scattered
    into V with a very low logit (probability exactly 0 after softmax) elsewhere."""
    if "head_ids" not in params:
        return FeatureDraft(cfg).apply({"params": module_params(params)}, g, method=FeatureDraft.logits)
    return scatter_reduced(head_product(g, params["head"]["kernel"]), params["head_ids"], cfg.vocab_size)


def scatter_reduced(sub, ids, vocab: int):
    """A reduced head's logits sub [..., n] over token ids [n] as logits [..., vocab]: -1e30
    (probability exactly 0 after softmax) at every other token."""
    full = jnp.full(sub.shape[:-1] + (vocab,), -1e30, jnp.float32)
    return full.at[..., ids].set(sub.astype(jnp.float32))


def head_product(g, kernel):
    """g [..., D] times the reduced head's kernel [D, N] (float or quantized) -> float32."""
    from specsamp.quant import is_quantized, matmul

    if is_quantized(kernel):
        return matmul(g, kernel)
    return row_dot(g, kernel).astype(jnp.float32)  # batch-invariant (`reductions`)


def reduced_head(target_cfg: ModelConfig, target_params, head_ids, pad: bool = False):
    """{'head_ids', 'head'} for the given token ids, from the target's head rows. The ids
    are sorted (`FeatureModel.greedy_tokens` relies on it). pad (for decoding, never for
    training, whose softmax is over the reduced head): pad them to a multiple of 16 by
    repeating the last one, as the quantized kernels take whole groups of 16 rows on their
    fastest path; a repeated id has the same row, so the same logit, which lands on the same
    token of the full vocabulary, and the first of equal logits wins an argmax: the draft's
    tokens and distribution do not change."""
    from specsamp.models.model import Model

    ids = jnp.sort(jnp.asarray(head_ids, jnp.int32))
    if pad:
        ids = jnp.concatenate([ids, jnp.repeat(ids[-1:], -ids.shape[0] % 16)])
    return {"head_ids": ids, "head": {"kernel": Model(target_cfg).head_rows(target_params, ids).T}}


def init_feature_draft(target_cfg: ModelConfig, target_params, n_layers: int = 1,
                       seed: int = 0, init_layer: int | None = 0):
    """Draft parameters: borrowed embedding/head, `fc` as [identity on the embedding half;
    zero] (so the untrained draft starts as the target's layer `init_layer` on tokens)."""

    cfg = target_cfg.truncated(n_layers)
    d = cfg.d_model
    params = dict(_init(cfg, jax.random.PRNGKey(seed)))
    for name in BORROWED:
        if name in target_params:
            params[name] = target_params[name]
    params["fc"] = {"kernel": jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)}
    if init_layer is not None:
        idx = jnp.arange(init_layer, init_layer + n_layers)
        from specsamp.models.model import Model

        params["layers"] = Model(target_cfg).layer_params(target_params, idx)
        params["final_norm"] = target_params["final_norm"]
    return cfg, params


@jax.jit(static_argnames=("cfg",))
def _init(cfg: ModelConfig, key):
    # One compiled program (op by op, an initialisation is hundreds of small programs).
    tokens = jnp.zeros((1, 2), jnp.int32)
    return FeatureDraft(cfg).init(key, tokens, jnp.zeros((1, 2, cfg.d_model)),
                                  jnp.arange(2)[None], init_cache(cfg, 1, 4))["params"]


# ---- on disk: a folder with specsamp_draft.json and model.safetensors (own weights only,
# float16), borrowing the target's embedding and head at load time.

MANIFEST = "specsamp_draft.json"


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def _unflatten(flat):
    tree = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def save_feature_draft(folder: str, cfg: ModelConfig, params, target_fingerprint: str,
                       extra: dict | None = None) -> None:
    import json
    import os

    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    own = {k: v for k, v in params.items() if k not in BORROWED}
    flat = {k: np.asarray(v, np.int32 if k == "head_ids" else np.float16)
            for k, v in _flatten(own).items()}
    save_file(flat, os.path.join(folder, "model.safetensors"))
    manifest = {"kind": "feature", "n_layers": cfg.n_layers, "d_model": cfg.d_model,
                "vocab_size": cfg.vocab_size, "target_fingerprint": target_fingerprint,
                **(extra or {})}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)


def is_feature_draft(path: str) -> bool:
    from specsamp import fs

    return fs.kind_of(path.rstrip("/") + "/" + MANIFEST) == "file"


def load_feature_draft(path: str, target):
    """(cfg, params) of the feature draft at `path` (local or gs://) for LoadedModel `target`."""
    import json

    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from specsamp import fs
    from specsamp.errors import UserError

    base = path.rstrip("/")
    with open(fs.local_file(f"{base}/{MANIFEST}")) as f:
        manifest = json.load(f)
    tc = target.cfg
    if manifest.get("target_fingerprint") != target.tokenizer.fingerprint or (
        manifest.get("d_model") != tc.d_model or manifest.get("vocab_size") != tc.vocab_size
    ):
        raise UserError(f"feature draft {path} was trained for another target "
                        f"(width {manifest.get('d_model')}, vocab {manifest.get('vocab_size')}); "
                        f"this target has width {tc.d_model}, vocab {tc.vocab_size}")
    flat = load_file(fs.local_file(f"{base}/model.safetensors"))
    params = _unflatten({k: jnp.asarray(v, jnp.int32 if k == "head_ids" else jnp.float32)
                         for k, v in flat.items()})
    for name in BORROWED:
        if name in target.params:
            params[name] = target.params[name]
    if "head_ids" in params:
        params.update(reduced_head(tc, target.params, params["head_ids"], pad=True))
    if getattr(target, "weights", "float32") != "float32":
        params = _compact(params, tc, target.params)
    return tc.truncated(int(manifest["n_layers"])), params


def _compact(params, target_cfg: ModelConfig, target_params):
    """With a quantized target: the reduced head as the target's own quantized rows (the
    same values, a quarter of the bytes), the draft's matrices int8 per output channel (a
    slightly different draft: sampling stays exact, only acceptance may move)."""
    from specsamp.quant import int8_kernel, is_quantized, take_rows

    table = target_params["embed"]["embedding"] if target_cfg.tie_embeddings \
        else target_params["lm_head"]["kernel"]
    out = dict(params)
    if "head_ids" in params and is_quantized(table):
        out["head"] = {"kernel": take_rows(table, params["head_ids"], transposed=True)}
        backend = table.backend
    else:
        from specsamp.quant.kernels import default_backend

        backend = default_backend()

    def compact(path, leaf):
        name = path[-1].key if hasattr(path[-1], "key") else ""
        return int8_kernel(leaf, backend) if name == "kernel" else leaf

    for own in ("fc", "layers"):
        out[own] = jax.tree_util.tree_map_with_path(compact, params[own])
    return out
