"""Training the feature-conditioned draft (architecture b, `specsamp.models.feature_draft`).

Data: the distillation shards of `specsamp.distill.data` (tokens, mask, teacher top-k),
plus the target's final hidden states for every position, computed once per shard with a
teacher-forced forward and cached beside it as float16 (`features/<split>/<shard>.npy`).

At position j the draft reads (x_j, h_{j-1}) and must give (a) the teacher's distribution
of x_{j+1} (cross-entropy + `tv_weight` * (1 - overlap), the acceptance being 1 - TV) and
(b) h_j itself (`reg_weight` * smooth-L1), since in drafting its output g_j is fed back as
the next feature. A second, chained pass feeds the draft's own g (stop-gradient) in place
of h and adds its loss with `chain_weight`: what drafting tokens 2..K will see.

The head is reduced to `head_vocab` token ids with the most teacher mass (rows borrowed
from the target, frozen): the draft can only propose those, which is exact, and both
training and drafting skip most of the 49,152-row head.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Callable

import numpy as np

from specsamp.distill import data as data_mod
from specsamp.distill import train as train_mod
from specsamp.errors import UserError


@dataclasses.dataclass(frozen=True)
class FeatureTrainConfig:
    data_dir: str  # shards of `specsamp distill-data` (train/ and heldout/)
    out_dir: str
    n_layers: int = 1
    init_layer: int = 0
    head_vocab: int = 8192
    learning_rate: float = 5e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    steps: int = 3000
    batch_rows: int = 4
    tv_weight: float = 2.0
    reg_weight: float = 0.1
    chain_weight: float = 0.5
    checkpoint_every: int = 50
    eval_every: int = 150
    max_minutes: float | None = None
    seed: int = 0
    # A saved feature draft (a folder, a name such as smollm2-feature) to start from instead
    # of target layer `init_layer`: its weights and its head's token ids (more data for a
    # shipped draft without retraining it from the start).
    init_from: str | None = None


def ensure_features(target, split_dir: str, log: Callable[[str], None] = print) -> None:
    """Cache the target's hidden states [N, T, D] (float16) for every shard of split_dir."""
    import jax
    import jax.numpy as jnp

    from specsamp.models import Model

    cfg = target.cfg

    @jax.jit
    def hidden(tokens):
        return Model(cfg).full_forward(target.params, tokens, head=False).astype(jnp.float16)

    for path in sorted(glob.glob(os.path.join(split_dir, "*.npz"))):
        if path.endswith(".tmp.npz"):
            continue
        dest = data_mod.features_path(path)
        if os.path.exists(dest):  # written by `distill-data` beside the shard, or earlier here
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with np.load(path) as z:
            tokens = z["tokens"]
        feats = np.concatenate([np.asarray(hidden(jnp.asarray(tokens[i:i + 4])))
                                for i in range(0, len(tokens), 4)])
        np.save(dest + ".tmp.npy", feats)
        os.replace(dest + ".tmp.npy", dest)
        log(f"features: {dest} {feats.shape}")


def load_split(split_dir: str) -> dict:
    """Shards of one split with their cached features, concatenated (only shards whose
    features exist)."""
    shards = []
    for shard in sorted(glob.glob(os.path.join(split_dir, "*.npz"))):
        feat = data_mod.features_path(shard)
        if shard.endswith(".tmp.npz") or not os.path.exists(feat):
            continue
        with np.load(shard) as z:
            row = {k: z[k] for k in z.files}
        row["features"] = np.load(feat)
        shards.append(row)
    return data_mod.concat(shards)


def make_fns(cfg, tc: FeatureTrainConfig, opt):
    """(train_step, stats) for the feature draft; params carry `head_ids` and `head`."""
    import jax
    import jax.numpy as jnp
    import optax

    from specsamp.distill.draft import merge
    from specsamp.models.feature_draft import FeatureModel, head_product

    model = FeatureModel(cfg)

    def shift(h):  # position j reads the feature of position j - 1 (zeros at 0)
        return jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]

    def terms(params, batch, feats_in):
        tokens = batch["tokens"]
        g = model.full_forward(params, tokens, feats_in)
        logp = jax.nn.log_softmax(head_product(g, params["head"]["kernel"]), axis=-1)
        to_sub = jnp.full((cfg.vocab_size,), -1, jnp.int32).at[params["head_ids"]].set(
            jnp.arange(params["head_ids"].shape[0], dtype=jnp.int32))
        ids = to_sub[batch["top_ids"].astype(jnp.int32)]
        q = jnp.where(ids >= 0, batch["top_p"].astype(jnp.float32), 0.0)
        logp_k = jnp.take_along_axis(logp, jnp.maximum(ids, 0), axis=-1)
        ce = -jnp.sum(q * logp_k, axis=-1)
        overlap = jnp.sum(jnp.minimum(q, jnp.where(ids >= 0, jnp.exp(logp_k), 0.0)), axis=-1)
        top = params["head_ids"][jnp.argmax(logp, axis=-1)]
        top1 = (top == batch["top_ids"][..., 0].astype(jnp.int32)).astype(jnp.float32)
        return g, ce, overlap, top1

    def stats(params, batch):
        h = batch["features"].astype(jnp.float32)
        _, ce, overlap, top1 = terms(params, batch, shift(h))
        return ce, overlap, top1

    def loss_fn(trainable, frozen, batch):
        params = merge(trainable, frozen)
        h = batch["features"].astype(jnp.float32)
        m = batch["mask"].astype(jnp.float32)
        mean = lambda x: jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)
        g, ce, overlap, _ = terms(params, batch, shift(h))
        reg = jnp.mean(optax.huber_loss(g, h), axis=-1)
        _, ce2, overlap2, _ = terms(params, batch, shift(jax.lax.stop_gradient(g)))
        loss = (mean(ce + tc.tv_weight * (1 - overlap)) + tc.reg_weight * mean(reg)
                + tc.chain_weight * mean(ce2 + tc.tv_weight * (1 - overlap2)))
        return loss, mean(overlap)

    return train_mod.make_train_step(loss_fn, opt), jax.jit(stats)


def initial_params(target, tc: FeatureTrainConfig, train_data: dict):
    """(cfg, trainable, frozen): the draft's own weights start from target layer
    `init_layer`; frozen: the borrowed embedding and the reduced head."""
    from specsamp.models.feature_draft import BORROWED, init_feature_draft, reduced_head

    if tc.init_from:
        cfg, params = _saved_draft(target, tc)
        ids = np.unique(np.asarray(params["head_ids"]))  # drops decoding's padding
    else:
        cfg, params = init_feature_draft(target.cfg, target.params, tc.n_layers, tc.seed,
                                         tc.init_layer)
        ids = train_mod.token_subset(train_data, tc.head_vocab)
        ids = np.union1d(ids, np.asarray(target.tokenizer.eos_ids, np.int32)).astype(np.int32)
    params.update(reduced_head(target.cfg, target.params, ids))
    frozen_keys = set(BORROWED) | {"head_ids"}
    trainable = {k: v for k, v in params.items() if k not in frozen_keys}
    frozen = {k: v for k, v in params.items() if k in frozen_keys}
    return cfg, trainable, frozen


def _saved_draft(target, tc: FeatureTrainConfig):
    """(cfg, params) of the feature draft `tc.init_from`, in float32 as training needs."""
    from specsamp.decoding.drafts import resolve
    from specsamp.models.feature_draft import is_feature_draft, load_feature_draft

    path = resolve(tc.init_from)
    if not is_feature_draft(path):
        raise UserError(f"init_from: {tc.init_from} is not a saved feature draft "
                        f"(no specsamp_draft.json of kind 'feature' there)")
    cfg, params = load_feature_draft(path, target)
    if cfg.n_layers != tc.n_layers:
        raise UserError(f"init_from: {tc.init_from} has {cfg.n_layers} layer(s); this "
                        f"recipe trains n_layers = {tc.n_layers}")
    return cfg, params


def train_feature_draft(target, tc: FeatureTrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train through `train.train` (resuming from out_dir/checkpoint.npz), evaluate held-out
    alpha per domain every `eval_every` steps, and save the draft to out_dir/draft after
    each evaluation."""
    from specsamp.models.feature_draft import save_feature_draft

    for split in ("train", "heldout"):
        ensure_features(target, os.path.join(tc.data_dir, split), log)
    data = load_split(os.path.join(tc.data_dir, "train"))
    heldout = load_split(os.path.join(tc.data_dir, "heldout"))
    if not data or not heldout:
        raise UserError(f"no training data in {tc.data_dir} (train and held-out shards): run "
                        "`specsamp distill-data --config <this config>` first")
    cfg, trainable, frozen = initial_params(target, tc, data)
    os.makedirs(tc.out_dir, exist_ok=True)

    def save(step: int, result: dict, params) -> None:
        save_feature_draft(os.path.join(tc.out_dir, "draft"), cfg, params,
                           target.tokenizer.fingerprint, extra=result)

    return train_mod.train(tc, cfg, trainable, frozen, data, heldout, tc.out_dir, log,
                           on_eval=save, fns=lambda opt: make_fns(cfg, tc, opt))
